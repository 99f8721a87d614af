"""What every endpoint decides about a request before it becomes a generation, the same way for chat,
completions, responses and batch lines: the model (one this key may use), the tier (the tenant's, or a
lower one it asks for), the engine's sampling arguments (OpenAI's defaults), the prompt's tokens from
the model's chat template, the context length, and a prediction's length."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from engine.tokenizer import Tokenizer
from gateway.adapters.service import is_adapter_model
from gateway.auth import Principal
from gateway.deps import GatewayRuntime
from gateway.errors import InvalidRequestError, ModelNotFoundError
from gateway.routing import ModelRoute


def resolve_tier(runtime: GatewayRuntime, principal: Principal, requested: str | None) -> str:
    """The tier a request runs at: the tenant's, or a lower one it asks for (never a higher one).
    ``auto``, ``None`` and tiers this platform does not define mean the tenant's tier."""
    tiers = runtime.settings.tiers
    own = principal.tenant.tier if principal.tenant.tier in tiers else next(iter(tiers))
    if requested is None or requested == "auto" or requested not in tiers:
        return own
    return requested if tiers[requested].rank <= tiers[own].rank else own


async def lookup_model(runtime: GatewayRuntime, principal: Principal, model: str) -> ModelRoute:
    """The route of ``model`` for ``principal``: a served model its key may use, or one of its tenant's
    adapter models (``ft:...``, ``gateway.adapters.directory``); anything else is a 404
    ``model_not_found``, the same whether it does not exist or belongs to another tenant."""
    if is_adapter_model(model) and runtime.adapters is not None:
        route = await runtime.adapters.route(principal, model)
    else:
        route = runtime.router.models.get(model)
        if route is not None and not principal.may_use(model):
            route = None
    if route is None:
        raise ModelNotFoundError(model)
    return route


# Conversations longer than this (characters) are rendered and tokenized in a worker thread.
OFFLOAD_CHARS = 32_000


Rendered = TypeVar("Rendered")


async def _through_template(render: Callable[[list[dict[str, Any]], list[dict] | None], Rendered],
                            messages: list[dict[str, Any]], tools: list[dict] | None, param: str) -> Rendered:
    """``render(messages, tools)`` (a use of the chat template), off the event loop for a long
    conversation; a template error is a 400 naming ``param``."""
    size = sum(len(m["content"] or "") for m in messages)
    try:
        if size > OFFLOAD_CHARS:
            return await asyncio.to_thread(render, messages, tools)
        return render(messages, tools)
    except ValueError as exc:
        raise InvalidRequestError(f"Invalid '{param}': {exc}", param=param) from None


async def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None,
                      param: str) -> list[int]:
    """The tokens of ``messages`` (and ``tools``) through the model's chat template, as the engine will
    run them; a long conversation off the event loop; a template error is a 400 naming ``param``."""
    return await _through_template(tokenizer.encode_chat, messages, tools, param)


async def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Plain text's tokens (no chat template, no special tokens); a long text off the event loop."""
    if len(text) > OFFLOAD_CHARS:
        return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False)


# On a chat-template message: the characters of its content that end at its last prompt-cache breakpoint
# (``gateway.openai.caching``).
BREAKPOINT_KEY = "_cache_breakpoint"


# Put at a breakpoint to find it in the rendered conversation (private-use characters: no text has them,
# and no template rewrites them).
_MARK = "\ue000tollgate-cache-breakpoint\ue000"


async def breakpoint_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None,
                            prompt: list[int], param: str) -> int | None:
    """The tokens of ``prompt`` (the rendered ``messages``) before the conversation's last breakpoint;
    None when no message has one. The whole conversation is rendered again with a mark at the breakpoint
    (so the template sees the same shape: roles, tool calls, the generation prompt), and the text before
    the mark is tokenized: the tokens it shares with the prompt count (a token merging across the mark
    does not). A template that drops the mark leaves nothing cacheable."""
    last = max((i for i, m in enumerate(messages) if m.get(BREAKPOINT_KEY) is not None), default=None)
    if last is None:
        return None
    marked = dict(messages[last])
    at = marked[BREAKPOINT_KEY]
    marked["content"] = marked["content"][:at] + _MARK + marked["content"][at:]
    conversation = [*messages[:last], marked, *messages[last + 1:]]
    text = await _through_template(tokenizer.apply_chat_template, conversation, tools, param)
    end = text.find(_MARK)
    if end < 0:
        return 0
    common = 0
    for mine, theirs in zip(tokenizer.encode(text[:end], add_special_tokens=False), prompt, strict=False):
        if mine != theirs:
            break
        common += 1
    return common


def sampling_arguments(temperature: float | None, top_p: float | None, *,
                       presence_penalty: float | None = None, frequency_penalty: float | None = None,
                       seed: int | None = None, stop: list[str] | None = None) -> dict[str, Any]:
    """The engine's sampling arguments from OpenAI's fields (defaults: temperature 1, top_p 1)."""
    temperature = 1.0 if temperature is None else temperature
    top_p = 1.0 if top_p is None else top_p
    if top_p == 0.0:  # OpenAI accepts 0: only the most likely token remains, i.e. greedy decoding
        temperature, top_p = 0.0, 1.0
    return {
        "temperature": temperature, "top_p": top_p, "presence_penalty": presence_penalty or 0.0,
        "frequency_penalty": frequency_penalty or 0.0, "seed": seed, "stop": stop or [],
    }


def sampling_fields(body: Any) -> dict[str, Any]:
    """``sampling_arguments`` of a chat or completions body (``SamplingFields``)."""
    return sampling_arguments(body.temperature, body.top_p, presence_penalty=body.presence_penalty,
                              frequency_penalty=body.frequency_penalty, seed=body.seed, stop=body.stop_list)


def check_context_length(route: ModelRoute, prompt_tokens: int, max_tokens: int | None, what: str,
                         param: str | None = None) -> None:
    """400 ``context_length_exceeded`` (naming ``param``, by default ``messages`` or ``prompt`` after
    ``what``) when the prompt and ``max_tokens`` do not fit the model's context."""
    info = route.info()
    if info is None:
        return
    limit = info.max_model_len
    wanted = prompt_tokens + (max_tokens or 0)
    if prompt_tokens >= limit or wanted > limit:
        detail = f"{prompt_tokens} in the {what}"
        if max_tokens:
            detail += f", {max_tokens} in the completion"
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested {wanted} tokens "
            f"({detail}). Please reduce the length of the {what} or completion.",
            param=param or ("messages" if what == "messages" else "prompt"), code="context_length_exceeded",
        )


def check_prediction_length(route: ModelRoute, prediction: list[int]) -> None:
    """400 naming ``prediction`` when the prediction has more tokens than the model's context (what the
    engine refuses too): refused before admission reserves its length (``gateway.generation.service``),
    so a batch line says so in its error record instead of waiting on a quota it can never fit."""
    info = route.info()
    if info is None or len(prediction) <= info.max_model_len:
        return
    raise InvalidRequestError(
        f"Invalid 'prediction': it has {len(prediction)} tokens, more than this model's maximum context "
        f"length of {info.max_model_len} tokens.", param="prediction", code="invalid_value")
