"""HTTP/1.1 client for engine replicas (``engine/protocol.py``): keep-alive connections on asyncio.

The gateway talks to its own engines only, over plain HTTP/1.1 on a trusted network, so this client
is deliberately small: an ``asyncio.Protocol`` per connection with ``httptools``' response parser (the
C parser uvicorn uses), a LIFO pool of idle connections per replica, and requests written in one
``transport.write``. It replaced ``httpx`` on the hot path, which cost about half of the gateway's
per-request CPU (``benchmarks/RESULTS.md``, issue #5).

- Connections are kept alive between requests (no TCP handshake on the hot path). An idle connection
  is dropped after ``KEEPALIVE_EXPIRY_S``, before the engine's uvicorn closes it (its keep-alive timeout
  is 5 s); one the server closed anyway is skipped at checkout, and a request whose reused connection
  dies before a single response byte arrived is sent once more on a fresh connection (the engine never
  saw it: it answers every request it reads).
- ``/generate`` answers NDJSON: body bytes are split into lines as they arrive (in the protocol
  callback) and each line is parsed once (``engine.protocol.parse_record``). ``EngineStream.buffered``
  tells whether the next record is already here, so the SSE writer can coalesce writes.
- Backpressure: a stream whose consumer falls behind by ``PAUSE_LINES`` lines pauses reading the socket.
- Timeouts: ``connect_timeout_s`` for connecting (and for waiting on a free connection when
  ``max_connections`` per replica are busy); ``request_timeout_s`` between two reads of a response.

Error mapping (what the client of the gateway sees):
- The replica cannot be reached, or refuses for overload (``429``/``503``) → ``EngineUnavailable``
  (a ``ServiceUnavailableError``, 503). ``retryable`` is true: nothing started, so the caller may send
  the request to another replica. ``refused`` is true when nothing listens at the address.
- The engine refuses the request (``400`` with an ``ErrorRecord``) → ``InvalidRequestError`` (400) with
  the engine's message and param.
- Any other answer, a broken stream, or an ``ErrorRecord`` line mid-stream → ``EngineStreamError``
  (502); tokens already streamed are still billed by the caller.
Closing an ``EngineStream`` (``aclose``) before its response ended closes the connection, which aborts
the request in the engine within one step; a stream read to its end returns the connection to the pool.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from typing import TypeVar
from urllib.parse import urlsplit

import httptools
import orjson
from pydantic import BaseModel, ValidationError

from engine.protocol import (
    AbortRequest,
    DeltaRecord,
    ErrorRecord,
    FinalRecord,
    GenerateRequest,
    HealthResponse,
    InfoResponse,
    LoadReport,
    parse_record,
)
from gateway.errors import InvalidRequestError, ServiceUnavailableError, UpstreamError

Record = DeltaRecord | FinalRecord | ErrorRecord
KEEPALIVE_EXPIRY_S = 4.0
# A stream whose consumer is this many lines behind stops reading its socket until it catches up.
PAUSE_LINES = 4096
M = TypeVar("M", bound=BaseModel)


class EngineUnavailable(ServiceUnavailableError):
    """The replica could not take the request; nothing was generated (safe to try another replica)."""

    retryable = True

    def __init__(self, message: str = "The model is temporarily unavailable. Please retry.", *,
                 refused: bool = False) -> None:
        super().__init__(message)
        # True when nothing listens at the address (the replica is certainly down), as opposed to a
        # slow or odd answer from a process that is alive.
        self.refused = refused


class EngineStreamError(UpstreamError):
    """The engine failed after accepting the request (broken stream or an error record)."""

    def __init__(self, message: str = "The engine failed while generating. Please retry.",
                 *, code: str | None = None) -> None:
        super().__init__(message, code=code)


class _ConnectionBroken(Exception):
    """The connection failed or closed before the response ended."""

    def __init__(self, reason: str, *, before_response: bool) -> None:
        super().__init__(reason)
        self.before_response = before_response


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time. Response state lives here too:
    status, header end, body (NDJSON lines or raw bytes), end of message, failure."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.idle_since = 0.0
        self.reused = False
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers_done = False
        self.complete = False
        self.keep_alive = True
        self.error: str | None = None
        self.received = False
        self.lines_mode = False
        self.lines: collections.deque[bytes] = collections.deque()
        self.partial = b""
        self.body: list[bytes] = []
        self.paused = False

    # -- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"unreadable HTTP response: {exc}")
            self.close()

    def eof_received(self) -> bool | None:
        return False  # close the transport (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(type(exc).__name__ if exc is not None else "the engine closed the connection")
        self.pool.forget(self)

    # -- httptools callbacks -----------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not self.lines_mode:
            self.body.append(body)
            return
        if self.partial:
            body = self.partial + body
        parts = body.split(b"\n")
        self.partial = parts.pop()
        for part in parts:
            if part:
                self.lines.append(part)
        if parts:
            if len(self.lines) > PAUSE_LINES and not self.paused and self.transport is not None:
                self.paused = True
                self.transport.pause_reading()
            self._wake()

    def on_message_complete(self) -> None:
        if self.partial.strip():
            self.lines.append(self.partial)
        self.partial = b""
        self.complete = True
        self._wake()

    # -- for the client ----------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until something happens on the response (or ``TimeoutError`` after ``timeout`` seconds)."""
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def send(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(data)

    def broken(self) -> _ConnectionBroken:
        return _ConnectionBroken(self.error or "connection closed", before_response=not self.received)

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True
        self.pool.forget(self)

    def release(self) -> None:
        """Back to the pool if the response ended cleanly and the server keeps the connection."""
        if self.complete and self.keep_alive and self.error is None and not self.closed:
            self.pool.put(self)
        else:
            self.close()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Pool:
    """Connections to one replica: idle ones (LIFO) and a cap on open ones."""

    def __init__(self, scheme: str, host: str, port: int, max_connections: int, connect_timeout_s: float,
                 ssl_context: ssl.SSLContext | None) -> None:
        self.host, self.port = host, port
        self.host_header = f"Host: {host}:{port}\r\n".encode("latin-1") if ":" not in host else \
            f"Host: [{host}]:{port}\r\n".encode("latin-1")
        self.max_connections = max_connections
        self.connect_timeout_s = connect_timeout_s
        self.ssl = ssl_context if scheme == "https" else None
        self.idle: list[_Connection] = []
        self.open: set[_Connection] = set()
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def get(self) -> _Connection:
        loop = asyncio.get_running_loop()
        now = loop.time()
        idle = self.idle
        while idle:
            conn = idle.pop()
            if conn.closed or now - conn.idle_since > KEEPALIVE_EXPIRY_S or (
                    conn.transport is not None and conn.transport.is_closing()):
                conn.close()
                continue
            conn.reused = True
            return conn
        while len(self.open) >= self.max_connections:
            waiter = loop.create_future()
            self.waiters.append(waiter)
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await waiter
            except TimeoutError:
                raise EngineUnavailable("No connection to the engine is free. Please retry.") from None
            finally:
                if waiter in self.waiters:
                    self.waiters.remove(waiter)
            if idle:
                return await self.get()
        conn = _Connection(self)
        self.open.add(conn)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: conn, self.host, self.port, ssl=self.ssl)
        except TimeoutError:
            self.forget(conn)
            raise EngineUnavailable("The engine did not accept a connection in time.") from None
        except OSError as exc:  # refused, unreachable, unknown host: nothing listens there
            self.forget(conn)
            raise EngineUnavailable(f"Cannot connect to the engine: {type(exc).__name__}",
                                    refused=True) from exc
        except BaseException:
            conn.close()
            raise
        return conn

    def put(self, conn: _Connection) -> None:
        conn.idle_since = asyncio.get_running_loop().time()
        self.idle.append(conn)
        self._wake_one()

    def forget(self, conn: _Connection) -> None:
        if conn in self.open:
            self.open.discard(conn)
            self._wake_one()
        if conn in self.idle:
            self.idle.remove(conn)

    def _wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close_all(self) -> None:
        for conn in list(self.open):
            conn.close()
        self.idle.clear()


