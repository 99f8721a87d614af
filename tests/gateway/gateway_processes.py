"""Real gateway and engine *processes* for tests that need what only separate processes show: several
uvicorn workers sharing admission and metrics, SIGTERM drain, a Postgres outage under a running gateway.

- ``synthetic_engine(...)``: ``engine.server.serve("synthetic", ...)`` in a subprocess (the ``--model
  synthetic`` stand-in: no model, tokens on a timer) with the token timing the test asks for.
- ``gateway_process(...)``: ``python -m tollgate gateway --workers N`` configured through ``TOLLGATE_*``
  variables only (as an operator would), serving one model named ``MODEL`` on the given replicas with
  the tiny checkpoint's tokenizer. It is ready once ``/health`` answers 200 and every worker sees a
  healthy replica (``GET /v1/models`` from a fresh connection per try, so requests reach every worker).
Both run in their own process group (``tollgate.processes.spawn``) and are stopped with their children.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.polling import wait_until
from tollgate.local_services import free_port
from tollgate.processes import spawn, stop, wait_http_ok

MODEL = "synthetic"
START_TIMEOUT_S = 90.0
# Loose SLOs: these tests are about admission, metering and shutdown, never overload shedding.
LOOSE_TIERS = {name: {"engine_priority": prio, "ttft_slo_ms": 600_000, "tpot_slo_ms": 60_000, "rank": rank}
               for name, prio, rank in (("priority", 0, 3), ("default", 1, 2), ("flex", 2, 1))}


@dataclass
class EngineProcess:
    url: str
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL the replica (a crash): open streams break, new connections are refused."""
        stop(self.proc, sig=signal.SIGKILL, timeout=10)


@contextlib.contextmanager
def synthetic_engine(log: Path, *, token_interval_s: float = 0.01, ttft_s: float = 0.02,
                     max_model_len: int = 8192, drain_timeout_s: float | None = None,
                     env: dict[str, str] | None = None, **options: float) -> Iterator[EngineProcess]:
    """A synthetic engine replica subprocess; ``options``: more ``engine.synthetic`` settings (e.g.
    ``prefill_tokens_per_s`` for a replica that queues prefill); ``env``: variables to add (e.g.
    ``TOLLGATE_INTERNAL_TOKEN``)."""
    port = free_port()
    extra = {"token_interval_s": token_interval_s, "ttft_s": ttft_s, **options}
    drain = "" if drain_timeout_s is None else f"drain_timeout_s={drain_timeout_s}, "
    code = ("from engine.server import serve; "
            f"serve('synthetic', port={port}, model_name={MODEL!r}, max_model_len={max_model_len}, "
            f"{drain}extra={extra!r})")
    proc = spawn([sys.executable, "-c", code], log_path=log,
                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc, log, START_TIMEOUT_S)
        yield EngineProcess(url, proc)
    finally:
        stop(proc, timeout=10)


@dataclass
class GatewayProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]

    def terminate(self) -> None:
        """SIGTERM to the uvicorn parent only (what an orchestrator sends); it signals its workers."""
        self.proc.send_signal(signal.SIGTERM)

    def log_lines(self) -> list[dict[str, Any]]:
        """The gateway's JSON log lines (other lines, e.g. a Python crash before logging, are skipped)."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out


def gateway_env(*, database_url: str, redis_url: str, replicas: list[str], tokenizer_dir: Path,
                **settings: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOLLGATE_", "PROMETHEUS_"))}
    env.update({
        "PYTHONUNBUFFERED": "1",
        "TOLLGATE_ENVIRONMENT": "test",
        "TOLLGATE_DATABASE_URL": database_url,
        "TOLLGATE_REDIS_URL": redis_url,
        "TOLLGATE_MODELS": json.dumps([{"name": MODEL, "path": str(tokenizer_dir)}]),
        "TOLLGATE_POOLS": json.dumps({"interactive": {"replicas": replicas}}),
        "TOLLGATE_TIERS": json.dumps(LOOSE_TIERS),
        "TOLLGATE_HEALTH_POLL_INTERVAL_S": "0.2",
        "TOLLGATE_HEALTH_CHECK_TIMEOUT_S": "2.0",
        "TOLLGATE_KEY_CACHE_TTL_S": "5",
        "TOLLGATE_DATABASE_POOL_SIZE": "4",
    })
    for name, value in settings.items():
        env[f"TOLLGATE_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


@contextlib.contextmanager
def gateway_process(env: dict[str, str], log: Path, *, workers: int = 1,
                    api_key: str | None = None) -> Iterator[GatewayProcess]:
    """``tollgate gateway`` on a free port. With ``api_key``, waits until every worker serves the model."""
    port = free_port()
    argv = [sys.executable, "-m", "tollgate", "gateway", "--port", str(port), "--workers", str(workers)]
    proc = spawn(argv, log_path=log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", proc, log, START_TIMEOUT_S)
        if api_key is not None:
            wait_model_served(url, api_key, proc, log, workers)
        yield GatewayProcess(url, proc, log, env)
    finally:
        stop(proc, timeout=30)


def wait_model_served(url: str, api_key: str, proc: subprocess.Popen[bytes], log: Path,
                       workers: int) -> None:
    """Until ``workers * 4`` consecutive fresh connections find the model's replica healthy."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 1}

    def served() -> bool:
        """One try: ``workers * 4`` requests in a row, each on a fresh connection, all answered 200."""
        for _ in range(workers * 4):
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                status = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=10.0,
                                    headers={"Authorization": f"Bearer {api_key}"}).status_code
            except httpx.HTTPError:
                status = 0
            if status != 200:
                return False
        return True

    try:
        wait_until(served, f"every gateway worker to serve {MODEL}", timeout_s=START_TIMEOUT_S,
                   interval_s=0.1)
    except AssertionError as exc:
        raise RuntimeError(f"gateway never served {MODEL} ({exc}):\n{log.read_text()[-4000:]}") from None
