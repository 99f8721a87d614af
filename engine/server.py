"""An engine replica's internal HTTP server (FastAPI + uvicorn). The wire schema is ``engine.protocol``.

- ``POST /generate``: validates the request fully (schema, sampling parameters, context length, vocab)
  and answers ``400`` with an error record before streaming if anything is wrong — never a 500, and
  nobody else's request is affected. Otherwise streams NDJSON: delta records, then one final record
  (or an error record if the engine failed). ``max_tokens`` omitted means "up to the end of the
  context". Closing the HTTP stream aborts the request before the engine's next step.
- ``POST /abort`` ``{"request_id"}``: 200 ``{"aborted": bool, "usage": {...} | null}``: ``aborted`` false if
  it was not in flight; ``usage`` the request's final usage, once the abort took effect (waited for up to
  ``ABORT_USAGE_WAIT_S``: the step loop applies aborts between steps), or of a request that ended
  earlier (``engine.recent_requests``). The gateway bills an abandoned stream by it.
- ``GET /health`` (200 once the model is loaded: the app exists only after that), ``GET /info``,
  ``GET /load``, ``GET /metrics`` (Prometheus text from the replica's own registry).
- ``GET /kv/events?epoch=&after=&limit=&wait_s=``: the prefix cache's block events after a cursor (with
  ``wait_s``, a long poll: it answers as soon as there is one), or a snapshot of every held block hash
  when the cursor is of another engine start or too old (``engine.kv.events``;
  the wire form is ``engine.protocol.KVEventsResponse``). The gateways' routing index follows it.
- ``POST /lora/check`` ``{"lora"}``: read and check adapter ``lora`` of the replica's adapter store
  (``--lora-dir``) against the served model; 200 with its digest, rank, targets and size, or 400 naming
  what does not fit. The gateway registers an adapter only after a replica said yes.
- ``POST /kv/purge`` ``{"cache_salt"}``: drop one tenant's cached blocks from every tier (device, host,
  disk files); 200 ``{"purged_blocks": n}``.

In front of every route, ``engine.gate``: the internal token (every path but ``/health`` and ``/metrics``)
and the drain on SIGTERM (``/health`` 503 ``draining``, new ``/generate`` refused with 503
``engine_draining``, running streams finished within ``drain_timeout_s``).

``serve(model, ...)`` builds the engine and runs uvicorn (one worker: the engine owns the device). The
internal token comes from the argument or ``TOLLGATE_INTERNAL_TOKEN``; without one the replica may only
listen on a loopback address (checked before the model loads). Traces are on when the ``OTEL_*``
variables ask for them (``engine.tracing``): a span per ``/generate``, continuing the caller's
``traceparent``.
``model="synthetic"`` runs ``engine.synthetic.SyntheticEngine`` instead, which emits tokens on a timer
without any model — a stand-in for gateway load tests only, never a default.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import gc
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError as SchemaError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.async_engine import EngineError, RequestStream
from engine.config import EngineConfig
from engine.gate import (
    CUT_GRACE_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    Drain,
    DrainingServer,
    ReplicaGate,
    check_internal_token,
)
from engine.kv.connector import RemoteKV
from engine.kv.events import KVEventLog
from engine.kv.pins import DEFAULT_POLICY, CachePolicy
from engine.lora.adapter import LoRAAdapter
from engine.metrics import CONTENT_TYPE
from engine.outputs import CompletionDelta, EngineStats, RequestValidationError
from engine.pooling import PoolingParams
from engine.protocol import (
    INTERNAL_TOKEN_ENV,
    AbortRequest,
    AbortResponse,
    AdapterCheckRequest,
    AdapterCheckResponse,
    CacheReport,
    ErrorInfo,
    ErrorRecord,
    GenerateRequest,
    HealthResponse,
    InfoResponse,
    LivenessResponse,
    LoadReport,
    PurgeRequest,
    encode_kv_events,
    encode_record,
)
from engine.recent_requests import RecentRequests
from engine.sampler import Logprob
from engine.sampling_params import SamplingParams
from engine.tracing import RequestTrace, Tracing, configure

logger = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
MAX_EVENTS_WAIT_S = 10.0
# How long ``/abort`` waits for the aborted request's final usage: an abort takes effect between steps, so
# one step (a long prefill chunk on a CPU: well under a second) plus the delivery.
ABORT_USAGE_WAIT_S = 5.0
# /live: a replica whose step loop has not finished a step for this long with requests queued is stuck (a
# step takes milliseconds to seconds; the first compiles are done before the server starts).
LIVENESS_STALL_S = float(os.environ.get("TOLLGATE_ENGINE_LIVENESS_STALL_S", "120"))


class ServingEngine(Protocol):
    """What the server needs from an engine (``AsyncEngine`` or ``SyntheticEngine``)."""

    model_name: str
    pool: str
    max_model_len: int

    pooling: PoolingParams  # the checkpoint's embedding pooling
    kv_events: KVEventLog  # what its prefix cache holds, in order

    def purge_cache(self, cache_salt: str | None) -> concurrent.futures.Future[int]: ...

    async def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                          tenant: str = "", cache_salt: str | None = None, priority: int = 0,
                          pooling: PoolingParams | None = None,
                          cache_policy: CachePolicy = DEFAULT_POLICY,
                          prediction: list[int] | None = None, lora: str | None = None,
                          kv_source: RemoteKV | None = None) -> RequestStream: ...

    def abort(self, request_id: str) -> bool: ...

    def stats(self) -> EngineStats: ...

    def check_adapter(self, lora: str) -> LoRAAdapter: ...

    def resident_adapters(self) -> list[str]: ...

    def stalled(self, stall_s: float) -> str | None: ...

    def info(self) -> dict[str, Any]: ...

    def render_metrics(self) -> bytes: ...

    def shutdown(self) -> None: ...



def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
           request_id: str | None = None, code: str | None = None) -> JSONResponse:
    record = ErrorRecord(request_id=request_id,
                         error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(record.model_dump(exclude_none=True), status_code=status)


def _param_of(message: str) -> str | None:
    """SamplingParams messages start with the parameter's name (``top_p must be ...``)."""
    head = message.split(" ", 1)[0].rstrip("[]")
    return head if head in SamplingParams.__dataclass_fields__ else None


