"""Server-sent events and client-disconnect handling for generations.

``EventStreamResponse`` is a small ASGI response (not Starlette's ``StreamingResponse``) because the
gateway must *always* run cleanup when a client goes away: it sends the events of an async iterator of
already-encoded SSE frames while a second task waits for ``http.disconnect``; whichever ends first
cancels the other, and then — shielded from cancellation — the iterator is closed and
``Generation.finish()`` runs (engine abort, settle, meter). A write to a vanished client counts as a
disconnect too.

``collect_unless_disconnected`` does the same for non-streamed answers: a client that hangs up while
waiting aborts the engine work instead of letting it run to the end.

Frames are ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``, or after an error frame
``data: {"error": {...}}`` (what OpenAI sends and its SDKs raise on).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.openai.generation import Generation

T = TypeVar("T")

DONE_FRAME = b"data: [DONE]\n\n"


def frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def json_frame(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class EventStreamResponse(Response):
    """A ``Response`` subclass so FastAPI passes it through untouched; it overrides the whole send."""

    def __init__(self, frames: AsyncIterator[bytes], generation: Generation,
                 headers: Mapping[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.frames = frames
        self.generation = generation
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"),
                            (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        self.raw_headers += [(k.lower().encode("latin-1"), v.encode("latin-1"))
                             for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        generation = self.generation
        try:
            async with anyio.create_task_group() as tg:

                async def watch_disconnect() -> None:
                    while True:
                        message = await receive()
                        if message["type"] == "http.disconnect":
                            generation.cancel()
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch_disconnect)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                    async for chunk in self.frames:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client went away while we were writing
                    generation.cancel()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.frames, "aclose", None)
                if aclose is not None:
                    await aclose()
                await generation.finish()


async def collect_unless_disconnected(receive: Receive, generation: Generation,
                                      collect: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``collect()``; if the client disconnects first, cancel it and return None. Always finishes
    the generation (shielded)."""
    result: list[T] = []
    try:
        async with anyio.create_task_group() as tg:

            async def watch_disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        generation.cancel()
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch_disconnect)
            result.append(await collect())
            tg.cancel_scope.cancel()
    finally:
        with anyio.CancelScope(shield=True):
            await generation.finish()
    return result[0] if result else None
