"""``/v1/responses``: input items → the model's chat template → one generation → a ``Response`` object or
its stream of typed events (``gateway.responses.output``).

The input becomes chat messages the way OpenAI's models read it: ``instructions`` first as a system
message, ``developer`` as ``system``, consecutive ``function_call`` items as one assistant message's tool
calls, each ``function_call_output`` as a tool message answering its ``call_id`` (an output whose call is
not in the input is a 400). Tools, forced calls (``tool_choice`` ``required`` or a named function) and
``text.format`` (``json_object``, ``json_schema``) go through the engine's constrained decoding exactly as
in chat (``gateway.chat.tools``), so the output is valid even from a random-weight model; forced calls
win over ``text.format``. The generation is the one service every endpoint uses
(``gateway.generation``): admitted, routed, billed and metered exactly like a chat completion.

A response cut by ``max_output_tokens`` ends ``incomplete`` (``incomplete_details.reason =
max_output_tokens``), a forced call cut so as an ``incomplete`` ``function_call`` item with the arguments
generated so far (never as text: ``gateway.chat.tools``); an engine failure after the stream began ends
it with ``response.failed``.

Stored responses (``store``, true unless the request says false, as OpenAI): when a response ends
(completed, incomplete, failed, or cancelled by the client going away) its object and its input items,
each with an id, are stored tenant-scoped for ``responses_retention_s``: in Redis at once, in Postgres
with the next flush (``gateway.responses.store``). ``previous_response_id`` continues a conversation:
the stored chain's input and output items, oldest first, come before the new input (the previous
``instructions`` do not carry over), so the shared prefix is the same tokens and hits the prefix cache
(``cached_tokens``). An id that is not this tenant's, expired, or deleted is a 400 naming
``previous_response_id``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import orjson

from engine.protocol import CacheSpec, DeltaRecord
from engine.tokenizer import Tokenizer
from gateway.auth import Principal
from gateway.chat.schemas import FunctionDefinition, FunctionTool
from gateway.chat.tools import ToolCallParser, ToolUse
from gateway.deps import GatewayRuntime
from gateway.errors import InvalidRequestError, NotFoundError, ServiceUnavailableError
from gateway.generation.requests import (
    BREAKPOINT_KEY,
    breakpoint_tokens,
    check_context_length,
    lookup_model,
    render_chat,
    resolve_tier,
    sampling_arguments,
)
from gateway.generation.service import STATUS_CANCELLED, Generation, run_generation
from gateway.openai.answers import Answer
from gateway.openai.caching import breakpoint_offset
from gateway.openai.encoding import chat_token_logprobs, response_usage
from gateway.responses.output import STATUS_CANCELLED as RESPONSE_CANCELLED
from gateway.responses.output import STATUS_IN_PROGRESS, STATUS_QUEUED, ResponseBuilder, new_id
from gateway.responses.repository import ResponseRepository
from gateway.responses.schemas import (
    CreateResponseRequest,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ToolChoiceFunction,
    part_text,
)
from gateway.responses.store import ResponseStore, database
from gateway.routing import ModelRoute
from gateway.tracing import set_response_id
from tollgate.models import StoredResponse

logger = logging.getLogger("tollgate.gateway.responses")

# Background responses run at this tier, by a worker (``gateway.responses.background``).
BACKGROUND_TIER = "flex"
BACKGROUND_TASK = "responses.background"


def _text_part(text: str, kind: str = "input_text", breakpoint: bool = False) -> dict[str, Any]:
    part: dict[str, Any] = {"type": kind, "text": text}
    if kind == "output_text":
        part |= {"annotations": [], "logprobs": []}
    if breakpoint:  # kept whatever the part's kind: a later turn's conversation still has it
        part["prompt_cache_breakpoint"] = {"mode": "explicit"}
    return part


def _message_parts(item: MessageItem) -> list[dict[str, Any]]:
    """A message's content as stored: its text in one part, or its parts one by one where a part marks a
    prompt-cache breakpoint (the breakpoint is kept on its part)."""
    kind = "output_text" if item.role == "assistant" else "input_text"
    if isinstance(item.content, list):
        marks = [getattr(p, "prompt_cache_breakpoint", None) is not None for p in item.content]
        if any(marks):
            return [_text_part(part_text(p), kind, mark) for p, mark in zip(item.content, marks, strict=True)]
    return [_text_part(item.text, kind)]


def input_items(body: CreateResponseRequest) -> list[dict[str, Any]]:
    """The request's input as stored items (OpenAI's item resources, each with an id)."""
    if isinstance(body.input, str):
        return [{"id": new_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [_text_part(body.input)]}]
    items: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            items.append({"id": new_id("msg"), "type": "message", "role": item.role, "status": "completed",
                          "content": _message_parts(item)})
        elif isinstance(item, FunctionCallItem):
            items.append({"id": item.id or new_id("fc"), "type": "function_call", "status": "completed",
                          "call_id": item.call_id, "name": item.name, "arguments": item.arguments})
        elif isinstance(item, FunctionCallOutputItem):
            items.append({"id": new_id("fco"), "type": "function_call_output", "status": "completed",
                          "call_id": item.call_id, "output": item.text})
    return items


def _stored_part_text(part: dict[str, Any]) -> str:
    return part.get("text") or part.get("refusal") or ""


def _message_text(item: dict[str, Any]) -> str:
    return "".join(_stored_part_text(part) for part in item["content"])


def template_messages(instructions: str | None, history: list[dict[str, Any]],
                      items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat-template messages of a conversation: ``instructions``, then the items of the earlier
    responses (``history``), then this request's ``items`` (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    calls: set[str] = set()
    for index, item in enumerate([*history, *items]):
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            message = {"role": role, "content": _message_text(item)}
            offset = breakpoint_offset([(_stored_part_text(p), "prompt_cache_breakpoint" in p)
                                        for p in item["content"]])
            if offset is not None:
                message[BREAKPOINT_KEY] = offset
            messages.append(message)
        elif kind == "function_call":
            calls.add(item["call_id"])
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if item["call_id"] not in calls:
                at = index - len(history)
                raise InvalidRequestError(
                    f"Invalid 'input[{at}]': no function call with call_id '{item['call_id']}' comes before "
                    "this function_call_output.", param=f"input[{at}].call_id", code="invalid_value")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


async def _history(runtime: GatewayRuntime, tenant_id: int,
                   previous_response_id: str) -> list[dict[str, Any]]:
    """The items of the conversation ending with ``previous_response_id``, oldest first."""
    chain = await ResponseStore(runtime, tenant_id).conversation(previous_response_id)
    if not chain or chain[-1].id != previous_response_id:
        raise InvalidRequestError(f"Previous response with id '{previous_response_id}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
    return [item for row in chain for item in (*row.input_items, *row.body.get("output", []))]


def _chat_tools(body: CreateResponseRequest) -> list[FunctionTool]:
    return [FunctionTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict))
        for t in body.function_tools]


def _echo(body: CreateResponseRequest, model: str, tier: str) -> dict[str, Any]:
    """What the ``Response`` object repeats of the request, with OpenAI's defaults filled in."""
    choice = body.tool_choice
    text_format = body.format.model_dump(mode="json", by_alias=True, exclude_none=True)
    verbosity = (body.text.verbosity if body.text else None) or "medium"
    return {
        "model": model, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None}, "service_tier": tier,
        "store": body.store is not False, "background": bool(body.background),
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "top_logprobs": body.top_logprobs or 0,
        "text": {"format": text_format, "verbosity": verbosity},
        "tool_choice": choice.model_dump() if isinstance(choice, ToolChoiceFunction) else (choice or "auto"),
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": t.strict} for t in body.function_tools],
        "truncation": "disabled", "user": body.user, "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key, "metadata": body.metadata or {},
        "prompt_cache_retention": body.prompt_cache_retention,
        **({"prompt_cache_options": options} if (options := body.applied_options()) else {}),
    }


