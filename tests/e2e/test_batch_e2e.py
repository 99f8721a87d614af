"""The Batch API end to end: the official ``openai`` SDK against the session's shared platform
(``tests/e2e/conftest.py``: ``tollgate up``'s gateway, Celery worker and beat under its supervisor, a
tiny engine replica in both the ``interactive`` and ``batch`` pools, Postgres and Redis).

Time constants are shortened through ``TOLLGATE_*`` variables (``platform_harness.PLATFORM_SETTINGS``):
3 s leases, a 0.5 s sweep, 0.2 s polls. Each test makes its own tenant and looks only at its own batches
and rows.

Helpers: ``jsonl``, ``wait_for_batch`` (polls until a final status), ``ledger_rows``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from datetime import UTC, datetime
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from sqlalchemy import func, select

from billing.prices import PRICE_FIELDS, Price, cost_pico_usd
from billing.spend import month_field, month_to_date_spend
from gateway.batches.lines import line_request_id
from gateway.batches.schemas import FINAL_STATUSES
from tests.e2e.platform_harness import MODEL, PLATFORM_GROUP, Platform
from tests.openai_schema import assert_conforms
from tests.polling import eventually
from tollgate.db import Database
from tollgate.models import BatchItem, UsageEvent
from tollgate.models import Price as PriceRow

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(PLATFORM_GROUP)]

# Deadlines only bound a hang: a batch on a loaded CPU machine may take minutes and is not a failure.
BATCH_TIMEOUT_S = 300.0
LEDGER_TIMEOUT_S = 120.0


def jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def chat_line(custom_id: str, content: str, *, max_tokens: int = 4, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, "temperature": 0, **body}}


async def wait_for_batch(fetch: Any, batch_id: str, until: Any = None) -> Any:
    """Poll ``fetch(batch_id)`` until the batch is final (or ``until(batch)`` holds); the batch."""
    seen: list[Any] = []

    async def reached() -> Any:
        batch = await fetch(batch_id)
        seen.append(batch)
        return batch if (until(batch) if until is not None else batch.status in FINAL_STATUSES) else None

    try:
        return await eventually(reached, f"batch {batch_id}", timeout_s=BATCH_TIMEOUT_S, interval_s=0.1)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen[-1] if seen else None}") from None


async def ledger_rows(db: Database, request_ids: set[str]) -> list[UsageEvent]:
    """The ledger rows of ``request_ids`` once all of them have landed (beat flushes the outbox)."""
    async def landed() -> list[UsageEvent] | None:
        async with db.session() as session:
            rows = list(await session.scalars(
                select(UsageEvent).where(UsageEvent.request_id.in_(request_ids))))
        return rows if {r.request_id for r in rows} >= request_ids else None

    return await eventually(landed, f"{len(request_ids)} ledger rows", timeout_s=LEDGER_TIMEOUT_S,
                            interval_s=0.1)


async def platform_price(db: Database) -> Price:
    """The price ``tollgate up`` gave the model: its only one (the platform's database is new)."""
    async with db.session() as session:
        row = (await session.scalars(select(PriceRow).where(PriceRow.model == MODEL))).one()
    return Price(**{name: getattr(row, name) for name in PRICE_FIELDS})


def sdk(platform: Platform, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=platform.openai_base_url, api_key=key, max_retries=0, timeout=120)


def read_jsonl(content: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in content.decode().splitlines() if line]


async def test_upload_run_download_and_bill_at_batch_prices(platform: Platform,
                                                            platform_db: Database) -> None:
    tenant = await platform.tenant(platform_db)
    client = sdk(platform, tenant.key)
    price = await platform_price(platform_db)
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

    async with httpx.AsyncClient(base_url=platform.openai_base_url, headers=tenant.headers) as raw:
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
    rows = await ledger_rows(platform_db, request_ids)
    assert sorted(r.request_id for r in rows) == sorted(request_ids)
    for row in rows:
        assert (row.request_class, row.status) == ("batch", "completed")
        assert row.cost_pico_usd == cost_pico_usd(price, row.prompt_tokens, row.cached_tokens,
                                                  row.completion_tokens, "batch")
    # The same request interactively costs exactly twice as much for the same tokens.
    response = await client.chat.completions.with_raw_response.create(**lines[0]["body"])
    (interactive,) = await ledger_rows(platform_db, {response.headers["x-request-id"]})
    assert interactive.request_class == "interactive"
    tokens = (interactive.prompt_tokens, interactive.cached_tokens, interactive.completion_tokens)
    assert interactive.cost_pico_usd == cost_pico_usd(price, *tokens, "interactive")
    for row in rows:
        assert 2 * row.cost_pico_usd == cost_pico_usd(price, row.prompt_tokens, row.cached_tokens,
                                                      row.completion_tokens, "interactive")

    # Batch spend counts toward the month, once per line.
    redis = aioredis.Redis.from_url(platform.redis_url)
    try:
        spent = await month_to_date_spend(redis, tenant.tenant_id, month_field(datetime.now(UTC)))
    finally:
        await redis.aclose()
    assert spent == sum(r.cost_pico_usd for r in rows) + interactive.cost_pico_usd


async def test_a_malformed_file_fails_validation_naming_its_lines(platform: Platform,
                                                                  platform_db: Database) -> None:
    tenant = await platform.tenant(platform_db)
    client = sdk(platform, tenant.key)
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
    async with platform_db.session() as session:
        items = await session.scalar(select(func.count()).select_from(BatchItem)
                                     .where(BatchItem.batch_id == batch.id))
        billed = await session.scalar(select(func.count()).select_from(UsageEvent)
                                      .where(UsageEvent.tenant_id == tenant.tenant_id))
    assert items == 0 and billed == 0


async def test_cancel_stops_new_lines_and_keeps_finished_ones(platform: Platform,
                                                              platform_db: Database) -> None:
    tenant = await platform.tenant(platform_db)
    client = sdk(platform, tenant.key)
    custom_ids = [f"line-{i:03d}" for i in range(120)]
    lines: list[Any] = [chat_line(cid, f"Count to {i}.", max_tokens=24) for i, cid in enumerate(custom_ids)]
    uploaded = await client.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    await wait_for_batch(client.batches.retrieve, batch.id, until=lambda b: b.request_counts.completed >= 1)
    cancelling = await client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await wait_for_batch(client.batches.retrieve, batch.id)
    assert done.status == "cancelled" and done.cancelled_at
    assert 1 <= done.request_counts.completed < len(custom_ids)
    output = read_jsonl((await client.files.content(done.output_file_id)).content)
    errors = read_jsonl((await client.files.content(done.error_file_id)).content)
    assert len(output) == done.request_counts.completed
    assert sorted(o["custom_id"] for o in output + errors) == custom_ids  # every line exactly once
    assert {e["error"]["code"] for e in errors if e["response"] is None} <= {"batch_cancelled"}
    again = await client.batches.cancel(batch.id)  # idempotent on a cancelled batch
    assert again.status == "cancelled"


async def test_a_worker_killed_mid_batch_resumes_without_duplicates(platform: Platform,
                                                                   platform_db: Database) -> None:
    """SIGKILL the Celery worker (all its processes) mid-batch; ``tollgate up``'s supervisor starts
    another: the sweep frees the dead leases (no broker redelivery needed), the batch completes, each
    line is answered, billed and written exactly once, and no line was started more than twice."""
    tenant = await platform.tenant(platform_db)
    client = sdk(platform, tenant.key)
    custom_ids = [f"crash-{i:03d}" for i in range(200)]
    lines: list[Any] = [chat_line(cid, f"Item number {i}.", max_tokens=4) for i, cid in enumerate(custom_ids)]
    uploaded = await client.files.create(file=("crash.jsonl", jsonl(lines)), purpose="batch")
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    # An operator watches it with `tollgate batches watch` (a progress bar until the batch is final).
    watch = [sys.executable, "-m", "tollgate", "batches", "watch", batch.id, "--interval", "0.2"]
    watcher = subprocess.Popen(watch, env=platform.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert watcher.stdout is not None
    first_bar = await asyncio.to_thread(watcher.stdout.readline)  # drawn before the kill, so not the last
    assert first_bar.startswith("["), first_bar
    await wait_for_batch(client.batches.retrieve, batch.id, until=lambda b: b.request_counts.completed >= 20)
    # The supervisor is paused from the kill until this block ends: the look at the batch happens with no
    # worker alive at all, whatever the machine's speed.
    with platform.supervisor_paused():
        victim = platform.kill_child("worker")
        at_kill = await client.batches.retrieve(batch.id)
        async with platform_db.session() as session:
            orphaned = await session.scalar(select(func.count()).select_from(BatchItem).where(
                BatchItem.batch_id == batch.id, BatchItem.status == "running"))
    assert at_kill.status == "in_progress" and at_kill.request_counts.completed < len(custom_ids)

    done = await wait_for_batch(client.batches.retrieve, batch.id)
    assert done.status == "completed"
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (200, 200, 0)
    output = read_jsonl((await client.files.content(done.output_file_id)).content)
    assert [o["custom_id"] for o in output] == custom_ids
    assert done.error_file_id is None
    rest, err = watcher.communicate(timeout=BATCH_TIMEOUT_S)
    assert watcher.returncode == 0, err
    assert f"batch {batch.id}: completed, 200 completed, 0 failed, of 200" in rest
    bars = [line for line in (first_bar + rest).splitlines() if line.startswith("[")]
    assert len(bars) >= 2 and bars[-1].startswith("[" + "#" * 40 + "] 200/200 100% completed")

    request_ids = {line_request_id(batch.id, cid) for cid in custom_ids}
    rows = await ledger_rows(platform_db, request_ids)
    assert len(rows) == len(request_ids) and {r.request_id for r in rows} == request_ids
    assert all(r.request_class == "batch" and r.status == "completed" for r in rows)
    async with platform_db.session() as session:
        attempts = list(await session.scalars(
            select(BatchItem.attempts).where(BatchItem.batch_id == batch.id)))
    assert max(attempts) <= 2
    assert orphaned == 0 or attempts.count(2) >= 1  # lines the dead worker held were started again
    platform.wait_healthy("worker", not_pid=victim)  # the supervisor restarted it: the platform is whole
