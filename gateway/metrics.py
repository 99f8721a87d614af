"""Gateway observability and graceful drain, as a ``gateway.app`` extension module.

Metrics (Prometheus text at ``GET /metrics``, not in the OpenAPI schema). A scrape must present
``Authorization: Bearer <token>``: ``TOLLGATE_METRICS_TOKEN`` (what a Prometheus scrape config carries)
or an admin API token; anything else is a 401 in OpenAI's error body.

- ``tollgate_gateway_requests_total{route, method, status}`` and
  ``tollgate_gateway_request_duration_seconds{route}``: every HTTP request, labelled with the matched
  route *template* (``/v1/files/{file_id}``; ``unmatched`` for 404s on unknown paths), so the label set
  stays bounded whatever clients send. A stream's duration is the whole stream.
- ``tollgate_gateway_requests_in_flight``: requests whose response has not ended.
- ``tollgate_gateway_rejections_total{reason, tier}``: refusals before any engine work (the reasons of
  ``gateway.admission.rejections``: ``rpm``, ``tpm``, ``concurrency``, ``budget``, ``suspended``,
  ``overloaded``, ``unavailable``).
- ``tollgate_gateway_tokens_total{kind, model, tier}``: metered tokens, ``kind`` one of ``prompt``,
  ``cached`` (the part of ``prompt`` served from the prefix cache), ``cached_host`` and ``cached_disk``
  (the parts of ``cached`` the engine loaded from its host-memory and disk tiers; the rest came from the
  device pool), ``cache_write`` (prompt tokens newly written to the cache) and ``completion``: exactly the
  numbers of the usage record each generation appends to the billing outbox.
- ``tollgate_gateway_generations_total{model, tier, status}``: generations by how they ended.
- ``tollgate_gateway_kv_index_blocks{replica, tier}``: block hashes this process's routing index says a
  replica holds per tier (every process follows the same events, so the merged value is the largest);
  ``tollgate_gateway_kv_index_snapshots_total{replica}``: rebuilds of a replica's view from a snapshot
  (a gateway start, a replica restart, or a gap).
- ``tollgate_gateway_ttft_seconds{model, tier}``: time to first token as the gateway sees it (request
  accepted → first token from the engine: admission, routing and queueing included);
  ``tollgate_gateway_tpot_seconds{model, tier}``: the engine's time per output token of the request.

No label carries a tenant id, key or request id: per-tenant figures belong to the ledger, and metrics
cardinality must not grow with the number of customers.

Several worker processes: ``tollgate gateway`` sets ``PROMETHEUS_MULTIPROC_DIR`` (a fresh directory per
run) before uvicorn starts its workers; ``prometheus_client`` then keeps every value in per-process
memory-mapped files there, and a scrape of any worker merges all of them
(``MultiProcessCollector``), so ``/metrics`` is the same whole-gateway view whichever worker answers.
A worker that stops removes its live gauge file (``mark_process_dead``). Without the variable (tests,
embedding the app), metrics live in this process's own registry.

Drain: uvicorn's ``timeout_graceful_shutdown`` (``settings.drain_timeout_s``) stops accepting on SIGTERM,
lets open responses (streams included) finish, then *cancels* the request tasks that are still running and
starts the lifespan shutdown at once, without waiting for the cancelled tasks. A cancelled generation
settles and meters in a shielded ``finally`` (``gateway.openai.streaming``) that needs Redis and the engine
client, which the lifespan shutdown closes. So this extension's lifespan, exited before ``gateway.api``'s
(it is listed after it in ``tollgate.gateway_app``), waits until every request tracked by its middleware has
ended (bounded by ``drain_timeout_s`` again; normally milliseconds): each cut stream is then billed exactly
once, as ``cancelled`` with the tokens the engine computed for it (docs/batch-and-billing.md, "Abandoned
requests"). The middleware answers a request cut before its response started with 503
``server_shutting_down`` + ``retry-after`` (SDKs retry it) instead of uvicorn's 500, and such a request is
metered as ``failed`` with nothing billed (``Generation.void``); a cut stream's connection is closed
(clients see a broken stream, never a truncated answer that looks whole). ``tollgate gateway`` makes the
uvicorn parent close its listening socket on SIGTERM, so new connections are refused at once with several
workers too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import lru_cache
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.usage import CACHE_TIERS, KINDS, Usage
from gateway.errors import AuthenticationError, error_body
from gateway.tenants.keys import bearer_token

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

logger = logging.getLogger("tollgate.gateway.metrics")

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                     60.0, 120.0, 300.0, 600.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                 0.2, 0.3, 0.5, 1.0)


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


class GatewayMetrics:
    """The gateway's metric families (one instance per process: ``gateway_metrics()``)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, values

        if multiprocess_dir() and values.ValueClass.__name__ != "MmapedValue":
            # prometheus_client chose its value class when first imported, before the variable was set
            # (an embedding process): choose again so these metrics are shared between workers.
            values.ValueClass = values.get_value_class()
        self.multiprocess = multiprocess_dir() is not None
        # In multiprocess mode the values live in files; the registry only names the families.
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter("tollgate_gateway_requests", "HTTP requests by route template, method and "
                                "status.", ["route", "method", "status"], registry=reg)
        self.duration = Histogram("tollgate_gateway_request_duration_seconds", "HTTP request duration "
                                  "(a stream: until its end).", ["route"], buckets=_DURATION_BUCKETS,
                                  registry=reg)
        self.in_flight = Gauge("tollgate_gateway_requests_in_flight", "Requests whose response has not "
                               "ended.", registry=reg, multiprocess_mode="livesum")
        self.rejections = Counter("tollgate_gateway_rejections", "Requests refused before any engine work, "
                                  "by reason and tier.", ["reason", "tier"], registry=reg)
        self.tokens = Counter("tollgate_gateway_tokens", "Metered tokens by kind: each token kind "
                              "(engine.usage) by its field name less _tokens (prompt, cached, ...).",
                              ["kind", "model", "tier"], registry=reg)
        self.generations = Counter("tollgate_gateway_generations", "Generations by how they ended.",
                                   ["model", "tier", "status"], registry=reg)
        self.ttft = Histogram("tollgate_gateway_ttft_seconds", "Time to first token seen by the gateway.",
                              ["model", "tier"], buckets=_TTFT_BUCKETS, registry=reg)
        self.tpot = Histogram("tollgate_gateway_tpot_seconds", "Time per output token (engine-measured).",
                              ["model", "tier"], buckets=_TPOT_BUCKETS, registry=reg)
        self.kv_index_blocks = Gauge("tollgate_gateway_kv_index_blocks", "Block hashes the routing index "
                                     "says a replica holds, by tier.", ["replica", "tier"], registry=reg,
                                     multiprocess_mode="max")
        self.kv_index_snapshots = Counter("tollgate_gateway_kv_index_snapshots", "Rebuilds of a replica's "
                                          "routing index from a snapshot.", ["replica"], registry=reg)
        # Label lookups cost a lock and a few dict probes; the hot path reuses bound children.
        self._request_children: dict[tuple[str, str, int], Any] = {}
        self._duration_children: dict[str, Any] = {}

    def render(self) -> bytes:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        if not self.multiprocess:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged)
        return generate_latest(merged)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        key = (route, method, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, method, str(status))
        child.inc()
        duration = self._duration_children.get(route)
        if duration is None:
            duration = self._duration_children[route] = self.duration.labels(route)
        duration.observe(seconds)

    def process_stopping(self) -> None:
        if self.multiprocess:
            from prometheus_client.multiprocess import mark_process_dead

            mark_process_dead(os.getpid())