@dataclass
class _Plan:
    """What a request becomes before any engine work: validated, rendered and priced in tokens."""

    route: ModelRoute
    tokenizer: Tokenizer
    prompt: list[int]
    cache: CacheSpec | None
    items: list[dict[str, Any]]
    sampling: dict[str, Any]
    tier: str
    forced: bool
    parser: ToolCallParser | None
    logprobs: bool


async def _plan(runtime: GatewayRuntime, principal: Principal, body: CreateResponseRequest) -> _Plan:
    """Every check that needs no engine (model, tools, conversation, template, context length); raises
    the 400/404 to answer."""
    body.check()
    route = await lookup_model(runtime, principal, body.model)
    tokenizer = runtime.tokenizer(route.served)
    choice = body.tool_choice
    tool_use = ToolUse.of(_chat_tools(body), None if isinstance(choice, ToolChoiceFunction) else choice,
                          choice.name if isinstance(choice, ToolChoiceFunction) else None)
    history = (await _history(runtime, principal.tenant_id, body.previous_response_id)
               if body.previous_response_id else [])
    items = input_items(body)
    messages = template_messages(body.instructions, history, items)
    prompt = await render_chat(tokenizer, messages, tool_use.template_tools, "input")
    check_context_length(route, len(prompt), body.max_output_tokens, "input", param="input")
    breakpoint = (await breakpoint_tokens(tokenizer, messages, tool_use.template_tools, prompt, "input")
                  if body.explicit_cache else None)

    sampling = sampling_arguments(body.temperature, body.top_p)
    logprobs = body.wants_logprobs
    sampling["logprobs"] = logprobs
    sampling["top_logprobs"] = body.top_logprobs or 0
    text_format = body.format
    if tool_use.forced:
        sampling["response_format"] = tool_use.response_format
    elif isinstance(text_format, FormatJsonObject):
        sampling["response_format"] = {"type": "json_object"}
    elif isinstance(text_format, FormatJsonSchema):
        sampling["response_format"] = {"type": "json_schema", "json_schema": text_format.json_schema}
    parser = tool_use.parser(parallel=body.parallel_tool_calls is not False)
    tier = resolve_tier(runtime, principal, body.service_tier)
    return _Plan(route, tokenizer, prompt, body.cache_spec(breakpoint), items, sampling, tier,
                 tool_use.forced, parser, logprobs)


