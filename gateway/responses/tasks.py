"""Celery tasks of the Responses API (``tollgate.worker`` lists this module in ``TASK_MODULES`` and merges
``beat_schedule``):

- ``responses.background(response_id)``: sent by the gateway for a ``background`` response; runs it
  (``gateway.responses.background.run_background``). Idempotent: only a ``queued`` response is claimed.
- ``responses.flush`` every ``usage_flush_interval_s`` (beat): stored responses, Redis → ``responses``
  (``gateway.responses.store.ResponseFlusher``); safe to run concurrently with itself.
- ``responses.retention`` every ``responses_retention_sweep_s`` (beat): deletes stored responses past
  their ``expires_at`` (queries stop seeing them at that moment; this frees the rows), and fails
  background responses whose worker died (still ``in_progress`` after ``request_timeout_s``).
- ``responses.requeue`` every ``batch_sweep_interval_s`` (beat): background responses ``in_progress``
  whose lease expired (their worker died) are queued and sent again, and those queued for a lease
  period get their task sent again (``background.requeue_orphans``).

Each worker process keeps one event loop, database engine and Redis client
(``tollgate.process_runtime``) and, once it runs a background response, one ``BackgroundRuntime``
(engine connections, tokenizers, price book, replica polling), created lazily in that process.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from celery import shared_task
from redis.asyncio import Redis

from gateway.deps import WorkerRuntime
from gateway.responses.background import BackgroundRuntime, fail_abandoned, requeue_orphans, run_background
from gateway.responses.repository import delete_expired
from gateway.responses.service import BACKGROUND_TASK
from gateway.responses.store import ResponseFlusher, SessionFactory
from tollgate.process_runtime import PerProcess
from tollgate.settings import Settings
from tollgate.streams import claim_idle_ms, consumer_name
from tollgate.task_sender import TaskSender

RETENTION_TASK = "responses.retention"
FLUSH_TASK = "responses.flush"
REQUEUE_TASK = "responses.requeue"


class _ProcessRuntime(WorkerRuntime[BackgroundRuntime]):
    runtime_class = BackgroundRuntime

    async def run_background(self, response_id: str) -> str | None:
        return await run_background(await self.gateway_runtime(), response_id)

    async def flush(self) -> dict[str, int]:
        return await flush_responses(self.redis, self.db.session, self.settings)

    _sender: TaskSender | None = None

    async def requeue(self) -> dict[str, int]:
        if self._sender is None:
            self._sender = TaskSender(self.settings)
        sender = self._sender
        return await requeue_orphans(self.db.session, self.redis,
                                     lambda response_id: sender.send(BACKGROUND_TASK, [response_id]),
                                     resend_after_ms=round(self.settings.background_lease_ttl_s * 1000))

    async def retention(self) -> dict[str, int]:
        now = datetime.now(UTC)
        async with self.db.session() as session, session.begin():
            failed = await fail_abandoned(session, now, self.settings.request_timeout_s)
            deleted = await delete_expired(session, now)
        return {"failed": failed, "deleted": deleted}


_runtime = PerProcess(_ProcessRuntime)


def shutdown_process_runtime() -> None:
    _runtime.shutdown()


@shared_task(name=BACKGROUND_TASK, ignore_result=True)
def background_task(response_id: str) -> str | None:
    runtime = _runtime.get()
    return runtime.loop.run_until_complete(runtime.run_background(response_id))


@shared_task(name=RETENTION_TASK, ignore_result=True)
def retention_task() -> dict[str, int]:
    runtime = _runtime.get()
    return runtime.loop.run_until_complete(runtime.retention())


@shared_task(name=REQUEUE_TASK, ignore_result=True)
def requeue_task() -> dict[str, int]:
    runtime = _runtime.get()
    return runtime.loop.run_until_complete(runtime.requeue())


@shared_task(name=FLUSH_TASK, ignore_result=True)
def flush_task() -> dict[str, int]:
    runtime = _runtime.get()
    return runtime.loop.run_until_complete(runtime.flush())


async def flush_responses(redis: Redis, sessions: SessionFactory, settings: Settings) -> dict[str, int]:
    """One flush run (the task, the tests)."""
    flusher = ResponseFlusher(redis, sessions, consumer=consumer_name(),
                              batch_size=settings.usage_flush_batch,
                              claim_idle_ms=claim_idle_ms(settings.usage_flush_interval_s))
    result = await flusher.flush()
    return {"entries": result.entries, "inserted": result.inserted, "postponed": int(result.postponed)}


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    return {task: {"task": task, "schedule": interval, "options": {"expires": max(1.0, interval)}}
            for task, interval in ((RETENTION_TASK, settings.responses_retention_sweep_s),
                                   (FLUSH_TASK, settings.usage_flush_interval_s),
                                   (REQUEUE_TASK, settings.batch_sweep_interval_s))}
