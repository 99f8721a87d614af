"""Celery tasks of the batch tier (``tollgate.worker`` lists this module in ``TASK_MODULES`` and merges
``beat_schedule``):

- ``batches.validate(batch_id)``: sent by the gateway after a batch is committed.
- ``batches.run(batch_id, slot, token)``: one chunk of a run chain (``gateway.batches.dispatch``).
- ``batches.finalize(batch_id)``: sent after a cancel; also called by runs and the sweep.
- ``batches.sweep`` every ``batch_sweep_interval_s`` (beat): stale leases, expiry, kicks, retention.

Chunks are short (``batch_chunk_size`` lines), so a worker that dies loses at most one chunk's
progress, and the sweep — not the broker's hour-long visibility timeout — brings its lines back within
``batch_lease_ttl_s`` + ``batch_sweep_interval_s``. Every task is idempotent; its broker message expires
after ``batch_lease_ttl_s`` where a newer one would supersede it (run chains, sweeps).

Each worker process keeps one event loop, database engine, Redis client (``tollgate.process_runtime``)
and ``BatchRuntime`` (engine connections, tokenizers, price book, replica polling), created lazily in
the process that runs the task (never before Celery forks).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from celery import current_app, shared_task

from gateway.batches.dispatch import (
    FINALIZE_TASK,
    RUN_TASK,
    SWEEP_TASK,
    VALIDATE_TASK,
    BatchDispatcher,
)
from gateway.batches.runner import BatchRunner
from gateway.batches.runtime import BatchRuntime
from gateway.deps import WorkerRuntime
from gateway.files.storage import create_storage
from tollgate.process_runtime import PerProcess
from tollgate.settings import Settings

T = TypeVar("T")


class _ProcessRuntime(WorkerRuntime[BatchRuntime]):
    runtime_class = BatchRuntime

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.runner = BatchRunner(settings, self.db, create_storage(settings),
                                  BatchDispatcher(settings, self.redis, current_app), self._batch_runtime)

    async def _batch_runtime(self) -> BatchRuntime:
        fresh = self.runtime is None
        runtime = await self.gateway_runtime()
        if not fresh:
            await runtime.router.refresh()  # the batch pool's replicas now, fresh load figures for soaking
        return runtime

    def run(self, job: Callable[[BatchRunner], Awaitable[T]]) -> T:
        return self.loop.run_until_complete(job(self.runner))


_runtime = PerProcess(_ProcessRuntime)


def shutdown_process_runtime() -> None:
    _runtime.shutdown()


@shared_task(name=VALIDATE_TASK, ignore_result=True)
def validate_task(batch_id: str) -> str | None:
    return _runtime.get().run(lambda runner: runner.validate(batch_id))


@shared_task(name=RUN_TASK, ignore_result=True)
def run_task(batch_id: str, slot: int, token: str) -> int:
    return _runtime.get().run(lambda runner: runner.run(batch_id, slot, token))


@shared_task(name=FINALIZE_TASK, ignore_result=True)
def finalize_task(batch_id: str) -> str | None:
    return _runtime.get().run(lambda runner: runner.finalize(batch_id))


@shared_task(name=SWEEP_TASK, ignore_result=True)
def sweep_task() -> dict[str, int]:
    return _runtime.get().run(lambda runner: runner.sweep())


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    interval = settings.batch_sweep_interval_s
    return {SWEEP_TASK: {"task": SWEEP_TASK, "schedule": interval,
                         "options": {"expires": max(1.0, interval)}}}
