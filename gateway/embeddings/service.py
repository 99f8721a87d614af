"""``/v1/embeddings``: tokenize each input → one generation whose prompts are pooled by the engine
(``engine.pooling``) → OpenAI's ``CreateEmbeddingResponse``.

It runs on the one generation service (``gateway.generation``): priced, shed, admitted (the inputs'
tokens and one token each of reservation, settled to the real use), routed with prefix affinity and
``prompt_cache_key``-free, billed at the model's embedding input price (every prompt token, cached or
not) and metered as one usage record with ``prompt_tokens`` only. A model whose replicas report no
``embedding_dimensions`` does not embed. ``dimensions`` keeps each vector's first values and
re-normalises them (Matryoshka-trained embedding models keep their quality this way; OpenAI's
``text-embedding-3`` shorten the same way).
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

from gateway.auth import Principal
from gateway.deps import GatewayRuntime
from gateway.embeddings.schemas import CreateEmbeddingRequest
from gateway.errors import InvalidRequestError
from gateway.generation.requests import check_context_length, lookup_model, resolve_tier
from gateway.generation.service import Generation, run_generation
from gateway.openai.answers import Answer
from gateway.routing import ModelRoute


def _dimensions(route: ModelRoute, requested: int | None) -> int:
    info = route.info()
    size = info.embedding_dimensions if info is not None else None
    if route.adapter is not None or (info is not None and size is None):
        raise InvalidRequestError(f"The model `{route.name}` does not support embeddings.", param="model",
                                  code="invalid_value")
    if requested is not None and size is not None and requested > size:
        raise InvalidRequestError(
            f"Invalid 'dimensions': this model's embeddings have {size} dimensions; ask for at most that.",
            param="dimensions", code="invalid_value")
    return requested or size or 0


def _tokenize(runtime: GatewayRuntime, route: ModelRoute, inputs: list[str | list[int]]) -> list[list[int]]:
    tokenizer = runtime.tokenizer(route.served)
    prompts = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            ids = tokenizer.encode(item)
        else:
            bad = next((t for t in item if not 0 <= t < tokenizer.vocab_size), None)
            if bad is not None:
                raise InvalidRequestError(
                    f"Invalid 'input[{i}]': token id {bad} is outside the model's vocabulary "
                    f"(size {tokenizer.vocab_size}).", param=f"input[{i}]", code="invalid_value")
            ids = list(item)
        if not ids:
            raise InvalidRequestError(f"Invalid 'input[{i}]': it has no tokens.", param=f"input[{i}]",
                                      code="invalid_value")
        check_context_length(route, len(ids), 1, "input", param=f"input[{i}]")
        prompts.append(ids)
    return prompts


def _encode(vector: list[float], dimensions: int, encoding: str) -> list[float] | str:
    if dimensions and dimensions < len(vector):
        vector = vector[:dimensions]
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        vector = [v / norm for v in vector]
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
    return vector


async def start_embeddings(runtime: GatewayRuntime, principal: Principal, request_id: str,
                           body: CreateEmbeddingRequest) -> Answer:
    """The embeddings, started (``gateway.openai.answers``; not streamable); raises what to answer."""
    route = await lookup_model(runtime, principal, body.model)
    dimensions = _dimensions(route, body.dimensions)
    prompts = _tokenize(runtime, route, body.inputs())
    generation = await run_generation(runtime, principal, route, request_id, prompts, {"pooling": {}}, n=1,
                                      max_tokens=1, tier=resolve_tier(runtime, principal, None))

    async def collect() -> dict[str, Any]:
        return await _complete(generation, len(prompts), dimensions, body.encoding_format)

    return Answer(generation, body=collect)


async def _complete(generation: Generation, count: int, dimensions: int, encoding: str) -> dict[str, Any]:
    async for _ in generation.records():
        pass  # an embedding request streams no tokens: its vectors come with the final records
    if generation.error is not None:
        raise generation.error
    data = [{"object": "embedding", "index": i,
             "embedding": _encode(generation.embeddings[i], dimensions, encoding)} for i in range(count)]
    usage = generation.usage
    return {"object": "list", "data": data, "model": generation.route.name,
            "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}}