async def start_response(runtime: GatewayRuntime, principal: Principal, request_id: str,
                         body: CreateResponseRequest, *, response_id: str | None = None,
                         created_at: int | None = None) -> Answer:
    """The response, started (``gateway.openai.answers``); raises what to answer instead.
    ``response_id`` and ``created_at``: a queued background response's, which a worker runs now."""
    if body.background and response_id is None:
        raise InvalidRequestError("A background response is created with POST /v1/responses and polled; it "
                                  "cannot run here.", param="background", code="unsupported_parameter")
    plan = await _plan(runtime, principal, body)
    try:
        generation = await run_generation(runtime, principal, plan.route, request_id, [plan.prompt],
                                          plan.sampling, n=1, max_tokens=body.max_output_tokens,
                                          tier=plan.tier, routing_key=body.prompt_cache_key, cache=plan.cache)
    except InvalidRequestError as exc:
        if exc.param in ("json_schema", "response_format"):  # the engine names its own field
            exc.param = "tools" if plan.forced else "text.format"
        raise
    builder = ResponseBuilder(response_id or new_id("resp"), _echo(body, plan.route.name, plan.tier),
                              created_at)
    set_response_id(builder.id)
    save = None
    if body.store is not False:
        save = _saver(runtime, principal, body.previous_response_id, plan.items, builder, generation,
                      queued=response_id is not None)
    output = _Output(generation, builder, plan.parser, plan.tokenizer, plan.logprobs, save)
    return Answer(generation, body=output.complete, frames=output.stream)


async def queue_response(runtime: GatewayRuntime, principal: Principal,
                         body: CreateResponseRequest) -> dict[str, Any]:
    """A ``background`` response: checked now (a bad request is still a 400), stored ``queued`` with the
    request a worker runs at the ``flex`` tier (``gateway.responses.background``); returns the queued
    object, which ``GET`` polls."""
    body = body.model_copy(update={"service_tier": BACKGROUND_TIER})
    plan = await _plan(runtime, principal, body)
    builder = ResponseBuilder(new_id("resp"), _echo(body, plan.route.name, plan.tier))
    builder.status = STATUS_QUEUED
    response = builder.response()
    row = _row(runtime, principal, body.previous_response_id, plan.items, builder, response,
               request=body.model_dump(mode="json", by_alias=True, exclude_none=True))
    async with database(runtime, write=True) as session:
        await ResponseRepository(session, principal.tenant_id).add(row)
    try:
        await runtime.task_sender().send(BACKGROUND_TASK, [builder.id])
    except Exception as exc:  # the broker (Redis) is unreachable: Celery raises kombu's or redis' errors
        logger.warning("queueing background response %s failed: %r", builder.id, exc)
        # Nobody learns the id: drop the row (a task that did reach the broker finds nothing to claim).
        with contextlib.suppress(Exception):
            async with database(runtime, write=True) as session:
                await ResponseRepository(session, principal.tenant_id).delete(builder.id)
        raise ServiceUnavailableError("The background response could not be queued right now. Please retry.",
                                      code="service_unavailable") from exc
    return response


