"""Sending Celery tasks by name from the web processes (no task module imported there).

``producer_app`` is a Celery app that only sends, on the worker's broker and with its serializer;
``TaskSender.send`` runs Celery's synchronous send in a worker thread so the event loop never blocks.
"""

from __future__ import annotations

from typing import Any

import anyio
from celery import Celery

from tollgate.settings import Settings


def producer_app(settings: Settings) -> Celery:
    """A Celery app that only sends (no task modules imported), on the same broker as the worker."""
    app = Celery("tollgate-producer")
    app.conf.update(broker_url=settings.redis_url, broker_connection_retry_on_startup=True,
                    broker_transport_options={"visibility_timeout": settings.celery_visibility_timeout_s},
                    task_serializer="json", accept_content=["json"])
    return app


class TaskSender:
    def __init__(self, settings: Settings, celery_app: Celery | None = None) -> None:
        self.celery = celery_app or producer_app(settings)

    async def send(self, name: str, args: list[Any], **options: Any) -> None:
        await anyio.to_thread.run_sync(lambda: self.celery.send_task(name, args=args, **options))
