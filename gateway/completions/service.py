"""``/v1/completions`` (legacy text completions): tokenize → generate → ``text_completion`` objects.

Each prompt (string or token ids) is one engine request with ``n`` completions; choice ``index`` is
``prompt_index * n + i``. ``echo`` prepends the prompt's text. An empty prompt is the start of a new
document: the model's BOS token if it has one, else its first EOS token (OpenAI's ``<|endoftext|>``).
Token-id prompts are checked against the vocabulary (an id the model does not have is a 400, not an
engine crash). Streamed chunks have the same shape as the full object (that is how OpenAI streams this
endpoint), with the usage chunk last when ``stream_options.include_usage`` is set. Like OpenAI's own
stream (and unlike its published schema, which shares one object for both), a chunk's
``finish_reason`` is ``null`` until its choice finishes; clients test exactly that.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

from engine.tokenizer import Tokenizer
from gateway.auth import Principal
from gateway.completions.schemas import CompletionRequest
from gateway.deps import GatewayRuntime
from gateway.errors import InvalidRequestError
from gateway.generation.requests import check_context_length, lookup_model, resolve_tier, sampling_fields
from gateway.generation.service import Generation, run_generation
from gateway.openai.answers import Answer
from gateway.openai.encoding import (
    CompletionLogprobs,
    completion_id,
    completion_usage,
    prompt_logprobs_by_id,
    system_fingerprint,
)
from gateway.openai.streaming import DONE_FRAME, json_frame
from gateway.tracing import set_response_id


def _finish_reason(engine_reason: str | None) -> str:
    return "length" if engine_reason == "length" else "stop"


def _tokenize(tokenizer: Tokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    out = []
    vocab = tokenizer.vocab_size
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt) if prompt else []
        else:
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"Invalid 'prompt': token id {bad} is outside the model's vocabulary (size {vocab}).",
                    param="prompt", code="invalid_value")
            ids = prompt
        if not ids:
            start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else (
                tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None)
            if start is None:
                raise InvalidRequestError(f"Invalid 'prompt': prompt {i} is empty.", param="prompt")
            ids = [start]
        out.append(ids)
    return out


# vLLM's ``prompt_logprobs`` of one choice from the engine's records (``prompt_logprobs_by_id``).
PromptLogprobsById = Callable[[list[Any]], list[Any]]

async def start_completion(runtime: GatewayRuntime, principal: Principal, request_id: str,
                           body: CompletionRequest) -> Answer:
    """The completion, started (``gateway.openai.answers``); raises what to answer instead."""
    body.check()
    if body.max_tokens == 0:
        raise InvalidRequestError(
            "Invalid 'max_tokens': generating zero tokens is not supported; use at least 1.",
            param="max_tokens", code="invalid_value")
    route = await lookup_model(runtime, principal, body.model)
    tokenizer = runtime.tokenizer(route.served)
    prompt_inputs = body.prompts()
    prompts = _tokenize(tokenizer, prompt_inputs)
    max_tokens = body.max_tokens
    for prompt in prompts:
        check_context_length(route, len(prompt), max_tokens, "prompt")
    n = body.n or 1
    echo_texts = None
    if body.echo:
        echo_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompt_inputs]

    sampling = sampling_fields(body)
    if body.logprobs is not None:
        sampling["logprobs"] = True
        sampling["top_logprobs"] = body.logprobs
        if body.echo:  # the echoed prompt's tokens are scored too
            sampling["prompt_logprobs"] = body.logprobs
    if body.prompt_logprobs is not None:
        sampling["prompt_logprobs"] = max(body.prompt_logprobs, sampling.get("prompt_logprobs") or 0)
    tier = resolve_tier(runtime, principal, body.service_tier)
    generation = await run_generation(runtime, principal, route, request_id, prompts, sampling, n=n,
                                      max_tokens=max_tokens, tier=tier, routing_key=body.prompt_cache_key,
                                      cache=body.cache_spec())
    response_id = completion_id("cmpl")
    set_response_id(response_id)
    created = int(time.time())
    fingerprint = system_fingerprint(route)
    logprob_builders = ([CompletionLogprobs(tokenizer, len(echo_texts[i // n]) if echo_texts else 0)
                         for i in range(n * len(prompts))] if body.logprobs is not None else None)
    by_id: PromptLogprobsById | None = None
    if body.prompt_logprobs is not None:
        def by_id(records: list[Any]) -> list[Any]:
            return prompt_logprobs_by_id(tokenizer, records)
    return Answer(
        generation,
        body=lambda: _complete(generation, response_id, created, fingerprint, echo_texts, logprob_builders,
                               by_id),
        frames=lambda: _stream(generation, response_id, created, fingerprint, echo_texts, logprob_builders,
                               by_id, include_usage=body.include_usage),
    )


async def _complete(generation: Generation, response_id: str, created: int, fingerprint: str,
                    echo_texts: list[str] | None, logprob_builders: list[CompletionLogprobs] | None,
                    by_id: PromptLogprobsById | None) -> dict[str, Any]:
    count = generation.n * len(generation.prompts)
    texts: list[list[str]] = [[echo_texts[i // generation.n]] if echo_texts else [] for i in range(count)]
    scored: dict[int, list[Any]] = {}
    async for record in generation.records():
        if by_id is not None and record.prompt_logprobs is not None:
            scored[record.index] = by_id(record.prompt_logprobs)
        texts[record.index].append(record.text)
        if logprob_builders is not None and record.prompt_logprobs is not None:
            logprob_builders[record.index].add_prompt(generation.prompts[record.index // generation.n],
                                                      record.prompt_logprobs)
        if logprob_builders is not None and record.logprobs:
            logprob_builders[record.index].add(record.logprobs)
    if generation.error is not None:
        raise generation.error
    choices = [{
        "text": "".join(texts[i]), "index": i,
        "logprobs": logprob_builders[i].as_openai() if logprob_builders is not None else None,
        "finish_reason": _finish_reason(generation.finish_reasons.get(i)),
        **({"prompt_logprobs": scored.get(i)} if by_id is not None else {}),
    } for i in range(count)]
    return {"id": response_id, "object": "text_completion", "created": created,
            "model": generation.route.name, "system_fingerprint": fingerprint, "choices": choices,
            "usage": completion_usage(generation.usage, generation.reports_lifetimes)}


async def _stream(generation: Generation, response_id: str, created: int, fingerprint: str,
                  echo_texts: list[str] | None, logprob_builders: list[CompletionLogprobs] | None,
                  by_id: PromptLogprobsById | None, *, include_usage: bool) -> AsyncIterator[bytes]:
    head = b"data: " + orjson.dumps({"id": response_id, "object": "text_completion", "created": created,
                                     "model": generation.route.name,
                                     "system_fingerprint": fingerprint})[:-1] + b',"choices":['
    tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def chunk(index: int, text: str, finish_reason: str | None = None, lp: dict | None = None,
              prompt: list[Any] | None = None) -> bytes:
        choice = {"text": text, "index": index, "logprobs": lp, "finish_reason": finish_reason}
        if prompt is not None:
            choice["prompt_logprobs"] = prompt
        return head + orjson.dumps(choice) + tail

    count = generation.n * len(generation.prompts)
    # The echo leads each choice; with logprobs it waits for the engine's scores of the prompt.
    scored = echo_texts is not None and logprob_builders is not None
    if echo_texts and not scored:
        for i in range(count):
            yield chunk(i, echo_texts[i // generation.n])
    async for record in generation.records():
        if by_id is not None and record.prompt_logprobs is not None:
            yield chunk(record.index, "", None, None, by_id(record.prompt_logprobs))
        if scored and record.prompt_logprobs is not None:
            assert echo_texts is not None and logprob_builders is not None
            prompt_ids = generation.prompts[record.index // generation.n]
            prompt_lp = logprob_builders[record.index].add_prompt(prompt_ids, record.prompt_logprobs)
            yield chunk(record.index, echo_texts[record.index // generation.n], None, prompt_lp)
        lp = None
        if logprob_builders is not None and record.logprobs:
            lp = logprob_builders[record.index].add(record.logprobs)
        if record.text or lp is not None:
            yield chunk(record.index, record.text, None, lp)
    if generation.error is not None:
        yield json_frame(generation.error.body())
        return
    for i in range(count):
        yield chunk(i, "", _finish_reason(generation.finish_reasons.get(i)))
    if include_usage:
        yield json_frame({"id": response_id, "object": "text_completion", "created": created,
                          "model": generation.route.name, "system_fingerprint": fingerprint, "choices": [],
                          "usage": completion_usage(generation.usage, generation.reports_lifetimes)})
    yield DONE_FRAME
