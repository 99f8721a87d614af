"""Wire schema of an engine replica's internal HTTP API (the gateway's only way to reach an engine).

This module imports no torch: the gateway imports it. Endpoints (``engine/server.py``):

- ``POST /generate`` takes a ``GenerateRequest`` (prompt *token ids*: the gateway tokenizes, so
  admission, routing and billing count the same tokens). A request that fails validation is answered
  ``400`` with an ``ErrorRecord`` body before any streaming starts. Otherwise the answer is
  ``200 application/x-ndjson``: zero or more ``DeltaRecord`` lines, then exactly one ``FinalRecord``
  line (or one ``ErrorRecord`` line if the engine failed mid-request). Closing the stream aborts the
  request within one engine step.
- ``POST /abort`` takes an ``AbortRequest`` → ``AbortResponse``: whether it stopped a running request, and
  the request's final usage once ended (the engine's own count, kept a while after the end: what a
  stream the client abandoned is billed); ``GET /health`` → ``HealthResponse``; ``GET /info`` →
  ``InfoResponse``; ``GET /load`` → ``LoadReport``; ``GET /metrics`` → Prometheus text.
- Internal authentication (``engine.gate``): a replica started with an internal token
  (``INTERNAL_TOKEN_ENV``) answers every path but ``/health`` and ``/metrics`` only with
  ``Authorization: Bearer <token>``; otherwise ``401`` with an ``ErrorRecord`` (code ``INTERNAL_TOKEN_CODE``).
- Drain: a replica that got SIGTERM answers ``/health`` with ``503`` and ``status: "draining"``, reports
  ``LoadReport.draining``, and refuses a new ``/generate`` with ``503`` and the code ``DRAINING_CODE``
  (nothing started: the caller sends it to another replica); its running streams finish.

Every record carries a ``type`` discriminator (``delta`` / ``final`` / ``error``); ``parse_record``
turns one NDJSON line back into a model. Invariants of a stream:

- ``DeltaRecord.index`` is the completion index (``0 .. n-1``); the concatenation of one index's
  ``text`` values is that completion's final text (stop strings already cut off), and of its
  ``token_ids`` all the tokens it generated (a stop/eos token included, its text excluded).
- ``FinalRecord.finish_reasons[i]`` is the finish reason of completion ``i``.
- ``Usage`` counts the prompt once even when ``n > 1``; ``cached_tokens`` are prompt tokens served from
  the prefix cache when the request first started (recompute after a preemption is never billed);
  ``completion_tokens`` sums the tokens of all ``n`` completions.
- ``Timings`` are in **seconds** (floats), measured on the engine's monotonic clock from the moment the
  engine accepted the request: ``queued`` until first scheduled, ``ttft`` until the first token,
  ``tpot`` mean time per output token after the first (0 when fewer than two), ``e2e`` until finished.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    TypeAdapter,
    field_validator,
    model_validator,
)

from engine.kv.events import EventPage
from engine.kv.pins import CachePolicy
from engine.usage import Usage as EngineUsage

# The environment variable that carries the internal token, for engines, gateways and workers alike.
INTERNAL_TOKEN_ENV = "TOLLGATE_INTERNAL_TOKEN"
# Error codes: a missing or wrong internal token (401); a replica that is draining (503 on /generate).
INTERNAL_TOKEN_CODE = "invalid_internal_token"
DRAINING_CODE = "engine_draining"
# A request (or an adapter check) naming an adapter its replica's store does not hold: deleted, or a store
# the replica does not share with the gateways.
ADAPTER_NOT_FOUND_CODE = "adapter_not_found"

FinishReasonName = Literal["stop", "length", "abort", "error"]

MAX_STOP_SEQUENCES = 16
MAX_TOP_LOGPROBS = 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ResponseFormat(_Strict):
    """Structured output. ``json_object``: any JSON object; ``json_schema``: JSON matching ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and not isinstance(self.json_schema, dict):
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        return self


class PoolingSpec(_Strict):
    """An embedding request (``engine.pooling``); a field left out takes the checkpoint's pooling."""

    mode: Literal["last", "mean", "first"] | None = None
    normalize: bool | None = None


