"""Structured output (JSON mode, JSON schema, regex) with xgrammar token bitmasks.

One ``GrammarBackend`` per engine: it holds xgrammar's tokenizer info (built from the checkpoint's
``tokenizer.json`` with the HF ``tokenizers`` library, never ``transformers``), a grammar compiler and
a bounded LRU cache of compiled grammars keyed by the canonical JSON of the request's constraint.

Invariants:

- Output is compact: no free whitespace (``any_whitespace=False``) and ``(",", ":")`` separators, so the
  only way for a model, even a random-weight one, to make a bounded schema long is to fill its strings
  and numbers; an ``enum`` / ``maxLength`` / small object terminates in a bounded number of tokens.
- JSON schemas are strict (no properties or items beyond the schema). JSON mode (``json_object``) is a
  compact JSON object with any properties.
- Each sequence owns one matcher, created on its first sample and stored in ``seq.sampler_state`` as a
  :class:`GrammarState`. The sampler masks the logits with the matcher's bitmask and advances it with
  the sampled token. Once the document is complete only stop tokens are allowed; accepting one
  terminates the matcher, and :func:`is_terminated` tells the engine loop to finish the sequence with
  reason ``stop``. Preemption keeps ``token_ids`` and therefore the matcher state.
- Special tokens (``special: true`` in ``added_tokens``) are given an empty spelling, which xgrammar
  treats as never matching text: they can only be produced as stop tokens.
- JSON grammars never emit a raw control character (bytes 0x00-0x1F): compact JSON has none outside
  strings and JSON forbids them unescaped inside. xgrammar's rule for length-bounded strings admits
  them, so tokens containing one are masked out for every JSON row on top of the grammar's bitmask.
  Likewise xgrammar admits UTF-8-encoded surrogates (``ED A0..BF ..``), which are not valid UTF-8:
  tokens containing one are masked, and after a token ending in the lead byte ``ED`` so are tokens
  starting with ``A0..BF``.
- Speculative decoding: a sequence with ``k`` drafts has ``k + 1`` rows, and row ``j`` is masked with the
  grammar state reached after drafts ``0..j-1``. ``fill_bitmask`` walks the matcher along the drafts
  (accepting each that its row's final mask allows), then rolls it back: between steps a matcher has
  accepted exactly the sequence's known output. Rows past a draft the grammar refuses (or past one that
  completes the document) copy the last filled row: they are reached only if that draft stands, and it
  cannot (its row forbids it) or the sequence stops there. Rollback is unbounded in xgrammar >= 0.1.23.

Schemas and regular expressions are validated when ``SamplingParams`` is built, by
``engine.grammar_check`` (a schema xgrammar cannot compile raises ``ValueError``).

Threads: ``GrammarBackend``'s compile side (``compile``, ``compile_async``, ``withdraw``, ``pin``,
``unpin``, ``cached``) may be called from any thread; one lock guards the cache, the in-flight compiles
and the pins, and is never held while compiling (xgrammar's compiler releases the GIL, so compiles run
in parallel with the engine thread). Concurrent requests for one constraint share one compile. The
matcher side (``state_for``, ``fill_bitmask``, ``accept``) belongs to the engine thread.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

from engine.device import upload
from engine.grammar_check import SEPARATORS

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def tokenizer_info_from_json(
    tokenizer_json: str | Path, vocab_size: int, stop_token_ids: list[int]
) -> xgr.TokenizerInfo:
    """xgrammar's view of a HF ``tokenizer.json``: decoded vocabulary, vocab type, stop tokens.

    ``vocab_size`` is the model's (lm_head rows), which may exceed the tokenizer's; ids without a token
    are never allowed. ``stop_token_ids`` are the ids that end a completed document (EOS).
    """
    from tokenizers import Tokenizer

    if not stop_token_ids:
        raise ValueError("stop_token_ids must name at least one token (EOS)")
    text = Path(tokenizer_json).read_text(encoding="utf-8")
    spec = json.loads(text)
    tokenizer = Tokenizer.from_str(text)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    special = {t["content"] for t in spec.get("added_tokens", []) if t.get("special")}
    size = max(vocab_size, max(vocab.values()) + 1)
    encoded = [""] * size
    for token, token_id in vocab.items():
        encoded[token_id] = "" if token in special else token
    vocab_type, add_prefix_space = _detect_vocab_type(spec)
    return xgr.TokenizerInfo(
        encoded[:vocab_size] if size > vocab_size else encoded,
        vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=add_prefix_space,
    )


def _components(node: dict[str, Any] | None, kind: str) -> list[dict[str, Any]]:
    """A tokenizer.json component and, for ``Sequence`` components, its children."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [c for child in node.get(kind, []) for c in _components(child, kind)]
    return [node]