def _row(runtime: GatewayRuntime, principal: Principal, previous_response_id: str | None,
         items: list[dict[str, Any]], builder: ResponseBuilder, response: dict[str, Any],
         request: dict[str, Any] | None = None) -> StoredResponse:
    """The stored form of ``response`` (``request``: a background one's, for its worker)."""
    retention = timedelta(seconds=runtime.settings.responses_retention_s)
    return StoredResponse(id=builder.id, tenant_id=principal.tenant_id, api_key_id=principal.api_key_id,
                          previous_response_id=previous_response_id, status=response["status"],
                          model=response["model"], input_items=items, body=response, request=request,
                          created_at=datetime.fromtimestamp(builder.created_at, UTC),
                          expires_at=datetime.now(UTC) + retention)


def _saver(runtime: GatewayRuntime, principal: Principal, previous_response_id: str | None,
           items: list[dict[str, Any]], builder: ResponseBuilder, generation: Generation,
           queued: bool) -> Callable[[], Awaitable[None]]:
    """Stores the response as it ended: one INSERT, or for a ``queued`` (background) one an update of
    its row under the row lock, where a cancel that came meanwhile keeps it ``cancelled`` (with what was
    generated until the worker noticed). A background response's update also keeps the usage record its
    worker meters next (``usage_pending``, until the worker cleared it or the requeue sweep metered it:
    ``gateway.responses.background``)."""
    tenant_id = principal.tenant_id

    async def save() -> None:
        response = builder.response()
        if not queued:
            await ResponseStore(runtime, tenant_id).put(
                _row(runtime, principal, previous_response_id, items, builder, response))
            return
        async with database(runtime, write=True) as session:
            row = await ResponseRepository(session, tenant_id).get(builder.id, for_update=True)
            if row is None:  # deleted (or expired) meanwhile: nothing to keep
                return
            if row.status == RESPONSE_CANCELLED:
                response["status"] = RESPONSE_CANCELLED
            row.status, row.body = response["status"], response
            record = generation.final_record()
            row.usage_pending = orjson.loads(record.to_json()) if record is not None else None

    return save