class EngineStream:
    """An open ``/generate`` response: iterate for records; ``aclose`` aborts the request unless it ended."""

    def __init__(self, conn: _Connection, request_id: str, read_timeout_s: float) -> None:
        self._conn = conn
        self._timeout = read_timeout_s
        self.request_id = request_id
        self.closed = False
        self.interrupted = False

    def interrupt(self) -> None:
        """End the iteration now, quietly; the connection closes (the engine aborts the request)."""
        if not self.interrupted and not self.closed:
            self.interrupted = True
            conn = self._conn
            if not conn.complete:
                conn.close()
            conn._wake()

    def buffered(self) -> bool:
        """True when the next step of the iteration needs no network wait (a record is here, or the
        response is over)."""
        conn = self._conn
        return bool(conn.lines) or conn.complete or conn.error is not None or self.closed or self.interrupted

    async def __aiter__(self) -> AsyncIterator[Record]:
        conn = self._conn
        lines = conn.lines
        ended = False
        try:
            while True:
                if self.interrupted:
                    return
                if lines:
                    line = lines.popleft()
                    if conn.paused and not lines:
                        conn.resume()
                    if ended:
                        continue  # read to the end of the body, so the connection goes back to the pool
                    try:
                        record = parse_record(line)
                    except (ValueError, ValidationError) as exc:
                        raise EngineStreamError(f"The engine sent an unreadable record: {exc}") from exc
                    ended = not isinstance(record, DeltaRecord)
                    yield record
                    continue
                if conn.complete:
                    return
                if conn.error is not None:
                    raise EngineStreamError(f"The connection to the engine broke: {conn.error}")
                try:
                    await conn.wait(self._timeout)
                except TimeoutError:
                    raise EngineStreamError("The connection to the engine broke: ReadTimeout") from None
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self._conn.release()


