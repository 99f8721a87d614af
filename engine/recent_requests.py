"""What a replica computed for each request, kept a while after the request ended, for ``POST /abort``.

The gateway bills a stream its client abandoned for what the engine computed for it until the abort
took effect (docs/batch-and-billing.md, "Abandoned requests"). By then nobody reads the request's stream:
the gateway closed the connection, and the final delta with the engine's usage goes nowhere. So the server
tracks every request's ``RequestStream`` (``track``) and keeps the final usage of the last ``capacity``
ended ones; ``final_usage`` answers from there, waiting (bounded) for a request whose abort is still on its
way to the step loop (one engine step at most).

Invariants:
- At most ``capacity`` ended requests are remembered (oldest forgotten first); requests in flight are
  tracked until they end, however many.
- The usage is the engine's final one: tokens emitted to the stream, never the extra token an overlapped
  step computed for a finished request, nor rejected drafts beyond what ``Usage`` reports.
- A request that ended by an engine failure has no usage (None): the caller bills what it saw.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict

from engine.async_engine import RequestStream
from engine.outputs import Usage

RECENT_CAPACITY = 8192


class RecentRequests:
    """request id → stream while in flight, then → final usage for the last ``capacity`` ended."""

    def __init__(self, capacity: int = RECENT_CAPACITY) -> None:
        self.capacity = capacity
        self._live: dict[str, RequestStream] = {}
        self._ended: OrderedDict[str, Usage | None] = OrderedDict()

    def track(self, stream: RequestStream) -> None:
        if stream.ended.is_set():
            self._remember(stream)
            return
        self._live[stream.request_id] = stream
        stream.on_end = self._remember

    def _remember(self, stream: RequestStream) -> None:
        if self._live.get(stream.request_id) is stream:
            del self._live[stream.request_id]
        final = stream.final
        self._ended[stream.request_id] = final.usage if final is not None else None
        self._ended.move_to_end(stream.request_id)
        while len(self._ended) > self.capacity:
            self._ended.popitem(last=False)

    def __len__(self) -> int:
        return len(self._live) + len(self._ended)

    async def final_usage(self, request_id: str, wait_s: float) -> Usage | None:
        """The request's final usage; waits up to ``wait_s`` for one still in flight (being aborted).
        None when the request is unknown, failed, or still running after ``wait_s``."""
        if request_id in self._ended:
            return self._ended[request_id]
        stream = self._live.get(request_id)
        if stream is None:
            return None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stream.ended.wait(), wait_s)
        return self._ended.get(request_id)
