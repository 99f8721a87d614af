"""The event loop and connections a Celery task module keeps in each worker process.

Invariants:
- A worker process has one event loop, one database engine and one Redis client per task module
  (``ProcessRuntime``), so a task that runs every second does not open new Postgres and Redis
  connections every second.
- They are created lazily in the process that runs the task (``PerProcess.get``), never before Celery
  forks: a forked child that finds its parent's runtime builds its own and leaves the parent's alone.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Generic, TypeVar

from tollgate.db import Database
from tollgate.redis import create_redis
from tollgate.settings import Settings, get_settings


class ProcessRuntime:
    """One worker process's event loop, database engine and Redis client."""

    def __init__(self, settings: Settings) -> None:
        self.pid = os.getpid()
        self.settings = settings
        self.loop = asyncio.new_event_loop()
        self.db = Database.from_settings(settings)
        self.redis = create_redis(settings)

    def close(self) -> None:
        self.loop.run_until_complete(self.redis.aclose())
        self.loop.run_until_complete(self.db.dispose())
        self.loop.close()


R = TypeVar("R", bound=ProcessRuntime)


class PerProcess(Generic[R]):
    """The runtime of the current process, made by ``factory(get_settings())`` on first use."""

    def __init__(self, factory: Callable[[Settings], R]) -> None:
        self._factory = factory
        self._runtime: R | None = None

    def get(self) -> R:
        if self._runtime is None or self._runtime.pid != os.getpid():  # first task, or a forked child
            self._runtime = self._factory(get_settings())
        return self._runtime

    def shutdown(self) -> None:
        """Close this process's runtime (worker shutdown, tests); a parent's is left alone."""
        runtime, self._runtime = self._runtime, None
        if runtime is not None and runtime.pid == os.getpid():
            runtime.close()
