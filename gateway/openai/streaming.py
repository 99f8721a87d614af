"""Server-sent events and client-disconnect handling for generations.

``EventStreamResponse`` is a small ASGI response (not Starlette's ``StreamingResponse``) because the
gateway must *always* run cleanup when a client goes away: it sends the events of an async iterator of
already-encoded SSE frames while a watcher task waits for ``http.disconnect``; a disconnect marks the
generation cancelled and interrupts its engine streams (``Generation.interrupt``: their connections
close, so the engine aborts within one step, and the frame iterator ends at once). Then — shielded from
cancellation — the iterator is closed and ``Generation.finish()`` runs (engine abort, settle, meter). A
write to a vanished client counts as a disconnect too. (No anyio task group per request: it cost ~5%
of a request's CPU.)

``collect_until`` does the same for non-streamed answers: a client that hangs up while waiting
(``client_gone``), or a batch line its runner stops, aborts the engine work instead of letting it run
to the end (and is billed for what was generated, as a cancelled stream is); one cut by the server at
shutdown, which the client sees as a 503 to retry, or one answered with an error after it started (the
replica failed mid-request), is billed nothing (``Generation.void``): its client got no token of it.

Frames that are ready together are written together: while the generation's next record is already
buffered (``Generation.ready``: a zero-delay engine's burst, or a backlog after a slow write), frames are
joined into one ``send`` (up to ``COALESCE_BYTES``), so one write carries many chunks; a frame is never
held while the engine has nothing more to give, so nothing waits for a later token. Each token still
has its own ``chat.completion.chunk`` as OpenAI sends it.

Frames are ``data: <json>\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``, or after an error frame
``data: {"error": {...}}`` (what OpenAI sends and its SDKs raise on).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import anyio
import orjson
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.generation.service import Generation

T = TypeVar("T")

DONE_FRAME = b"data: [DONE]\n\n"
# At most this many bytes of frames are held back to be written together.
COALESCE_BYTES = 64 * 1024


def frame(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


def json_frame(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def client_gone(receive: Receive) -> Callable[[], Awaitable[None]]:
    """Waits until the client has disconnected (``http.disconnect`` on the request's channel)."""

    async def gone() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    return gone


def _watch(gone: Callable[[], Awaitable[None]], generation: Generation,
           seen: list[bool]) -> asyncio.Task[None]:
    """A task that waits for ``gone()``; then it marks the generation cancelled and interrupts its
    engine streams (closing their connections aborts the engine work within one step), which ends
    whatever is reading them. No task group and no cancellation of the request's own task: the
    request's code runs to its end, quickly, and its cleanup is never cut short."""

    async def watch() -> None:
        await gone()
        seen.append(True)
        generation.cancel()
        generation.interrupt()

    return asyncio.get_running_loop().create_task(watch())


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
        disconnected: list[bool] = []
        watcher = _watch(client_gone(receive), generation, disconnected)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            # Coalesce: frames whose records were already buffered go out in one write; a frame is
            # held only while the next one is ready without waiting on the engine.
            pending: list[bytes] = []
            size = 0
            async for chunk in self.frames:
                if disconnected:
                    break
                pending.append(chunk)
                size += len(chunk)
                if size >= COALESCE_BYTES or not generation.ready():
                    body = pending[0] if len(pending) == 1 else b"".join(pending)
                    pending, size = [], 0
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            if not disconnected:
                await send({"type": "http.response.body", "body": b"".join(pending), "more_body": False})
        except OSError:  # the client went away while we were writing
            generation.cancel()
        finally:
            watcher.cancel()
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.frames, "aclose", None)
                if aclose is not None:
                    await aclose()
                await generation.finish()


async def collect_until(gone: Callable[[], Awaitable[None]], generation: Generation,
                        collect: Callable[[], Awaitable[T]]) -> T | None:
    """Run ``collect()``; if ``gone()`` returns first (the client disconnected, the batch line was
    stopped), the generation is interrupted (engine work aborted) and None is returned. Always finishes
    the generation (shielded)."""
    disconnected: list[bool] = []
    watcher = _watch(gone, generation, disconnected)
    try:
        result = await collect()
    except Exception:
        # The answer is an error (the replica failed mid-request, past the point of a retry elsewhere; or
        # a bug): the client gets no token of this attempt, so none is billed; it is metered as failed.
        # A batch line then leaves no record, and its retry bills the line.
        generation.void()
        raise
    except asyncio.CancelledError:
        # Only uvicorn cancels a request's task: at shutdown, once the drain timeout has passed. The
        # client is answered 503 server_shutting_down (gateway.metrics) and retries elsewhere; nothing
        # of this attempt reached it, so none of it is billed.
        if not disconnected:
            generation.void()
        raise
    finally:
        watcher.cancel()
        with anyio.CancelScope(shield=True):
            await generation.finish()
    return None if disconnected else result
