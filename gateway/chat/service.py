"""``/v1/chat/completions``: render → tokenize → generate → OpenAI's response or chunk stream.

Rendering uses the model's own chat template (``engine.tokenizer``, loaded once per model) with the
request's tools, so the tokens admitted, routed and billed are exactly the tokens the engine runs.

Predicted Outputs: ``prediction``'s text, tokenized as plain text (no template), goes to the engine as
drafts for speculative decoding; the usage reports ``accepted_prediction_tokens`` and
``rejected_prediction_tokens``, and counts the rejected ones in ``completion_tokens`` (billed as output,
as OpenAI does); the ledger records both counts (``billing.outbox``). A prediction longer than the model's
context is a 400 naming ``prediction``, before admission.

Structured output: ``response_format`` ``json_object``/``json_schema`` and forced tool calls
(``tool_choice`` ``required`` or a named function) become the engine's constrained decoding, so the
output is valid even from a random-weight model. Forced calls win over ``response_format``. A forced
call cut short (``max_tokens``) is still the call, with the arguments generated so far, and
``finish_reason`` ``length`` (``gateway.chat.tools`` says how it is named).

Streaming follows OpenAI exactly: per choice a first chunk with ``role`` (and empty content), content
or ``tool_calls`` deltas, a chunk with ``finish_reason`` and an empty delta; with
``stream_options.include_usage`` every chunk carries ``"usage": null`` and a last chunk carries the usage
with empty ``choices``; then ``data: [DONE]``. Chunks share one id, ``created`` and fingerprint; the
constant part of a chunk is encoded once per request and only the choice is encoded per delta.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from engine.protocol import DeltaRecord
from engine.tokenizer import Tokenizer
from gateway.auth import Principal
from gateway.chat.schemas import (
    AllowedToolsChoice,
    ChatCompletionRequest,
    NamedToolChoice,
    to_template_dict,
)
from gateway.chat.tools import ParsedCall, ToolCallParser, ToolUse
from gateway.deps import GatewayRuntime
from gateway.errors import InvalidRequestError
from gateway.generation.requests import (
    breakpoint_tokens,
    check_context_length,
    check_prediction_length,
    encode_text,
    lookup_model,
    render_chat,
    resolve_tier,
    sampling_fields,
)
from gateway.generation.service import Generation, run_generation
from gateway.openai.answers import Answer
from gateway.openai.encoding import chat_token_logprobs, completion_id, completion_usage, system_fingerprint
from gateway.openai.schemas import ResponseFormatJsonObject, ResponseFormatJsonSchema
from gateway.openai.streaming import DONE_FRAME, json_frame
from gateway.tracing import set_response_id


def _finish_reason(engine_reason: str | None, has_calls: bool, truncated: bool = False) -> str:
    """``tool_calls`` for whole calls; a forced call cut short says why it was cut (``length``)."""
    if has_calls and not truncated:
        return "tool_calls"
    return "length" if engine_reason == "length" else "stop"


async def start_chat_completion(runtime: GatewayRuntime, principal: Principal, request_id: str,
                                body: ChatCompletionRequest) -> Answer:
    """The chat completion, started (``gateway.openai.answers``); raises what to answer instead."""
    body.check()
    route = await lookup_model(runtime, principal, body.model)
    tokenizer = runtime.tokenizer(route.served)
    choice = body.tool_choice
    if isinstance(choice, AllowedToolsChoice):  # check() has narrowed the tools and left its mode instead
        choice = choice.allowed_tools.mode
    tool_use = ToolUse.of(body.function_tools, None if isinstance(choice, NamedToolChoice) else choice,
                          choice.function.name if isinstance(choice, NamedToolChoice) else None)
    messages = [to_template_dict(m) for m in body.messages]
    prompt = await render_chat(tokenizer, messages, tool_use.template_tools, "messages")
    max_tokens = body.completion_limit
    check_context_length(route, len(prompt), max_tokens, "messages")
    breakpoint = (await breakpoint_tokens(tokenizer, messages, tool_use.template_tools, prompt, "messages")
                  if body.explicit_cache else None)

    sampling = sampling_fields(body)
    sampling["logprobs"] = bool(body.logprobs)
    sampling["top_logprobs"] = body.top_logprobs or 0
    if tool_use.forced:
        sampling["response_format"] = tool_use.response_format
    elif isinstance(body.response_format, ResponseFormatJsonObject):
        sampling["response_format"] = {"type": "json_object"}
    elif isinstance(body.response_format, ResponseFormatJsonSchema):
        schema = body.response_format.json_schema.json_schema or {"type": "object"}
        sampling["response_format"] = {"type": "json_schema", "json_schema": schema}

    n = body.n or 1
    tier = resolve_tier(runtime, principal, body.service_tier)
    prediction = (await encode_text(tokenizer, body.prediction.text)) if body.prediction is not None else None
    if prediction is not None:
        check_prediction_length(route, prediction)
    try:
        generation = await run_generation(runtime, principal, route, request_id, [prompt], sampling, n=n,
                                          max_tokens=max_tokens, tier=tier, routing_key=body.prompt_cache_key,
                                          cache=body.cache_spec(breakpoint), prediction=prediction)
    except InvalidRequestError as exc:
        if exc.param in ("json_schema", "response_format"):  # the engine names its own field
            exc.param = "tools" if tool_use.forced else "response_format"
        raise
    parsers = [tool_use.parser(parallel=body.parallel_tool_calls is not False) for _ in range(n)]
    response_id = completion_id("chatcmpl")
    set_response_id(response_id)
    created = int(time.time())
    fingerprint = system_fingerprint(route)
    logprobs = bool(body.logprobs)
    return Answer(
        generation,
        body=lambda: _complete(generation, tokenizer, parsers, response_id, created, fingerprint,
                               logprobs=logprobs),
        frames=lambda: _stream(generation, tokenizer, parsers, response_id, created, fingerprint,
                               include_usage=body.include_usage, logprobs=logprobs),
    )


async def _complete(generation: Generation, tokenizer: Tokenizer, parsers: list[ToolCallParser | None],
                    response_id: str, created: int, fingerprint: str, *, logprobs: bool) -> dict[str, Any]:
    n = generation.n
    texts: list[list[str]] = [[] for _ in range(n)]
    token_logprobs: list[list] = [[] for _ in range(n)]
    async for record in generation.records():
        texts[record.index].append(record.text)
        if logprobs and record.logprobs:
            token_logprobs[record.index].extend(record.logprobs)
    if generation.error is not None:
        raise generation.error
    choices = []
    for i in range(n):
        text = "".join(texts[i])
        parser = parsers[i]
        calls: list[ParsedCall] = []
        if parser is not None:
            content, calls = parser.feed(text)
            rest, more = parser.finish()
            text, calls = content + rest, calls + more
        truncated = parser is not None and parser.truncated
        message: dict[str, Any] = {"role": "assistant",
                                   "content": text if (text or not (calls or truncated)) else None,
                                   "refusal": None, "annotations": []}
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
        choices.append({
            "index": i, "message": message,
            "logprobs": ({"content": chat_token_logprobs(tokenizer, token_logprobs[i]), "refusal": None}
                         if logprobs else None),
            "finish_reason": _finish_reason(generation.finish_reasons.get(i), bool(calls), truncated),
        })
    return {
        "id": response_id, "object": "chat.completion", "created": created, "model": generation.route.name,
        "choices": choices, "usage": completion_usage(generation.usage, generation.reports_lifetimes),
        "service_tier": generation.tier, "system_fingerprint": fingerprint,
    }


async def _stream(generation: Generation, tokenizer: Tokenizer, parsers: list[ToolCallParser | None],
                  response_id: str, created: int, fingerprint: str, *, include_usage: bool,
                  logprobs: bool) -> AsyncIterator[bytes]:
    head = orjson.dumps({"id": response_id, "object": "chat.completion.chunk", "created": created,
                         "model": generation.route.name, "service_tier": generation.tier,
                         "system_fingerprint": fingerprint})[:-1] + b',"choices":['
    tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"
    head = b"data: " + head

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None,
              lp: dict[str, Any] | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        return head + orjson.dumps(choice) + tail

    n = generation.n
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": "", "refusal": None})
    call_counts = [0] * n

    def call_deltas(index: int, calls: list) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"index": call_counts[index], "id": call.id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}})
            call_counts[index] += 1
        return out

    async for record in generation.records():
        data = _delta_chunk(record, parsers, chunk, call_deltas, tokenizer, logprobs)
        if data:
            yield data
    if generation.error is not None:
        yield json_frame(generation.error.body())
        return
    for i in range(n):
        parser = parsers[i]
        if parser is not None:
            rest, calls = parser.finish()
            if rest:
                yield chunk(i, {"content": rest})
            if calls:
                yield chunk(i, {"tool_calls": call_deltas(i, calls)})
        yield chunk(i, {}, _finish_reason(generation.finish_reasons.get(i), call_counts[i] > 0,
                                          parser is not None and parser.truncated))
    if include_usage:
        yield json_frame({"id": response_id, "object": "chat.completion.chunk", "created": created,
                          "model": generation.route.name, "service_tier": generation.tier,
                          "system_fingerprint": fingerprint, "choices": [],
                          "usage": completion_usage(generation.usage, generation.reports_lifetimes)})
    yield DONE_FRAME


def _delta_chunk(record: DeltaRecord, parsers: list[ToolCallParser | None], chunk: Any, call_deltas: Any,
                 tokenizer: Tokenizer, logprobs: bool) -> bytes:
    i = record.index
    lp = ({"content": chat_token_logprobs(tokenizer, record.logprobs), "refusal": None}
          if logprobs and record.logprobs else None)
    parser = parsers[i]
    content, calls = parser.feed(record.text) if parser is not None else (record.text, [])
    out = b""
    if content or lp is not None:
        out += chunk(i, {"content": content}, None, lp)
    if calls:
        out += chunk(i, {"tool_calls": call_deltas(i, calls)})
    return out
