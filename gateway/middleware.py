"""Outermost ASGI middleware of the gateway: request id, body size limit, last-resort 500.

One pure-ASGI layer (no ``BaseHTTPMiddleware``: it would buffer streams and cost a task per request):

- Every HTTP response carries ``x-request-id`` (``req_<32 hex>``). The id is stored in
  ``scope["state"]["request_id"]`` (``request.state.request_id``) and in a context variable that the
  ``RequestIdLogFilter`` adds to every log record, so a client's report can be found in the logs.
  ``request_path_var`` holds the request's path while it is served (what the GenAI metrics name a
  generation's operation from: ``gateway.tracing.current_operation``).
- Request bodies larger than ``max_body_bytes`` are refused with 413 in OpenAI's error body. The limit
  is enforced on the bytes actually received (chunked uploads and lying ``content-length`` included);
  a declared ``content-length`` over the limit is refused before reading anything. ``path_limits``
  gives some path prefixes their own limit (file uploads are far larger than API calls).
- An exception that escapes the app before the response started becomes a logged 500 with OpenAI's
  body; after it started (a stream) it is logged and the connection is closed.
"""

from __future__ import annotations

import contextvars
import logging
import uuid
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import error_body

logger = logging.getLogger("tollgate.gateway")

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("tollgate_request_id", default="-")
request_path_var: contextvars.ContextVar[str] = contextvars.ContextVar("tollgate_request_path", default="")


class RequestIdLogFilter(logging.Filter):
    """Adds ``record.request_id`` (``-`` outside a request) for log formats that print it."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id_var.get()
        return True


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class _BodyTooLarge(Exception):
    pass


def _too_large_body(limit: int) -> bytes:
    return orjson.dumps(error_body(
        f"Request body too large: the limit is {limit} bytes.", "invalid_request_error",
        code="request_too_large",
    ))


_SERVER_ERROR_BODY = orjson.dumps(error_body(
    "The server had an error while processing your request. Sorry about that!", "server_error",
))


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int,
                 path_limits: dict[str, int] | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.path_limits = sorted((path_limits or {}).items(), key=lambda item: -len(item[0]))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        rid_header = (b"x-request-id", request_id.encode())
        limit = self.max_body_bytes
        path = scope.get("path", "")
        path_token = request_path_var.set(path)
        for prefix, prefix_limit in self.path_limits:
            if path.startswith(prefix):
                limit = prefix_limit
                break
        state: dict[str, Any] = {"started": False, "too_large": False, "received": 0}

        async def send_json(status: int, body: bytes) -> None:
            state["started"] = True
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                rid_header,
            ]})
            await send({"type": "http.response.body", "body": body})

        try:
            declared = _content_length(scope)
            if declared is not None and declared > limit:
                await send_json(413, _too_large_body(limit))
                return

            async def limited_receive() -> Message:
                message = await receive()
                if message["type"] == "http.request":
                    state["received"] += len(message.get("body", b""))
                    if state["received"] > limit:
                        state["too_large"] = True
                        raise _BodyTooLarge
                return message

            async def tagged_send(message: Message) -> None:
                if message["type"] == "http.response.start":
                    if state["too_large"]:
                        # The app turned our exception into some other answer; 413 is the truth.
                        await send_json(413, _too_large_body(limit))
                        return
                    state["started"] = True
                    message["headers"] = [*message.get("headers", ()), rid_header]
                elif state["too_large"]:
                    return
                await send(message)

            await self.app(scope, limited_receive, tagged_send)
        except _BodyTooLarge:
            if not state["started"]:
                await send_json(413, _too_large_body(limit))
        except Exception:
            logger.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not state["started"]:
                await send_json(500, _SERVER_ERROR_BODY)
        finally:
            request_id_var.reset(token)
            request_path_var.reset(path_token)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
