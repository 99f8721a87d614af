"""Stopping a process's background asyncio tasks (pollers, listeners, refreshers) for sure.

``cancel_and_wait(tasks, what=...)`` cancels the tasks and returns once every one has ended. A single
``Task.cancel()`` is not always enough: a cancellation that arrives inside a library's own timeout handling
can be turned into that library's timeout and swallowed, and the task then loops on as if nothing happened
(seen with a Redis pub/sub listener whose ``get_message(timeout=...)`` loop survived its cancellation, so a
gateway's shutdown awaited it forever). So a task still running after ``retry_s`` is cancelled again, and
logged; one still running after ``give_up_s`` is left (logged as an error) so that shutdown goes on.

The caller's own cancellation is never swallowed (``contextlib.suppress(CancelledError)`` around ``await
task`` would swallow it: it cannot tell the caller's cancellation from the task's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("tollgate.background")

RETRY_S = 0.5
GIVE_UP_S = 10.0


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, what: str, retry_s: float = RETRY_S,
                          give_up_s: float = GIVE_UP_S) -> None:
    """Cancel ``tasks`` (``what``: whose they are, for the logs) and wait until each has ended."""
    tasks = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + give_up_s
    pending = {task for task in tasks if not task.done()}
    for task in pending:
        task.cancel()
    while pending:
        _, pending = await asyncio.wait(pending, timeout=max(0.0, min(retry_s, deadline - loop.time())))
        if not pending:
            break
        names = sorted(task.get_name() for task in pending)
        if loop.time() >= deadline:
            logger.error("%s: background task(s) %s still running %.0f s after their cancellation; "
                         "leaving them", what, names, give_up_s)
            break
        logger.warning("%s: background task(s) %s ignored a cancellation; cancelling again", what, names)
        for task in pending:
            task.cancel()
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.error("%s: background task %s had failed", what, task.get_name(),
                         exc_info=task.exception())
