"""The engine client of ``gateway.engine_client`` on aiohttp instead of a hand-written HTTP/1.1 protocol:
the same interface, errors and semantics (``EngineUnavailable`` when nothing was answered and the
request may go elsewhere, ``InvalidRequestError`` for the engine's 400, ``EngineStreamError`` for a
broken stream; closing a stream early closes its connection, which aborts the request in the engine).

aiohttp's connector keeps connections alive per replica (dropped after ``KEEPALIVE_EXPIRY_S`` idle,
before the engine's uvicorn closes them) and bounds them at ``max_connections``. A request whose reused
connection turns out closed by the server before any response byte is sent once more.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator

import aiohttp
import orjson
from pydantic import ValidationError

from engine.protocol import (
    AbortRequest,
    DeltaRecord,
    GenerateRequest,
    HealthResponse,
    InfoResponse,
    LoadReport,
    parse_record,
)
from gateway.engine_client import (
    KEEPALIVE_EXPIRY_S,
    EngineStreamError,
    EngineUnavailable,
    M,
    Record,
    _error_for_status,
)

_NOT_ANSWERED = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


class AiohttpEngineStream:
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


class AiohttpEngineClient:
    def __init__(self, *, request_timeout_s: float, connect_timeout_s: float = 2.0,
                 max_connections: int = 1000) -> None:
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._probe_timeout_s = connect_timeout_s * 2
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            limit = self._max_connections
            connector = aiohttp.TCPConnector(limit=limit, limit_per_host=limit,
                                             keepalive_timeout=KEEPALIVE_EXPIRY_S)  # fmt: skip
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=lambda o: o,
                                                  skip_auto_headers=("User-Agent",), auto_decompress=False)
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
            except aiohttp.ClientConnectorError as exc:
                refused = isinstance(exc.os_error, ConnectionRefusedError)
                raise EngineUnavailable(f"The engine did not answer: {exc}", refused=refused) from None
            except _NOT_ANSWERED as exc:
                if attempt == 0:
                    continue  # a kept-alive connection the server had closed: try a fresh one once
                raise EngineUnavailable(f"The engine did not answer: {type(exc).__name__}") from None
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise EngineUnavailable(f"The engine did not answer: {type(exc).__name__}") from None
        raise AssertionError("unreachable")

    async def generate(self, base_url: str, request: GenerateRequest) -> AiohttpEngineStream:
        """Start a generation; returns once the engine accepted it (status 200 and headers)."""
        body = request.model_dump_json(exclude_none=True).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/x-ndjson"}
        response = await self._send("POST", f"{base_url}/generate", body, self._request_timeout_s, headers)
        if response.status == 200:
            return AiohttpEngineStream(response, request.request_id)
        try:
            content = await response.read()
        except (TimeoutError, aiohttp.ClientError):
            content = b""
        finally:
            response.release()
        raise _error_for_status(response.status, content)

    async def abort(self, base_url: str, request_id: str) -> None:
        """Best-effort abort (closing the stream already aborts; this covers a lost connection)."""
        body = AbortRequest(request_id=request_id).model_dump_json().encode()
        try:
            response = await self._send("POST", f"{base_url}/abort", body, self._probe_timeout_s,
                                        {"Content-Type": "application/json"})
            await response.read()
            response.release()
        except (TimeoutError, EngineUnavailable, aiohttp.ClientError):
            pass

    async def health(self, base_url: str) -> HealthResponse:
        return await self._get(base_url, "/health", HealthResponse)

    async def load(self, base_url: str) -> LoadReport:
        return await self._get(base_url, "/load", LoadReport)

    async def info(self, base_url: str) -> InfoResponse:
        return await self._get(base_url, "/info", InfoResponse)

    async def _get(self, base_url: str, path: str, model: type[M]) -> M:
        """Raises ``EngineUnavailable`` on any failure (probes decide health on it)."""
        try:
            response = await self._send("GET", f"{base_url}{path}", None, self._probe_timeout_s)
            try:
                status, content = response.status, await response.read()
            finally:
                response.release()
        except EngineUnavailable as exc:
            raise EngineUnavailable(f"{base_url}{path}: {exc.message}", refused=exc.refused) from exc
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise EngineUnavailable(f"{base_url}{path}: {type(exc).__name__}") from exc
        if status != 200:
            raise EngineUnavailable(f"{base_url}{path}: HTTP {status}")
        try:
            return model.model_validate(orjson.loads(content))
        except (ValueError, ValidationError) as exc:
            raise EngineUnavailable(f"{base_url}{path}: unreadable answer") from exc