def _delta_line(request_id: str, completion: CompletionDelta) -> bytes:
    """One ``DeltaRecord`` line, dumped straight from the engine's objects (the hot path: one per
    token per stream; the pydantic models are the schema, and the tests parse the stream with them)."""
    record: dict[str, Any] = {"type": "delta", "request_id": request_id, "index": completion.index,
                              "token_ids": completion.token_ids, "text": completion.text}
    if completion.logprobs is not None:
        record["logprobs"] = [_logprob(r) for r in completion.logprobs]
    if completion.prompt_logprobs is not None:
        record["prompt_logprobs"] = [None if r is None else _logprob(r) for r in completion.prompt_logprobs]
    return orjson.dumps(record) + b"\n"


def _logprob(r: Logprob) -> dict[str, Any]:
    out = {"token_id": r.token_id, "logprob": r.logprob,
           "top_logprobs": [{"token_id": t, "logprob": lp} for t, lp in r.top_logprobs]}
    if r.rank is not None:
        out["rank"] = r.rank
    return out


async def _ndjson(stream: RequestStream, trace: RequestTrace | None = None) -> AsyncIterator[bytes]:
    request_id = stream.request_id
    try:
        async for delta in stream:
            lines = [_delta_line(request_id, c) for c in delta.completions
                     if c.token_ids or c.text or c.prompt_logprobs is not None]
            if delta.finished and delta.usage is not None and delta.timings is not None:
                final: dict[str, Any] = {"type": "final", "request_id": request_id,
                                         "finish_reasons": delta.finish_reasons or [],
                                         "usage": delta.usage.fields(), "timings": asdict(delta.timings)}
                if delta.embedding is not None:
                    final["embedding"] = delta.embedding
                if delta.kv_transfer is not None:
                    final["kv_transfer"] = delta.kv_transfer
                if delta.kv_pull is not None:
                    final["kv_pull"] = delta.kv_pull
                lines.append(orjson.dumps(final) + b"\n")
                if trace is not None:
                    trace.finished(delta.finish_reasons or [], delta.usage, delta.timings)
            if lines:
                yield b"".join(lines)
    except (EngineError, RequestValidationError) as exc:
        kind = "invalid_request_error" if isinstance(exc, RequestValidationError) else "server_error"
        if trace is not None:
            trace.failed(kind)
        yield encode_record(ErrorRecord(request_id=request_id, error=ErrorInfo(message=str(exc), type=kind)))
    finally:
        stream.close()  # the client went away (or the stream ended): abort if still running
        if trace is not None:
            trace.end()