class CacheSpec(_Strict):
    """A request's prompt-cache lifetimes (``engine.kv.pins.CachePolicy``, which says what each means)."""

    prefix_tokens: int | None = Field(default=None, ge=0)
    ttl_s: float = Field(default=0.0, ge=0.0, le=7 * 86_400)
    retention_s: float = Field(default=0.0, ge=0.0, le=7 * 86_400)
    persist: bool = True

    @model_validator(mode="after")
    def _consistent(self) -> CacheSpec:
        self.policy()  # its rules across fields (a contradiction is a 400, not a failure later)
        return self

    def policy(self) -> CachePolicy:
        return CachePolicy(**self.model_dump())


class KVTransferSpec(_Strict):
    """Disaggregated serving (``engine.kv.connector``): where a prompt's KV blocks are held. A prefill
    replica's final record carries it; the decode request carries it back (``on_failure``: what the decode
    replica does when the pull fails, ``recompute`` or ``fail``; None: the replica's default)."""

    host: str = Field(min_length=1, max_length=255)
    port: int = Field(ge=1, le=65535)
    lease_id: str = Field(min_length=1, max_length=64)
    num_tokens: int | None = Field(default=None, ge=0)
    on_failure: Literal["recompute", "fail"] | None = None


class KVPullReport(BaseModel):
    """A decode replica's final record: the prompt tokens the pulled blocks served, and why the pull failed
    (None: it did not)."""

    pulled_tokens: int
    error: str | None = None


class GenerateRequest(_Strict):
    """One generation request. Sampling fields mirror ``engine.sampling_params.SamplingParams``."""

    request_id: str = Field(min_length=1, max_length=256)
    prompt_token_ids: list[int] = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    # None: up to the end of the model's context.
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_SEQUENCES)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    # The prompt tokens' logprobs with this many alternatives (vLLM's ``prompt_logprobs``); None: none.
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    skip_special_tokens: bool = True
    # Who is asking: fair sharing between tenants and the prefix-cache salt default.
    tenant: str = ""
    # Prefix-cache isolation: requests only share cached blocks with requests of the same salt.
    cache_salt: str | None = None
    # Lower runs first (interactive tiers above batch).
    priority: int = 0
    # An embedding instead of tokens: the final record carries it, with zero completion tokens.
    pooling: PoolingSpec | None = None
    # Prompt-cache lifetimes; None: the cache's defaults (implicit, no pins).
    cache: CacheSpec | None = None
    # Predicted Outputs: the output expected, mostly (an edited file), as token ids: drafts for
    # speculative decoding; the final usage says how many were accepted and rejected.
    prediction_token_ids: list[int] | None = None
    # The LoRA adapter its tokens run through, by id in the replica's adapter store (``--lora-dir``).
    lora: str | None = Field(default=None, min_length=1, max_length=128)
    # A decode replica: the prefill replica's lease on this prompt's blocks (its final record's).
    kv_transfer: KVTransferSpec | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def sampling_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``SamplingParams`` (without ``max_tokens`` when it is None: the engine
        fills in the rest of the context)."""
        kwargs = self.model_dump(
            include={
                "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
                "skip_special_tokens", "prompt_logprobs",
            }
        )
        if kwargs["max_tokens"] is None:
            del kwargs["max_tokens"]
        kwargs["logprobs"] = self.top_logprobs if self.logprobs else None
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            kwargs["json_object"] = True
        elif fmt is not None and fmt.type == "json_schema":
            kwargs["json_schema"] = fmt.json_schema
        return kwargs


class AbortRequest(_Strict):
    request_id: str = Field(min_length=1, max_length=256)


class AdapterCheckRequest(_Strict):
    """``POST /lora/check``: read the adapter ``lora`` of the replica's adapter store and check it against
    the served model, as serving it would (``engine.lora.adapter``)."""

    lora: str = Field(min_length=1, max_length=128)


class AdapterCheckResponse(BaseModel):
    """An adapter the replica can serve: its content digest (what prefix-cache keys use), rank, the
    projections it modifies and its weights' size in bytes (float32)."""

    lora: str
    digest: str
    rank: int
    target_modules: list[str]
    num_bytes: int


