"""The processes ``tollgate up`` supervises above its servers: the engine replicas, the gateway, the Celery
worker and beat, each as a ``tollgate.supervisor.ProcessSpec`` (its command, log, health probe and how it
stops). ``tollgate.commands.up`` starts the servers, prepares the data dir and hands these to its
supervisor.

Invariants: one replica is ``engine`` on ``engine_port`` with its disk tier in ``DATA_DIR/kv``; several
are ``engine-0``, ``engine-1``, ... on consecutive ports, each with a disk tier of its own. Engines and
the gateway get their drain timeout (plus a margin) to stop; the gateway, worker and beat stop together,
then the engines (``stop_group``). The worker and beat are healthy while their Redis heartbeat holds
their pid. Heavy imports (the supervisor's httpx, Celery's names) happen inside the functions.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tollgate.settings import Settings

# How a child runs a module: this interpreter, without the current directory on ``sys.path`` (``-P``), so a
# folder named ``tollgate`` (or ``celery``) where ``tollgate up`` was started cannot shadow the package.
PYTHON_M = (sys.executable, "-P", "-m")

if TYPE_CHECKING:
    from redis import Redis

    from tollgate.supervisor import ProcessSpec


@dataclass(frozen=True)
class ChildLayout:
    """Where the children of one ``tollgate up`` listen and write."""

    settings: Settings
    data_dir: Path
    logs: Path
    run_dir: Path
    port: int
    engine_port: int
    engine_replicas: int
    gateway_workers: int
    # Disaggregated serving: prefill replicas beside the engine replicas, which then decode (0: none).
    prefill_replicas: int = 0

    def engines(self) -> list[tuple[str, int, Path]]:
        """(supervisor name, port, disk-tier directory) of each engine replica (the interactive pool's)."""
        if self.engine_replicas == 1:
            return [("engine", self.engine_port, self.data_dir / "kv")]
        return [
            (f"engine-{i}", self.engine_port + i, self.data_dir / ("kv" if i == 0 else f"kv-{i}"))
            for i in range(self.engine_replicas)
        ]

    def prefill_engines(self) -> list[tuple[str, int, Path]]:
        """(supervisor name, port, disk-tier directory) of each prefill replica, on the ports after the
        engine replicas'."""
        first = self.engine_port + self.engine_replicas
        return [(f"prefill-{i}", first + i, self.data_dir / f"kv-prefill-{i}")
                for i in range(self.prefill_replicas)]

    def pools(self) -> dict[str, dict[str, list[str]]]:
        """``TOLLGATE_POOLS`` of the engines started here."""
        def urls(engines: list[tuple[str, int, Path]]) -> dict[str, list[str]]:
            return {"replicas": [f"http://127.0.0.1:{port}" for _, port, _ in engines]}

        pools = {"interactive": urls(self.engines())}
        if self.prefill_replicas:
            pools["prefill"] = urls(self.prefill_engines())
        return pools

    @property
    def drain_stop_timeout_s(self) -> float:
        return max(self.settings.stop_timeout_s, self.settings.drain_timeout_s + 5.0)


def engine_specs(layout: ChildLayout, model_dir: Path, env: dict[str, str]) -> list[ProcessSpec]:
    """``tollgate engine`` for each replica, serving ``model_dir`` in the interactive pool and the tenants'
    adapters of the store the gateway writes; with prefill replicas, those decode (``--role decode``) and
    the prefill replicas (``--role prefill``) prefill their long prompts."""
    from gateway.adapters.store import store_root
    from tollgate.supervisor import ProcessSpec, http_probe

    s = layout.settings
    return [
        ProcessSpec(
            name,
            [
                *PYTHON_M, "tollgate", "engine",
                "--model", str(model_dir),
                "--host", "127.0.0.1",
                "--port", str(port),
                "--pool", "interactive",
                "--host-kv-gb", str(s.engine_host_kv_gb),
                "--disk-kv-gb", str(s.engine_disk_kv_gb if s.engine_host_kv_gb else 0),
                "--kv-disk-dir", str(kv_dir),
                "--drain-timeout-s", str(s.drain_timeout_s),
                "--tensor-parallel-size", str(s.engine_tensor_parallel_size),
                "--max-loras", str(s.engine_max_loras),
                "--max-lora-rank", str(s.engine_max_lora_rank),
                # The store the gateway child uses: under this data dir (``s`` is the parent's settings).
                "--lora-dir", str(store_root(s.model_copy(update={"data_dir": layout.data_dir}))),
                *(() if not layout.prefill_replicas else ("--role", role)),
            ],
            layout.logs / f"{name}.log",
            http_probe(f"http://127.0.0.1:{port}/health", s.health_check_timeout_s),
            env=env,
            stop_timeout_s=layout.drain_stop_timeout_s,
            stop_group="engines",
        )
        for role, engines in (("decode", layout.engines()), ("prefill", layout.prefill_engines()))
        for name, port, kv_dir in engines
    ]


def service_specs(layout: ChildLayout, env: dict[str, str], heartbeat_client: Redis) -> list[ProcessSpec]:
    """The gateway (``--workers`` of them), the Celery worker and beat; ``heartbeat_client`` reads the
    worker's and beat's heartbeats for their health probes."""
    from tollgate.supervisor import ProcessSpec, http_probe
    from tollgate.worker import beat_name, read_heartbeat, worker_name

    s = layout.settings

    def heartbeat(role: str, name: str) -> Any:
        def probe(proc: Any) -> bool:
            try:
                return read_heartbeat(heartbeat_client, role, name) == proc.pid
            except Exception:  # Redis down: the worker is not healthy either way
                return False

        return probe

    return [
        ProcessSpec(
            "gateway",
            [*PYTHON_M, "tollgate", "gateway", "--host", s.host, "--port", str(layout.port),
             "--workers", str(layout.gateway_workers)],
            layout.logs / "gateway.log",
            http_probe(f"http://127.0.0.1:{layout.port}/health", s.health_check_timeout_s),
            env=env,
            stop_timeout_s=layout.drain_stop_timeout_s,
            stop_group="front",
        ),
        ProcessSpec(
            "worker",
            [*PYTHON_M, "celery", "-A", "tollgate.worker", "worker", "-n", worker_name(),
             "-c", str(s.worker_concurrency), "-l", "info"],
            layout.logs / "worker.log",
            heartbeat("worker", worker_name()),
            env=env,
            cwd=layout.run_dir,
            stop_group="front",
        ),
        ProcessSpec(
            "beat",
            [*PYTHON_M, "celery", "-A", "tollgate.worker", "beat", "-l", "info",
             "-s", str(layout.run_dir / "celerybeat-schedule")],
            layout.logs / "beat.log",
            heartbeat("beat", beat_name()),
            env=env,
            cwd=layout.run_dir,
            stop_group="front",
        ),
    ]
