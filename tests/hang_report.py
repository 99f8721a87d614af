"""A report of what a test that runs far longer than it should is waiting for (a pytest plugin, loaded
through ``addopts`` in pyproject.toml).

A test still running (its setup, call and teardown together: session fixtures set up or torn down with it
count) after ``HANG_REPORT_AFTER_S`` (``SLOW_HANG_REPORT_AFTER_S`` for tests marked ``slow`` or ``e2e``,
which start whole platforms) gets, once, on the run's real stderr (the one pytest's faulthandler writes to,
which xdist workers share with the controller): its node id and phase, every thread's stack and every
pending task of each asyncio event loop with its coroutine stack. The last part is what a thread dump
cannot show: a test or fixture teardown blocked in an ``await`` sits in the event loop's ``select``, and
pytest-timeout's dump (it ends the worker at the ``timeout`` of pyproject.toml) shows only that.
Nothing is stopped or failed here.
"""

from __future__ import annotations

import asyncio
import gc
import io
import os
import sys
import threading
import time
import traceback
import types
from collections.abc import Iterator

import pytest
from _pytest.faulthandler import fault_handler_stderr_fd_key

HANG_REPORT_AFTER_S = 45.0
SLOW_HANG_REPORT_AFTER_S = 240.0


def report(title: str) -> str:
    """Every other thread's stack and every asyncio loop's pending tasks, as text."""
    out = io.StringIO()
    out.write(f"\n{'=' * 30} {title} {'=' * 30}\n")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue
        out.write(f"--- thread {names.get(ident, ident)}\n")
        out.write("".join(traceback.format_stack(frame)))
    tasks = _tasks()
    out.write(f"--- {len(tasks)} pending asyncio task(s)\n")
    for task in tasks:
        out.write(f"task {task.get_name()}\n")
        _write_awaits(out, task.get_coro())
    return out.getvalue()


def _write_awaits(out: io.StringIO, awaitable: object) -> None:
    """The frames of a coroutine (or async generator) and of what it awaits, down to the innermost
    awaited object (a future, another task). An ``asend`` object (an async generator fixture's teardown
    awaits one) and a future's iterator lead on only through the garbage collector's referents."""
    for _ in range(64):
        frame = next((getattr(awaitable, a) for a in ("cr_frame", "gi_frame", "ag_frame")
                      if getattr(awaitable, a, None) is not None), None)
        if frame is not None:
            out.write(f"    {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}\n")
            awaitable = next((getattr(awaitable, a) for a in ("cr_await", "gi_yieldfrom", "ag_await")
                              if getattr(awaitable, a, None) is not None), None)
        else:
            inner = [r for r in gc.get_referents(awaitable)
                     if isinstance(r, types.CoroutineType | types.AsyncGeneratorType | asyncio.Future)]
            if not inner or isinstance(inner[0], asyncio.Future):  # the innermost: a future, or opaque
                out.write(f"    awaiting {(inner or [awaitable])[0]!r}"[:600] + "\n")
                return
            awaitable = inner[0]
        if awaitable is None:
            return


def _tasks() -> list[asyncio.Task[object]]:
    """Every pending task of every event loop, from asyncio's own registry (a walk of the garbage
    collector's objects would miss a loop or generator that ``gc.freeze()`` moved out of its sight: the
    gateway's lifespan freezes everything it finds)."""
    for _ in range(5):  # a loop's thread may add or drop a task while the set is copied
        try:
            return [t for t in list(asyncio.tasks._all_tasks) if not t.done()]
        except RuntimeError:
            time.sleep(0.01)  # not a wait: a retry of a copy that raced
    return []


def _write(config: pytest.Config, text: str) -> None:
    fd = config.stash.get(fault_handler_stderr_fd_key, None)
    if fd is None:
        fd = sys.__stderr__.fileno() if sys.__stderr__ else 2
    try:
        os.write(fd, text.encode(errors="replace"))
    except OSError:
        pass


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    heavy = item.get_closest_marker("slow") or item.get_closest_marker("e2e")
    after = SLOW_HANG_REPORT_AFTER_S if heavy else HANG_REPORT_AFTER_S
    phase = ["setup"]
    item.stash[_PHASE] = phase
    started = time.monotonic()

    def fire() -> None:
        _write(item.config, report(f"{item.nodeid}: {phase[0]} still running after "
                                   f"{time.monotonic() - started:.0f} s"))

    timer = threading.Timer(after, fire)
    timer.daemon = True
    timer.start()
    try:
        return (yield)
    finally:
        timer.cancel()


_PHASE = pytest.StashKey[list[str]]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    if _PHASE in item.stash:
        item.stash[_PHASE][0] = "call"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _PHASE in item.stash:
        item.stash[_PHASE][0] = "teardown"
