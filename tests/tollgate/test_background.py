"""``tollgate.background.cancel_and_wait``: background tasks stop for sure, even one that swallows a
cancellation, and the caller's own cancellation is never swallowed."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tollgate.background import cancel_and_wait


async def _swallows_cancellations(times: int, stopped: list[str]) -> None:
    """Loops on through its first ``times`` cancellations (as a library timeout that takes a cancellation
    for its own expiry does), then stops."""
    swallowed = 0
    while True:
        try:
            await asyncio.sleep(3600)  # not a wait: idles until cancelled
        except asyncio.CancelledError:
            swallowed += 1
            if swallowed > times:
                stopped.append("stopped")
                raise


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again(caplog) -> None:
    stopped: list[str] = []
    task = asyncio.create_task(_swallows_cancellations(2, stopped), name="stubborn")
    polite = asyncio.create_task(asyncio.sleep(3600), name="polite")  # not a wait: idles until cancelled
    await asyncio.sleep(0)  # not a wait: both reach their await
    with caplog.at_level(logging.WARNING, logger="tollgate.background"):
        await cancel_and_wait([task, polite], what="the test", retry_s=0.01)
    assert task.done() and polite.cancelled() and stopped == ["stopped"]
    assert "['stubborn'] ignored a cancellation" in caplog.text


async def test_a_task_that_never_stops_is_left_after_the_deadline(caplog) -> None:
    stopped: list[str] = []
    task = asyncio.create_task(_swallows_cancellations(1000, stopped), name="immortal")
    await asyncio.sleep(0)  # not a wait: the task reaches its await
    with caplog.at_level(logging.ERROR, logger="tollgate.background"):
        await cancel_and_wait([task], what="the test", retry_s=0.01, give_up_s=0.05)
    assert not task.done() and "still running" in caplog.text
    await cancel_and_wait([task], what="the test's clean-up", retry_s=0, give_up_s=60)
    assert stopped == ["stopped"]


async def test_the_callers_cancellation_propagates() -> None:
    stopped: list[str] = []
    stubborn = asyncio.create_task(_swallows_cancellations(1000, stopped), name="stubborn")
    await asyncio.sleep(0)  # not a wait: the task reaches its await
    stopper = asyncio.create_task(cancel_and_wait([stubborn], what="the test", retry_s=0.01))
    await asyncio.sleep(0.02)  # not a wait: lets the stopper cancel the stubborn task at least once
    stopper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await stopper
    assert not stubborn.done()
    await cancel_and_wait([stubborn], what="the test's clean-up", retry_s=0, give_up_s=60)
    assert stopped == ["stopped"]


async def test_a_failed_task_is_logged_and_nothing_raises(caplog) -> None:
    async def fails() -> None:
        raise RuntimeError("broken poller")

    task = asyncio.create_task(fails(), name="failed")
    await asyncio.sleep(0)  # not a wait: the task runs and fails
    with caplog.at_level(logging.ERROR, logger="tollgate.background"):
        await cancel_and_wait([task], what="the test")
    assert "background task failed had failed" in caplog.text and "broken poller" in caplog.text
