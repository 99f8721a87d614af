"""``RecentRequests``: the final usage of ended requests, kept for ``POST /abort`` (no engine)."""

from __future__ import annotations

import asyncio

from engine.async_engine import RequestStream
from engine.outputs import RequestDelta, Usage
from engine.recent_requests import RecentRequests


def _final(request_id: str, completion: int) -> RequestDelta:
    usage = Usage.of(prompt_tokens=10, completion_tokens=completion)
    return RequestDelta(request_id, [], True, ["abort"], usage)


async def test_usage_of_an_ended_request_and_of_one_ending_while_asked() -> None:
    recent = RecentRequests(capacity=2)
    aborted: list[str] = []
    done, running = RequestStream("done", aborted.append), RequestStream("running", aborted.append)
    recent.track(done)
    recent.track(running)
    done.put_nowait(_final("done", 3))
    assert await recent.final_usage("done", wait_s=0) == Usage.of(prompt_tokens=10, completion_tokens=3)
    # Still running after the wait: unknown yet. Ending meanwhile: the waiter gets it.
    assert await recent.final_usage("running", wait_s=0.01) is None
    # The final delta arrives while final_usage is already waiting for it (call_soon runs it after the
    # coroutine below reached its wait).
    asyncio.get_running_loop().call_soon(running.put_nowait, _final("running", 7))
    assert await recent.final_usage("running", wait_s=5) == Usage.of(prompt_tokens=10, completion_tokens=7)
    assert await recent.final_usage("never-seen", wait_s=0.01) is None


async def test_only_the_last_ended_are_kept_and_failures_have_no_usage() -> None:
    recent = RecentRequests(capacity=2)
    streams = [RequestStream(f"r{i}", lambda _id: None) for i in range(3)]
    for stream in streams:
        recent.track(stream)
    for i, stream in enumerate(streams[:2]):
        stream.put_nowait(_final(f"r{i}", i))
    streams[2].put_nowait(RuntimeError("the step failed"))  # an engine failure: no final usage
    assert await recent.final_usage("r0", wait_s=0) is None  # forgotten: the oldest of three ended
    assert await recent.final_usage("r1", wait_s=0) == Usage.of(prompt_tokens=10, completion_tokens=1)
    assert await recent.final_usage("r2", wait_s=0) is None
    assert len(recent) == 2
