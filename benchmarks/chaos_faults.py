"""The chaos benchmark's faults, injected on a schedule while the load runs (one at a time, or overlapping
in the short run), each timed.

Kinds (``FAULTS``):
- ``engine``: SIGKILL of one engine replica's process group (replicas in turn); the supervisor restarts it,
  with its disk tier kept. The other replica serves meanwhile.
- ``gateway_worker``: SIGKILL of one uvicorn worker of the gateway; uvicorn's parent starts another.
- ``redis``: SIGKILL of Redis, started again ``down_s`` later from its append-only file.
- ``postgres``: SIGKILL of Postgres's whole process group, started again ``down_s`` later (crash recovery).
- ``celery_worker``: SIGKILL of the Celery worker while a batch it runs is in progress (one is submitted
  first); the supervisor restarts it and the batch's lines resume once their leases expire.

``recovery_s``: from the kill to the first successful probe (a one-token chat completion of the demo tenant,
every ``PROBE_INTERVAL_S``): how long tenants were refused (for an engine replica, ~0: the other one
serves); ``component_s``: from the kill until the component itself is back (the supervisor's health check,
the worker count, or the server answering). Both run from the kill at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from benchmarks.chaos_load import Load, Tenant
from benchmarks.chaos_platform import ChaosPlatform, wait_for

FAULTS = ("engine", "gateway_worker", "redis", "postgres", "celery_worker")
PROBE_INTERVAL_S = 0.2
RECOVERY_TIMEOUT_S = 180.0


@dataclass
class FaultRecord:
    kind: str
    target: str
    at_s: float  # since the load started
    component_s: float | None = None
    recovery_s: float | None = None
    note: str = ""
    killed_at: float = 0.0  # time.monotonic() of the kill


class Faults:
    def __init__(
        self,
        platform: ChaosPlatform,
        load: Load,
        tenants: list[Tenant],
        *,
        down_s: float,
        batch_lines: int,
        started_at: float,
    ) -> None:
        self.platform = platform
        self.load = load
        self.tenants = tenants
        self.down_s = down_s
        self.batch_lines = batch_lines
        self.started_at = started_at
        self.records: list[FaultRecord] = []
        self._engine_turn = 0

    async def _probe_ok(self, client: httpx.AsyncClient) -> bool:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "probe"}], "max_tokens": 1}
        try:
            response = await client.post(
                "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {self.platform.demo_key}"},
            )
        except httpx.TransportError:
            return False
        return response.status_code == 200

    async def _until(self, condition: Any, timeout_s: float = RECOVERY_TIMEOUT_S) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = condition()
            if asyncio.iscoroutine(value):
                value = await value
            if value:
                return True
            await asyncio.sleep(PROBE_INTERVAL_S)
        return False

    async def inject(self, kind: str, injected: asyncio.Event | None = None) -> FaultRecord:
        """Inject one fault and wait until the component is back and tenants are served again;
        ``injected`` is set once the kill (and, for Redis and Postgres, the restart) was done."""
        record = FaultRecord(kind, "", time.monotonic() - self.started_at)
        killed_at = time.monotonic()
        p = self.platform
        if kind == "engine":
            name = p.engine_names()[self._engine_turn % len(p.engine_names())]
            self._engine_turn += 1
            record.target = name
            killed_at = time.monotonic()
            old = await asyncio.to_thread(p.kill_child, name)
            back = lambda: p.healthy_again(name, old)  # noqa: E731
        elif kind == "gateway_worker":
            before = len(p.gateway_workers_pids())
            killed_at = time.monotonic()
            victim = await asyncio.to_thread(p.kill_gateway_worker)
            record.target = f"gateway worker {victim}"
            back = lambda: len([w for w in p.gateway_workers_pids() if w != victim]) >= before  # noqa: E731
        elif kind in ("redis", "postgres"):
            servers = {"redis": (p.kill_redis, p.start_redis),
                       "postgres": (p.kill_postgres, p.start_postgres)}
            kill, start = servers[kind]
            record.target = kind
            killed_at = time.monotonic()
            await asyncio.to_thread(kill)
            await asyncio.sleep(self.down_s)
            await asyncio.to_thread(start)
            back = lambda: True  # noqa: E731
        elif kind == "celery_worker":
            tenant = self.tenants[len(self.records) % len(self.tenants)]
            batch = await self.load.submit_batch(tenant, self.batch_lines)
            if batch is not None:
                record.note = f"batch {batch.batch_id} of {tenant.name}"
                await self._until(lambda: self._batch_running(tenant, batch.batch_id), timeout_s=30.0)
            record.target = "celery worker"
            killed_at = time.monotonic()
            old = await asyncio.to_thread(p.kill_child, "worker")
            back = lambda: p.healthy_again("worker", old)  # noqa: E731
        else:
            raise ValueError(f"unknown fault {kind!r}")
        record.killed_at = killed_at
        if injected is not None:
            injected.set()

        async def component() -> None:
            if await self._until(back):
                record.component_s = time.monotonic() - killed_at

        async def served() -> None:
            async with httpx.AsyncClient(base_url=p.base_url, timeout=30.0) as client:
                if await self._until(lambda: self._probe_ok(client)):
                    record.recovery_s = time.monotonic() - killed_at

        await asyncio.gather(component(), served())
        self.records.append(record)
        return record

    async def _batch_running(self, tenant: Tenant, batch_id: str) -> bool:
        async with httpx.AsyncClient(base_url=self.platform.base_url, timeout=10.0) as client:
            try:
                answer = await client.get(f"/v1/batches/{batch_id}", headers=tenant.headers)
            except httpx.TransportError:
                return False
        if answer.status_code != 200:
            return False
        counts = answer.json().get("request_counts") or {}
        return answer.json()["status"] == "in_progress" and counts.get("completed", 0) > 0

    async def run(self, schedule: list[str], interval_s: float, stop: asyncio.Event,
                  overlap: bool = False) -> None:  # fmt: skip
        """Inject ``schedule`` in order, one every ``interval_s`` after the previous one recovered, or
        (``overlap``) after the previous one was injected: faults then combine (a replica still
        restarting when Redis dies, Postgres down while the Celery worker is killed)."""
        pending: list[asyncio.Task[FaultRecord]] = []
        for kind in schedule:
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
                break
            except TimeoutError:
                pass
            injected = asyncio.Event()
            task = asyncio.create_task(self.inject(kind, injected))
            if overlap:  # on to the next once this one's kill is done (or its injection failed)
                waiter = asyncio.create_task(injected.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                pending.append(task)
            else:
                await task
        await asyncio.gather(*pending)


def wait_platform_quiet(platform: ChaosPlatform) -> None:
    """Every supervised child healthy (after the last fault's restarts)."""
    wait_for(
        lambda: all(c["state"] == "healthy" for c in platform.status().values()),
        "every child of tollgate up healthy",
        timeout_s=RECOVERY_TIMEOUT_S,
    )
