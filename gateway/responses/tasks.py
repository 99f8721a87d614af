"""Celery task of the Responses API (``tollgate.worker`` lists this module in ``TASK_MODULES``):
``responses.retention`` every ``responses_retention_sweep_s`` (beat) deletes stored responses past
their ``expires_at`` (queries stop seeing them at that moment; this frees the rows)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from celery import shared_task

from gateway.responses.repository import delete_expired
from tollgate.process_runtime import PerProcess, ProcessRuntime
from tollgate.settings import Settings

RETENTION_TASK = "responses.retention"

_runtime = PerProcess(ProcessRuntime)


def shutdown_process_runtime() -> None:
    _runtime.shutdown()


async def _delete_expired(runtime: ProcessRuntime) -> int:
    async with runtime.db.session() as session, session.begin():
        return await delete_expired(session, datetime.now(UTC))


@shared_task(name=RETENTION_TASK, ignore_result=True)
def retention_task() -> int:
    runtime = _runtime.get()
    return runtime.loop.run_until_complete(_delete_expired(runtime))


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    interval = settings.responses_retention_sweep_s
    return {RETENTION_TASK: {"task": RETENTION_TASK, "schedule": interval,
                             "options": {"expires": max(1.0, interval)}}}
