"""What the engine hands back: per-step deltas (``LLMEngine.step``), the offline API's ``RequestOutput``
(vLLM's shape), and the counters snapshot behind ``/load`` and ``/metrics``.

Plain dataclasses, no torch. Invariants:

- A ``RequestDelta`` carries, per completion index, only what is new since the previous step; the text
  of a completion is the concatenation of its deltas' ``text`` (stop strings already removed).
- ``usage`` and ``timings`` are set exactly once, on the delta with ``finished == True``; ``usage``
  counts the prompt once for ``n > 1`` and sums the completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.lora.stats import LoRAStats
from engine.usage import Usage

__all__ = ["Usage"]  # the one usage value (``engine.usage``), carried by the final delta


class RequestValidationError(ValueError):
    """A request the engine refuses (an HTTP 400); ``param`` names the offending field and ``code`` is
    OpenAI's error code where one applies (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass(slots=True)
class Timings:
    """Seconds since the engine accepted the request (``tpot``: mean per output token after the first)."""

    queued: float
    ttft: float
    tpot: float
    e2e: float


@dataclass(slots=True)
class CompletionDelta:
    index: int
    token_ids: list[int]
    text: str
    # One record per new token when logprobs were asked for (sampler-defined ``token_id``/``logprob``/
    # ``top_logprobs`` objects), else None.
    logprobs: list[Any] | None = None
    finish_reason: str | None = None
    # Once, with the stream's first delta after its prompt was scored (``prompt_logprobs``): one record per
    # prompt token, the first None (nothing precedes it).
    prompt_logprobs: list[Any] | None = None


@dataclass(slots=True)
class RequestDelta:
    request_id: str
    completions: list[CompletionDelta]
    finished: bool = False
    # Set with ``finished``: the finish reason of every completion, by index.
    finish_reasons: list[str] | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    # Set with ``finished`` for an embedding request (``engine.pooling``): its vector.
    embedding: list[float] | None = None
    # Disaggregated serving (``engine.kv.connector``), set with ``finished``: on a prefill replica, where
    # the lease on the prompt's blocks is (``host``, ``port``, ``lease_id``, ``num_tokens``); on a decode
    # replica, what the pull brought (``pulled_tokens``) and why it failed (``error``, or None).
    kv_transfer: dict[str, Any] | None = None
    kv_pull: dict[str, Any] | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request (vLLM's ``CompletionOutput``)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] | None = None
    finish_reason: str | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        if self.logprobs is None:
            return None
        return float(sum(record.logprob for record in self.logprobs))


@dataclass(slots=True)
class RequestOutput:
    """A finished request of the offline API. ``token_ids``/``text``/``finish_reason``/``logprobs``
    are those of the first completion; ``outputs`` has all ``n``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    usage: Usage | None = None
    timings: Timings | None = None
    prompt: str | None = None
    # An embedding request's vector (``LLM.embed``).
    embedding: list[float] | None = None
    # ``SamplingParams.prompt_logprobs``: per prompt token its record (vLLM's), the first None.
    prompt_logprobs: list[Any] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[Any] | None:
        return self.outputs[0].logprobs

    def add(self, delta: RequestDelta) -> None:
        """Fold one step's delta into this output."""
        for completion in delta.completions:
            out = self.outputs[completion.index]
            out.token_ids.extend(completion.token_ids)
            out.text += completion.text
            if completion.logprobs is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.extend(completion.logprobs)
            if completion.finish_reason is not None:
                out.finish_reason = completion.finish_reason
            if completion.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = completion.prompt_logprobs
        if delta.finished:
            self.finished = True
            self.usage = delta.usage
            self.timings = delta.timings
            self.embedding = delta.embedding
            if delta.usage is not None:
                self.num_cached_tokens = delta.usage.cached_tokens


@dataclass(slots=True)
class EngineStats:
    """A point-in-time snapshot of the engine's gauges and (monotonic) counters."""

    num_waiting: int = 0
    num_running: int = 0
    pending_prefill_tokens: int = 0
    # The same backlog by engine priority (lower runs first): what the gateway's overload shedding
    # counts as ahead of a new request. Empty when the engine does not break it down.
    pending_prefill_tokens_by_priority: dict[int, int] = field(default_factory=dict)
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0
    kv_usage: float = 0.0
    # Counters since start.
    num_steps: int = 0
    num_preemptions: int = 0
    # Of those, preemptions for the tenants' fair share of running slots (``Scheduler``).
    num_fairness_preemptions: int = 0
    num_partial_prefill_chunks: int = 0
    computed_prefill_tokens: int = 0
    computed_decode_tokens: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Of the hits, where they were served from: device, host (the host tier), disk (read from disk).
    prefix_hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # The lower tiers (``engine.kv.tiers``; empty without them): blocks held and capacity per tier,
    # blocks moved since start (offloaded, demoted, loaded, disk_read, host_evicted, disk_evicted), and
    # the bytes of one block (moved blocks x this = bytes copied).
    kv_tier_blocks: dict[str, int] = field(default_factory=dict)
    kv_tier_capacity: dict[str, int] = field(default_factory=dict)
    kv_tier_moves: dict[str, int] = field(default_factory=dict)
    kv_block_bytes: int = 0
    # Blocks held by cache lifetimes (``engine.kv.pins``): pinned in the host tier, retained on disk.
    kv_pinned_blocks: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_requests_finished: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: draft tokens verified, and accepted (``drafted_tokens``, ``accepted_tokens``);
    # steps that processed the step in flight first to draft (``waits``: the overlap given up).
    speculation: dict[str, int] = field(default_factory=dict)
    # Disaggregated serving: pulls, leases and their blocks (``KVConnector.stats``; empty in role both).
    kv_transfer: dict[str, int] = field(default_factory=dict)
    # LoRA adapters (``engine.lora.stats``): loads, evictions, load times by tier, requests by adapter;
    # None on an engine without adapter slots.
    lora: LoRAStats | None = None
    # Moving averages over recent steps / requests.
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    ttft_s: float = 0.0

    @property
    def prefix_hit_rate(self) -> float:
        if not self.prefix_query_tokens:
            return 0.0
        return self.prefix_hit_tokens / self.prefix_query_tokens
