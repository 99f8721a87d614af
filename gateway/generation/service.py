"""One generation from admission to settlement: the one service that chat, completions and batch lines
call (``run_generation``), whatever wire format they answer in.

``Generation`` runs the request path after validation and tokenization (docs/architecture.md, "Request
path", steps 4-7):
price → shed check → admission (reserve prompt + max_tokens) → route (prefix affinity, retry on
another replica while nothing has started) → engine streams → settle + meter.

Invariants:
- ``start()`` raises every error that can happen before the engine accepted the work (rate limits,
  overload, no replica, engine 400), so the endpoint can still answer with a proper status code.
- After ``start()`` succeeded, ``finish()`` runs exactly once whatever happens (normal end, engine
  failure, client disconnect, bug): it closes the engine streams (which aborts them within one engine
  step), settles the admission with the tokens really used, and appends exactly one usage record
  (status ``completed``, ``failed`` or ``cancelled``) to the billing outbox. Tokens generated before a
  failure or a disconnect are billed; recomputation is the engine's business and never billed.
- A stream that ends without the engine's final record (the client went away, the gateway gave up) is
  billed for what the engine computed until its abort took effect: the usage ``POST /abort`` returns,
  the engine's own count (docs/batch-and-billing.md, "Abandoned requests"), which is at least what was
  written to the client. Only when the replica cannot say (it died) the gateway bills what it read.
- A request the gateway itself gives up on before answering (``void()``: a non-streamed request cut at
  shutdown, answered 503 ``server_shutting_down`` for the client to retry elsewhere; a non-streamed
  request whose answer is an error; a request with several prompts whose later prompt could not start;
  a batch line whose lease another chain took over) is metered as ``failed`` with zero tokens and zero
  cost: the client got nothing from that attempt, and its retry is billed in full. A batch line's void
  attempt appends no record at all: every attempt of a line has the line's request id, and the ledger
  keeps the first row of a request id.
- Several prompts (legacy completions with a list prompt) are several engine requests run
  concurrently; their records are merged and re-indexed as ``prompt_index * n + i``; usage is summed.
- Prices, the ledger's ``request_class`` and admission come from the runtime: a ``GatewayRuntime``
  meters ``interactive``; the batch tier runs the same pipeline on a runtime whose ``request_class`` is
  ``batch`` (``gateway.batches.runtime``). Admission is an ``AdmissionPolicy``: the service calls the
  same four methods on either, and never asks which one it has.
- An embeddings request (``sampling["pooling"]``) generates nothing: admission holds and the ledger bills
  its prompt tokens at the model's embedding input price (``billing.prices``, ``embedding=True``), while
  its token reservation still counts the one token per prompt the engine request asks for.
- Predicted Outputs (``prediction``): the engine's rejected prediction tokens are added to
  ``completion_tokens`` (billed as output, as OpenAI bills them), and the usage record carries the
  accepted and rejected counts to the ledger, for chat completions and batch lines alike; its admission
  reserves the prediction's length on top of ``max_tokens``.
- The GenAI server metrics (``engine.otel_metrics``, when the ``OTEL_*`` variables turn them on) count
  every request once, here and nowhere else: ``finish()`` records it, or ``start()`` does for one refused
  before admission (``_observe``); attributes shared with the request's span (``gateway.tracing``).
- After ``finish()``, ``cost_pico_usd`` is what the request was billed and ``served_pool`` the pool of
  the replica that ran it (what a batch line records); wire formats live with the endpoints.
- The engine request id is the gateway request id (suffixed ``-<prompt index>`` for several prompts),
  so logs on both sides join on it.
- A ``routing_key`` (the request's ``prompt_cache_key``; empty means none) reaches the router only as
  an HMAC keyed by the tenant's cache salt (``tenant_routing_key``): one tenant's requests with one key
  share a replica, and no routing identity is shared across tenants. Every replica choice of the
  request (shed check, first try, failover) uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind

from billing.outbox import UsageRecord
from billing.price_cache import PricesNotLoaded
from billing.prices import Charge, Price, PriceNotFound, max_cost_pico_usd
from engine.kv.block_hash import adapter_cache_salt, prefix_block_hashes
from engine.protocol import CacheSpec, DeltaRecord, ErrorRecord, FinalRecord, GenerateRequest
from engine.usage import TokenKind, Usage
from gateway.admission import Admission
from gateway.admission.rejections import count_rejections
from gateway.admission.shedding import should_shed
from gateway.auth import Principal
from gateway.deps import GatewayRuntime
from gateway.engine_client import EngineStream, EngineStreamError, EngineUnavailable
from gateway.errors import GatewayError, InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from gateway.generation.disaggregation import Prefill, merged_usage, prefill, remote_prefill_wanted
from gateway.generation.metering import billed_usage, charged, price_at
from gateway.metrics import observe_generation
from gateway.routing import ModelRoute, Replica
from gateway.tenants.cache_salt import cache_salt
from gateway.tracing import (
    child_span,
    current,
    current_operation,
    end,
    error_type,
    fail,
    metric_attributes,
    request_attributes,
    result_attributes,
)

logger = logging.getLogger("tollgate.gateway.generation")

STATUS_COMPLETED = "completed"
STATUS_FAILED = "failed"
STATUS_CANCELLED = "cancelled"


def tenant_routing_key(salt: str, routing_key: str | None) -> bytes | None:
    """The router's key for a request's ``prompt_cache_key`` (None without one): an HMAC under the
    tenant's cache salt, so the same key string of two tenants routes independently."""
    if not routing_key:
        return None
    return hmac.new(salt.encode(), f"prompt_cache_key:{routing_key}".encode(), hashlib.sha256).digest()