class TopLogprob(BaseModel):
    token_id: int
    logprob: float


class TokenLogprob(BaseModel):
    """Log-probability of a sampled token and, if asked for, of the most likely alternatives."""

    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob] = Field(default_factory=list)
    # A scored prompt token's rank in its position's distribution (1: the likeliest).
    rank: int | None = None


class DeltaRecord(BaseModel):
    type: Literal["delta"] = "delta"
    request_id: str
    index: int = 0
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    # Once per stream, before or with its first tokens, when the request asked for ``prompt_logprobs``: one
    # record per prompt token, the first null.
    prompt_logprobs: list[TokenLogprob | None] | None = None


# The final usage on the wire: ``engine.usage.Usage`` in its flat form (every kind by its field name). The
# three base counts are required; a kind a replica older than it does not send reads as 0.
_REQUIRED_USAGE_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens")


def _usage_from_wire(value: Any) -> EngineUsage:
    if isinstance(value, EngineUsage):
        return value
    if not isinstance(value, dict):
        raise ValueError("usage must be an object")
    if missing := [name for name in _REQUIRED_USAGE_FIELDS if name not in value]:
        raise ValueError(f"usage lacks {', '.join(missing)}")
    return EngineUsage.from_fields(value)


Usage = Annotated[EngineUsage, BeforeValidator(_usage_from_wire), PlainSerializer(EngineUsage.fields)]


class AbortResponse(BaseModel):
    """``aborted``: the request was running and is stopped now. ``usage``: what the engine computed for it,
    as its final record reports (None if unknown to the replica, failed, or still running after the wait)."""

    aborted: bool
    usage: Usage | None = None


class Timings(BaseModel):
    """Seconds on the engine's clock since the request was accepted (``tpot``: per output token)."""

    queued: float
    ttft: float
    tpot: float
    e2e: float


class FinalRecord(BaseModel):
    type: Literal["final"] = "final"
    request_id: str
    finish_reasons: list[FinishReasonName]
    usage: Usage
    timings: Timings
    # An embedding request's vector (``GenerateRequest.pooling``).
    embedding: list[float] | None = None
    # A prefill replica: where the prompt's blocks are leased. A decode replica: what its pull brought.
    kv_transfer: KVTransferSpec | None = None
    kv_pull: KVPullReport | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorRecord(BaseModel):
    """An error: the body of a ``400`` before streaming, or the last line of a failed stream."""

    type: Literal["error"] = "error"
    request_id: str | None = None
    error: ErrorInfo


StreamRecord = Annotated[DeltaRecord | FinalRecord | ErrorRecord, Field(discriminator="type")]
_record_adapter: TypeAdapter[DeltaRecord | FinalRecord | ErrorRecord] = TypeAdapter(StreamRecord)


def parse_record(line: bytes | str) -> DeltaRecord | FinalRecord | ErrorRecord:
    """Parse one NDJSON line of a ``/generate`` stream."""
    return _record_adapter.validate_python(orjson.loads(line))


def encode_record(record: BaseModel) -> bytes:
    """One NDJSON line (with its trailing newline)."""
    return orjson.dumps(record.model_dump(exclude_none=True)) + b"\n"


class HealthResponse(BaseModel):
    """``GET /health``: 200 with ``ok`` while the replica takes requests, 503 with ``draining`` once it
    got SIGTERM."""

    status: Literal["ok", "draining"] = "ok"
    model: str
    pool: str


class LivenessResponse(BaseModel):
    """``GET /live``: 200 ``ok``, or 503 ``stalled`` with the ``reason`` when the replica cannot recover
    by itself (a step stuck, requests waiting with no step finishing, steps that keep failing)."""

    status: Literal["ok", "stalled"] = "ok"
    model: str
    pool: str
    reason: str | None = None