@lru_cache(maxsize=1)
def gateway_metrics() -> GatewayMetrics:
    return GatewayMetrics()


def observe_rejection(reason: str, tier: str) -> None:
    """A request was refused before any engine work (``gateway.admission.rejections`` reasons)."""
    gateway_metrics().rejections.labels(reason, tier).inc()


def observe_generation(*, model: str, tier: str, status: str, usage: Usage, ttft_s: float | None,
                       tpot_s: float | None) -> None:
    """A generation was settled and metered (called once per usage record). Never raises."""
    try:
        m = gateway_metrics()
        for kind, spec in KINDS.items():
            if count := usage[kind]:
                m.tokens.labels(spec.field.removesuffix("_tokens"), model, tier).inc(count)
        m.generations.labels(model, tier, status).inc()
        if ttft_s is not None:
            m.ttft.labels(model, tier).observe(ttft_s)
        if tpot_s:
            m.tpot.labels(model, tier).observe(tpot_s)
    except Exception:  # observability must never break metering
        logger.exception("recording generation metrics failed")


def observe_kv_index(replica: str, blocks: dict[str, int], new_snapshots: int) -> None:
    """A replica's routing index after following its events. Never raises."""
    try:
        m = gateway_metrics()
        for tier, count in blocks.items():
            m.kv_index_blocks.labels(replica, tier).set(count)
        if new_snapshots:
            m.kv_index_snapshots.labels(replica).inc(new_snapshots)
    except Exception:
        logger.exception("recording routing index metrics failed")


def forget_kv_index(replica: str) -> None:
    """A replica left its pool (``gateway.replicas``): its index series read 0, and leave the registry of
    a single-process gateway (a fleet whose pods come and go must not grow a series per address forever;
    with several workers, ``prometheus_client`` cannot remove a series from its files, so it stays at
    0 until the gateway restarts). Never raises."""
    try:
        m = gateway_metrics()
        for tier in CACHE_TIERS:
            m.kv_index_blocks.labels(replica, tier).set(0)
        if MULTIPROC_ENV in os.environ:
            return
        for tier in CACHE_TIERS:
            m.kv_index_blocks.remove(replica, tier)
        with contextlib.suppress(KeyError):
            m.kv_index_snapshots.remove(replica)
    except Exception:
        logger.exception("forgetting routing index metrics failed")


_SHUTTING_DOWN_BODY = orjson.dumps(error_body(
    "The server is shutting down and could not finish your request in time. Please retry.",
    "server_error", code="server_shutting_down"))


