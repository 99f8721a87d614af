"""The whole platform as ``tollgate up`` runs it, started once per test session for the end-to-end tests.

``start_platform`` starts one ``tollgate engine`` replica of the tiny model (``tests.gateway.conftest.
run_engine``, with a host and a disk tier as ``tollgate up`` gives its own engine), then ``python -m
tollgate up --no-engine`` (gateway, Celery worker and beat, under its supervisor) in a fresh data directory,
on a free port, pointed at a database and a Redis database index of its own on the session's shared servers
(``tests/conftest.py``), so it starts no Postgres or Redis of its own. The replica serves the model ``tiny``
in both the ``interactive`` and the ``batch`` pools (as an operator with replicas of their own configures
it; ``tollgate up`` with its own engine has no batch pool, and its batch lines only soak the interactive
replica). Everything is configured through ``TOLLGATE_*`` variables, as an operator would: time constants
shortened (``PLATFORM_SETTINGS``), SLOs loose enough that a CPU engine is never shed. Ready once ``tollgate
up`` prints "tollgate is up" (every child healthy, the ``env`` file written); stopped with SIGTERM (its
supervisor stops every child), then the engine, and the database is dropped.

Tests share it; each makes its own tenants and keys (``Platform.tenant``) and looks only at its own rows, so
no test sees another's traffic. The demo key of the ``env`` file is the SDK tests' key.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.factories import create_api_key, create_tenant
from tests.gateway.conftest import TenantKey, run_engine, tiered
from tests.gateway.gateway_processes import LOOSE_TIERS
from tests.polling import wait_until
from tollgate.db import Database
from tollgate.local_services import free_port
from tollgate.processes import group_running, signal_group, spawn, stop
from tollgate.settings import Settings

MODEL = "tiny"  # the model `tollgate up` prices (its demo price) and the harness's engine serves
PLATFORM_GROUP = "e2e_platform"  # the xdist_group of every test that uses the shared platform
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
PLATFORM_REDIS_DB_BASE = 40  # + xdist worker index + 1: clear of the workers' own indexes (1, 2, ...)

PLATFORM_SETTINGS: dict[str, Any] = {
    "environment": "test",
    # Shortened so that nothing waits out a production interval: health polls and heartbeats, the
    # outbox flush, the key cache, batch leases (a killed worker's lines are free again after 3 s),
    # sweeps and cancel polls, the supervisor's restart backoff.
    "health_poll_interval_s": 0.2,
    "heartbeat_interval_s": 0.5,
    "beat_max_loop_interval_s": 0.5,
    "usage_flush_interval_s": 0.2,
    "key_cache_ttl_s": 0.5,
    "batch_lease_ttl_s": 3.0,
    "batch_sweep_interval_s": 0.5,
    "batch_status_poll_interval_s": 0.2,
    "restart_backoff_s": 0.2,
    "restart_backoff_max_s": 1.0,
    "stop_timeout_s": 10.0,
    "startup_timeout_s": STARTUP_TIMEOUT_S,
    # Generous, not short: a loaded machine's engine may answer a health check slowly, and a replica
    # taken out for that would fail requests for a reason no user of a quiet machine would see.
    "health_check_timeout_s": 5.0,
    "database_pool_size": 4,
    "default_max_tokens_reservation": 64,
    "tiers": LOOSE_TIERS,
}


ENGINE_TENSOR_PARALLEL_SIZE = 2


def platform_env(database_url: str, redis_url: str, engine_url: str, model_dir: Path,
                 adapter_dir: Path) -> dict[str, str]:
    """The environment ``tollgate up`` (and every CLI call against it) runs with; ``adapter_dir``: the
    adapter store the gateway writes and the engine reads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOLLGATE_", "OPENAI_"))}
    pools = ["interactive", "batch"]
    env.update({
        "PYTHONUNBUFFERED": "1",
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_REDIS_URL": redis_url,
        "TOLLGATE_MODELS": json.dumps([{"name": MODEL, "path": str(model_dir), "pools": pools}]),
        "TOLLGATE_POOLS": json.dumps({pool: {"replicas": [engine_url]} for pool in pools}),
        "TOLLGATE_ADAPTER_DIR": str(adapter_dir),
    })
    for name, value in PLATFORM_SETTINGS.items():
        env[f"TOLLGATE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            values[name] = shlex.split(value)[0]
    return values


@dataclass
class Platform:
    proc: subprocess.Popen[bytes]  # `tollgate up`
    data_dir: Path
    log: Path
    env: dict[str, str]  # platform_env() plus the `env` file's exports (OPENAI_BASE_URL, OPENAI_API_KEY)
    settings: Settings

    @property
    def openai_base_url(self) -> str:
        return self.env["OPENAI_BASE_URL"]

    @property
    def api_key(self) -> str:
        """The demo tenant's key that `tollgate up` wrote to the ``env`` file."""
        return self.env["OPENAI_API_KEY"]

    @property
    def database_url(self) -> str:
        return self.env["TOLLGATE_DATABASE_URL"]

    @property
    def redis_url(self) -> str:
        return self.env["TOLLGATE_REDIS_URL"]

    @property
    def engine_url(self) -> str:
        """The interactive pool's (only) engine replica."""
        return json.loads(self.env["TOLLGATE_POOLS"])["interactive"]["replicas"][0]

    def cli(self, *args: str) -> str:
        """``tollgate ARGS`` against this platform (as an operator who sourced the ``env`` file)."""
        done = subprocess.run([sys.executable, "-m", "tollgate", *args], env=self.env, check=True,
                              capture_output=True, text=True)
        return done.stdout

    async def tenant(self, db: Database, **columns: Any) -> TenantKey:
        """A new tenant (``columns``: its limits) and an API key for it, committed."""
        async with db.session() as session:
            tenant = await create_tenant(session, **columns)
            key, full_key = await create_api_key(session, tenant, settings=self.settings)
        return TenantKey(tenant.id, key.id, full_key)

    def status(self) -> dict[str, Any]:
        """The supervisor's table (``run/status.json``): each child's pid, state and restarts."""
        return json.loads((self.data_dir / "run" / "status.json").read_text())["processes"]

    @contextlib.contextmanager
    def supervisor_paused(self) -> Iterator[None]:
        """SIGSTOP ``tollgate up`` for the block: its children run on, but none that exits is restarted
        before the block ends (a test can look at the platform with a child really gone)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill_child(self, name: str) -> int:
        """SIGKILL child ``name`` and every process of its group at once (a machine dying); returns its
        pid once none of them runs any more."""
        pid = int(self.status()[name]["pid"])
        signal_group(pid, signal.SIGKILL)
        wait_until(lambda: not group_running(pid), f"every process of {name} (pid {pid}) to die")
        return pid

    def wait_healthy(self, name: str, *, not_pid: int | None = None) -> int:
        """The pid of child ``name`` once the supervisor reports it healthy (and, with ``not_pid``, it is
        a new process: restarted)."""
        def healthy() -> int | None:
            child = self.status()[name]
            fresh = child["pid"] is not None and child["pid"] != not_pid
            return child["pid"] if fresh and child["state"] == "healthy" else None

        return wait_until(healthy, f"{name} healthy (tollgate up's log: {self.log})",
                          timeout_s=STARTUP_TIMEOUT_S)


def _up_output(log: Path) -> str:
    return log.read_text(errors="replace") if log.exists() else ""


@contextlib.contextmanager
def start_platform(shared_servers: Any, root: Path) -> Iterator[Platform]:
    """The platform on its own database and Redis index of ``shared_servers``, until the block ends."""
    from engine.tiny import create_tiny_checkpoint

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw-1")
    redis_url = shared_servers.redis.url(PLATFORM_REDIS_DB_BASE + int(worker.removeprefix("gw")) + 1)
    database = f"tollgate_e2e_{worker.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
    shared_servers.postgres.create_database(database, recreate=True)  # empty: `tollgate up` migrates it
    with redis.Redis.from_url(redis_url) as client:
        client.flushdb()
    model_dir = create_tiny_checkpoint(root / "tiny", arch="llama", seed=0)
    data_dir, log = root / "data", root / "up.log"
    try:
        # The replica splits the model over two ranks (tensor parallelism, gloo on the CPU): every e2e test
        # also shows a tensor-parallel engine serving the platform through the official SDKs.
        # It serves tenants' LoRA adapters too, from the store the platform's gateway writes.
        adapter_dir = root / "adapters"
        engine_options = (*tiered(root / "kv"), "--tensor-parallel-size", str(ENGINE_TENSOR_PARALLEL_SIZE),
                          "--max-loras", "2", "--max-lora-rank", "8", "--lora-dir", str(adapter_dir))
        with run_engine(model_dir, root / "engine.log", options=engine_options) as (engine_url, _engine):
            env = platform_env(shared_servers.postgres.url(database), redis_url, engine_url, model_dir,
                               adapter_dir)
            proc = spawn([sys.executable, "-m", "tollgate", "up", "--no-engine", "--data-dir", str(data_dir),
                          "--port", str(free_port())], log_path=log, env=env, cwd=root)
            try:
                def up() -> bool:
                    if proc.poll() is not None:
                        raise AssertionError(f"tollgate up exited with {proc.returncode}:\n"
                                             f"{_up_output(log)[-4000:]}")
                    return "tollgate is up" in _up_output(log)

                wait_until(up, "tollgate up to report the platform up", timeout_s=STARTUP_TIMEOUT_S,
                           interval_s=0.1)
                env.update(read_env_file(data_dir / "env"))
                settings = Settings(environment="test", database_url=env["TOLLGATE_DATABASE_URL"],
                                    redis_url=env["TOLLGATE_REDIS_URL"])
                yield Platform(proc=proc, data_dir=data_dir, log=log, env=env, settings=settings)
            finally:
                stop(proc, timeout=STOP_TIMEOUT_S)  # SIGTERM: the supervisor stops every child first
    finally:
        shared_servers.postgres.drop_database(database)
