"""The front door of an engine replica's server: internal authentication and drain on SIGTERM.

Internal authentication. A replica started with an internal token (``TOLLGATE_INTERNAL_TOKEN``, read by
``engine.server.serve``; the gateway and the Celery worker send the same one) answers ``/health`` and
``/metrics`` to anyone (Kubernetes probes, Prometheus) and every other path only to a caller that presents
``Authorization: Bearer <token>``; anything else is a 401 with an error record (``invalid_internal_token``),
before the request reaches a route. The token is compared in constant time (``hmac.compare_digest``).
Without a token a replica serves only on a loopback address (``check_internal_token``): a laptop's
``tollgate engine``, the tests; on any other address it refuses to start, so a replica in a shared
network can never run open by default. A token shorter than ``MIN_TOKEN_CHARS`` is refused too.

Drain. ``DrainingServer`` is uvicorn's server, except that the first SIGTERM (or SIGINT) does not stop
it: the replica keeps listening but is *draining* (``Drain``):
- ``GET /health`` answers 503 ``{"status": "draining"}`` at once, so a Kubernetes readiness probe takes
  the pod out of its Service, and ``GET /load`` says ``draining: true``, so every gateway's probe takes
  the replica out of routing;
- a new ``POST /generate`` is refused with 503 and the code ``engine_draining``, which the gateway reads
  as "try another replica" (failover, never an error to the tenant) and as a reason to stop sending here;
- ``GET /kv/events`` answers at once instead of holding a long poll;
- streams already running go on; once none is left, or ``drain_timeout_s`` has passed, the server
  stops as uvicorn stops (whatever still streams then is cut, ``CUT_GRACE_S`` later) and the process
  exits with status 0. A second signal stops at once.
So an orchestrator's grace period (``terminationGracePeriodSeconds``) must exceed ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from types import FrameType
from typing import Any

import orjson
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.protocol import DRAINING_CODE, INTERNAL_TOKEN_CODE, ErrorInfo, ErrorRecord

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/live", "/metrics"})
GENERATE_PATH = "/generate"
MIN_TOKEN_CHARS = 16
DEFAULT_DRAIN_TIMEOUT_S = 120.0
# After the drain (or its timeout), how long uvicorn lets the remaining connections finish.
CUT_GRACE_S = 2


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_internal_token(token: str | None, host: str) -> None:
    """``ValueError`` (with what to do) when a replica on ``host`` may not serve with this token."""
    if token is None:
        if not is_loopback(host):
            raise ValueError(
                f"an engine listening on {host} needs an internal token: set TOLLGATE_INTERNAL_TOKEN "
                "(the same value the gateways and workers get); only an engine on a loopback address "
                "may run without one")
        return
    if len(token) < MIN_TOKEN_CHARS or token != token.strip():
        raise ValueError(f"TOLLGATE_INTERNAL_TOKEN must be at least {MIN_TOKEN_CHARS} characters, without "
                         "surrounding whitespace (e.g. the output of `openssl rand -hex 32`)")


def _error_body(message: str, type_: str, code: str) -> bytes:
    return orjson.dumps(ErrorRecord(error=ErrorInfo(message=message, type=type_, code=code))
                        .model_dump(exclude_none=True))


_UNAUTHORIZED = _error_body("This engine endpoint needs the internal token (Authorization: Bearer <token>).",
                            "authentication_error", INTERNAL_TOKEN_CODE)
_DRAINING = _error_body("This replica is draining (shutting down); send the request to another replica.",
                        "server_error", DRAINING_CODE)


class Drain:
    """Whether the replica is draining, and how many ``/generate`` calls are still open."""

    def __init__(self, timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> None:
        if timeout_s < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        self.timeout_s = timeout_s
        self.draining = False
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.draining = True

    def enter(self) -> None:
        self.inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait(self) -> bool:
        """Until no ``/generate`` is open (True) or the timeout passed (False)."""
        try:
            await asyncio.wait_for(self._idle.wait(), self.timeout_s)
        except TimeoutError:
            return False
        return True


class ReplicaGate:
    """ASGI middleware in front of every route: the token check, then the drain's refusal and count."""

    def __init__(self, app: ASGIApp, token: str | None, drain: Drain) -> None:
        self.app = app
        self.drain = drain
        self._expected = f"Bearer {token}".encode() if token is not None else None

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self._expected or b"")
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self._expected is not None and path not in OPEN_PATHS and not self._authorized(scope):
            await _answer(send, 401, _UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        if path != GENERATE_PATH:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _answer(send, 503, _DRAINING, [(b"retry-after", b"1")])
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


async def _answer(send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain before the stop (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self._loop is None or not self.started:
            self.should_exit = True  # a second signal, or one before serving: stop now
            return
        self.drain.begin()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.create_task(self._drain_then_exit(), name="tollgate-engine-drain")

    async def _drain_then_exit(self) -> None:
        started, open_streams = time.monotonic(), self.drain.inflight
        logger.info("draining: %d stream(s) in flight, up to %.0f s", open_streams, self.drain.timeout_s)
        if await self.drain.wait():
            logger.info("drained in %.1f s", time.monotonic() - started)
        else:
            logger.warning("drain timeout (%.0f s): cutting %d stream(s)", self.drain.timeout_s,
                           self.drain.inflight)
        self.should_exit = True
