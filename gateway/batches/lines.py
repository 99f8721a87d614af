"""One batch input line: validation before anything runs, execution through the interactive pipeline,
and its output-file record.

Validation (``LineValidator.check``) mirrors what the endpoint would say about the request, before a
token is spent: JSON object per line, a unique string ``custom_id``, ``method`` ``POST``, ``url`` equal to
the batch's endpoint, a ``body`` the endpoint's own pydantic schema accepts (plus its cross-field
``check()``), no ``stream``, a model this key may use, one model per batch. Errors are OpenAI's
``BatchError`` (code, message, param, 1-based line).

Execution (``execute_line``) starts the line with the same service function as the HTTP route
(``start_chat_completion`` / ``start_completion``) and collects the answer's body until the runner
stops the line (cancel, expiry, lost lease), which aborts the engine work exactly as a client hang-up
does. The body is the object the interactive API would have sent; the generation says what it cost
and which pool ran it.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from gateway.auth import Principal
from gateway.batches.runtime import BatchDeferred, BatchRuntime
from gateway.chat.schemas import ChatCompletionRequest
from gateway.chat.service import start_chat_completion
from gateway.completions.schemas import CompletionRequest
from gateway.completions.service import start_completion
from gateway.embeddings.schemas import CreateEmbeddingRequest
from gateway.embeddings.service import start_embeddings
from gateway.errors import GatewayError, InvalidRequestError, from_pydantic
from gateway.openai.answers import Answer
from gateway.openai.streaming import collect_until
from gateway.responses.schemas import CreateResponseRequest
from gateway.responses.service import start_response

MAX_REPORTED_ERRORS = 1000
UTF8_BOM = b"\xef\xbb\xbf"

Start = Callable[[BatchRuntime, Principal, str, Any], Awaitable[Answer]]
ENDPOINTS: dict[str, tuple[type[BaseModel], Start]] = {
    "/v1/chat/completions": (ChatCompletionRequest, start_chat_completion),
    "/v1/completions": (CompletionRequest, start_completion),
    "/v1/responses": (CreateResponseRequest, start_response),
    "/v1/embeddings": (CreateEmbeddingRequest, start_embeddings),
}


def line_request_id(batch_id: str, custom_id: str) -> str:
    """The line's request id: the ledger's idempotency key, the same on every attempt."""
    digest = hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:40]
    return f"batch_req_{digest}"


def batch_error(code: str, message: str, *, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass
class ParsedLine:
    line: int
    custom_id: str
    body: dict[str, Any]
    model: str


@dataclass
class LineValidator:
    """Checks lines in order; collects the first ``MAX_REPORTED_ERRORS`` errors."""

    endpoint: str
    known_models: frozenset[str]
    allowed_models: frozenset[str] | None
    # The batch owner's adapter models (``gateway.adapters``), each with its base model: known too, and
    # allowed to a key that may use the adapter's model or its base.
    adapters: Mapping[str, str] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    error_count: int = 0
    model: str | None = None
    _seen: dict[str, int] = field(default_factory=dict)

    def _error(self, code: str, message: str, line: int, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(batch_error(code, message, line=line, param=param))

    def check(self, number: int, raw: bytes) -> ParsedLine | None:
        if number == 1:
            raw = raw.removeprefix(UTF8_BOM)  # editors on Windows start UTF-8 files with one
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            self._error("invalid_json_line", "This line is not parseable as valid JSON.", number)
            return None
        if not isinstance(data, dict):
            self._error("invalid_json_line", "Each line must be a JSON object.", number)
            return None
        custom_id = data.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            self._error("missing_required_parameter", "Each request needs a non-empty string 'custom_id'.",
                        number, "custom_id")
            return None
        first = self._seen.setdefault(custom_id, number)
        if first != number:
            self._error("duplicate_custom_id", f"The custom_id '{custom_id}' is a duplicate of line {first}.",
                        number, "custom_id")
            return None
        if data.get("method") != "POST":
            self._error("invalid_method", "The only supported method is 'POST'.", number, "method")
            return None
        if data.get("url") != self.endpoint:
            self._error("invalid_url", f"The url must be the batch's endpoint, '{self.endpoint}'.", number,
                        "url")
            return None
        body = data.get("body")
        if not isinstance(body, dict):
            self._error("invalid_request", "The 'body' must be a JSON object.", number, "body")
            return None
        schema, _ = ENDPOINTS[self.endpoint]
        try:
            request = schema.model_validate(body)
            request.check()  # type: ignore[attr-defined]
        except ValidationError as exc:
            err = from_pydantic(exc)
            self._error(err.code or "invalid_request", err.message, number, _body_param(err.param))
            return None
        except InvalidRequestError as exc:
            self._error(exc.code or "invalid_request", exc.message, number, _body_param(exc.param))
            return None
        if getattr(request, "stream", False):
            self._error("invalid_request", "Streaming is not supported in batches.", number, "body.stream")
            return None
        model = request.model  # type: ignore[attr-defined]
        known = model in self.known_models or model in self.adapters
        allowed = self.allowed_models is None or model in self.allowed_models or (
            model in self.adapters and self.adapters[model] in self.allowed_models)
        if not known or not allowed:
            self._error("model_not_found", f"The model `{model}` does not exist or you do not have access "
                        "to it.", number, "body.model")
            return None
        if self.model is None:
            self.model = model
        elif model != self.model:
            self._error("mismatched_model", f"All requests of a batch must use one model; line {number} "
                        f"uses '{model}', earlier lines '{self.model}'.", number, "body.model")
            return None
        return ParsedLine(number, custom_id, body, model)


def _body_param(param: str | None) -> str:
    return f"body.{param}" if param else "body"


DEFER_LIMITS = "limits"  # the tenant's batch quota, budget or status: retry much later (beat's sweep)
DEFER_CAPACITY = "capacity"  # no replica can take batch work now: retry soon


@dataclass
class LineResult:
    """How a line ended. ``deferred`` (a ``DEFER_*`` reason): it never started (put it back).
    ``status_code`` None otherwise: stopped by the runner (cancel, expiry, lost lease) before an answer."""

    deferred: str | None = None
    status_code: int | None = None
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    served_pool: str | None = None
    cost_pico_usd: int = 0

    @property
    def succeeded(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300

    def usage(self) -> tuple[int, int, int]:
        """(prompt, cached, completion) tokens reported in a successful body: chat, completions and
        embeddings name them ``prompt_tokens``/``completion_tokens``, Responses ``input_tokens``/
        ``output_tokens``."""
        usage = (self.body or {}).get("usage") or {}
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
        details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        completion = usage.get("completion_tokens", usage.get("output_tokens"))
        return int(prompt or 0), int(details.get("cached_tokens") or 0), int(completion or 0)


async def execute_line(runtime: BatchRuntime, principal: Principal, endpoint: str, request_id: str,
                       body: dict[str, Any], stop: asyncio.Event,
                       retried: Callable[[], bool] = lambda: False) -> LineResult:
    """Run one line. ``stop`` ends it early (engine work aborted); ``retried()``, asked then, says
    whether another chain runs the line again (this chain lost its lease): this attempt then bills
    nothing, since the ledger keeps the first row of the line's request id and the retry's must count.
    A line stopped for good (cancel, expiry) is billed what it computed."""
    schema, start = ENDPOINTS[endpoint]
    try:
        request_body = schema.model_validate(body)
    except ValidationError as exc:
        err = from_pydantic(exc)
        return LineResult(status_code=err.status, body=err.body())
    try:
        answer = await start(runtime, principal, request_id, request_body)
    except BatchDeferred:
        return LineResult(deferred=DEFER_LIMITS)
    except GatewayError as exc:  # raised before the engine accepted anything
        if exc.status == 429:
            return LineResult(deferred=DEFER_LIMITS)
        if exc.status == 503 or exc.param == "request_id":
            # No replica can take it now; or the engine still runs an earlier attempt of this line
            # (its worker died a moment ago) until it notices the dropped connection.
            return LineResult(deferred=DEFER_CAPACITY)
        return LineResult(status_code=exc.status, body=exc.body())
    generation = answer.generation

    async def stopped() -> None:
        await stop.wait()
        if retried():
            generation.void()

    try:
        response = await collect_until(stopped, generation, answer.body)
    except GatewayError as exc:  # the engine failed the line after it started
        return LineResult(status_code=exc.status, body=exc.body(), served_pool=generation.served_pool,
                          cost_pico_usd=generation.cost_pico_usd)
    if response is None or stop.is_set():  # stopped: what it computed was billed (unless it runs again)
        return LineResult(served_pool=generation.served_pool, cost_pico_usd=generation.cost_pico_usd)
    return LineResult(status_code=200, body=response, served_pool=generation.served_pool,
                      cost_pico_usd=generation.cost_pico_usd)


def output_record(item: Any) -> dict[str, Any]:
    """The output/error file line of a finished item (OpenAI's batch output format)."""
    response = None
    if item.response_status is not None:
        response = {"status_code": item.response_status, "request_id": item.request_id, "body": item.response}
    return {"id": item.request_id, "custom_id": item.custom_id, "response": response, "error": item.error}
