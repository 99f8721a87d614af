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

Schemas are validated by :func:`check_json_schema` (used by ``SamplingParams``): a schema that xgrammar
cannot compile raises ``ValueError``.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence

_SEPARATORS = (",", ":")
_JSON_OBJECT_SCHEMA = '{"type": "object"}'
_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def check_json_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError if the schema cannot be turned into a grammar."""
    try:
        xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=_SEPARATORS, strict_mode=True
        )
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses from C++
        raise ValueError(f"json_schema is not a supported JSON Schema: {exc}") from None


def check_regex(regex: str) -> None:
    """Raise ValueError if the regular expression cannot be turned into a grammar."""
    try:
        xgr.Grammar.from_regex(regex)
    except Exception as exc:
        raise ValueError(f"regex is not supported: {exc}") from None


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

    def compile(self, params: SamplingParams) -> xgr.CompiledGrammar | None:
        """The compiled grammar of the request's constraint (cached), or None if it has none."""
        if params.json_schema is not None:
            key = "schema:" + json.dumps(params.json_schema, sort_keys=True, separators=_SEPARATORS)
        elif params.json_object:
            key = "json_object"
        elif params.regex is not None:
            key = "regex:" + params.regex
        else:
            return None
        compiled = self._cache.get(key)
        if compiled is not None:
            self._cache.move_to_end(key)
            return compiled
        try:
            if params.json_schema is not None:
                compiled = self._compiler.compile_json_schema(
                    json.dumps(params.json_schema), any_whitespace=False, separators=_SEPARATORS
                )
            elif params.json_object:
                compiled = self._compiler.compile_json_schema(
                    _JSON_OBJECT_SCHEMA, any_whitespace=False, separators=_SEPARATORS, strict_mode=False
                )
            else:
                compiled = self._compiler.compile_regex(params.regex or "")
        except Exception as exc:
            raise ValueError(f"cannot compile the response format: {exc}") from None
        self._cache[key] = compiled
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return compiled

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

    def fill_bitmask(self, states: list[GrammarState | None]) -> tuple[torch.Tensor, list[int]] | None:
        """A CPU int32 bitmask ``[len(states), ceil(V/32)]`` and the rows that need masking, or None."""
        rows = [i for i, s in enumerate(states) if s is not None and not s.matcher.is_terminated()]
        if not rows:
            return None
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        json_rows, after_ed_rows = [], []
        for i in rows:
            state = states[i]
            if state is None:
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

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of disallowed tokens to -inf in place (only ``rows`` are touched)."""
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), vocab_size=self.vocab_size, indices=rows
        )

    def accept(self, state: GrammarState, token_id: int) -> bool:
        """Advance the matcher with a sampled token; False if the grammar rejects it."""
        if state.matcher.is_terminated() or not state.matcher.accept_token(token_id):
            return False
        state.after_ed = token_id in self._ends_with_ed
        return True


def _pack_bitmask(allowed: list[bool], vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask layout for one row: int32 words, bit ``j`` of word ``w`` = token ``32 w + j``."""
    bits = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.int64)
    bits[: min(len(allowed), vocab_size)] = torch.tensor(allowed[:vocab_size], dtype=torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