def _detect_vocab_type(spec: dict[str, Any]) -> tuple[xgr.VocabType, bool]:
    decoders = {d.get("type") for d in _components(spec.get("decoder"), "decoders")}
    if "ByteLevel" in decoders:
        return xgr.VocabType.BYTE_LEVEL, False
    prepends = False
    for node in _components(spec.get("normalizer"), "normalizers") + _components(
        spec.get("pre_tokenizer"), "pretokenizers"
    ):
        if node.get("type") == "Prepend":
            prepends = True
        if node.get("type") == "Metaspace":
            prepends = node.get("prepend_scheme", "always") != "never" and node.get("add_prefix_space", True)
    if "ByteFallback" in decoders:
        return xgr.VocabType.BYTE_FALLBACK, prepends
    return xgr.VocabType.RAW, prepends


@dataclass(slots=True)
class GrammarState:
    """Per-sequence grammar state, stored in ``seq.sampler_state``."""

    matcher: xgr.GrammarMatcher
    # A JSON grammar (json_schema / json_object): raw control characters are masked as well.
    is_json: bool = False
    # The last accepted token ends with the UTF-8 lead byte 0xED: the next byte must be 0x80..0x9F.
    after_ed: bool = False


@dataclass(slots=True)
class _InFlight:
    """A compile in progress (or queued): its future and how many callers still wait for it."""

    future: Future
    waiters: int = 1


def is_terminated(seq: Sequence) -> bool:
    """True once the sequence's grammar accepted a stop token: the engine finishes it with ``stop``."""
    state = seq.sampler_state
    return isinstance(state, GrammarState) and state.matcher.is_terminated()