class EngineClient:
    def __init__(self, *, request_timeout_s: float, connect_timeout_s: float = 2.0,
                 max_connections: int = 1000) -> None:
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._probe_timeout_s = connect_timeout_s * 2
        self._pools: dict[str, _Pool] = {}
        self._ssl: ssl.SSLContext | None = None

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close_all()
        self._pools.clear()

    def _pool(self, base_url: str) -> _Pool:
        pool = self._pools.get(base_url)
        if pool is None:
            parts = urlsplit(base_url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise EngineUnavailable(f"Bad engine URL {base_url!r}.", refused=True)
            if parts.scheme == "https" and self._ssl is None:
                self._ssl = ssl.create_default_context()
            port = parts.port or (443 if parts.scheme == "https" else 80)
            pool = self._pools[base_url] = _Pool(parts.scheme, parts.hostname, port, self._max_connections,
                                                 self._connect_timeout_s, self._ssl)
        return pool

    async def _start(self, base_url: str, method: bytes, path: bytes, body: bytes | None,
                     timeout_s: float, *, lines: bool) -> _Connection:
        """Send a request; return the connection once the response headers are in. Raises
        ``EngineUnavailable`` when nothing was answered (connect failure, timeout, broken connection)."""
        pool = self._pool(base_url)
        head = method + b" " + path + b" HTTP/1.1\r\n" + pool.host_header
        if body is not None:
            head += (b"Content-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n")
        if lines:
            head += b"Accept: application/x-ndjson\r\n"
        data = head + b"\r\n" + body if body is not None else head + b"\r\n"
        for attempt in (0, 1):
            conn = await pool.get()
            try:
                conn.send(data)
                conn.lines_mode = lines
                while not conn.headers_done:
                    if conn.error is not None:
                        raise conn.broken()
                    await conn.wait(timeout_s)
                return conn
            except _ConnectionBroken as exc:
                conn.close()
                if attempt == 0 and conn.reused and exc.before_response:
                    continue  # the server had closed this idle connection: try a fresh one once
                raise EngineUnavailable(f"The engine did not answer: {exc}") from None
            except TimeoutError:
                conn.close()
                raise EngineUnavailable("The engine did not answer: ReadTimeout") from None
            except BaseException:
                conn.close()
                raise
        raise AssertionError("unreachable")

    async def _read_body(self, conn: _Connection, timeout_s: float) -> bytes:
        """The rest of a non-streamed response; the connection goes back to the pool (or is closed)."""
        try:
            while not conn.complete:
                if conn.error is not None:
                    raise conn.broken()
                await conn.wait(timeout_s)
            return b"".join(conn.body)
        finally:
            conn.release()

    async def generate(self, base_url: str, request: GenerateRequest) -> EngineStream:
        """Start a generation; returns once the engine accepted it (status 200 and headers)."""
        body = request.model_dump_json(exclude_none=True).encode()
        conn = await self._start(base_url, b"POST", b"/generate", body, self._request_timeout_s, lines=True)
        if conn.status == 200:
            return EngineStream(conn, request.request_id, self._request_timeout_s)
        status = conn.status
        conn.lines_mode = False  # an error answer is one JSON body (lines so far are its start)
        conn.body = [b"\n".join(conn.lines) + conn.partial] if conn.lines or conn.partial else []
        conn.lines.clear()
        conn.partial = b""
        try:
            content = await self._read_body(conn, self._probe_timeout_s)
        except (_ConnectionBroken, TimeoutError):
            content = b""
        raise _error_for_status(status, content)

    async def abort(self, base_url: str, request_id: str) -> None:
        """Best-effort abort (closing the stream already aborts; this covers a lost connection)."""
        try:
            body = AbortRequest(request_id=request_id).model_dump_json().encode()
            conn = await self._start(base_url, b"POST", b"/abort", body, self._probe_timeout_s, lines=False)
            await self._read_body(conn, self._probe_timeout_s)
        except (EngineUnavailable, _ConnectionBroken, TimeoutError):
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
            conn = await self._start(base_url, b"GET", path.encode(), None, self._probe_timeout_s,
                                     lines=False)
            status = conn.status
            content = await self._read_body(conn, self._probe_timeout_s)
        except EngineUnavailable as exc:
            raise EngineUnavailable(f"{base_url}{path}: {exc.message}", refused=exc.refused) from exc
        except (_ConnectionBroken, TimeoutError) as exc:
            raise EngineUnavailable(f"{base_url}{path}: {type(exc).__name__}") from exc
        if status != 200:
            raise EngineUnavailable(f"{base_url}{path}: HTTP {status}")
        try:
            return model.model_validate(orjson.loads(content))
        except (ValueError, ValidationError) as exc:
            raise EngineUnavailable(f"{base_url}{path}: unreadable answer") from exc


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
        return EngineUnavailable(message or "The model is overloaded. Please retry.")
    return EngineStreamError(message or f"The engine answered HTTP {status}.")