def create_app(engine: ServingEngine, *, internal_token: str | None = None,
               drain: Drain | None = None, tracing: Tracing | None = None) -> FastAPI:
    """The replica's FastAPI app over an already-loaded engine (shut down with the app). With
    ``internal_token``, every path but ``/health`` and ``/metrics`` needs it; ``drain`` is the state that
    ``DrainingServer`` flips on SIGTERM (a fresh one when omitted: ``app.state.drain``); with ``tracing``
    (``engine.tracing``) every ``/generate`` records a span, flushed when the app shuts down."""
    drain = drain or Drain()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The model, torch and the server's imports (~270k objects for the tiny checkpoint) live as long
        # as the process: move them out of the collector's sight, so that a full collection walks only
        # what requests allocate. Over the whole heap one took ~130 ms on the 2-core dev box, with the
        # step thread and every stream stopped meanwhile.
        gc.collect()
        gc.freeze()
        yield
        engine.shutdown()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(title="Tollgate engine replica", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    recent = app.state.recent_requests = RecentRequests()
    app.state.drain = drain
    app.add_middleware(ReplicaGate, token=internal_token, drain=drain)

    @app.exception_handler(SchemaError)
    async def schema_error(request: Request, exc: SchemaError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        message = first.get("msg", "invalid request")
        param = ".".join(loc) or None
        return _error(400, f"{param}: {message}" if param else message, param)

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Response:
        if tracing is None:
            return await _generate(body, None)
        trace = RequestTrace(tracing.tracer, request.headers, {
            "tollgate.request.id": body.request_id, "gen_ai.request.model": engine.model_name,
            "tollgate.engine.pool": engine.pool, "tollgate.engine.tenant": body.tenant,
            "tollgate.priority": body.priority, "gen_ai.request.temperature": body.temperature,
            **({} if body.max_tokens is None else {"gen_ai.request.max_tokens": body.max_tokens}),
            **({} if body.n == 1 else {"gen_ai.request.choice.count": body.n}),
        })
        try:
            response = await _generate(body, trace)
        except BaseException as exc:
            trace.failed(type(exc).__qualname__)
            trace.end()
            raise
        trace.answered(response.status_code)
        if not isinstance(response, StreamingResponse):  # refused: the error answer is the whole response
            trace.end()
        return response

    async def _generate(body: GenerateRequest, trace: RequestTrace | None) -> Response:
        pooling = None
        if body.pooling is not None:  # an embedding: no sampling, one final record with the vector
            spec, default = body.pooling, engine.pooling
            pooling = PoolingParams(spec.mode or default.mode,
                                    default.normalize if spec.normalize is None else spec.normalize)
            params = SamplingParams(max_tokens=1, temperature=0.0)
        else:
            kwargs = body.sampling_kwargs()
            kwargs.setdefault("max_tokens", max(1, engine.max_model_len - len(body.prompt_token_ids)))
            try:
                params = SamplingParams(**kwargs)
            except ValueError as exc:
                return _error(400, str(exc), _param_of(str(exc)), request_id=body.request_id)
        cache_policy = DEFAULT_POLICY if body.cache is None else body.cache.policy()
        held = body.kv_transfer
        kv_source = None if held is None else RemoteKV(held.host, held.port, held.lease_id, held.on_failure)
        if trace is not None:
            trace.accepted()
        try:
            stream = await engine.add_request(body.request_id, body.prompt_token_ids, params,
                                              tenant=body.tenant, cache_salt=body.cache_salt,
                                              priority=body.priority, pooling=pooling,
                                              cache_policy=cache_policy, prediction=body.prediction_token_ids,
                                              lora=body.lora, kv_source=kv_source)
        except RequestValidationError as exc:
            return _error(400, exc.message, exc.param, request_id=body.request_id, code=exc.code)
        except EngineError as exc:
            return _error(503, str(exc), type_="server_error", request_id=body.request_id)
        recent.track(stream)
        return StreamingResponse(_ndjson(stream, trace), media_type=NDJSON)

    @app.post("/lora/check", response_model=None)
    async def lora_check(body: AdapterCheckRequest) -> AdapterCheckResponse | JSONResponse:
        try:
            adapter = await asyncio.to_thread(engine.check_adapter, body.lora)
        except RequestValidationError as exc:
            return _error(400, exc.message, exc.param, code=exc.code)
        return AdapterCheckResponse(lora=body.lora, digest=adapter.digest, rank=adapter.rank,
                                    target_modules=list(adapter.target_modules), num_bytes=adapter.num_bytes)

    @app.post("/abort")
    async def abort(body: AbortRequest) -> AbortResponse:
        aborted = engine.abort(body.request_id)
        usage = await recent.final_usage(body.request_id, ABORT_USAGE_WAIT_S)
        final = None if usage is None else usage.fields()
        return AbortResponse.model_validate({"aborted": aborted, "usage": final})

    @app.get("/health", response_model=None)
    async def health() -> HealthResponse | JSONResponse:
        if drain.draining:  # out of the Service and of every gateway's routing, at once
            body = HealthResponse(status="draining", model=engine.model_name, pool=engine.pool)
            return JSONResponse(body.model_dump(), status_code=503)
        return HealthResponse(model=engine.model_name, pool=engine.pool)

    @app.get("/live", response_model=None)
    async def live() -> LivenessResponse | JSONResponse:
        """Liveness (a Kubernetes liveness probe): 503 ``stalled`` when the replica cannot recover by
        itself (``AsyncEngine.stalled``); a draining replica is still alive."""
        reason = engine.stalled(LIVENESS_STALL_S)
        if reason is not None:
            body = LivenessResponse(status="stalled", model=engine.model_name, pool=engine.pool,
                                    reason=reason)
            return JSONResponse(body.model_dump(), status_code=503)
        return LivenessResponse(model=engine.model_name, pool=engine.pool)

    @app.get("/info")
    async def info() -> InfoResponse:
        return InfoResponse(**engine.info())

    @app.get("/load")
    async def load() -> LoadReport:
        s = engine.stats()
        return LoadReport(
            model=engine.model_name,
            pool=engine.pool,
            waiting=s.num_waiting,
            running=s.num_running,
            pending_prefill_tokens=s.pending_prefill_tokens,
            pending_prefill_tokens_by_priority=dict(s.pending_prefill_tokens_by_priority),
            kv_usage=s.kv_usage,
            num_kv_blocks=s.num_kv_blocks,
            free_kv_blocks=s.num_free_kv_blocks,
            prefix_hit_rate=s.prefix_hit_rate,
            num_preemptions=s.num_preemptions,
            tokens_per_s=s.tokens_per_s,
            step_time_s=s.step_time_s,
            ttft_s=s.ttft_s,
            cache=CacheReport(query_tokens=s.prefix_query_tokens,
                              hit_tokens_by_tier=s.prefix_hit_tokens_by_tier, tier_blocks=s.kv_tier_blocks,
                              tier_capacity=s.kv_tier_capacity, pinned_blocks=s.kv_pinned_blocks,
                              moved_blocks=s.kv_tier_moves, block_bytes=s.kv_block_bytes),
            draining=drain.draining,
            kv_transfer=dict(s.kv_transfer),
            adapters=engine.resident_adapters(),
        )

    @app.get("/kv/events")
    async def kv_events(after: int = 0, epoch: str | None = None, limit: int = 10_000,
                        wait_s: float = 0.0) -> Response:
        log = engine.kv_events
        if wait_s > 0 and not drain.draining and epoch == log.epoch and after >= log.seq:
            await asyncio.to_thread(log.wait, after, epoch, min(wait_s, MAX_EVENTS_WAIT_S))
        page = log.since(max(0, after), epoch, limit=max(1, min(limit, 100_000)))
        return Response(encode_kv_events(page), media_type="application/json")

    @app.post("/kv/purge")
    async def kv_purge(body: PurgeRequest) -> dict[str, int]:
        return {"purged_blocks": await asyncio.wrap_future(engine.purge_cache(body.cache_salt))}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.render_metrics(), media_type=CONTENT_TYPE)

    return app


def build_engine(model: str | EngineConfig, pool: str = "interactive", model_name: str | None = None,
                 **engine_kwargs: Any) -> ServingEngine:
    """The engine ``serve`` runs: an ``AsyncEngine`` over ``model`` (a checkpoint directory or a full
    ``EngineConfig``), or the synthetic stand-in for ``model == "synthetic"``."""
    if isinstance(model, EngineConfig):
        if engine_kwargs:
            raise ValueError(f"pass engine settings inside the EngineConfig, not as {sorted(engine_kwargs)}")
        config = model
    elif model == "synthetic":
        from engine.synthetic import SyntheticEngine

        return SyntheticEngine.from_engine_kwargs(pool=pool, model_name=model_name, **engine_kwargs)
    else:
        config = EngineConfig(model=str(model), **engine_kwargs)
    from engine.async_engine import AsyncEngine

    return AsyncEngine(config, model_name=model_name or Path(config.model).name, pool=pool)


def serve(model: str | EngineConfig, host: str = "127.0.0.1", port: int = 8100, pool: str = "interactive",
          model_name: str | None = None, *, internal_token: str | None = None,
          drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, **engine_kwargs: Any) -> None:
    """Load the model and serve it until SIGTERM (then drain) or a second signal. ``engine_kwargs`` are
    ``EngineConfig`` fields. ``ValueError`` before anything loads when the token does not fit ``host``."""
    import uvicorn

    token = internal_token if internal_token is not None else (os.environ.get(INTERNAL_TOKEN_ENV) or None)
    check_internal_token(token, host)
    tracing = configure("tollgate-engine")  # before the model loads: a bad OTEL_* setting fails at once
    drain = Drain(drain_timeout_s)
    engine = build_engine(model, pool=pool, model_name=model_name, **engine_kwargs)
    logger.info("engine %s (pool %s) listening on %s:%d (internal token %s, drain up to %.0f s, traces %s)",
                engine.model_name, pool, host, port, "required" if token else "off", drain_timeout_s,
                "on" if tracing else "off")
    app = create_app(engine, internal_token=token, drain=drain, tracing=tracing)
    config = uvicorn.Config(app, host=host, port=port, log_level="info", access_log=False,
                            timeout_graceful_shutdown=CUT_GRACE_S)
    DrainingServer(config, drain).run()
