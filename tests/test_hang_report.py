"""``tests/hang_report.py``: the report of a test running far too long names what each pending asyncio
task awaits, down to the innermost frame, and each thread's stack."""

from __future__ import annotations

import asyncio
import threading

from tests.hang_report import report


async def _waits_for_the_event(event: asyncio.Event) -> None:
    await event.wait()


async def _generator_waiting_for(event: asyncio.Event):
    yield
    await event.wait()  # a fixture's teardown, say
    yield


async def test_the_report_shows_each_task_down_to_the_innermost_await() -> None:
    event = asyncio.Event()
    task = asyncio.create_task(_waits_for_the_event(event), name="the-waiting-task")
    generator = _generator_waiting_for(event)
    await generator.asend(None)
    teardown = asyncio.create_task(generator.asend(None), name="the-teardown")  # as pytest-asyncio's
    await asyncio.sleep(0)  # not a wait: lets the tasks reach their awaits
    text = await asyncio.to_thread(report, "a test")  # from another thread, as the report's timer runs
    event.set()
    await task
    await teardown
    assert "a test" in text and "task the-waiting-task" in text
    waiting = text.split("task the-waiting-task", 1)[1]
    assert "in _waits_for_the_event" in waiting and "in wait" in waiting  # asyncio.Event.wait, inside it
    # Through the asend object to the generator's frame.
    assert "in _generator_waiting_for" in text.split("task the-teardown", 1)[1]
    assert f"--- thread {threading.main_thread().name}" in text