class GrammarBackend:
    def __init__(self, tokenizer_info: xgr.TokenizerInfo, *, max_cached_grammars: int = 256) -> None:
        if max_cached_grammars < 1:
            raise ValueError(f"max_cached_grammars must be >= 1, got {max_cached_grammars}")
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        # The xgrammar compiler's own cache is keyed by the raw schema text; ours is canonical and bounded.
        self._compiler = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._max_cached = max_cached_grammars
        # The cache, the in-flight compiles and the pins are shared by the engine thread and the
        # compile threads; the lock is never held while compiling.
        self._lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}
        # key -> [compiled grammar, pin count]: grammars of accepted requests, kept past LRU eviction.
        self._pinned: dict[str, list[Any]] = {}
        vocab = tokenizer_info.decoded_vocab
        self._json_allowed = _pack_bitmask(
            [not any(b < 0x20 for b in t) and _SURROGATE.search(t) is None for t in vocab], self.vocab_size
        )
        self._after_ed_allowed = _pack_bitmask(
            [not t or not 0xA0 <= t[0] <= 0xBF for t in vocab], self.vocab_size
        )
        self._ends_with_ed = frozenset(i for i, t in enumerate(vocab) if t.endswith(b"\xed"))

    @classmethod
    def from_tokenizer_json(
        cls, tokenizer_json: str | Path, vocab_size: int, stop_token_ids: list[int]
    ) -> GrammarBackend:
        return cls(tokenizer_info_from_json(tokenizer_json, vocab_size, stop_token_ids))

    @staticmethod
    def key(params: SamplingParams) -> str | None:
        """The cache key of the request's constraint (canonical JSON of a schema), or None if none."""
        if params.json_schema is not None:
            return "schema:" + json.dumps(params.json_schema, sort_keys=True, separators=SEPARATORS)
        if params.json_object:
            return "json_object"
        if params.regex is not None:
            return "regex:" + params.regex
        return None

    def cached(self, key: str) -> xgr.CompiledGrammar | None:
        """The compiled grammar of ``key`` if it is cached or pinned (never compiles)."""
        with self._lock:
            return self._lookup(key)

    def compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar of the request's constraint (cached), or None if it has none.

        Compiles in the calling thread, unless the same constraint is being compiled already
        (:meth:`compile_async`): then it waits for that compile. ValueError if it cannot be compiled.
        """
        key = self.key(params)
        if key is None:
            return None
        with self._lock:
            compiled = self._lookup(key)
            if compiled is not None:
                return compiled
            entry = self._inflight.get(key)
            if entry is None:
                entry = self._inflight[key] = _InFlight(Future())
                entry.future.set_running_or_notify_cancel()
                owner = True
            else:
                entry.waiters += 1  # a waiter: nobody may cancel it under us
                owner = False
        if owner:
            self._run(key, params, entry)
        return entry.future.result()

    def compile_async(self, params: SamplingParams, executor: Executor) -> tuple[str | None, Future]:
        """Start compiling the request's constraint on ``executor``; returns its key and a future.

        The future's result is the compiled grammar (None without a constraint); it is already done on a
        cache hit, and concurrent calls for one constraint share one compile and one future. Its
        exception is a ValueError when the constraint cannot be compiled; its callbacks run in the
        compiling thread (or the caller's on a hit). A caller that no longer needs it calls
        :meth:`withdraw`: the compile is cancelled if it has not started and nobody else waits for it.
        """
        key = self.key(params)
        done: Future = Future()
        if key is None:
            done.set_result(None)
            return None, done
        with self._lock:
            compiled = self._lookup(key)
            if compiled is not None:
                done.set_result(compiled)
                return key, done
            entry = self._inflight.get(key)
            if entry is None:
                entry = self._inflight[key] = _InFlight(Future(), waiters=0)
                executor.submit(self._run_queued, key, params, entry)
            entry.waiters += 1
            return key, entry.future

    def withdraw(self, key: str, future: Future) -> None:
        """One waiter of :meth:`compile_async`'s ``future`` gave up; cancel the compile if it was the
        last one and the compile has not started (a started compile finishes and is cached)."""
        with self._lock:
            entry = self._inflight.get(key)
            if entry is None or entry.future is not future:
                return
            entry.waiters -= 1
            if entry.waiters > 0 or future.running():
                return
            del self._inflight[key]
        # Outside the lock: cancelling runs the future's callbacks. A compile that started meanwhile
        # finishes into the cache.
        future.cancel()

    def pin(self, key: str, compiled: xgr.CompiledGrammar) -> None:
        """Keep ``key``'s grammar available, whatever the LRU evicts, until it is unpinned as often."""
        with self._lock:
            entry = self._pinned.get(key)
            if entry is None:
                self._pinned[key] = [compiled, 1]
            else:
                entry[1] += 1

    def unpin(self, key: str) -> None:
        with self._lock:
            entry = self._pinned.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._pinned[key]

    @property
    def num_compiling(self) -> int:
        """Constraints being compiled or queued for it (a gauge for tests and stats)."""
        with self._lock:
            return len(self._inflight)

    def _lookup(self, key: str) -> xgr.CompiledGrammar | None:
        """Under ``_lock``."""
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        pinned = self._pinned.get(key)
        return None if pinned is None else pinned[0]

    def _run_queued(self, key: str, params: SamplingParams, entry: _InFlight) -> None:
        """An executor's job: compile unless every waiter withdrew before it started."""
        if entry.future.set_running_or_notify_cancel():
            self._run(key, params, entry)

    def _run(self, key: str, params: SamplingParams, entry: _InFlight) -> None:
        """Compile (without the lock: xgrammar releases the GIL), cache, then resolve the future."""
        try:
            compiled = self._compile(params)
        except BaseException as exc:
            with self._lock:
                if self._inflight.get(key) is entry:
                    del self._inflight[key]
            entry.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        with self._lock:
            if self._inflight.get(key) is entry:
                del self._inflight[key]
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            if len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        entry.future.set_result(compiled)

    def _compile(self, params: SamplingParams) -> xgr.CompiledGrammar:
        try:
            if params.json_schema is not None:
                return self._compiler.compile_json_schema(
                    json.dumps(params.json_schema), any_whitespace=False, separators=SEPARATORS
                )
            if params.json_object:
                return self._compiler.compile_json_schema(
                    _JSON_OBJECT_SCHEMA, any_whitespace=False, separators=SEPARATORS, strict_mode=False
                )
            return self._compiler.compile_regex(params.regex or "")
        except Exception as exc:
            raise ValueError(f"cannot compile the response format: {exc}") from None

    def state_for(self, seq: Sequence) -> GrammarState | None:
        """The sequence's grammar state, created (and caught up with its output) on first use."""
        state = seq.sampler_state
        if isinstance(state, GrammarState):
            return state
        compiled = self.compile(seq.params)
        if compiled is None:
            return None
        is_json = seq.params.json_schema is not None or seq.params.json_object
        state = GrammarState(xgr.GrammarMatcher(compiled), is_json)
        for token_id in seq.output_token_ids:
            if not self.accept(state, token_id):
                raise ValueError(f"sequence {seq.seq_id}: existing output does not match its grammar")
        seq.sampler_state = state
        return state

    def fill_bitmask(self, states: list[GrammarState | None],
                     drafts: dict[int, list[int]] | None = None) -> tuple[torch.Tensor, list[int]] | None:
        """A CPU int32 bitmask ``[len(states), ceil(V/32)]`` (rows not filled allow every token) and the
        rows that need masking, or None. ``drafts``: the first row of a sequence with draft tokens -> its
        drafts; its next ``len(drafts)`` rows hold the same state and verify them, each masked with the
        state after the drafts before it (``_fill_drafts``)."""
        rows = [i for i, s in enumerate(states) if s is not None and not s.matcher.is_terminated()]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        json_rows, after_ed_rows = [], []
        drafted_until = -1  # the last row of the current sequence's drafts
        for i in rows:
            state = states[i]
            if state is None or i <= drafted_until:
                continue
            group = drafts.get(i) if drafts else None
            if group:
                self._fill_drafts(state, group, bitmask, i)
                drafted_until = i + len(group)
                continue
            state.matcher.fill_next_token_bitmask(bitmask, i)
            if state.is_json:
                json_rows.append(i)
                if state.after_ed:
                    after_ed_rows.append(i)
        if json_rows:
            bitmask[torch.tensor(json_rows)] &= self._json_allowed
        if after_ed_rows:
            bitmask[torch.tensor(after_ed_rows)] &= self._after_ed_allowed
        return bitmask, rows

    def _fill_drafts(self, state: GrammarState, drafts: list[int], bitmask: torch.Tensor, first: int) -> None:
        """Rows ``first .. first + len(drafts)`` of ``bitmask``: row ``j`` with the state after
        ``drafts[:j]``, walked tentatively and rolled back. The walk stops at a draft its row forbids (it
        will be rejected there) or one that completes the document (the stream stops there); the rows
        after it, reachable only through it, copy its row (a valid, unused mask)."""
        matcher = state.matcher
        after_ed = state.after_ed
        walked = 0
        row = first
        for j in range(len(drafts) + 1):
            row = first + j
            matcher.fill_next_token_bitmask(bitmask, row)
            if state.is_json:
                bitmask[row] &= self._json_allowed
                if after_ed:
                    bitmask[row] &= self._after_ed_allowed
            if j == len(drafts):
                break
            token = drafts[j]
            if not _allows(bitmask[row], token) or not matcher.accept_token(token):
                break
            walked += 1
            after_ed = token in self._ends_with_ed
            if matcher.is_terminated():
                break
        last = first + len(drafts)
        if row < last:
            bitmask[row + 1:last + 1] = bitmask[row]
        if walked:
            matcher.rollback(walked)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of disallowed tokens to -inf in place (only ``rows`` are touched). On a GPU the
        whole bitmask is applied (unmasked rows allow every token) and uploaded without waiting: xgrammar
        turns ``indices`` into a device tensor with a synchronous copy, which would wait for the step
        queued behind this one."""
        if logits.device.type == "cpu":
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
            return
        xgr.apply_token_bitmask_inplace(logits, upload(bitmask, logits.device), vocab_size=self.vocab_size)

    def accept(self, state: GrammarState, token_id: int) -> bool:
        """Advance the matcher with a sampled token; False if the grammar rejects it."""
        if state.matcher.is_terminated() or not state.matcher.accept_token(token_id):
            return False
        state.after_ed = token_id in self._ends_with_ed
        return True


def _allows(row: torch.Tensor, token_id: int) -> bool:
    """Whether a bitmask row allows ``token_id`` (ids past the row are not allowed)."""
    word = token_id >> 5
    return 0 <= word < row.shape[0] and bool((int(row[word]) >> (token_id & 31)) & 1)


def _pack_bitmask(allowed: list[bool], vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask layout for one row: int32 words, bit ``j`` of word ``w`` = token ``32 w + j``."""
    bits = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.int64)
    bits[: min(len(allowed), vocab_size)] = torch.tensor(allowed[:vocab_size], dtype=torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
