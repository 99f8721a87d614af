"""``tests/hang_report.py``: the report of a test running far too long names what each pending asyncio
task awaits, down to the innermost frame, and each thread's stack."""

from __future__ import annotations

import asyncio
import threading

from tests.hang_report import report


async def _waits_for_the_event(event: asyncio.Event) -> None:
    await event.wait()


async def test_the_report_shows_each_task_down_to_the_innermost_await() -> None:
    event = asyncio.Event()
    task = asyncio.create_task(_waits_for_the_event(event), name="the-waiting-task")
    await asyncio.sleep(0)  # not a wait: lets the task reach its await
    text = await asyncio.to_thread(report, "a test")  # from another thread, as the report's timer runs
    event.set()
    await task
    assert "a test" in text and "task the-waiting-task" in text
    waiting = text.split("task the-waiting-task", 1)[1]
    assert "in _waits_for_the_event" in waiting and "in wait" in waiting  # asyncio.Event.wait, inside it
    assert f"--- thread {threading.main_thread().name}" in text
