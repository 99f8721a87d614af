"""HTTP client for engine replicas (``engine/protocol.py``), on aiohttp.

A hand-written HTTP/1.1 client (``asyncio.Protocol`` + ``httptools``) served here until issue #16's
trial: side by side at 300 RPS, it saved 9.9% of the gateway's CPU per non-streamed request and 5.2%
per streamed one against this aiohttp client (``benchmarks/RESULTS.md``), under the 10% that would
justify keeping ~500 lines of protocol code, so it was deleted.

- Connections are kept alive per replica by aiohttp's connector (at most ``max_connections``), and an
  idle one is dropped after ``KEEPALIVE_EXPIRY_S``, before the engine's uvicorn closes it (its keep-alive
  timeout is 5 s). A request whose reused connection turns out closed by the server before any response
  byte is sent once more on a fresh connection (the engine never saw it).
- ``/generate`` answers NDJSON: body bytes are split into lines as they arrive and each line is parsed
  once (``engine.protocol.parse_record``). ``EngineStream.buffered`` tells whether the next record is
  already here, so the SSE writer can coalesce writes. The socket is read only as the consumer asks for
  more lines, so aiohttp's flow control pauses a replica that streams faster than its client reads.
- Timeouts: ``connect_timeout_s`` for connecting (and for waiting on a free connection when
  ``max_connections`` per replica are busy); ``request_timeout_s`` between two reads of a response
  (a ``/generate`` stream, and a ``/kv/purge``, which deletes files before it answers; the admin
  service that purges bounds the whole call itself). Probes and ``/kv/events`` use a short one.

A ``/generate`` sent while a span is current (tracing on: ``gateway.tracing``) carries its W3C
``traceparent``, so the engine's span of the request joins the gateway's trace.

Every request carries the internal token (``settings.internal_token``) as ``Authorization: Bearer``: an
engine started with one answers nothing else but ``/health`` and ``/metrics`` without it (``engine.gate``).

Error mapping (what the client of the gateway sees):
- The replica cannot be reached, or refuses for overload (``429``/``503``) → ``EngineUnavailable``
  (a ``ServiceUnavailableError``, 503). ``retryable`` is true: nothing started, so the caller may send
  the request to another replica. ``refused`` is true when nothing listens at the address; ``draining``
  when the replica refused because it is shutting down (the router takes it out at once).
- The engine refuses the internal token (``401``) → ``EngineUnavailable`` too (a misconfigured replica
  is one the router cannot use; another may do), logged by the caller with the engine's message.
- The engine refuses the request (``400`` with an ``ErrorRecord``) → ``InvalidRequestError`` (400) with
  the engine's message and param.
- Any other answer, a broken stream, or an ``ErrorRecord`` line mid-stream → ``EngineStreamError``
  (502); tokens already streamed are still billed by the caller.
Closing an ``EngineStream`` (``aclose``) or interrupting it before its response ended closes the
connection, which aborts the request in the engine within one step; a stream read to its end returns
the connection to the pool.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar

import aiohttp
import orjson
from pydantic import BaseModel, ValidationError

from engine.protocol import (
    ADAPTER_NOT_FOUND_CODE,
    DRAINING_CODE,
    AbortRequest,
    AbortResponse,
    AdapterCheckRequest,
    AdapterCheckResponse,
    DeltaRecord,
    ErrorRecord,
    FinalRecord,
    GenerateRequest,
    HealthResponse,
    InfoResponse,
    LoadReport,
    PurgeRequest,
    Usage,
    parse_record,
)
from engine.tracing import inject
from gateway.errors import InvalidRequestError, ServiceUnavailableError, UpstreamError
from tollgate.settings import Settings

logger = logging.getLogger("tollgate.gateway.engine_client")
Record = DeltaRecord | FinalRecord | ErrorRecord
KEEPALIVE_EXPIRY_S = 4.0
# The engine waits up to this long for an aborted request's final usage (``engine.server``).
ABORT_USAGE_WAIT_S = 5.0
M = TypeVar("M", bound=BaseModel)
# A kept-alive connection the server had closed: nothing was answered, the request may be sent again.
_NOT_ANSWERED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class EngineUnavailable(ServiceUnavailableError):
    """The replica could not take the request; nothing was generated (safe to try another replica)."""

    retryable = True

    def __init__(self, message: str = "The model is temporarily unavailable. Please retry.", *,
                 refused: bool = False, draining: bool = False) -> None:
        super().__init__(message)
        # True when nothing listens at the address (the replica is certainly down), as opposed to a
        # slow or odd answer from a process that is alive.
        self.refused = refused
        # True when the replica refused because it is draining (SIGTERM): it will take nothing new.
        self.draining = draining


class EngineStreamError(UpstreamError):
    """The engine failed after accepting the request (broken stream or an error record)."""

    def __init__(self, message: str = "The engine failed while generating. Please retry.",
                 *, code: str | None = None) -> None:
        super().__init__(message, code=code)


class EngineStream:
    """An open ``/generate`` response: iterate for records; ``aclose`` aborts the request unless it ended."""

    def __init__(self, response: aiohttp.ClientResponse, request_id: str) -> None:
        self._response = response
        self._lines: collections.deque[bytes] = collections.deque()
        self._partial = b""
        self._eof = False
        self.request_id = request_id
        self.closed = False
        self.interrupted = False

    def interrupt(self) -> None:
        """End the iteration now, quietly; the connection closes (the engine aborts the request)."""
        if not self.interrupted and not self.closed:
            self.interrupted = True
            if not self._eof:
                self._response.close()

    def buffered(self) -> bool:
        return bool(self._lines) or self._eof or self.closed or self.interrupted

    async def _fill(self) -> None:
        try:
            chunk = await self._response.content.readany()
        except (TimeoutError, aiohttp.ClientError) as exc:
            if self.interrupted:
                return  # interrupt() closed the response under this read
            raise EngineStreamError(f"The connection to the engine broke: {type(exc).__name__}") from exc
        if not chunk:
            self._eof = True
            if self._partial:
                self._lines.append(self._partial)
                self._partial = b""
            return
        *complete, self._partial = (self._partial + chunk).split(b"\n")
        self._lines.extend(line for line in complete if line)

    async def __aiter__(self) -> AsyncIterator[Record]:
        ended = False
        try:
            while not self.interrupted:
                if self._lines:
                    line = self._lines.popleft()
                    if ended:
                        continue
                    try:
                        record = parse_record(line)
                    except (ValueError, ValidationError) as exc:
                        raise EngineStreamError(f"The engine sent an unreadable record: {exc}") from exc
                    ended = not isinstance(record, DeltaRecord)
                    yield record
                    continue
                if self._eof:
                    return
                await self._fill()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            if self._eof:
                self._response.release()
            else:
                self._response.close()


class EngineClient:
    def __init__(self, *, request_timeout_s: float, connect_timeout_s: float = 2.0,
                 max_connections: int = 1000, internal_token: str | None = None) -> None:
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._probe_timeout_s = connect_timeout_s * 2
        self._headers = {"Authorization": f"Bearer {internal_token}"} if internal_token else None
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def for_settings(cls, settings: Settings) -> EngineClient:
        """The client a gateway or worker process uses: its timeouts and the internal token."""
        token = settings.internal_token.get_secret_value() if settings.internal_token is not None else None
        return cls(request_timeout_s=settings.request_timeout_s,
                   connect_timeout_s=settings.health_check_timeout_s, internal_token=token)

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            limit = self._max_connections
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit,
                                             keepalive_timeout=KEEPALIVE_EXPIRY_S)  # fmt: skip
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=lambda o: o,
                                                  headers=self._headers, skip_auto_headers=("User-Agent",),
                                                  auto_decompress=False)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _send(self, method: str, url: str, body: bytes | None, read_timeout_s: float,
                    headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """The response once its headers are in; ``EngineUnavailable`` when nothing was answered."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s,
                                        connect=self._connect_timeout_s, sock_read=read_timeout_s)
        for attempt in (0, 1):
            try:
                return await self._client().request(method, url, data=body, headers=headers,
                                                    timeout=timeout)
            except aiohttp.ClientConnectorError as exc:  # refused, unreachable, unknown host: nothing there
                raise EngineUnavailable(f"Cannot connect to the engine: {exc}", refused=True) from None
            except _NOT_ANSWERED as exc:
                if attempt == 0:
                    continue  # a kept-alive connection the server had closed: try a fresh one once
                raise EngineUnavailable(f"The engine did not answer: {type(exc).__name__}") from None
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineUnavailable(f"The engine did not answer: {type(exc).__name__}") from None
        raise AssertionError("unreachable")

    async def generate(self, base_url: str, request: GenerateRequest) -> EngineStream:
        """Start a generation; returns once the engine accepted it (status 200 and headers)."""
        body = request.model_dump_json(exclude_none=True).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/x-ndjson"}
        inject(headers)  # the current span's traceparent (tracing on): the engine's span is its child
        response = await self._send("POST", f"{base_url}/generate", body, self._request_timeout_s, headers)
        if response.status == 200:
            return EngineStream(response, request.request_id)
        try:
            content = await response.read()
        except (TimeoutError, aiohttp.ClientError):
            content = b""
        finally:
            response.release()
        if response.status == 401:
            logger.error("%s/generate refused the internal token: TOLLGATE_INTERNAL_TOKEN differs between "
                         "the engine and this process", base_url)
        raise _error_for_status(response.status, content)

    async def abort(self, base_url: str, request_id: str) -> Usage | None:
        """Best-effort abort (closing the stream already aborts; this covers a lost connection). Returns
        the engine's final usage of the request (what it computed until the abort took effect), or None
        when the replica cannot say (unreachable, restarted, or the request failed there)."""
        body = AbortRequest(request_id=request_id).model_dump_json().encode()
        try:
            response = await self._send("POST", f"{base_url}/abort", body,
                                        self._probe_timeout_s + ABORT_USAGE_WAIT_S,
                                        {"Content-Type": "application/json"})
            try:
                content = await response.read()
            finally:
                response.release()
        except (TimeoutError, EngineUnavailable, aiohttp.ClientError):
            return None
        if response.status != 200:
            return None
        try:
            return AbortResponse.model_validate_json(content).usage
        except ValidationError:
            return None

    async def health(self, base_url: str) -> HealthResponse:
        return await self._get(base_url, "/health", HealthResponse)

    async def load(self, base_url: str) -> LoadReport:
        return await self._get(base_url, "/load", LoadReport)

    async def info(self, base_url: str) -> InfoResponse:
        return await self._get(base_url, "/info", InfoResponse)

    async def kv_events(self, base_url: str, epoch: str | None, after: int,
                        wait_s: float = 0.0) -> dict[str, Any]:
        """A page of the replica's block events after ``after`` (``engine.protocol.KVEventsResponse``,
        parsed but not validated field by field: a snapshot may carry a million hashes); with ``wait_s``
        the engine holds the answer until there is an event (a long poll)."""
        query = f"/kv/events?after={after}&wait_s={wait_s}" + (f"&epoch={epoch}" if epoch else "")
        try:
            page = orjson.loads(await self._get_bytes(base_url, query, self._probe_timeout_s + wait_s))
        except orjson.JSONDecodeError:
            page = None
        if not isinstance(page, dict) or not isinstance(page.get("events"), list) or "seq" not in page:
            raise EngineUnavailable(f"{base_url}/kv/events: unreadable answer")
        return page

    async def purge(self, base_url: str, cache_salt: str) -> int:
        """``POST /kv/purge``: the replica drops every cached block of ``cache_salt`` from every tier;
        returns how many went. ``EngineUnavailable`` on any failure (the caller reports it per replica).
        The answer may take a while (the disk tier's files are deleted first): it is read with the
        request timeout, not the probes' short one."""
        body = PurgeRequest(cache_salt=cache_salt).model_dump_json().encode()
        content = await self._request_bytes("POST", base_url, "/kv/purge", self._request_timeout_s, body)
        try:
            purged = orjson.loads(content)["purged_blocks"]
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise EngineUnavailable(f"{base_url}/kv/purge: unreadable answer") from exc
        if not isinstance(purged, int) or isinstance(purged, bool):
            raise EngineUnavailable(f"{base_url}/kv/purge: unreadable answer")
        return purged

    async def check_adapter(self, base_url: str, lora: str) -> AdapterCheckResponse:
        """``POST /lora/check``: the replica reads adapter ``lora`` of its store and checks it against its
        model. ``InvalidRequestError`` with the replica's reason when it cannot serve it;
        ``EngineUnavailable`` when the replica did not answer (ask another)."""
        body = AdapterCheckRequest(lora=lora).model_dump_json().encode()
        url = f"{base_url}/lora/check"
        try:
            response = await self._send("POST", url, body, self._request_timeout_s,
                                        {"Content-Type": "application/json"})
            try:
                status, content = response.status, await response.read()
            finally:
                response.release()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineUnavailable(f"{url}: {type(exc).__name__}") from exc
        if status == 400:
            error = _error_for_status(status, content)
            if getattr(error, "code", None) == ADAPTER_NOT_FOUND_CODE:  # its store is not the gateways'
                raise EngineUnavailable(f"{url}: the adapter is not in this replica's store (--lora-dir)")
            raise InvalidRequestError(getattr(error, "message", "The adapter cannot be served."),
                                      code="invalid_adapter")
        if status != 200:
            raise EngineUnavailable(f"{url}: HTTP {status}")
        try:
            return AdapterCheckResponse.model_validate(orjson.loads(content))
        except (ValueError, ValidationError) as exc:
            raise EngineUnavailable(f"{url}: unreadable answer") from exc

    async def _get(self, base_url: str, path: str, model: type[M]) -> M:
        """Raises ``EngineUnavailable`` on any failure (probes decide health on it)."""
        content = await self._get_bytes(base_url, path)
        try:
            return model.model_validate(orjson.loads(content))
        except (ValueError, ValidationError) as exc:
            raise EngineUnavailable(f"{base_url}{path}: unreadable answer") from exc

    async def _get_bytes(self, base_url: str, path: str, timeout_s: float | None = None) -> bytes:
        return await self._request_bytes("GET", base_url, path, timeout_s or self._probe_timeout_s)

    async def _request_bytes(self, method: str, base_url: str, path: str, timeout_s: float,
                             body: bytes | None = None) -> bytes:
        """The body of a 200 answer; raises ``EngineUnavailable`` on any failure."""
        headers = {"Content-Type": "application/json"} if body is not None else None
        try:
            response = await self._send(method, f"{base_url}{path}", body, timeout_s, headers)
            try:
                status, content = response.status, await response.read()
            finally:
                response.release()
        except EngineUnavailable as exc:
            raise EngineUnavailable(f"{base_url}{path}: {exc.message}", refused=exc.refused) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineUnavailable(f"{base_url}{path}: {type(exc).__name__}") from exc
        if status == 401:
            raise EngineUnavailable(f"{base_url}{path}: HTTP 401, the engine refused the internal token "
                                    "(TOLLGATE_INTERNAL_TOKEN differs between the engine and this process)")
        if status != 200:
            raise EngineUnavailable(f"{base_url}{path}: HTTP {status}")
        return content


def _error_for_status(status: int, body: bytes) -> Exception:
    message, param, code = None, None, None
    try:
        record = ErrorRecord.model_validate(orjson.loads(body))
        message, param, code = record.error.message, record.error.param, record.error.code
    except (ValueError, ValidationError):
        pass
    if status == 400 or status == 422:
        return InvalidRequestError(message or "The engine refused the request.", param=param, code=code)
    if status in (429, 503):
        return EngineUnavailable(message or "The model is overloaded. Please retry.",
                                 draining=code == DRAINING_CODE)
    if status == 401:  # the operator's mistake, logged by ``generate``; the tenant learns nothing of it
        return EngineUnavailable()
    return EngineStreamError(message or f"The engine answered HTTP {status}.")
