"""The Batch API end to end: the official ``openai`` SDK against the real gateway, Celery worker and beat
subprocesses, an engine subprocess, Postgres and Redis.

The platform is started once per test session and shared:

- a tiny random-weight model and one ``tollgate engine`` subprocess serving it, registered in both the
  ``interactive`` and ``batch`` pools;
- a database of its own (workers commit), a Redis database index of its own (the Celery broker and the
  usage outbox; other tests flush theirs), a storage directory for files;
- the gateway app under uvicorn in the test loop (``/v1/files``, ``/v1/batches``, chat...);
- a Celery beat subprocess and Celery worker subprocesses (``celery -A tollgate.worker``) with the time
  constants shortened through ``TOLLGATE_*`` variables: 3 s leases, a 0.5 s sweep, 0.2 s polls.
  ``start_worker()`` / ``kill_worker()`` let a test SIGKILL a whole worker (its process group) and start
  another.

Helpers: ``jsonl``, ``wait_for_batch`` (polls until a final status, with a deadline), ``ledger_rows``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from sqlalchemy import func, select

from billing.prices import Price, cost_pico_usd
from billing.spend import month_field, month_to_date_spend
from gateway.batch_runner.lines import line_request_id
from gateway.batches.schemas import FINAL_STATUSES
from tests.factories import DEFAULT_INPUT_PRICE, DEFAULT_OUTPUT_PRICE, create_price
from tests.gateway.conftest import GatewayUnderTest, TenantKey, make_tenant_key, run_engine, run_gateway
from tests.openai_schema import assert_conforms
from tollgate.db import Database
from tollgate.models import BatchItem, UsageEvent
from tollgate.processes import group_alive, signal_group, spawn, stop
from tollgate.settings import ModelConfig, PoolConfig, Settings, default_tiers

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny"
WORKER_START_TIMEOUT_S = 60.0
BATCH_REDIS_DB_BASE = 40

SHORT_TIMES = {
    "batch_lease_ttl_s": 3.0,
    "batch_sweep_interval_s": 0.5,
    "batch_status_poll_interval_s": 0.2,
    "usage_flush_interval_s": 0.2,
    "health_poll_interval_s": 0.2,
    "health_check_timeout_s": 1.0,
    "heartbeat_interval_s": 0.5,
    "beat_max_loop_interval_s": 0.5,
    "key_cache_ttl_s": 0.5,
}


def jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def chat_line(custom_id: str, content: str, *, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


@dataclass
class BatchPlatform:
    gateway: GatewayUnderTest
    settings: Settings
    env: dict[str, str]
    logs: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    beat: subprocess.Popen[bytes] | None = None

    @property
    def db(self) -> Database:
        return self.gateway.db

    def start_worker(self) -> subprocess.Popen[bytes]:
        name = f"batch-test-{uuid.uuid4().hex[:6]}"
        proc = spawn([sys.executable, "-m", "celery", "-A", "tollgate.worker", "worker", "-n", f"{name}@%h",
                      "-c", "2", "-P", "prefork", "-l", "info", "--without-gossip", "--without-mingle"],
                     log_path=self.logs / f"{name}.log", env=self.env, cwd=self.logs)
        self.workers.append(proc)
        return proc

    def kill_worker(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the worker and its pool processes at once (a machine dying), and reap it."""
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.workers.remove(proc)

    def start_beat(self) -> None:
        self.beat = spawn([sys.executable, "-m", "celery", "-A", "tollgate.worker", "beat", "-l", "info",
                           "-s", str(self.logs / "celerybeat-schedule")],
                          log_path=self.logs / "beat.log", env=self.env, cwd=self.logs)

    def stop_all(self) -> None:
        for proc in [*self.workers, *([self.beat] if self.beat else [])]:
            stop(proc, timeout=10)
        self.workers.clear()

    async def tenant(self, **columns: Any) -> TenantKey:
        return await make_tenant_key(self.gateway, **columns)


