"""Gateway errors and their rendering in OpenAI's error body.

Every error the public API returns has the body ``{"error": {"message", "type", "param", "code"}}``
(OpenAI's ``ErrorResponse``), whatever raised it: a ``GatewayError`` from our own code, FastAPI's
request validation, Starlette's routing (unknown route → 404, wrong method → 405), or a bug (a
last-resort 500, logged with the request id; see ``gateway.middleware``).

Invariants:
- Bad input is a 4xx: ``GatewayError`` subclasses carry the status, and pydantic validation errors are
  turned into 400 ``invalid_request_error`` naming the offending parameter (``messages[0].content``).
- ``headers`` of an error (``Retry-After``, ``x-ratelimit-*``, ``x-should-retry``) reach the client.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger("tollgate.gateway")

M = TypeVar("M", bound=BaseModel)


class GatewayError(Exception):
    """An error with an HTTP status and OpenAI's ``type``/``code``/``param``."""

    status: int = 500
    type: str = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type
        if code is not None:
            self.code = code
        self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, param=self.param, code=self.code)

    def to_response(self) -> Response:
        return json_error_response(self.status, self.body(), self.headers)


class InvalidRequestError(GatewayError):
    status = 400
    type = "invalid_request_error"


class AuthenticationError(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDeniedError(GatewayError):
    status = 403
    type = "invalid_request_error"


class NotFoundError(GatewayError):
    status = 404
    type = "invalid_request_error"


class ModelNotFoundError(NotFoundError):
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.", param="model"
        )


class RequestTooLargeError(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimitError(GatewayError):
    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class UpstreamError(GatewayError):
    """The engine answered something the gateway cannot use (502)."""

    status = 502
    type = "server_error"
    code = "bad_gateway"


class ServiceUnavailableError(GatewayError):
    """No engine replica can take the request now (503); retrying later can help."""

    status = 503
    type = "server_error"
    code = "service_unavailable"


def error_body(message: str, type: str, *, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def json_error_response(status: int, body: dict, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, headers=dict(headers or {}),
                    media_type="application/json")


# pydantic puts union member names and discriminator tags into error locations; they are not parameters.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "nullable"})
_DISCRIMINATOR_TAGS = frozenset({
    "system", "developer", "user", "assistant", "tool", "function",  # message roles
    "text", "image_url", "input_audio", "file", "refusal",  # content part types
    "json_object", "json_schema", "custom",  # response formats, tool types
    "message", "function_call", "function_call_output", "input_text", "output_text",  # Responses items
    "unsupported",  # the tag of whatever the platform refuses (``Tag("unsupported")`` members)
})
_DISCRIMINATED_FIELDS = frozenset({"response_format"})


def format_loc(loc: Sequence[int | str]) -> str:
    """``("body", "messages", 0, "user", "content")`` → ``messages[0].content`` (OpenAI's param naming)."""
    out = ""
    prev: int | str | None = None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("body", "query", "path", "header") and prev is None:
            continue
        elif part in _UNION_MEMBERS or "[" in part or "-" in part or part[:1].isupper():
            pass  # a member of a union: a type (``str``, ``list[...]``, ``function-after[...]``) or a model
            # class (``NamedToolChoice``); no OpenAI parameter is named so
        elif part in _DISCRIMINATOR_TAGS and (isinstance(prev, int) or prev in _DISCRIMINATED_FIELDS):
            pass
        else:
            out += f".{part}" if out else part
        prev = part
    return out


_JSON_HINT = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your "
    "HTTP library correctly. The API expects a JSON payload, but what was sent was not valid JSON.)"
)


def validation_error(errors: Sequence[Mapping[str, Any]]) -> InvalidRequestError:
    """The first pydantic/FastAPI validation error as a 400 naming its parameter."""
    if not errors:
        return InvalidRequestError("Invalid request.")
    # In a union every member reports an error; the deepest one is the member the client meant.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    kind = first.get("type", "")
    if kind in ("json_invalid", "json_type"):
        return InvalidRequestError(_JSON_HINT)
    loc = first.get("loc", ())
    param = format_loc(loc) or None
    if kind == "missing":
        return InvalidRequestError(f"Missing required parameter: '{param}'.", param=param,
                                   code="missing_required_parameter")
    if kind == "extra_forbidden":
        return InvalidRequestError(f"Unrecognized request argument supplied: {param}", param=param,
                                   code="unknown_parameter")
    if kind == "model_attributes_type" or (kind.endswith("_type") and not param):
        return InvalidRequestError("The request body must be a JSON object.", code="invalid_type")
    msg = str(first.get("msg", "invalid value"))
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    code = "invalid_value"
    if kind == "unsupported_parameter":  # ``gateway.openai.schemas.unsupported``
        code = kind
    elif kind.endswith("_type") or kind in ("literal_error", "union_tag_invalid", "union_tag_not_found"):
        code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    if param:
        return InvalidRequestError(f"Invalid '{param}': {msg}.", param=param, code=code)
    return InvalidRequestError(f"Invalid request: {msg}.", code=code)


def from_pydantic(exc: ValidationError) -> InvalidRequestError:
    return validation_error(exc.errors(include_url=False, include_input=False))


def parse_request_body(model: type[M], body: bytes) -> M:
    """``body`` validated from bytes as ``model``; any failure (bad JSON included) is OpenAI's 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise from_pydantic(exc) from None


async def _gateway_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return exc.to_response()


async def _validation_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    return validation_error(exc.errors()).to_response()


async def _http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    status = exc.status_code
    if status == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
        err = GatewayError(message, status=404, type="invalid_request_error", code="unknown_url")
    elif status == 405:
        message = f"Method {request.method} not allowed for {request.url.path}"
        err = GatewayError(message, status=405, type="invalid_request_error", code="method_not_allowed",
                           headers=exc.headers)
    else:
        kind = "invalid_request_error" if status < 500 else "server_error"
        err = GatewayError(str(exc.detail), status=status, type=kind, headers=exc.headers)
    return err.to_response()


def install_exception_handlers(app: FastAPI) -> None:
    """Register the handlers that render every error in OpenAI's body. The last-resort 500 for
    unexpected exceptions lives in ``gateway.middleware.RequestContextMiddleware``."""
    app.add_exception_handler(GatewayError, _gateway_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)
