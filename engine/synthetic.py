"""``--model synthetic``: a stand-in engine that runs NO model and emits tokens on a timer.

For gateway load tests only (admission, routing, streaming and metering at scale without a model);
never a default. It speaks the same protocol as a real replica (``engine.server`` serves it): it
validates requests the same way (empty prompt, vocab range, context length), streams one token per
completion every ``token_interval_s`` after ``ttft_s``, and stops at ``max_tokens`` (``length``) or
when it emits one of ``stop_token_ids`` (``stop``). Token ids cycle through a small fixed word list, so
texts are readable and deterministic per request. Prefix caching is simulated with the real block hash
chain (``engine.kv.block_hash``, same salt rules) over an LRU of ``cache_blocks`` hashes, so the gateway's
cached-token pricing sees realistic ``cached_tokens``. No torch.

Queueing (opt-in, ``prefill_tokens_per_s > 0``; for overload and shedding tests): prompts are then
"prefilled" one at a time at that rate, in chunks of ``prefill_chunk_tokens``, from a queue ordered as
the real scheduler orders work (lower ``priority`` first, then arrival); after each chunk the best
waiting request goes next, so a better-priority arrival waits at most one chunk. A request's first
token comes ``ttft_s`` after its prefill ends. ``stats()`` then reports what a real replica measures:
``pending_prefill_tokens`` (and by priority), ``num_waiting``, ``tokens_per_s`` (the rate, from the
first computed chunk on) and ``step_time_s`` (one chunk). Cached prompt blocks are not prefilled.

Embedding requests (``pooling``) end after their prefill (and ``ttft_s``) with no tokens and a
deterministic ``EMBEDDING_DIMENSIONS``-long vector: the prompt's token ids counted into buckets (``id mod
EMBEDDING_DIMENSIONS``), L2-normalised unless asked not to, so equal prompts embed equally.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from engine.async_engine import RequestStream
from engine.kv.block_hash import prefix_block_hashes
from engine.kv.connector import RemoteKV
from engine.kv.events import KVEventLog
from engine.kv.pins import DEFAULT_POLICY, CachePolicy
from engine.metrics import EngineMetrics
from engine.outputs import CompletionDelta, EngineStats, RequestDelta, RequestValidationError, Timings, Usage
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.lora.adapter import LoRAAdapter


class _Prefill:
    """A prompt waiting for (or in) its synthetic prefill."""

    __slots__ = ("arrival", "done", "priority", "remaining", "started")

    def __init__(self, priority: int, arrival: int, tokens: int) -> None:
        self.priority = priority
        self.arrival = arrival
        self.remaining = tokens
        self.done = asyncio.Event()
        self.started: float | None = None

WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "and", "then", "runs",
         "far", "away", "into", "woods")
FIRST_WORD_ID = 1000


class SyntheticEngine:
    """Timer-driven token source with the ``ServingEngine`` interface of ``engine.server``."""

    def __init__(self, model_name: str = "synthetic", pool: str = "interactive", vocab_size: int = 32000,
                 max_model_len: int = 8192, block_size: int = 16, token_interval_s: float = 0.01,
                 ttft_s: float = 0.02, cache_blocks: int = 65536, prefill_tokens_per_s: float = 0.0,
                 prefill_chunk_tokens: int = 256) -> None:
        if token_interval_s < 0 or ttft_s < 0 or prefill_tokens_per_s < 0:
            raise ValueError("token_interval_s, ttft_s and prefill_tokens_per_s must be >= 0")
        if prefill_chunk_tokens < 1:
            raise ValueError("prefill_chunk_tokens must be >= 1")
        if vocab_size <= FIRST_WORD_ID + len(WORDS):
            raise ValueError(f"vocab_size must exceed {FIRST_WORD_ID + len(WORDS)}")
        self.model_name = model_name
        self.pool = pool
        self.pooling = PoolingParams("last")
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.token_interval_s = token_interval_s
        self.ttft_s = ttft_s
        self._cache: OrderedDict[bytes, str | None] = OrderedDict()  # block hash -> its cache salt
        self.kv_events = KVEventLog()  # its simulated device cache, published like a real engine's
        self._cache_blocks = cache_blocks
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stats = EngineStats(num_kv_blocks=cache_blocks)
        self.metrics = EngineMetrics(self.stats, model_name, pool)
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._prefill_queue: list[_Prefill] = []
        self._arrivals = 0
        self._prefill_wakeup: asyncio.Event | None = None
        self._prefill_task: asyncio.Task[None] | None = None

    @classmethod
    def from_engine_kwargs(cls, pool: str = "interactive", model_name: str | None = None,
                           **engine_kwargs: Any) -> SyntheticEngine:
        """Build from ``EngineConfig``-style keyword arguments (``block_size``, ``max_model_len``, and
        ``extra={"token_interval_s": ..., "ttft_s": ...}``); settings that need a model are ignored."""
        extra = dict(engine_kwargs.get("extra") or {})
        kwargs: dict[str, Any] = {k: extra.pop(k) for k in ("token_interval_s", "ttft_s", "vocab_size",
                                                            "prefill_tokens_per_s", "prefill_chunk_tokens")
                                  if k in extra}
        if extra:
            raise ValueError(f"unknown synthetic engine settings: {sorted(extra)}")
        if engine_kwargs.get("block_size"):
            kwargs["block_size"] = engine_kwargs["block_size"]
        if engine_kwargs.get("max_model_len"):
            kwargs["max_model_len"] = engine_kwargs["max_model_len"]
        return cls(model_name=model_name or "synthetic", pool=pool, **kwargs)

    # ---- ServingEngine --------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          tenant: str = "", cache_salt: str | None = None,
                          priority: int = 0, pooling: PoolingParams | None = None,
                          cache_policy: CachePolicy = DEFAULT_POLICY,
                          prediction: list[int] | None = None, lora: str | None = None,
                          kv_source: RemoteKV | None = None) -> RequestStream:
        # ``cache_policy``: the stand-in has no tiers to pin in; it reports no pinned or retained tokens.
        # ``prediction``: it does not speculate; it reports no accepted or rejected prediction tokens.
        if lora is not None:
            raise RequestValidationError("the synthetic engine serves no LoRA adapters", "lora")
        if kv_source is not None:
            raise RequestValidationError("the synthetic engine pulls no KV blocks", "kv_transfer")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise RequestValidationError("the prompt is empty: at least one token is required", "prompt")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise RequestValidationError(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise RequestValidationError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(prompt)} tokens and max_tokens asks for {params.max_tokens} more", "max_tokens")
        if request_id in self._tasks:
            raise RequestValidationError(f"request_id {request_id!r} is already in flight", "request_id")
        stream = RequestStream(request_id, self.abort)
        cached, written = self._lookup_prefix(prompt, cache_salt)
        self._stats.prompt_tokens += len(prompt)
        self._stats.prefix_query_tokens += len(prompt)
        self._stats.prefix_hit_tokens += cached
        self._stats.num_running += params.n
        prefill = self._queue_prefill(priority, len(prompt) - cached) if self.prefill_tokens_per_s else None
        self._tasks[request_id] = asyncio.create_task(self._emit(stream, prompt, params, cached, prefill,
                                                                 pooling, written))
        return stream

    def abort(self, request_id: str) -> bool:
        task = self._tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def stats(self) -> EngineStats:
        return self._stats

    def stalled(self, stall_s: float) -> str | None:
        """Never: its "steps" are asyncio sleeps on the server's own event loop, which answers the probe."""
        return None

    def purge_cache(self, cache_salt: str | None) -> concurrent.futures.Future[int]:
        gone = [digest for digest, salt in self._cache.items() if salt == cache_salt]
        for digest in gone:
            del self._cache[digest]
            self.kv_events.removed(digest, "device")
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        done.set_result(len(gone))
        return done

    def check_adapter(self, lora: str) -> LoRAAdapter:
        raise RequestValidationError("the synthetic engine serves no LoRA adapters", "lora")

    def resident_adapters(self) -> list[str]:
        return []

    def info(self) -> dict[str, Any]:
        return {"model": self.model_name, "pool": self.pool, "max_model_len": self.max_model_len,
                "vocab_size": self.vocab_size, "block_size": self.block_size, "eos_token_ids": [],
                "num_kv_blocks": self._cache_blocks, "max_num_seqs": 1 << 16,
                "max_num_batched_tokens": 1 << 20, "synthetic": True,
                "embedding_dimensions": EMBEDDING_DIMENSIONS, "pooling": self.pooling.mode}

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def shutdown(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        if self._prefill_task is not None:
            self._prefill_task.cancel()

    # ---- synthetic prefill queue ----------------------------------------------------------------
    def _queue_prefill(self, priority: int, uncached_tokens: int) -> _Prefill:
        self._arrivals += 1
        item = _Prefill(priority, self._arrivals, max(1, uncached_tokens))  # the last token always runs
        self._prefill_queue.append(item)
        self._refresh_backlog()
        if self._prefill_task is None or self._prefill_task.done():
            self._prefill_wakeup = asyncio.Event()
            self._prefill_task = asyncio.create_task(self._prefill_loop(), name="synthetic-prefill")
        elif self._prefill_wakeup is not None:
            self._prefill_wakeup.set()
        return item

    def _drop_prefill(self, item: _Prefill) -> None:
        if item in self._prefill_queue:
            self._prefill_queue.remove(item)
            self._refresh_backlog()

    def _refresh_backlog(self) -> None:
        by_priority: dict[int, int] = {}
        for item in self._prefill_queue:
            by_priority[item.priority] = by_priority.get(item.priority, 0) + item.remaining
        self._stats.pending_prefill_tokens = sum(by_priority.values())
        self._stats.pending_prefill_tokens_by_priority = by_priority
        self._stats.num_waiting = sum(1 for item in self._prefill_queue if item.started is None)

    async def _prefill_loop(self) -> None:
        rate, chunk_tokens = self.prefill_tokens_per_s, self.prefill_chunk_tokens
        while True:
            if not self._prefill_queue:
                assert self._prefill_wakeup is not None
                self._prefill_wakeup.clear()
                await self._prefill_wakeup.wait()
                continue
            item = min(self._prefill_queue, key=lambda p: (p.priority, p.arrival))
            if item.started is None:
                item.started = time.monotonic()
            chunk = min(item.remaining, chunk_tokens)
            await asyncio.sleep(chunk / rate)
            self._stats.computed_prefill_tokens += chunk
            self._stats.num_steps += 1
            self._stats.tokens_per_s = rate
            self._stats.step_time_s = chunk_tokens / rate
            if item not in self._prefill_queue:  # aborted during the chunk
                continue
            item.remaining -= chunk
            if item.remaining <= 0:
                self._prefill_queue.remove(item)
                item.done.set()
            self._refresh_backlog()

    # ---- internals ------------------------------------------------------------------------------
    def _lookup_prefix(self, prompt: list[int], cache_salt: str | None) -> tuple[int, int]:
        """(Prompt tokens found cached, prompt tokens newly written to the cache)."""
        hashes = prefix_block_hashes(prompt, self.block_size, cache_salt)
        usable = (len(prompt) - 1) // self.block_size
        hits = 0
        for digest in hashes[:usable]:
            if digest not in self._cache:
                break
            self._cache.move_to_end(digest)
            hits += 1
        written = 0
        for digest in hashes:
            if digest not in self._cache:
                self.kv_events.stored(digest, "device")
                written += self.block_size
            self._cache[digest] = cache_salt
            self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_blocks:
            self.kv_events.removed(self._cache.popitem(last=False)[0], "device")
        return hits * self.block_size, written

    async def _emit(self, stream: RequestStream, prompt: list[int], params: SamplingParams,
                    cached: int, prefill: _Prefill | None = None,
                    pooling: PoolingParams | None = None, written: int = 0) -> None:
        start = time.monotonic()
        n = params.n
        outputs: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        first_token = None
        try:
            if prefill is not None:
                await prefill.done.wait()
            await asyncio.sleep(self.ttft_s)
            step = 0
            deltas: list[CompletionDelta] = []
            if pooling is not None:  # an embedding: no tokens
                reasons = ["stop"] * n
                first_token = time.monotonic()
            while any(r is None for r in reasons):
                deltas = []
                for i in range(n):
                    if reasons[i] is not None:
                        continue
                    word = (len(prompt) + step + i) % len(WORDS)
                    token = FIRST_WORD_ID + word
                    outputs[i].append(token)
                    if token in params.stop_token_ids:
                        reasons[i] = "stop"
                        text = ""
                    else:
                        text = " " + WORDS[word]
                        if len(outputs[i]) >= params.max_tokens:
                            reasons[i] = "length"
                    deltas.append(CompletionDelta(i, [token], text, None, reasons[i]))
                self._stats.generation_tokens += len(deltas)
                first_token = first_token or time.monotonic()
                if all(r is not None for r in reasons):
                    break
                stream.put_nowait(RequestDelta(stream.request_id, deltas))
                step += 1
                await asyncio.sleep(self.token_interval_s)
        except asyncio.CancelledError:
            reasons = [r or "abort" for r in reasons]
            deltas = []
        finally:
            self._tasks.pop(stream.request_id, None)
            self._stats.num_running -= n
            if prefill is not None:
                self._drop_prefill(prefill)
        end = time.monotonic()
        longest = max(len(o) for o in outputs)
        ttft = (first_token - start) if first_token else 0.0
        queued = (prefill.started or end) - start if prefill is not None else 0.0
        timings = Timings(queued=queued, ttft=ttft,
                          tpot=(end - first_token) / (longest - 1) if first_token and longest > 1 else 0.0,
                          e2e=end - start)
        usage = Usage.of(prompt_tokens=len(prompt), cached_tokens=cached,
                         completion_tokens=sum(len(o) for o in outputs), cache_write_tokens=written)
        self.metrics.observe_finished(timings, usage.completion_tokens)
        counts = self._stats.num_requests_finished
        for reason in reasons:
            counts[reason or "abort"] = counts.get(reason or "abort", 0) + 1
        embedding = _embedding(prompt, pooling) if pooling is not None and reasons == ["stop"] * n else None
        stream.put_nowait(RequestDelta(stream.request_id, deltas, True, [r or "abort" for r in reasons],
                                       usage, timings, embedding))


EMBEDDING_DIMENSIONS = 32


def _embedding(prompt: list[int], pooling: PoolingParams) -> list[float]:
    counts = [0.0] * EMBEDDING_DIMENSIONS
    for token in prompt:
        counts[token % EMBEDDING_DIMENSIONS] += 1.0
    if not pooling.normalize:
        return counts
    norm = sum(c * c for c in counts) ** 0.5
    return [c / norm for c in counts]

