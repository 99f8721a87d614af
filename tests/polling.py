"""Waiting for a state in tests, independently of the machine's speed.

A test never sleeps to *reach* a state (a sleep long enough on a quiet machine is too short on a loaded
one) and never compares an elapsed time with a bound (that is a measurement: ``benchmarks/``). It waits
for the state itself: :func:`wait_until` / :func:`eventually` poll a predicate until it holds, with a
deadline that only bounds a hang (generous: a slow machine is not a failure). Where the code under
test offers an event, a counter or an ordering, wait on that instead. ``tests/test_test_rules.py``
keeps sleeps out of every other test file.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0


def wait_until(predicate: Callable[[], T], what: str, timeout_s: float = DEFAULT_TIMEOUT_S,
               interval_s: float = 0.01) -> T:  # fmt: skip
    """Poll ``predicate`` until it returns a truthy value, and return that value; ``AssertionError``
    naming ``what`` once ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


async def eventually(predicate: Callable[[], T | Awaitable[T]], what: str,
                     timeout_s: float = DEFAULT_TIMEOUT_S, interval_s: float = 0.01) -> T:  # fmt: skip
    """:func:`wait_until` for the event loop: ``predicate`` may be a plain or an async function."""
    deadline = time.monotonic() + timeout_s
    while True:
        value: Any = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)
