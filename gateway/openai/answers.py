"""An ``Answer``: a started generation and its rendering in one of OpenAI's wire formats, and the two
ways it is delivered.

The endpoint services (chat, completions) validate, tokenize and start the generation
(``gateway.generation.run_generation``), then return an ``Answer``: ``body()`` collects the whole
response object (raising the ``GatewayError`` an engine failure left), ``frames()`` yields its SSE
frames. They know nothing about who asked:

- ``respond`` answers an HTTP request: the event stream, or the JSON body collected unless the client
  hangs up first (then 499, nobody to read it);
- a batch line (``gateway.batches.lines``) collects ``body()`` until its runner stops it.

Either way the generation is finished (settled and metered) exactly once, by the stream or by
``collect_until``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.generation.service import Generation
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