def _env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env.update({
        "TOLLGATE_ENVIRONMENT": "test",
        "TOLLGATE_DATABASE_URL": settings.database_url or "",
        "TOLLGATE_REDIS_URL": settings.redis_url or "",
        "TOLLGATE_MODELS": json.dumps([m.model_dump() for m in settings.models]),
        "TOLLGATE_POOLS": json.dumps({k: v.model_dump() for k, v in settings.pools.items()}),
        "TOLLGATE_FILE_STORAGE_DIR": str(settings.file_storage_dir),
        "TOLLGATE_DATABASE_POOL_SIZE": "4",
        "PYTHONUNBUFFERED": "1",
    })
    for name, value in SHORT_TIMES.items():
        env[f"TOLLGATE_{name.upper()}"] = str(value)
    return env


@pytest.fixture(scope="session")
async def batch_platform(shared_servers: Any, tmp_path_factory: pytest.TempPathFactory,
                         ) -> AsyncIterator[BatchPlatform]:
    from engine.tiny import create_tiny_checkpoint
    from tollgate import schema

    root = tmp_path_factory.mktemp("batch_platform")
    model_dir = create_tiny_checkpoint(root / "tiny", arch="llama", seed=0)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw-1")
    redis_url = shared_servers.redis.url(BATCH_REDIS_DB_BASE + int(worker.removeprefix("gw")) + 1)
    name = f"tollgate_batch_{worker.replace('-', '_')}_{uuid.uuid4().hex[:6]}"
    shared_servers.postgres.create_database(name, recreate=True)
    database_url = shared_servers.postgres.url(name)
    schema.upgrade(database_url)
    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    await client.aclose()
    db = Database(database_url, pool_size=1)
    async with db.session() as session:
        await create_price(session, model=MODEL)
    await db.dispose()
    logs = root / "logs"
    logs.mkdir()
    with run_engine(model_dir, logs / "engine.log") as (engine_url, _proc):
        settings = Settings(
            environment="test", database_url=database_url, redis_url=redis_url,
            models=[ModelConfig(name=MODEL, path=str(model_dir), pools=["interactive", "batch"])],
            pools={"interactive": PoolConfig(replicas=[engine_url]),
                   "batch": PoolConfig(replicas=[engine_url])},
            file_storage_dir=root / "files", max_request_body_bytes=4 * 1024 * 1024,
            default_max_tokens_reservation=64,
            tiers={n: t.model_copy(update={"ttft_slo_ms": 600_000, "tpot_slo_ms": 60_000})
                   for n, t in default_tiers().items()},
            **SHORT_TIMES,
        )
        async with run_gateway(settings) as gateway:
            platform = BatchPlatform(gateway=gateway, settings=settings, env=_env(settings), logs=logs)
            platform.start_beat()
            platform.start_worker()
            try:
                yield platform
            finally:
                platform.stop_all()
    shared_servers.postgres.drop_database(name)


async def wait_for_batch(fetch: Any, batch_id: str, timeout_s: float = 120.0,
                         until: Any = None) -> Any:
    """Poll ``fetch(batch_id)`` until the batch is final (or ``until(batch)`` holds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = await fetch(batch_id)
        if (until(batch) if until is not None else batch.status in FINAL_STATUSES):
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {batch.status} after {timeout_s} s: {batch}")
        await asyncio.sleep(0.1)


async def ledger_rows(db: Database, request_ids: set[str], timeout_s: float = 30.0) -> list[UsageEvent]:
    """The ledger rows of ``request_ids`` once all of them have landed (beat flushes the outbox)."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with db.session() as session:
            rows = list(await session.scalars(
                select(UsageEvent).where(UsageEvent.request_id.in_(request_ids))))
        if {r.request_id for r in rows} >= request_ids or time.monotonic() > deadline:
            return rows
        await asyncio.sleep(0.1)


PRICE = Price.of(input=DEFAULT_INPUT_PRICE, output=DEFAULT_OUTPUT_PRICE)


