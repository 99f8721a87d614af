"""The Celery app's configuration, merged beat schedules and heartbeats (on real Redis)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from tollgate import worker
from tollgate.redis import create_sync_redis


def test_app_acks_late_on_the_redis_broker(service_settings):
    app = worker.create_celery_app(service_settings)
    conf = app.conf
    assert conf.broker_url == service_settings.redis_url
    assert conf.task_acks_late and conf.task_reject_on_worker_lost and conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == service_settings.celery_visibility_timeout_s
    assert conf.beat_scheduler == "tollgate.worker:HeartbeatScheduler"
    assert "billing.flush_usage" in conf.beat_schedule
    assert worker.WorkerHeartbeat in app.steps["worker"]


def test_beat_schedules_of_task_modules_are_merged_and_clashes_refused(settings, monkeypatch):
    def module(name: str, entries: dict) -> str:
        mod = types.ModuleType(name)
        mod.beat_schedule = lambda _settings: entries  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, name, mod)
        return name

    a = module("tollgate_test_tasks_a", {"a.tick": {"task": "a.tick", "schedule": 1.0}})
    b = module("tollgate_test_tasks_b", {"b.tick": {"task": "b.tick", "schedule": 2.0}})
    plain = types.ModuleType("tollgate_test_tasks_plain")
    monkeypatch.setitem(sys.modules, plain.__name__, plain)
    assert set(worker.collect_beat_schedule(settings, (a, b, plain.__name__))) == {"a.tick", "b.tick"}
    clash = module("tollgate_test_tasks_clash", {"a.tick": {"task": "x", "schedule": 3.0}})
    with pytest.raises(ValueError, match="defined twice"):
        worker.collect_beat_schedule(settings, (a, clash))


def test_heartbeat_key_roles_are_checked():
    assert worker.heartbeat_key("worker", "n@h") == "tollgate:heartbeat:worker:n@h"
    with pytest.raises(ValueError, match="role"):
        worker.heartbeat_key("scheduler", "x")


@pytest.mark.settings(heartbeat_interval_s=60)  # the key must outlive the check's interpreter start
def test_check_command_reads_this_hosts_heartbeat(service_settings):
    def check(role: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tollgate.worker", "check", role],
            capture_output=True,
            text=True,
            env=dict(os.environ),
            timeout=60,
        )

    client = create_sync_redis(service_settings)
    key = worker.heartbeat_key("worker", worker.worker_name())
    try:
        client.delete(key)
        missing = check("worker")
        assert missing.returncode == 1 and "no heartbeat" in missing.stderr
        heartbeat = worker._Heartbeat(service_settings, "worker", worker.worker_name())
        heartbeat.beat()
        assert worker.read_heartbeat(client, "worker", worker.worker_name()) == os.getpid()
        alive = check("worker")
        assert alive.returncode == 0 and f"pid {os.getpid()}" in alive.stdout
        heartbeat.clear()
        assert worker.read_heartbeat(client, "worker", worker.worker_name()) is None
        assert check("nonsense").returncode == 2
    finally:
        client.delete(key)
        client.close()


def test_the_app_is_made_on_first_use_so_the_check_imports_no_task_module(service_settings):
    """``celery -A tollgate.worker`` reads ``app``, which brings every task and beat entry. Importing the
    module (the liveness check, ``tollgate up``'s supervisor) makes no app and imports no task module."""
    script = """
import json, sys
import tollgate.worker as worker
loaded = lambda: sorted(set(worker.TASK_MODULES) & set(sys.modules))
before = loaded()
app = worker.app
print(json.dumps({"before": before, "same": app is worker.app, "after": loaded(),
                  "tasks": sorted(t for t in app.tasks if not t.startswith("celery.")),
                  "beat": sorted(app.conf.beat_schedule)}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=dict(os.environ), timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert found["before"] == [] and found["same"]
    assert found["after"] == sorted(worker.TASK_MODULES)
    assert {"billing.flush_usage", "batches.sweep", "responses.flush"} <= set(found["tasks"])
    assert "billing.flush_usage" in found["beat"]
    with pytest.raises(AttributeError, match="no attribute 'celery'"):
        worker.celery  # noqa: B018 - the module's __getattr__ answers only for app