class _Output:
    """Feeds the generation's records to the builder: the whole object, or the event stream."""

    def __init__(self, generation: Generation, builder: ResponseBuilder, parser: ToolCallParser | None,
                 tokenizer: Tokenizer, logprobs: bool, save: Callable[[], Awaitable[None]] | None) -> None:
        self.generation, self.builder, self.parser = generation, builder, parser
        self.tokenizer, self.logprobs = tokenizer, logprobs
        self._save = save

    def _feed(self, record: DeltaRecord) -> list[dict[str, Any]]:
        content, calls = self.parser.feed(record.text) if self.parser is not None else (record.text, [])
        lp = (chat_token_logprobs(self.tokenizer, record.logprobs)
              if self.logprobs and record.logprobs else None)
        events = self.builder.text(content, lp)
        for call in calls:
            events += self.builder.call(call)
        return events

    def _finish(self) -> list[dict[str, Any]]:
        generation = self.generation
        usage = response_usage(generation.usage, generation.reports_lifetimes)
        if generation.status == STATUS_CANCELLED:
            return self.builder.finish(usage, cancelled=True)
        if generation.error is not None:
            return self.builder.finish(usage, error_message=generation.error.message)
        cut = generation.finish_reasons.get(0) == "length"
        events: list[dict[str, Any]] = []
        if self.parser is not None:
            rest, calls = self.parser.finish()
            events += self.builder.text(rest)
            for call in calls:
                events += self.builder.call(call, complete=not cut)
        return events + self.builder.finish(usage, cut_short=cut)

    async def _settle_if_cancelled(self) -> None:
        """The client went away (or a background run was cancelled): ``finish`` now, before the object is
        built and stored, since the engine's count of what it computed until the abort comes with it, and
        the stored object must show the usage the request is billed. (Idempotent: the response's own
        ``finish`` later does nothing.)"""
        if self.generation.status == STATUS_CANCELLED:
            with anyio.CancelScope(shield=True):
                await self.generation.finish()

    async def _stored(self) -> None:
        """Store the response as it ended (once; never raises: the client has its answer already)."""
        save, self._save = self._save, None
        if save is not None:
            try:
                await save()
            except Exception:
                logger.exception("storing response %s failed", self.builder.id)

    async def complete(self) -> dict[str, Any]:
        try:
            async for record in self.generation.records():
                self._feed(record)
            await self._settle_if_cancelled()
            self._finish()
        finally:
            await self._stored()
        if self.generation.error is not None:
            raise self.generation.error
        return self.builder.response()

    async def stream(self) -> AsyncIterator[bytes]:
        try:
            for event in self.builder.start():
                yield _frame(event)
            async for record in self.generation.records():
                for event in self._feed(record):
                    yield _frame(event)
            await self._settle_if_cancelled()
            final = self._finish()
            # Stored before the client sees the end: a follow-up sent on response.completed finds it.
            await self._stored()
            for event in final:
                yield _frame(event)
        finally:
            if self.builder.status == STATUS_IN_PROGRESS:  # the client went away mid-stream
                self.generation.cancel()
                await self._settle_if_cancelled()
                usage = response_usage(self.generation.usage, self.generation.reports_lifetimes)
                self.builder.finish(usage, cancelled=True)
            await self._stored()


def _frame(event: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI sends the Responses stream: the type as the event name."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


# -- stored responses ----------------------------------------------------------------------------------

def _not_found(response_id: str) -> NotFoundError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id",
                         code="response_not_found")


async def get_response(runtime: GatewayRuntime, tenant_id: int, response_id: str) -> dict[str, Any]:
    row = await ResponseStore(runtime, tenant_id).get(response_id)
    if row is None:
        raise _not_found(response_id)
    return row.body


async def delete_response(runtime: GatewayRuntime, tenant_id: int, response_id: str) -> dict[str, Any]:
    if not await ResponseStore(runtime, tenant_id).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def list_input_items(runtime: GatewayRuntime, tenant_id: int, response_id: str, *, limit: int,
                           order: str, after: str | None) -> dict[str, Any]:
    """OpenAI's ``ResponseItemList`` of the response's own input items (``order`` ``desc``: newest
    first; ``after``: the id of the last item of the previous page)."""
    row = await ResponseStore(runtime, tenant_id).get(response_id)
    if row is None:
        raise _not_found(response_id)
    items = list(reversed(row.input_items)) if order == "desc" else list(row.input_items)
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise InvalidRequestError(f"Invalid 'after': no input item with id '{after}' in this response.",
                                      param="after", code="invalid_value")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None}


def _background_only() -> InvalidRequestError:
    return InvalidRequestError("Only background responses can be cancelled.", param="response_id",
                               code="invalid_value")


async def cancel_response(runtime: GatewayRuntime, tenant_id: int, response_id: str) -> dict[str, Any]:
    """Cancel a background response that is queued or running (its worker notices within a poll and
    stops the generation, which is billed for what it generated); a finished one is returned as is.
    Only background responses are rows from the start; any other is first found in Redis or as a row."""
    found = await ResponseStore(runtime, tenant_id).get(response_id)
    if found is not None and found.request is None:
        raise _background_only()
    async with database(runtime, write=True) as session:
        row = await ResponseRepository(session, tenant_id).get(response_id, for_update=True)
        if row is None:
            raise _not_found(response_id)
        if row.request is None:
            raise _background_only()
        if row.status in (STATUS_QUEUED, STATUS_IN_PROGRESS):
            row.status = RESPONSE_CANCELLED
            row.body = {**row.body, "status": RESPONSE_CANCELLED}
        return row.body

