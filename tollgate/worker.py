"""The Celery application (``celery -A tollgate.worker worker|beat``) on the Redis broker.

Invariants:
- Task modules are listed in ``TASK_MODULES``; a module's optional ``beat_schedule(settings)`` returns
  its beat entries, merged here, so a feature adds its tasks and schedules in one place.
- Tasks are acknowledged late and re-queued when a worker dies (``task_acks_late``,
  ``task_reject_on_worker_lost``), one prefetched at a time; the broker's visibility timeout is a setting.
- Liveness: the worker's main loop (a bootstep on its timer) and beat's scheduler loop (``tick``)
  write ``tollgate:heartbeat:<role>:<name>`` = their pid, with a TTL of three heartbeat intervals. A
  hung loop stops the heartbeat; ``tollgate up`` and Docker health checks read it
  (``python -m tollgate.worker check worker|beat``).
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import sys
from typing import Any

import redis
from celery import Celery, bootsteps, signals
from celery.beat import PersistentScheduler

from tollgate.redis import create_sync_redis
from tollgate.settings import Settings, get_settings

logger = logging.getLogger("tollgate.worker")

TASK_MODULES: tuple[str, ...] = (
    "billing.tasks",
    "gateway.batches.tasks",
    "gateway.responses.tasks",
)
WORKER_NAME_PREFIX = "tollgate-worker"


def heartbeat_key(role: str, name: str) -> str:
    if role not in ("worker", "beat"):
        raise ValueError(f"role must be 'worker' or 'beat', got {role!r}")
    return f"tollgate:heartbeat:{role}:{name}"


def worker_name(host: str | None = None) -> str:
    """The Celery node name ``tollgate up`` and the Docker image give the worker (``-n``)."""
    return f"{WORKER_NAME_PREFIX}@{host or socket.gethostname()}"


def beat_name() -> str:
    return socket.gethostname()


def read_heartbeat(client: redis.Redis, role: str, name: str) -> int | None:
    """The pid of the process whose heartbeat is current, or None."""
    value = client.get(heartbeat_key(role, name))
    return int(value) if value is not None else None


class _Heartbeat:
    def __init__(self, settings: Settings, role: str, name: str) -> None:
        self.client = create_sync_redis(settings)
        self.key = heartbeat_key(role, name)
        self.ttl_ms = max(1, int(settings.heartbeat_interval_s * 3000))

    def beat(self) -> None:
        try:
            self.client.set(self.key, os.getpid(), px=self.ttl_ms)
        except redis.RedisError as e:
            logger.warning("heartbeat %s not written: %s", self.key, e)

    def clear(self) -> None:
        try:
            if self.client.get(self.key) == str(os.getpid()).encode():
                self.client.delete(self.key)
        except redis.RedisError:
            pass
        self.client.close()


class WorkerHeartbeat(bootsteps.StartStopStep):
    """Writes the worker's heartbeat from its timer (the same loop that consumes tasks)."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.heartbeat: _Heartbeat | None = None
        self.tref: Any = None

    def start(self, worker: Any) -> None:
        settings = get_settings()
        self.heartbeat = _Heartbeat(settings, "worker", worker.hostname)
        self.heartbeat.beat()
        self.tref = worker.timer.call_repeatedly(settings.heartbeat_interval_s, self.heartbeat.beat)

    def stop(self, worker: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
        if self.heartbeat is not None:
            self.heartbeat.clear()
            self.heartbeat = None


class HeartbeatScheduler(PersistentScheduler):
    """Beat's persistent scheduler, writing beat's heartbeat on every tick."""

    def setup_schedule(self) -> None:
        super().setup_schedule()
        settings = get_settings()
        self._interval = settings.heartbeat_interval_s
        self._heartbeat = _Heartbeat(settings, "beat", beat_name())

    def tick(self, *args: Any, **kwargs: Any) -> float:
        self._heartbeat.beat()
        return min(super().tick(*args, **kwargs), self._interval)

    def close(self) -> None:
        super().close()
        self._heartbeat.clear()


def collect_beat_schedule(settings: Settings, modules: tuple[str, ...] = TASK_MODULES) -> dict[str, Any]:
    schedule: dict[str, Any] = {}
    for name in modules:
        provider = getattr(importlib.import_module(name), "beat_schedule", None)
        if provider is None:
            continue
        entries = provider(settings)
        clashes = schedule.keys() & entries.keys()
        if clashes:
            raise ValueError(f"beat schedule entries defined twice: {sorted(clashes)}")
        schedule.update(entries)
    return schedule


def create_celery_app(settings: Settings) -> Celery:
    celery_app = Celery("tollgate", include=list(TASK_MODULES))
    celery_app.conf.update(
        broker_url=settings.redis_url,
        broker_connection_retry_on_startup=True,
        broker_transport_options={"visibility_timeout": settings.celery_visibility_timeout_s},
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        worker_cancel_long_running_tasks_on_connection_loss=True,
        worker_concurrency=settings.worker_concurrency,
        worker_hijack_root_logger=False,
        timezone="UTC",
        enable_utc=True,
        beat_scheduler="tollgate.worker:HeartbeatScheduler",
        beat_max_loop_interval=settings.beat_max_loop_interval_s,
        beat_schedule=collect_beat_schedule(settings),
    )
    celery_app.steps["worker"].add(WorkerHeartbeat)
    return celery_app


def _require_broker(**_: Any) -> None:
    if not get_settings().redis_url:
        raise SystemExit("tollgate.worker: TOLLGATE_REDIS_URL is not set (the Celery broker is Redis)")


signals.celeryd_init.connect(_require_broker, weak=False)
signals.beat_init.connect(_require_broker, weak=False)

_app: Celery | None = None


def __getattr__(name: str) -> Any:
    """``app``, the Celery application, made on first use: ``celery -A tollgate.worker`` reads it. Making
    it imports every task module (~2 s of CPU); the heartbeat check, a liveness probe that Kubernetes runs
    every 30 s and Docker Compose every 15 s, and ``tollgate up``'s supervisor import this module without
    needing it."""
    global _app
    if name == "app":
        if _app is None:
            _app = create_celery_app(get_settings())
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str]) -> int:
    """``python -m tollgate.worker check worker|beat``: exit 0 when this host's process has a heartbeat."""
    if len(argv) != 2 or argv[0] != "check" or argv[1] not in ("worker", "beat"):
        print("usage: python -m tollgate.worker check worker|beat", file=sys.stderr)
        return 2
    role = argv[1]
    name = worker_name() if role == "worker" else beat_name()
    client = create_sync_redis(get_settings())
    try:
        pid = read_heartbeat(client, role, name)
    except redis.RedisError as e:
        print(f"{role}: Redis unreachable: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if pid is None:
        print(f"{role}: no heartbeat from {name}", file=sys.stderr)
        return 1
    print(f"{role}: alive (pid {pid} on {name})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