def sdk(platform: BatchPlatform, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{platform.gateway.url}/v1", api_key=key, max_retries=0, timeout=60)


def read_jsonl(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.decode().splitlines() if line]


async def test_upload_run_download_and_bill_at_batch_prices(batch_platform: BatchPlatform) -> None:
    tenant = await batch_platform.tenant()
    client = sdk(batch_platform, tenant.key)
    prompts = {f"req-{i}": f"Say something about the number {i}." for i in range(6)}
    lines: list[Any] = [chat_line(cid, text) for cid, text in prompts.items()]
    lines.append(chat_line("too-long", "hello", max_tokens=10_000_000))  # fails when it runs: 400
    uploaded = await client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))

    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
    done = await wait_for_batch(client.batches.retrieve, batch.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 6, 1)
    assert done.model == MODEL and done.in_progress_at and done.finalizing_at and done.completed_at

    async with httpx.AsyncClient(base_url=f"{batch_platform.gateway.url}/v1", headers=tenant.headers) as raw:
        assert_conforms((await raw.get(f"/batches/{batch.id}")).json(), "Batch")
        assert_conforms((await raw.get("/batches", params={"limit": 5})).json(), "ListBatchesResponse")
        assert_conforms((await raw.get(f"/files/{done.output_file_id}")).json(), "OpenAIFile")

    output = read_jsonl((await client.files.content(done.output_file_id)).content)
    errors = read_jsonl((await client.files.content(done.error_file_id)).content)
    assert [o["custom_id"] for o in output] == list(prompts)  # each once, in input order
    for record in output:
        assert record["error"] is None
        assert record["id"] == record["response"]["request_id"]
        assert record["id"] == line_request_id(batch.id, record["custom_id"])
        assert record["response"]["status_code"] == 200
        assert_conforms(record["response"]["body"], "CreateChatCompletionResponse")
    assert [e["custom_id"] for e in errors] == ["too-long"]
    assert errors[0]["response"]["status_code"] == 400
    assert errors[0]["response"]["body"]["error"]["code"] == "context_length_exceeded"

    # Usage on the batch object is the sum of the answered lines' usage.
    usages = [o["response"]["body"]["usage"] for o in output]
    assert done.usage.input_tokens == sum(u["prompt_tokens"] for u in usages)
    assert done.usage.output_tokens == sum(u["completion_tokens"] for u in usages)

    # Every answered line is in the ledger once, as class batch at the batch prices.
    request_ids = {line_request_id(batch.id, cid) for cid in prompts}
    rows = await ledger_rows(batch_platform.db, request_ids)
    assert sorted(r.request_id for r in rows) == sorted(request_ids)
    for row in rows:
        assert (row.request_class, row.status) == ("batch", "completed")
        assert row.cost_pico_usd == cost_pico_usd(PRICE, row.prompt_tokens, row.cached_tokens,
                                                  row.completion_tokens, "batch")
    # The same request interactively costs exactly twice as much for the same tokens.
    response = await client.chat.completions.with_raw_response.create(**lines[0]["body"])
    (interactive,) = await ledger_rows(batch_platform.db, {response.headers["x-request-id"]})
    assert interactive.request_class == "interactive"
    tokens = (interactive.prompt_tokens, interactive.cached_tokens, interactive.completion_tokens)
    assert interactive.cost_pico_usd == cost_pico_usd(PRICE, *tokens, "interactive")
    for row in rows:
        assert 2 * row.cost_pico_usd == cost_pico_usd(PRICE, row.prompt_tokens, row.cached_tokens,
                                                      row.completion_tokens, "interactive")

    # Batch spend counts toward the month, once per line.
    redis = aioredis.Redis.from_url(batch_platform.settings.redis_url)
    try:
        spent = await month_to_date_spend(redis, tenant.tenant_id, month_field(datetime.now(UTC)))
    finally:
        await redis.aclose()
    assert spent == sum(r.cost_pico_usd for r in rows) + interactive.cost_pico_usd


