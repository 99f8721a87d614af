"""HTTP client for engine replicas (``engine/protocol.py``): one shared ``httpx.AsyncClient`` per process.

The pool keeps HTTP/1.1 connections alive between requests, so the hot path pays no TCP handshake.
``/generate`` answers NDJSON; each line is parsed once (orjson + the protocol's pydantic models) and
never re-encoded here.

Error mapping (what the client of the gateway sees):
- The replica cannot be reached, or refuses for overload (``429``/``503``) → ``EngineUnavailable``
  (a ``ServiceUnavailableError``, 503). ``retryable`` is true: nothing started, so the caller may send
  the request to another replica.
- The engine refuses the request (``400`` with an ``ErrorRecord``) → ``InvalidRequestError`` (400) with
  the engine's message and param.
- Any other answer, a broken stream, or an ``ErrorRecord`` line mid-stream → ``EngineStreamError``
  (502); tokens already streamed are still billed by the caller.
Closing an ``EngineStream`` (``aclose``) closes the connection, which aborts the request in the engine
within one step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeVar

import httpx
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


class EngineStream:
    """An open ``/generate`` response: iterate for records; ``aclose`` aborts the request."""

    def __init__(self, response: httpx.Response, request_id: str) -> None:
        self._response = response
        self.request_id = request_id
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[Record]:
        ended = False
        try:
            async for line in self._response.aiter_lines():
                if not line or ended:
                    continue  # read to the end of the body, so the connection goes back to the pool
                try:
                    record = parse_record(line)
                except (ValueError, ValidationError) as exc:
                    raise EngineStreamError(f"The engine sent an unreadable record: {exc}") from exc
                ended = not isinstance(record, DeltaRecord)
                yield record
        except httpx.HTTPError as exc:
            raise EngineStreamError(f"The connection to the engine broke: {type(exc).__name__}") from exc
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            await self._response.aclose()


class EngineClient:
    def __init__(self, *, request_timeout_s: float, connect_timeout_s: float = 2.0,
                 max_connections: int = 1000, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s),
            # Idle connections are dropped before the engine's uvicorn closes them (its keep-alive
            # timeout is 5 s): reusing one the server is closing fails the request with ReadError.
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S),
            transport=transport,
            http2=False,
        )
        self._probe_timeout = httpx.Timeout(connect_timeout_s * 2, connect=connect_timeout_s)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(self, base_url: str, request: GenerateRequest) -> EngineStream:
        """Start a generation; returns once the engine accepted it (status 200 and headers)."""
        http_request = self._http.build_request(
            "POST", f"{base_url}/generate", content=request.model_dump_json(exclude_none=True),
            headers={"content-type": "application/json", "accept": "application/x-ndjson"},
        )
        try:
            response = await self._http.send(http_request, stream=True)
        except httpx.ConnectError as exc:
            raise EngineUnavailable(refused=True) from exc
        except (httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise EngineUnavailable() from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"The engine did not answer: {type(exc).__name__}") from exc
        if response.status_code == 200:
            return EngineStream(response, request.request_id)
        try:
            body = await response.aread()
        except httpx.HTTPError:
            body = b""
        finally:
            await response.aclose()
        raise _error_for_status(response.status_code, body)

    async def abort(self, base_url: str, request_id: str) -> None:
        """Best-effort abort (closing the stream already aborts; this covers a lost connection)."""
        try:
            await self._http.post(f"{base_url}/abort", content=AbortRequest(request_id=request_id)
                                  .model_dump_json(), headers={"content-type": "application/json"},
                                  timeout=self._probe_timeout)
        except httpx.HTTPError:
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
            response = await self._http.get(f"{base_url}{path}", timeout=self._probe_timeout)
        except httpx.ConnectError as exc:
            raise EngineUnavailable(f"{base_url}{path}: connection refused", refused=True) from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{base_url}{path}: {type(exc).__name__}") from exc
        if response.status_code != 200:
            raise EngineUnavailable(f"{base_url}{path}: HTTP {response.status_code}")
        try:
            return model.model_validate(orjson.loads(response.content))
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
