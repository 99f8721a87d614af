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
max_output_tokens``); an engine failure after the stream began ends it with ``response.failed``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson

from engine.protocol import DeltaRecord
from engine.tokenizer import Tokenizer
from gateway.auth import Principal
from gateway.chat.schemas import FunctionDefinition, FunctionTool
from gateway.chat.tools import ToolCallParser, forced_call_schema
from gateway.deps import GatewayRuntime
from gateway.errors import InvalidRequestError
from gateway.generation.requests import check_context_length, lookup_model, resolve_tier, sampling_arguments
from gateway.generation.service import Generation, run_generation
from gateway.openai.answers import Answer
from gateway.openai.encoding import chat_token_logprobs, response_usage
from gateway.responses.output import ResponseBuilder, new_id
from gateway.responses.schemas import (
    CreateResponseRequest,
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ToolChoiceFunction,
)

# Inputs longer than this (characters) are rendered and tokenized in a worker thread.
OFFLOAD_CHARS = 32_000


def template_messages(body: CreateResponseRequest) -> list[dict[str, Any]]:
    """The request's input as chat-template messages (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    calls: set[str] = set()
    for index, item in enumerate(body.input):
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            calls.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                raise InvalidRequestError(
                    f"Invalid 'input[{index}]': no function call with call_id '{item.call_id}' comes before "
                    "this function_call_output.", param=f"input[{index}].call_id", code="invalid_value")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


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
        "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None}, "service_tier": tier, "store": False,
        "background": False, "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "top_logprobs": body.top_logprobs or 0,
        "text": {"format": text_format, "verbosity": verbosity},
        "tool_choice": choice.model_dump() if isinstance(choice, ToolChoiceFunction) else (choice or "auto"),
        "tools": [{"type": "function", "name": t.name, "description": t.description,
                   "parameters": t.parameters, "strict": t.strict} for t in body.function_tools],
        "truncation": "disabled", "user": body.user, "safety_identifier": body.safety_identifier,
        "prompt_cache_key": body.prompt_cache_key, "metadata": body.metadata or {},
    }


async def _render(tokenizer: Tokenizer, messages: list[dict[str, Any]],
                  tools: list[dict] | None) -> list[int]:
    size = sum(len(m["content"] or "") for m in messages)
    try:
        if size > OFFLOAD_CHARS:
            return await asyncio.to_thread(tokenizer.encode_chat, messages, tools)
        return tokenizer.encode_chat(messages, tools)
    except ValueError as exc:
        raise InvalidRequestError(f"Invalid 'input': {exc}", param="input") from None


async def start_response(runtime: GatewayRuntime, principal: Principal, request_id: str,
                         body: CreateResponseRequest) -> Answer:
    """The response, started (``gateway.openai.answers``); raises what to answer instead."""
    body.check()
    route = lookup_model(runtime, principal, body.model)
    tokenizer = runtime.tokenizer(route.name)
    tools = _chat_tools(body)
    choice = body.tool_choice
    use_tools = bool(tools) and choice != "none"
    forced_name = choice.name if isinstance(choice, ToolChoiceFunction) else None
    forced = use_tools and (choice == "required" or forced_name is not None)
    rendered_tools = [t.model_dump(mode="json", exclude_none=True) for t in tools] if use_tools else None
    prompt = await _render(tokenizer, template_messages(body), rendered_tools)
    max_tokens = body.max_output_tokens
    check_context_length(route, len(prompt), max_tokens, "input", param="input")

    sampling = sampling_arguments(body.temperature, body.top_p)
    logprobs = body.wants_logprobs
    sampling["logprobs"] = logprobs
    sampling["top_logprobs"] = body.top_logprobs or 0
    text_format = body.format
    if forced:
        sampling["response_format"] = {"type": "json_schema",
                                       "json_schema": forced_call_schema(tools, forced_name)}
    elif isinstance(text_format, FormatJsonObject):
        sampling["response_format"] = {"type": "json_object"}
    elif isinstance(text_format, FormatJsonSchema):
        sampling["response_format"] = {"type": "json_schema", "json_schema": text_format.json_schema}

    tier = resolve_tier(runtime, principal, body.service_tier)
    try:
        generation = await run_generation(runtime, principal, route, request_id, [prompt], sampling, n=1,
                                          max_tokens=max_tokens, tier=tier)
    except InvalidRequestError as exc:
        if exc.param in ("json_schema", "response_format"):  # the engine names its own field
            exc.param = "tools" if forced else "text.format"
        raise
    builder = ResponseBuilder(new_id("resp"), _echo(body, route.name, tier))
    parallel = body.parallel_tool_calls is not False
    parser = ToolCallParser(forced=forced, parallel=parallel) if use_tools else None
    output = _Output(generation, builder, parser, tokenizer, logprobs)
    return Answer(generation, body=output.complete, frames=output.stream)


class _Output:
    """Feeds the generation's records to the builder: the whole object, or the event stream."""

    def __init__(self, generation: Generation, builder: ResponseBuilder, parser: ToolCallParser | None,
                 tokenizer: Tokenizer, logprobs: bool) -> None:
        self.generation, self.builder, self.parser = generation, builder, parser
        self.tokenizer, self.logprobs = tokenizer, logprobs

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
        usage = response_usage(generation.usage)
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

    async def complete(self) -> dict[str, Any]:
        async for record in self.generation.records():
            self._feed(record)
        if self.generation.error is not None:
            raise self.generation.error
        self._finish()
        return self.builder.response()

    async def stream(self) -> AsyncIterator[bytes]:
        for event in self.builder.start():
            yield _frame(event)
        async for record in self.generation.records():
            for event in self._feed(record):
                yield _frame(event)
        for event in self._finish():
            yield _frame(event)


def _frame(event: dict[str, Any]) -> bytes:
    """One server-sent event as OpenAI sends the Responses stream: the type as the event name."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