class InfoResponse(BaseModel):
    model: str
    pool: str
    max_model_len: int
    vocab_size: int
    block_size: int
    eos_token_ids: list[int]
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # True for ``--model synthetic`` (a load-test stand-in that runs no model).
    synthetic: bool = False
    # Embeddings: their length (the model's hidden size) and the checkpoint's pooling mode.
    embedding_dimensions: int | None = None
    pooling: str | None = None
    # Ranks the model is split over (tensor parallelism; 1: the whole model on one device).
    tensor_parallel_size: int = 1
    # Disaggregated serving: ``both``, ``prefill`` or ``decode`` (``engine.kv.connector``).
    role: str = "both"


class CacheReport(BaseModel):
    """A replica's prefix cache by tier (``LoadReport.cache``): prompt tokens looked up and served from
    each tier since start, blocks held / capacity / held by lifetimes (pinned on the host, retained on
    disk) in the lower tiers, blocks moved between tiers by kind since start, and one block's bytes."""

    query_tokens: int
    hit_tokens_by_tier: dict[str, int]
    tier_blocks: dict[str, int] = Field(default_factory=dict)
    tier_capacity: dict[str, int] = Field(default_factory=dict)
    pinned_blocks: dict[str, int] = Field(default_factory=dict)
    moved_blocks: dict[str, int] = Field(default_factory=dict)
    block_bytes: int = 0


class LoadReport(BaseModel):
    """What the gateway routes and admits on. Rates are exponential moving averages."""

    model: str
    pool: str
    waiting: int
    running: int
    # Prompt tokens still to be computed by waiting and running requests (prefill backlog).
    pending_prefill_tokens: int
    # The same backlog by engine priority (lower runs first; JSON object keys are the priorities as
    # strings). Empty when the engine does not break it down: then all of it counts as ahead of any
    # new request (``gateway.admission.shedding``).
    pending_prefill_tokens_by_priority: dict[int, int] = Field(default_factory=dict)
    kv_usage: float
    num_kv_blocks: int
    free_kv_blocks: int
    prefix_hit_rate: float
    num_preemptions: int
    # Recent throughput: tokens computed per second of engine step time (prefill and decode together).
    tokens_per_s: float
    # Recent mean wall time of one engine step, seconds.
    step_time_s: float
    # Recent mean time to first token of finished requests, seconds.
    ttft_s: float
    # The prefix cache by tier (None: an engine that does not report it).
    cache: CacheReport | None = None
    # True once the replica got SIGTERM: it refuses new requests and finishes its streams.
    draining: bool = False
    # Disaggregated serving: pulls, leases and the blocks they hold (empty in role ``both``).
    kv_transfer: dict[str, int] = Field(default_factory=dict)
    # The LoRA adapters (ids in its adapter store) the replica holds read in memory, most recently used
    # last: a request for one of them starts without reading its bundle (the gateway prefers these).
    adapters: list[str] = Field(default_factory=list)


class PurgeRequest(_Strict):
    """``POST /kv/purge``: the tenant's cache salt whose blocks every tier drops."""

    cache_salt: str | None


class KVEventsResponse(BaseModel):
    """``GET /kv/events``: the engine start it comes from (``epoch``), the sequence number it brings the
    reader to, and either the events after the reader's cursor (``[seq, "stored" | "removed", tier,
    hash hex]``) or, when ``snapshot`` is set, every held hash (hex) with its tiers as a bit set (device 1,
    host 2, disk 4) as of ``seq``: the reader replaces its view of the replica with it."""

    epoch: str
    seq: int
    events: list[tuple[int, str, str, str]]
    snapshot: dict[str, int] | None = None


def encode_kv_events(page: EventPage) -> bytes:
    """The ``KVEventsResponse`` body of a page of events (built directly: it may carry many hashes)."""
    snapshot = None if page.snapshot is None else {d.hex(): bits for d, bits in page.snapshot.items()}
    return orjson.dumps({"epoch": page.epoch, "seq": page.seq, "snapshot": snapshot,
                         "events": [(seq, kind, tier, d.hex()) for seq, kind, tier, d in page.events]})