@dataclass
class Generation:
    runtime: GatewayRuntime
    principal: Principal
    route: ModelRoute
    request_id: str
    prompts: list[list[int]]
    sampling: dict[str, Any]
    n: int
    max_tokens: int | None
    tier: str
    routing_key: str | None = None
    # Prompt-cache lifetimes for the engine (``gateway.openai.caching``); None: the defaults.
    cache: CacheSpec | None = None
    # Predicted Outputs: the tokens the answer is expected to repeat (drafts for the engine).
    prediction: list[int] | None = None
    usage: Usage = field(default_factory=Usage)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    status: str = STATUS_COMPLETED
    error: GatewayError | None = None
    admission: Admission | None = None
    cost_pico_usd: int = 0  # billed, once finish() ran
    # Embedding requests (``sampling["pooling"]``): each prompt's vector, by completion index.
    embeddings: dict[int, list[float]] = field(default_factory=dict)
    _streams: list[tuple[EngineStream, Replica]] = field(default_factory=list)
    # Disaggregated serving: each engine request's prompt prefilled on a prefill replica, by request id.
    _prefills: dict[str, Prefill] = field(default_factory=dict)
    _finals: int = 0
    _final_streams: set[int] = field(default_factory=set)  # prompt indices whose final usage is known
    _generated: int = 0
    _finished: bool = False
    _void: bool = False
    _record: UsageRecord | None = None  # built once: final_record() or finish()
    _started_at: float = field(default_factory=time.monotonic)
    _created_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    _first_token_at: float | None = None
    _last_final_at: float | None = None  # when the last stream's final record came: its last token
    _ttft_ms: float | None = None
    _tpot_ms: float | None = None
    _renewal: asyncio.Task[None] | None = None  # renews the admission lease until finish()
    _router_key: bytes | None = None
    _block_size: int = 16
    # The price in effect when the request was admitted (``start``): what it is billed at, whenever it ends.
    _price: Price | None = None
    # Tracing on (``gateway.tracing``): the request's span, which the result goes on, and each prompt's
    # engine call span until its stream ended.
    _span: Span | None = None
    _calls: list[Span | None] = field(default_factory=list)
    # GenAI metrics on (``engine.otel_metrics``): the API operation being served, taken when it started.
    _operation: str | None = None

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def embedding(self) -> bool:
        """An embeddings request (``sampling["pooling"]``): priced at the model's embedding input price."""
        return "pooling" in self.sampling

    @property
    def _adapter_id(self) -> str | None:
        """The adapter store id of the LoRA adapter the request runs through (None: the base model)."""
        return None if self.route.adapter is None else self.route.adapter.store_id

    @property
    def served_pool(self) -> str | None:
        """The pool of the replica that ran the (first) prompt; None if none did."""
        return self._streams[0][1].pool if self._streams else None

    @property
    def headers(self) -> dict[str, str]:
        return self.admission.headers if self.admission else {}

    # -- before the response starts ---------------------------------------------------------------
    async def start(self) -> None:
        if self.runtime.genai_metrics is not None:
            self._operation = current_operation()
        try:
            await self._start()
        except BaseException as exc:
            if not self._finished:  # refused before admission: no finish() records it
                self._observe(time.monotonic(), exc)
            raise

    async def _start(self) -> None:
        rt = self.runtime
        settings = rt.settings
        if rt.tracer is not None and (span := trace.get_current_span()).is_recording():
            self._span = span  # the request's (gateway.tracing.TracingMiddleware)
            span.set_attributes(request_attributes(
                model=self.route.name, tenant_id=self.principal.tenant_id, tier=self.tier,
                max_tokens=self.max_tokens, n=self.n, sampling=self.sampling))
        try:
            # Priced by the row in effect when it arrived (as the ledger's rollups re-price it), not when
            # it ends: a stream running across a price change keeps the price its hold was made at.
            price = self._price = price_at(rt.prices, self.route, self._created_at)
        except PriceNotFound:
            raise ServiceUnavailableError(
                f"The model `{self.route.name}` has no price configured and cannot be served.",
                code="model_not_priced", headers={"x-should-retry": "false"}) from None
        except PricesNotLoaded:
            raise ServiceUnavailableError(
                "The gateway is still loading its prices from the database; retry shortly.",
                code="prices_unavailable", headers={"retry-after": "1"}) from None
        info = self.route.info()
        per_completion = self.max_tokens
        if per_completion is None:
            per_completion = settings.default_max_tokens_reservation
        completion_budget = per_completion * self.n * len(self.prompts)
        # The cost held against the budget is the most the request can cost: without max_tokens the engine
        # may generate to the end of the context, so that (the token reservation, an estimate for the rate
        # limits, keeps the default). Held for less, requests admitted meanwhile could overshoot the budget
        # by more than one request's cost (docs/batch-and-billing.md, "Spend caps").
        cost_completion = completion_budget
        if self.max_tokens is None and info is not None:
            cost_completion = sum(max(0, info.max_model_len - len(p)) for p in self.prompts) * self.n
        if self.prediction:  # rejected prediction tokens are billed as output: at most the prediction's
            completion_budget += len(self.prediction) * self.n * len(self.prompts)
            cost_completion += len(self.prediction) * self.n * len(self.prompts)
        salt = cache_salt(settings.key_hash_secret.get_secret_value(), self.principal.tenant_id)
        self._router_key = tenant_routing_key(salt, self.routing_key)
        block_size = self._block_size = info.block_size if info is not None else 16
        # What each prompt may find cached (explicit mode: nothing past its breakpoint): what routing, shed
        # checks and the routing index's expectations look at.
        cacheable = None if self.cache is None or self.cache.prefix_tokens is None else (
            self.cache.prefix_tokens // block_size)
        adapter = self.route.adapter
        # An adapter's blocks are keyed by its contents too, as its replicas key them (their K/V differ).
        block_salt = salt if adapter is None else adapter_cache_salt(salt, adapter.digest)
        hashes = [prefix_block_hashes(p, block_size, block_salt)[:cacheable] for p in self.prompts]
        # Overload shedding on the replica the first prompt would go to (before any tokens are reserved),
        # crediting the prefix it probably holds (agents resending long prefixes cost little prefill).
        with child_span(rt.tracer, "admission", attributes={"tollgate.tier": self.tier}):
            async with count_rejections(rt.redis, self.principal.tenant_id, rt.request_class, tier=self.tier):
                first = rt.router.pick(self.route.served, hashes[0], routing_key=self._router_key,
                                       adapter=self._adapter_id)
                if first.load is not None:
                    cached = min(rt.router.cached_prefix_blocks(first, hashes[0]) * block_size,
                                 max(0, len(self.prompts[0]) - 1))
                    decision = should_shed(first.load, self.prompt_tokens, self.tier, settings.tiers, cached)
                    if decision is not None:
                        raise decision.error()
                self.admission = await rt.admission.admit(
                    self.principal.tenant, self.request_id, self.prompt_tokens + completion_budget,
                    max_cost_pico_usd(price, self.prompt_tokens, 0 if self.embedding else cost_completion,
                                      rt.request_class, embedding=self.embedding,
                                      cache_pin=self.cache is not None and self.cache.ttl_s > 0,
                                      cache_retention=self.cache is not None and self.cache.retention_s > 0),
                )
        try:
            priority = settings.tiers[self.tier].engine_priority
            for index, (prompt, prompt_hashes) in enumerate(zip(self.prompts, hashes, strict=True)):
                engine_id = self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"
                request = GenerateRequest(
                    request_id=engine_id, prompt_token_ids=prompt, n=self.n, max_tokens=self.max_tokens,
                    tenant=str(self.principal.tenant_id), cache_salt=salt, priority=priority,
                    cache=self.cache, prediction_token_ids=self.prediction or None, lora=self._adapter_id,
                    **self.sampling,
                )
                stream, replica, call = await self._open(request, prompt_hashes)
                self._streams.append((stream, replica))
                self._calls.append(call)
            self._renewal = asyncio.get_running_loop().create_task(
                self._renew_lease(), name=f"tollgate-lease-{self.request_id}")
        except BaseException as exc:
            # The client is answered an error: nothing of this attempt reaches it, so nothing is billed,
            # not even the prompts that had already started (several prompts: the first opened, the
            # second found no replica). A batch line's attempt then leaves no record to shadow its retry.
            self.void()
            if isinstance(exc, GatewayError):
                self.error = exc
            with anyio.CancelScope(shield=True):
                await self.finish()
            raise

    async def _open(self, request: GenerateRequest,
                    block_hashes: Sequence[bytes]) -> tuple[EngineStream, Replica, Span | None]:
        """The engine stream of ``request``, the replica it runs on, and its call's span (tracing on)."""
        router = self.runtime.router
        tracer = self.runtime.tracer
        tried: list[Replica] = []
        last_error: EngineUnavailable | None = None
        while True:
            with child_span(tracer, "routing") as routing:
                try:
                    replica = router.pick(self.route.served, block_hashes, exclude=tried,
                                          routing_key=self._router_key, adapter=self._adapter_id)
                except ServiceUnavailableError:
                    if last_error is not None:
                        raise last_error from None
                    raise
                if routing.is_recording():
                    routing.set_attributes({"tollgate.replica.url": replica.url,
                                            "tollgate.replica.pool": replica.pool,
                                            "tollgate.routing.excluded": len(tried)})
            # Counted on the decode replica before a remote prefill, which may take a while: requests
            # picked meanwhile see it busy.
            replica.inflight += 1
            try:
                send = await self._with_prefill(request, replica, block_hashes, first=not tried)
            except BaseException:
                replica.inflight -= 1
                raise
            call = None if tracer is None else tracer.start_span(
                "POST /generate", kind=SpanKind.CLIENT,
                attributes={"http.request.method": "POST", "url.full": f"{replica.url}/generate",
                            "tollgate.replica.pool": replica.pool, "tollgate.request.id": request.request_id})
            try:
                with current(call):  # the engine continues the trace under the call (its traceparent)
                    stream = await self.runtime.engine.generate(replica.url, send)
            except EngineUnavailable as exc:
                # Nothing started there: try another replica. Only a refused connection means the
                # replica is gone, and a draining one takes nothing new; a busy one (503, pool
                # timeout) stays in.
                end(call, exc)
                replica.inflight -= 1
                if exc.refused:
                    router.mark_failed(replica, exc.message)
                elif exc.draining:
                    router.mark_draining(replica)
                tried.append(replica)
                last_error = exc
                continue
            except InvalidRequestError as exc:
                end(call, exc)
                replica.inflight -= 1
                if exc.param == "lora" and self.route.adapter is not None:
                    # The replica has no such bundle: the adapter was deleted since this gateway looked it
                    # up (its directory had not heard yet). It no longer exists, as for anyone else.
                    if self.runtime.adapters is not None:
                        self.runtime.adapters.forget(self.route.name)
                    raise ModelNotFoundError(self.route.name) from None
                raise
            except BaseException as exc:
                end(call, exc)
                replica.inflight -= 1
                raise
            router.remember(replica, block_hashes)
            if self._adapter_id is not None:
                router.remember_adapter(replica, self._adapter_id)
            return stream, replica, call

    async def _with_prefill(self, request: GenerateRequest, replica: Replica, block_hashes: Sequence[bytes],
                            *, first: bool) -> GenerateRequest:
        """``request`` as ``replica`` gets it: with the lease on its prompt's blocks when it is a decode
        replica and the prompt was (on the first try: is now) prefilled on a prefill replica
        (``gateway.generation.disaggregation``); as it is otherwise."""
        rt = self.runtime
        decoding = replica.info is not None and replica.info.role == "decode"
        if first and remote_prefill_wanted(rt.settings, rt.router, self.route, replica, request, block_hashes,
                                           self._block_size):
            with child_span(rt.tracer, "prefill"):
                done = await prefill(rt.engine, rt.router, self.route, request, block_hashes,
                                     rt.settings.disagg_on_failure)
            if done is not None:
                self._prefills[request.request_id] = done
        done = self._prefills.get(request.request_id)
        if done is None or not decoding:
            return request
        return request.model_copy(update={"kv_transfer": done.transfer})

    @property
    def reports_lifetimes(self) -> bool:
        """Whether the request asked for a ttl or a retention (its answer then says what was held)."""
        return self.cache is not None and bool(self.cache.ttl_s or self.cache.retention_s)

    # -- streaming ------------------------------------------------------------------------------
    def ready(self) -> bool:
        """True when the next record (or the end) is already here: reading it waits on no network.
        The SSE writer coalesces frames while this holds (``gateway.openai.streaming``)."""
        if len(self._streams) == 1:
            return self._streams[0][0].buffered()
        return False

    async def records(self) -> AsyncIterator[DeltaRecord]:
        """Delta records of every prompt (``index`` re-numbered across prompts). Usage and finish
        reasons accumulate on ``self``; an engine failure sets ``status``/``error`` and ends the stream."""
        if len(self._streams) == 1:
            async for record in self._consume(0, self._streams[0][0]):
                yield record
            return
        queue: asyncio.Queue[DeltaRecord | None] = asyncio.Queue()

        async def pump(index: int, stream: EngineStream) -> None:
            try:
                async for record in self._consume(index, stream):
                    await queue.put(record)
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, (s, _) in enumerate(self._streams)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _consume(self, prompt_index: int, stream: EngineStream) -> AsyncIterator[DeltaRecord]:
        offset = prompt_index * self.n
        streamed = 0
        try:
            async for record in stream:
                if isinstance(record, DeltaRecord):
                    if self._first_token_at is None and record.token_ids:
                        self._first_token_at = time.monotonic()
                        if self._span is not None:
                            self._span.add_event("first_token")
                    self._generated += len(record.token_ids)
                    streamed += len(record.token_ids)
                    if offset:
                        record.index += offset
                    yield record
                elif isinstance(record, FinalRecord):
                    self._final_streams.add(prompt_index)
                    prefilled = self._prefills.get(stream.request_id)
                    if prefilled is not None:
                        record.usage = merged_usage(record.usage, record.kv_pull, prefilled)
                    if "error" in record.finish_reasons:
                        # The replica could not finish it (a failed KV pull where the request asked to fail
                        # rather than recompute): an error for the client, billed only if it got tokens.
                        reason = record.kv_pull.error if record.kv_pull is not None else None
                        self._fail(EngineStreamError(
                            "The engine could not complete the request" + (f" ({reason})" if reason else "")
                            + ". Please retry.", code="engine_error"))
                        if not streamed:
                            record.usage = Usage()
                    self._final(offset, record)
                elif isinstance(record, ErrorRecord):
                    self._fail(EngineStreamError(record.error.message, code=record.error.code))
                    return
        except EngineStreamError as exc:
            self._fail(exc)
        finally:
            self._end_call(prompt_index)

    def _end_call(self, prompt_index: int) -> None:
        """End the engine call's span of a prompt (once: its stream ended, or ``finish`` closed it)."""
        if self._calls and self._calls[prompt_index] is not None:
            end(self._calls[prompt_index], self.error if prompt_index not in self._final_streams else None)
            self._calls[prompt_index] = None

    def _final(self, offset: int, record: FinalRecord) -> None:
        self._finals += 1
        if self._finals == len(self._streams):
            self._last_final_at = time.monotonic()
        self._add_usage(record.usage)
        for i, reason in enumerate(record.finish_reasons):
            self.finish_reasons[offset + i] = reason
        if record.embedding is not None:
            self.embeddings[offset] = record.embedding
        if self._ttft_ms is None:
            self._ttft_ms = record.timings.ttft * 1000.0
            self._tpot_ms = record.timings.tpot * 1000.0

    def _add_usage(self, usage: Usage) -> None:
        # Rejected prediction tokens count as completion tokens (billed as output), as OpenAI counts them;
        # the engine's output counts the tokens it emitted.
        rejected = Usage({TokenKind.OUTPUT: usage[TokenKind.REJECTED_PREDICTION]})
        self.usage = self.usage + usage + rejected

    def _fail(self, error: GatewayError) -> None:
        if self.error is None:
            logger.warning("engine failed request %s: %s", self.request_id, error.message)
            self.error = error
            self.status = STATUS_FAILED

    async def _renew_lease(self) -> None:
        """Keep the admission lease (the concurrency slot and the cost hold) alive every third of its ttl
        until ``finish``: on a timer, not on the engine's records, since a request may go longer than the
        ttl without one (an embedding sends none; a long queue or prefill; a slow client holding the
        writer back). A lease lapses only when its gateway is gone."""
        interval = self.runtime.settings.stream_lease_ttl_s / 3
        while not self._finished and self.admission is not None:
            await asyncio.sleep(interval)
            with contextlib.suppress(Exception):  # Redis away for a moment: the next renewal retries
                await self.runtime.admission.renew_lease(self.admission)

    # -- the end --------------------------------------------------------------------------------
    def cancel(self) -> None:
        """The client went away. A request whose every stream already ended stays ``completed``
        (servers report a disconnect right after the last byte of a finished response, too)."""
        if self.status == STATUS_COMPLETED and self._finals < len(self._streams):
            self.status = STATUS_CANCELLED

    def interrupt(self) -> None:
        """Stop reading the engine streams now (the client went away): their connections close, which
        aborts the engine work within one step, and ``records()`` ends without an error."""
        for stream, _ in self._streams:
            stream.interrupt()

    def void(self) -> None:
        """The gateway gives up on this request before answering it (shutdown): nothing is billed."""
        self._void = True
        self.status = STATUS_FAILED

    async def finish(self) -> None:
        """Close streams, settle, meter: exactly once (see the module invariants). Never raises."""
        if self._finished:
            return
        self._finished = True
        ended_at = self._last_final_at or time.monotonic()
        await self._settle()
        self._observe(ended_at)
        if self._span is not None and self._span.is_recording():
            self._span.set_attributes(result_attributes(
                model=self.route.name, usage=self.usage, finish_reasons=self.finish_reasons,
                cost_pico_usd=self.cost_pico_usd, status=self.status))
            if self.error is not None:
                fail(self._span, self.error)

    def _observe(self, ended_at: float, refusal: BaseException | None = None) -> None:
        """The request in the GenAI server metrics, when they are on: once, from ``finish`` (or from
        ``start``, for a request refused before admission: ``refusal``). Its duration from its start until
        ``ended_at`` (its last token: the last final record, else its end), with ``error.type`` when it
        failed (not when its client went away); for a completed one, the time to its first token as the
        gateway saw it (like ``tollgate_gateway_ttft_seconds``) and the engine's time per output token after
        it; the input and output tokens its client was told of (what it is billed), unless the engine ran
        none of it or it bills nothing (``void``). Never raises."""
        metrics = self.runtime.genai_metrics
        if metrics is None:
            return
        try:
            error = refusal or self.error
            failed = error is not None or self.status == STATUS_FAILED
            completed = self.status == STATUS_COMPLETED and not failed
            counted = bool(self._streams) and not self._void
            metrics.record(
                metric_attributes(operation=self._operation, model=self.route.name, tier=self.tier),
                duration_s=ended_at - self._started_at,
                error_type=error_type(error) if error is not None else "_OTHER" if failed else None,
                ttft_s=(self._first_token_at - self._started_at
                        if completed and self._first_token_at is not None else None),
                tpot_s=self._tpot_ms / 1000 if completed and self._tpot_ms else None,
                input_tokens=self.usage.prompt_tokens if counted else None,
                output_tokens=self.usage.completion_tokens if counted and not self.embedding else None)
        except Exception:  # observability must never break a request or its metering
            logger.exception("recording the GenAI metrics of request %s failed", self.request_id)

    async def _settle(self) -> None:
        if self._renewal is not None:
            # Not awaited (finish never waits on it): a renewal already sent after the settle below finds
            # the lease gone and revives nothing (renew.lua).
            self._renewal.cancel()
        if self._finals < len(self._streams) and self.status == STATUS_COMPLETED:
            self.status = STATUS_CANCELLED
        for index, (stream, replica) in enumerate(self._streams):
            replica.inflight -= 1
            if not stream.closed:
                await stream.aclose()
            self._end_call(index)
            if index not in self._final_streams:
                # Ended before its final record: the engine's own count, once the abort took effect.
                engine_usage = await self.runtime.engine.abort(replica.url, stream.request_id)
                prefilled = self._prefills.get(stream.request_id)
                if engine_usage is not None and prefilled is not None:
                    engine_usage = merged_usage(engine_usage, None, prefilled)
                if engine_usage is not None:
                    self._final_streams.add(index)
                    self._finals += 1
                    self._add_usage(engine_usage)
        if self._finals < len(self._streams):
            # The replica could not say what it computed (it died): bill what we saw being generated.
            self.usage = self.usage.replace(
                prompt_tokens=self.prompt_tokens if self._streams else 0,
                completion_tokens=max(self.usage.completion_tokens, self._generated))
        if self._void:
            self.usage = Usage()
        if self.admission is None:
            return
        rt = self.runtime
        # A batch line's attempt that bills nothing leaves no ledger row: the line's request id is the same
        # on every attempt, and the ledger keeps a request id's first row, so a void attempt's row would
        # shadow the retry that answers (and bills) the line.
        if not self._streams or (self._void and rt.request_class == "batch"):
            self.cost_pico_usd = self._charge().total
            try:
                await rt.admission.settle(self.admission, self.usage.total_tokens, self.cost_pico_usd)
            except Exception:
                logger.exception("settling request %s failed (its lease will expire)", self.request_id)
            return
        record = self._record if self._record is not None and not self._void else self._usage_record()
        self.cost_pico_usd = record.cost_pico_usd
        settle_error, append_error = await rt.admission.settle_and_append(
            self.admission, self.usage.total_tokens, record.cost_pico_usd, record)
        if settle_error is not None:
            logger.error("settling request %s failed (its lease will expire): %r", self.request_id,
                         settle_error)
        observe_generation(model=record.model, tier=self.tier, status=self.status, usage=record.usage,
                           tpot_s=(self._tpot_ms or 0) / 1000,
                           ttft_s=(None if self._first_token_at is None
                                   else self._first_token_at - self._started_at))
        if append_error is not None:
            if rt.usage_spool is not None:
                rt.usage_spool.keep(record)  # replayed into the outbox once Redis answers
            else:
                logger.error("USAGE NOT RECORDED for request %s: %r (%r)", self.request_id, record,
                             append_error)

    def final_record(self) -> UsageRecord | None:
        """The usage record ``finish`` will meter, once every stream ended with its final record and
        nothing failed (None before that, or for a request that failed or bills nothing). A background
        response stores it with its final state, so that a worker killed before metering loses no usage
        (``gateway.responses.background``); ``finish`` then meters this very record."""
        if (self._record is None and self.admission is not None and self._streams and not self._void
                and self.error is None and self._finals == len(self._streams)):
            self._record = self._usage_record()
        return self._record

    def _billed_usage(self) -> Usage:
        return billed_usage(self.usage, embedding=self.embedding)

    def _charge(self) -> Charge:
        """The request's cost per kind, priced once, at the price it was admitted at."""
        price = self._price
        if price is None:
            try:
                price = price_at(self.runtime.prices, self.route, self._created_at)
            except Exception:
                logger.exception("pricing request %s failed", self.request_id)
        return charged(self._billed_usage(), price, self.runtime.request_class, embedding=self.embedding,
                       request_id=self.request_id)

    def _usage_record(self) -> UsageRecord:
        ttft = self._ttft_ms
        if ttft is None and self._first_token_at is not None:
            ttft = (self._first_token_at - self._started_at) * 1000.0
        assert self.admission is not None
        return UsageRecord.charged(
            request_id=self.request_id, tenant_id=self.principal.tenant_id,
            api_key_id=self.principal.api_key_id, model=self.route.name,
            request_class=self.runtime.request_class, tier=self.tier, usage=self._billed_usage(),
            costs=self._charge(), status=self.status, ttft_ms=ttft, tpot_ms=self._tpot_ms,
            created_at=self._created_at,
        )


async def run_generation(runtime: GatewayRuntime, principal: Principal, route: ModelRoute, request_id: str,
                         prompts: list[list[int]], sampling: dict[str, Any], *, n: int,
                         max_tokens: int | None, tier: str, routing_key: str | None = None,
                         cache: CacheSpec | None = None, prediction: list[int] | None = None) -> Generation:
    """A started generation (see the module invariants): the engine has accepted every prompt, or this
    raised the error to answer with, and nothing is left to settle."""
    generation = Generation(runtime=runtime, principal=principal, route=route, request_id=request_id,
                            prompts=prompts, sampling=sampling, n=n, max_tokens=max_tokens, tier=tier,
                            routing_key=routing_key, cache=cache, prediction=prediction)
    await generation.start()
    return generation
