"""An ``Answer``: a started generation and its rendering in one of OpenAI's wire formats, and the two
ways it is delivered.

The endpoint services (chat, completions) validate, tokenize and start the generation
(``gateway.generation.run_generation``), then return an ``Answer``: ``body()`` collects the whole
response object (raising the ``GatewayError`` an engine failure left), ``frames()`` yields its SSE
frames. They know nothing about who asked:

- ``respond`` answers an HTTP request: the event stream, or the JSON body collected unless the client
  hangs up first (then 499, nobody to read it); ``add_generation_route`` registers the thin ``POST``
  route that validates a body, starts it and responds (chat, completions, embeddings);
- a batch line (``gateway.batches.lines``) collects ``body()`` until its runner stops it.

Either way the generation is finished (settled and metered) exactly once, by the stream or by
``collect_until``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import APIRouter
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import Principal
from gateway.deps import CurrentPrincipal, GatewayRuntime, RequestId, Runtime
from gateway.errors import parse_request_body
from gateway.generation.service import Generation
from gateway.openai.schemas import openapi_request_body
from gateway.openai.streaming import EventStreamResponse, client_gone, collect_until

CLIENT_CLOSED_REQUEST = 499


@dataclass
class Answer:
    generation: Generation
    body: Callable[[], Awaitable[dict[str, Any]]]
    frames: Callable[[], AsyncIterator[bytes]] | None = None  # None: not streamable (embeddings)


async def respond(answer: Answer, request: Request, *, stream: bool) -> Response:
    generation = answer.generation
    if stream and answer.frames is not None:
        return EventStreamResponse(answer.frames(), generation, headers=generation.headers)
    body = await collect_until(client_gone(request.receive), generation, answer.body)
    if body is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return Response(orjson.dumps(body), media_type="application/json", headers=generation.headers)


Start = Callable[[GatewayRuntime, Principal, str, Any], Awaitable[Answer]]


def add_generation_route(router: APIRouter, path: str, schema: type[BaseModel], start: Start, *,
                         name: str, summary: str) -> None:
    """``POST path`` on ``router``: the body validated straight from bytes as ``schema`` (one pass;
    every failure, bad JSON included, is OpenAI's 400), started by the endpoint service ``start``, and
    delivered by ``respond`` (streamed when the body says ``stream``)."""

    async def endpoint(request: Request, runtime: Runtime, principal: CurrentPrincipal,
                       request_id: RequestId) -> Any:
        body = parse_request_body(schema, await request.body())
        answer = await start(runtime, principal, request_id, body)
        return await respond(answer, request, stream=bool(getattr(body, "stream", False)))

    router.post(path, name=name, summary=summary, openapi_extra=openapi_request_body(schema))(endpoint)