async def test_a_malformed_file_fails_validation_naming_its_lines(batch_platform: BatchPlatform) -> None:
    tenant = await batch_platform.tenant()
    client = sdk(batch_platform, tenant.key)
    wrong_url = chat_line("c", "hi")
    wrong_url["url"] = "/v1/completions"
    lines: list[Any] = [chat_line("a", "hi"), '{"custom_id": "b", "method": "POST",', chat_line("a", "again"),
                        wrong_url, chat_line("d", "fine")]
    uploaded = await client.files.create(file=("bad.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    failed = await wait_for_batch(client.batches.retrieve, batch.id)
    assert failed.status == "failed" and failed.failed_at
    found = {(e.line, e.code) for e in failed.errors.data}
    assert found == {(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_url")}
    assert failed.output_file_id is None and failed.request_counts.total == 0
    async with batch_platform.db.session() as session:
        items = await session.scalar(select(func.count()).select_from(BatchItem)
                                     .where(BatchItem.batch_id == batch.id))
        billed = await session.scalar(select(func.count()).select_from(UsageEvent)
                                      .where(UsageEvent.tenant_id == tenant.tenant_id))
    assert items == 0 and billed == 0


async def test_cancel_stops_new_lines_and_keeps_finished_ones(batch_platform: BatchPlatform) -> None:
    tenant = await batch_platform.tenant()
    client = sdk(batch_platform, tenant.key)
    custom_ids = [f"line-{i:03d}" for i in range(120)]
    lines: list[Any] = [chat_line(cid, f"Count to {i}.", max_tokens=24) for i, cid in enumerate(custom_ids)]
    uploaded = await client.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    await wait_for_batch(client.batches.retrieve, batch.id, until=lambda b: b.request_counts.completed >= 1)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await wait_for_batch(client.batches.retrieve, batch.id, timeout_s=30)
    assert done.status == "cancelled" and done.cancelled_at
    assert 1 <= done.request_counts.completed < len(custom_ids)
    output = read_jsonl((await client.files.content(done.output_file_id)).content)
    errors = read_jsonl((await client.files.content(done.error_file_id)).content)
    assert len(output) == done.request_counts.completed
    assert sorted(o["custom_id"] for o in output + errors) == custom_ids  # every line exactly once
    assert {e["error"]["code"] for e in errors if e["response"] is None} <= {"batch_cancelled"}
    again = await client.batches.cancel(batch.id)  # idempotent on a cancelled batch
    assert again.status == "cancelled"


async def test_a_worker_killed_mid_batch_resumes_without_duplicates(batch_platform: BatchPlatform) -> None:
    """SIGKILL the worker (all its processes) mid-batch and start another: the sweep frees the dead
    leases (no broker redelivery needed), the batch completes, each line is answered, billed and
    written exactly once, and no line was started more than twice."""
    tenant = await batch_platform.tenant()
    client = sdk(batch_platform, tenant.key)
    custom_ids = [f"crash-{i:03d}" for i in range(200)]
    lines: list[Any] = [chat_line(cid, f"Item number {i}.", max_tokens=4) for i, cid in enumerate(custom_ids)]
    uploaded = await client.files.create(file=("crash.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    # An operator watches it with `tollgate batches watch` (a progress bar until the batch is final).
    watch = [sys.executable, "-m", "tollgate", "batches", "watch", batch.id, "--interval", "0.2"]
    watcher = subprocess.Popen(watch, env=batch_platform.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    await wait_for_batch(client.batches.retrieve, batch.id, until=lambda b: b.request_counts.completed >= 20)
    (victim,) = batch_platform.workers
    batch_platform.kill_worker(victim)
    at_kill = await client.batches.retrieve(batch.id)
    assert at_kill.status == "in_progress" and at_kill.request_counts.completed < len(custom_ids)
    async with batch_platform.db.session() as session:
        orphaned = await session.scalar(select(func.count()).select_from(BatchItem).where(
            BatchItem.batch_id == batch.id, BatchItem.status == "running"))

    batch_platform.start_worker()
    done = await wait_for_batch(client.batches.retrieve, batch.id, timeout_s=60)  # resumes within a minute
    assert done.status == "completed"
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, 200, 0)
    output = read_jsonl((await client.files.content(done.output_file_id)).content)
    assert [o["custom_id"] for o in output] == custom_ids
    assert done.error_file_id is None
    out, err = watcher.communicate(timeout=30)
    assert watcher.returncode == 0, err
    assert f"batch {batch.id}: completed, 200 completed, 0 failed, of 200" in out
    bars = [line for line in out.splitlines() if line.startswith("[")]
    assert len(bars) >= 2 and bars[-1].startswith("[" + "#" * 40 + "] 200/200 100% completed")

    request_ids = {line_request_id(batch.id, cid) for cid in custom_ids}
    rows = await ledger_rows(batch_platform.db, request_ids)
    assert len(rows) == len(request_ids) and {r.request_id for r in rows} == request_ids
    assert all(r.request_class == "batch" and r.status == "completed" for r in rows)
    async with batch_platform.db.session() as session:
        attempts = list(await session.scalars(
            select(BatchItem.attempts).where(BatchItem.batch_id == batch.id)))
    assert max(attempts) <= 2
    assert orphaned == 0 or attempts.count(2) >= 1  # lines the dead worker held were started again