class InFlight:
    """Requests whose ASGI call has not returned yet (their cleanup included)."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def exit(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


def route_template(scope: Scope) -> str:
    """The matched route's template (``/v1/files/{file_id}``), rebuilt from the request path and the
    path parameters routing extracted (nested and included routers only know their own part of it);
    ``unmatched`` when no route matched, so unknown paths cannot grow the label set."""
    if scope.get("route") is None:
        return "unmatched"
    path: str = scope.get("path", "")
    end = len(path)
    # Parameters in path order; replace from the right so a value equal to a literal segment earlier in
    # the path (``/v1/models/v1``) is not mistaken for it.
    for name, value in reversed(list((scope.get("path_params") or {}).items())):
        at = path.rfind(f"/{value}", 0, end) if value != "" else -1
        if at >= 0:
            path = f"{path[:at]}/{{{name}}}{path[at + 1 + len(str(value)):]}"
            end = at
    return path


class MetricsMiddleware:
    """Outermost pure-ASGI layer: counts and times every HTTP request and tracks the ones in flight."""

    def __init__(self, app: ASGIApp, in_flight: InFlight) -> None:
        self.app = app
        self.in_flight = in_flight
        self.metrics = gateway_metrics()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app fails before answering
        responded = False
        metrics = self.metrics

        async def send_status(message: Message) -> None:
            nonlocal status, responded
            if message["type"] == "http.response.start":
                status, responded = message["status"], True
            await send(message)

        self.in_flight.enter()
        metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        except asyncio.CancelledError:
            # Only uvicorn cancels a request task: at shutdown, once the drain timeout has passed. The
            # app's own cleanup (settle + meter) already ran, shielded. Answer what is still possible.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            logger.warning("%s %s cut at shutdown: still running when the drain timeout passed",
                           scope.get("method"), scope.get("path"))
            if not responded:
                status = 503
                headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                           (b"content-length", str(len(_SHUTTING_DOWN_BODY)).encode())]
                request_id = scope.get("state", {}).get("request_id")  # set by RequestContextMiddleware
                if request_id:
                    headers.append((b"x-request-id", request_id.encode()))
                await send({"type": "http.response.start", "status": 503, "headers": headers})
                await send({"type": "http.response.body", "body": _SHUTTING_DOWN_BODY})
            # A started response (a stream) just ends: uvicorn closes the connection, which clients and
            # SDKs report as a broken stream rather than mistaking the partial answer for a whole one.
        finally:
            self.in_flight.exit()
            metrics.in_flight.dec()
            metrics.observe_request(route_template(scope), scope.get("method", ""), status,
                                    time.perf_counter() - started)


router = APIRouter()


_METRICS_CHALLENGE = {"www-authenticate": 'Bearer realm="tollgate-metrics"'}
_METRICS_MISSING = ("/metrics needs a bearer token: the metrics token (TOLLGATE_METRICS_TOKEN; the scrape "
                    "config's `authorization: {credentials: ...}`) or an admin API token.")
_METRICS_INVALID = "Incorrect metrics token provided."


async def _scrape_allowed(request: Request, presented: str) -> bool:
    """The metrics token (constant-time compare, no I/O) or an admin API token (one indexed lookup)."""
    settings = request.app.state.settings
    expected = settings.metrics_token.get_secret_value() if settings.metrics_token is not None else ""
    if expected and hmac.compare_digest(presented.encode(), expected.encode()):
        return True
    from gateway.admin.auth import authenticate_admin_token, is_admin_token

    if not is_admin_token(presented):
        return False
    async with request.app.state.db.session() as session:
        return await authenticate_admin_token(session, presented, settings) is not None


@router.get("/metrics", include_in_schema=False)
async def metrics_endpoint(request: Request) -> Response:
    """Prometheus text, for a bearer token only (``_scrape_allowed``): the figures (traffic, rejections
    by reason, token volumes) are the operator's, not the public's. Otherwise 401 with OpenAI's body."""
    presented = bearer_token(request.headers.get("authorization"))
    if presented is None:
        return AuthenticationError(_METRICS_MISSING, code=None, headers=_METRICS_CHALLENGE).to_response()
    if not await _scrape_allowed(request, presented):
        return AuthenticationError(_METRICS_INVALID, code="invalid_metrics_token",
                                   headers=_METRICS_CHALLENGE).to_response()
    return Response(gateway_metrics().render(), media_type=CONTENT_TYPE)


def install(app: FastAPI) -> None:
    app.state.in_flight = InFlight()
    app.add_middleware(MetricsMiddleware, in_flight=app.state.in_flight)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    try:
        yield
    finally:
        in_flight: InFlight = app.state.in_flight
        if in_flight.count:
            logger.info("waiting for %d request(s) to settle before shutting down", in_flight.count)
            if not await in_flight.wait_idle(app.state.settings.drain_timeout_s):
                logger.error("%d request(s) still running at shutdown", in_flight.count)
        gateway_metrics().process_stopping()
