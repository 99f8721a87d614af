"""The platform the chaos benchmark breaks: ``tollgate up`` with two engine replicas and two gateway workers,
over a Postgres and a Redis that the benchmark owns (so it can kill them and start them again, as a managed
service's failover would: same port, same data).

``ChaosPlatform`` starts Postgres and Redis from the installed server binaries (durable: fsync on, Redis
``appendfsync everysec``), then ``python -m tollgate up --engine-replicas 2 --workers 2`` pointed at them
through ``TOLLGATE_DATABASE_URL`` / ``TOLLGATE_REDIS_URL``; ``tollgate up`` migrates, creates the demo
tenant and key, writes the tiny model and supervises the engines, the gateway, the Celery worker and beat,
restarting any that dies. Time constants are shortened (``SETTINGS``) so that recovery is measured in
seconds, not in production intervals: health polls, heartbeats, the outbox flush, batch leases and sweeps,
stream leases.

Faults it can inject: ``kill_redis`` / ``start_redis``, ``kill_postgres`` / ``start_postgres`` (SIGKILL of
the whole process group: a crash, recovered from the WAL and the append-only file), ``kill_child(name)`` (an
engine replica, the Celery worker: SIGKILL of its group; the supervisor restarts it) and
``kill_gateway_worker`` (one uvicorn worker process; uvicorn's parent starts another).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tollgate.commands.gateway import worker_pids
from tollgate.local_services import LocalPostgres, LocalRedis, find_server_binaries, free_port
from tollgate.processes import group_alive, pid_alive, signal_group, spawn, stop
from tollgate.settings import Settings

MODEL = "tiny"
STARTUP_TIMEOUT_S = 300.0
# Loose SLOs (a CPU engine must not be shed for being a CPU), tiers as tollgate.toml names them.
TIERS = {
    name: {"engine_priority": prio, "ttft_slo_ms": 600_000, "tpot_slo_ms": 60_000, "rank": rank}
    for name, prio, rank in (("priority", 0, 3), ("default", 1, 2), ("flex", 2, 1))
}
SETTINGS: dict[str, Any] = {
    "environment": "test",
    "health_poll_interval_s": 0.25,
    "health_check_timeout_s": 5.0,
    "heartbeat_interval_s": 0.5,
    "beat_max_loop_interval_s": 0.5,
    "usage_flush_interval_s": 0.5,
    "usage_spool_retry_s": 0.5,
    "key_cache_ttl_s": 30.0,
    "stream_lease_ttl_s": 6.0,
    "batch_lease_ttl_s": 4.0,
    "background_lease_ttl_s": 4.0,
    "batch_sweep_interval_s": 1.0,
    "batch_status_poll_interval_s": 0.5,
    "restart_backoff_s": 0.5,
    "restart_backoff_max_s": 2.0,
    "stop_timeout_s": 10.0,
    "drain_timeout_s": 5.0,
    "startup_timeout_s": STARTUP_TIMEOUT_S,
    "database_pool_size": 4,
    "default_max_tokens_reservation": 64,
    # A host and a disk tier on each replica: cache lifetimes are sold from them.
    "engine_host_kv_gb": 0.05,
    "engine_disk_kv_gb": 0.2,
    "tiers": TIERS,
}
KEY_PATTERN = re.compile(r"sk-tg-\S+")


def wait_for(
    condition: Callable[[], Any], what: str, timeout_s: float = 120.0, interval_s: float = 0.1
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


class ChaosPlatform:
    def __init__(self, root: Path, *, engine_replicas: int = 2, gateway_workers: int = 2) -> None:
        self.root = root
        binaries = find_server_binaries(Settings())
        self.postgres = LocalPostgres(
            root / "pg", binaries.postgres_bin_dir, port=free_port(), password=secrets.token_hex(12)
        )
        self.redis = LocalRedis(
            root / "redis", binaries.redis_server, port=free_port(), password=secrets.token_hex(12)
        )
        self.pg_proc: subprocess.Popen[bytes] | None = None
        self.redis_proc: subprocess.Popen[bytes] | None = None
        self.up_proc: subprocess.Popen[bytes] | None = None
        self.data_dir = root / "data"
        self.up_log = root / "up.log"
        self.port = free_port()
        self.engine_port = free_port()
        self.engine_replicas = engine_replicas
        self.gateway_workers = gateway_workers
        self.env: dict[str, str] = {}

    # ---- servers -------------------------------------------------------------------------------
    def start_postgres(self) -> None:
        self.pg_proc = spawn(
            self.postgres.argv(),
            log_path=self.postgres.log_path,
            user=self.postgres.user,
            cwd=self.postgres.root,
            parent_death_signal=signal.SIGINT,
        )
        self.postgres.wait_ready(self.pg_proc, 120)

    def kill_postgres(self) -> None:
        assert self.pg_proc is not None
        signal_group(self.pg_proc.pid, signal.SIGKILL)
        self.pg_proc.wait()
        wait_for(lambda: not group_alive(self.pg_proc.pid), "every Postgres process to die")

    def start_redis(self) -> None:
        self.redis_proc = spawn(
            self.redis.argv(), log_path=self.redis.log_path, parent_death_signal=signal.SIGTERM
        )
        self.redis.wait_ready(self.redis_proc, 120)

    def kill_redis(self) -> None:
        assert self.redis_proc is not None
        signal_group(self.redis_proc.pid, signal.SIGKILL)
        self.redis_proc.wait()

    # ---- the platform --------------------------------------------------------------------------
    @property
    def database_url(self) -> str:
        return self.postgres.url("tollgate")

    @property
    def redis_url(self) -> str:
        return self.redis.url(0)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def engine_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.engine_port + i}" for i in range(self.engine_replicas)]

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # the postgres user must reach its directory
        self.postgres.prepare()
        self.start_postgres()
        self.postgres.create_database("tollgate")
        self.redis.prepare()
        self.start_redis()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOLLGATE_", "OPENAI_"))}
        env.update(
            {
                "PYTHONUNBUFFERED": "1",
                "TOLLGATE_DATABASE_URL": self.database_url,
                "TOLLGATE_REDIS_URL": self.redis_url,
            }
        )
        for name, value in SETTINGS.items():
            env[f"TOLLGATE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        self.env = env
        argv = [
            sys.executable,
            "-m",
            "tollgate",
            "up",
            "--data-dir",
            str(self.data_dir),
            "--port",
            str(self.port),
            "--engine-port",
            str(self.engine_port),
            "--engine-replicas",
            str(self.engine_replicas),
            "--workers",
            str(self.gateway_workers),
        ]
        self.up_proc = spawn(argv, log_path=self.up_log, env=env, cwd=self.root)

        def up() -> bool:
            if self.up_proc is not None and self.up_proc.poll() is not None:
                raise RuntimeError(
                    f"tollgate up exited with {self.up_proc.returncode}:\n{self.up_output()[-4000:]}"
                )
            return "tollgate is up" in self.up_output()

        wait_for(up, "tollgate up to report the platform up", timeout_s=STARTUP_TIMEOUT_S)
        for line in (self.data_dir / "env").read_text().splitlines():
            if line.startswith("export "):
                name, _, value = line.removeprefix("export ").partition("=")
                self.env[name] = value.strip("'")

    def up_output(self) -> str:
        return self.up_log.read_text(errors="replace") if self.up_log.exists() else ""

    def stop(self) -> None:
        if self.up_proc is not None:
            stop(self.up_proc, timeout=60)
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            stop(self.redis_proc, timeout=30)
        if self.pg_proc is not None and self.pg_proc.poll() is None:
            stop(self.pg_proc, sig=signal.SIGINT, timeout=30)

    @property
    def demo_key(self) -> str:
        return self.env["OPENAI_API_KEY"]

    def cli(self, *args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "tollgate", *args],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        )
        return done.stdout

    def tenant(self, name: str, *options: str) -> str:
        """A new tenant and its API key."""
        self.cli("tenants", "create", name, *options)
        match = KEY_PATTERN.search(self.cli("keys", "create", name).strip().splitlines()[-1])
        if match is None:
            raise RuntimeError(f"no key printed for tenant {name}")
        return match.group(0)

    # ---- supervised children -------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return json.loads((self.data_dir / "run" / "status.json").read_text())["processes"]

    def engine_names(self) -> list[str]:
        return (
            ["engine"] if self.engine_replicas == 1 else [f"engine-{i}" for i in range(self.engine_replicas)]
        )

    def kill_child(self, name: str) -> int:
        pid = int(self.status()[name]["pid"])
        signal_group(pid, signal.SIGKILL)
        wait_for(lambda: not pid_alive(pid), f"{name} (pid {pid}) to die")
        return pid

    def healthy_again(self, name: str, old_pid: int) -> bool:
        child = self.status()[name]
        return child["state"] == "healthy" and child["pid"] not in (None, old_pid)

    def gateway_workers_pids(self) -> list[int]:
        """The gateway's worker processes."""
        return worker_pids(int(self.status()["gateway"]["pid"]))

    def kill_gateway_worker(self) -> int:
        workers = self.gateway_workers_pids()
        if not workers:
            raise RuntimeError("the gateway has no worker processes")
        victim = workers[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not pid_alive(victim), f"gateway worker {victim} to die")
        return victim
