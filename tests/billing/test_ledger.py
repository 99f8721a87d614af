"""Outbox → ledger against real Redis and Postgres: exactly one row per request, nothing lost while
Postgres is unreachable, nothing doubled by redelivery or a dead consumer; every count of a record (cache
products, cache tiers, accepted and rejected prediction tokens) reaches its ledger column."""

from __future__ import annotations

from datetime import UTC, datetime

import orjson
import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from billing.ledger import DEAD_LETTER_STREAM, LEDGER_GROUP, LedgerUnavailable, UsageFlusher
from billing.outbox import OPTIONAL_COUNTS, PREDICTION_TOKEN_FIELDS, USAGE_STREAM, UsageRecord, append_usage
from billing.prices import CACHE_TOKEN_FIELDS, Price, charge
from billing.repository import insert_usage_events
from engine.usage import Usage
from tests.factories import create_tenant
from tollgate.db import Database
from tollgate.local_services import free_port
from tollgate.models import UsageEvent

PRICE = Price.of(input=3_000_000, output=15_000_000, cache_write=3_750_000, cache_pin=300_000,
                 cache_retention=100_000)


def charged(prompt: int, cached: int, completion: int, cache_tokens: dict[str, int]) -> dict[str, int]:
    """``cost_pico_usd`` and each kind's cost, as a gateway charges them at ``PRICE``."""
    costs = charge(Usage.of(prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
                            **cache_tokens), PRICE, "interactive")
    return {"cost_pico_usd": costs.total, **costs.fields()}


def record(tenant_id: int, request_id: str, *, prompt: int = 1_000, cached: int = 200,
           completion: int = 50, status: str = "completed", host: int = 0, disk: int = 0,
           accepted: int = 0, rejected: int = 0, **cache_tokens: int) -> UsageRecord:
    return UsageRecord.of(
        request_id=request_id, tenant_id=tenant_id, api_key_id=None, model="tiny",
        request_class="interactive", tier="default", prompt_tokens=prompt, cached_tokens=cached,
        completion_tokens=completion,
        **charged(prompt, cached, completion, cache_tokens), status=status, ttft_ms=12.5, tpot_ms=3.0,
        created_at=datetime.now(UTC), **cache_tokens,
        cached_host_tokens=host, cached_disk_tokens=disk, accepted_prediction_tokens=accepted,
        rejected_prediction_tokens=rejected,
    )


async def ledger_rows(db_session, tenant_id: int) -> list[UsageEvent]:
    stmt = select(UsageEvent).where(UsageEvent.tenant_id == tenant_id).order_by(UsageEvent.request_id)
    return list((await db_session.scalars(stmt)).all())


async def test_records_become_exactly_one_row_each(db_session, redis_client, unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    records = [record(tenant.id, f"req-{i:03d}", completion=i) for i in range(25)]
    for rec in records:
        await append_usage(redis_client, rec)
    await append_usage(redis_client, records[3])  # the gateway retried an append: same request id
    flusher = UsageFlusher(redis_client, unit_of_work, consumer="w1", batch_size=10)
    result = await flusher.flush()
    assert (result.entries, result.inserted, result.duplicates, result.dead) == (26, 25, 1, 0)
    rows = await ledger_rows(db_session, tenant.id)
    assert [r.request_id for r in rows] == [r.request_id for r in records]
    assert [r.cost_pico_usd for r in rows] == [r.cost_pico_usd for r in records]
    assert rows[7].prompt_tokens == 1_000 and rows[7].cached_tokens == 200 and rows[7].completion_tokens == 7
    assert await redis_client.xlen(USAGE_STREAM) == 0  # acknowledged entries leave the stream
    # Flushing the same record again later still leaves one row.
    await append_usage(redis_client, records[0])
    assert (await flusher.flush()).inserted == 0
    assert len(await ledger_rows(db_session, tenant.id)) == 25


async def test_cache_token_counts_reach_the_ledger_columns(db_session, redis_client, unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    cached = record(tenant.id, "cache-1", cache_write_tokens=784, cache_pinned_tokens=992,
                    cache_retained_tokens=496)
    plain = record(tenant.id, "cache-2")
    for rec in (cached, plain):
        await append_usage(redis_client, rec)
    assert (await UsageFlusher(redis_client, unit_of_work, consumer="w1").flush()).inserted == 2
    first, second = await ledger_rows(db_session, tenant.id)
    assert [getattr(first, name) for name in CACHE_TOKEN_FIELDS] == [784, 992, 496]
    assert first.cost_pico_usd == (800 * 3_000_000 + 200 * 300_000 + 50 * 15_000_000
                                   + 784 * 3_750_000 + 992 * 300_000 + 496 * 100_000)
    assert [getattr(second, name) for name in CACHE_TOKEN_FIELDS] == [0, 0, 0]
    assert second.cost_pico_usd == plain.cost_pico_usd


async def test_where_cached_tokens_came_from_reaches_the_ledger(db_session, redis_client,
                                                                unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    await append_usage(redis_client, record(tenant.id, "tiers-1", cached=200, host=96, disk=64))
    assert (await UsageFlusher(redis_client, unit_of_work, consumer="w1").flush()).inserted == 1
    [row] = await ledger_rows(db_session, tenant.id)
    assert (row.cached_tokens, row.cached_host_tokens, row.cached_disk_tokens) == (200, 96, 64)
    too_many = record(tenant.id, "tiers-2").row() | {"cached_host_tokens": 150, "cached_disk_tokens": 51}
    with pytest.raises(IntegrityError, match="ck_usage_events_cached_tier_counts"):
        async with unit_of_work() as session:
            await insert_usage_events(session, [too_many])


async def test_prediction_token_counts_reach_the_ledger(db_session, redis_client, unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    # 50 completion tokens: 30 of them accepted from the prediction, 12 rejected ones billed as output.
    predicted = record(tenant.id, "predicted-1", completion=50, accepted=30, rejected=12)
    await append_usage(redis_client, predicted)
    await append_usage(redis_client, record(tenant.id, "predicted-2"))
    assert (await UsageFlusher(redis_client, unit_of_work, consumer="w1").flush()).inserted == 2
    first, second = await ledger_rows(db_session, tenant.id)
    assert [getattr(first, name) for name in PREDICTION_TOKEN_FIELDS] == [30, 12]
    assert first.cost_pico_usd == 800 * 3_000_000 + 200 * 300_000 + 50 * 15_000_000
    assert [getattr(second, name) for name in PREDICTION_TOKEN_FIELDS] == [0, 0]
    for request_id, counts in (("predicted-3", {"accepted_prediction_tokens": 40,
                                                "rejected_prediction_tokens": 11}),
                               ("predicted-4", {"rejected_prediction_tokens": -1})):
        row = record(tenant.id, request_id).row() | counts
        with pytest.raises(IntegrityError, match="ck_usage_events_prediction_token_counts"):
            async with unit_of_work() as session:
                await insert_usage_events(session, [row])


@pytest.mark.parametrize("name", CACHE_TOKEN_FIELDS)
async def test_the_ledger_refuses_cache_counts_beyond_the_prompt(db_session, unit_of_work, name: str) -> None:
    tenant = await create_tenant(db_session)
    row = record(tenant.id, f"too-many-{name}").row() | {name: 1_001}
    with pytest.raises(IntegrityError, match="ck_usage_events_cache_token_counts"):
        async with unit_of_work() as session:
            await insert_usage_events(session, [row])


async def test_postgres_unreachable_keeps_records_until_a_later_flush(db_session, redis_client,
                                                                       unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    records = [record(tenant.id, f"out-{i}") for i in range(12)]
    for rec in records[:8]:
        await append_usage(redis_client, rec)
    dead_db = Database(f"postgresql://tollgate:x@127.0.0.1:{free_port()}/tollgate", pool_size=1)
    try:
        down = UsageFlusher(redis_client, dead_db.session, consumer="w1", batch_size=5)
        for _ in range(2):  # retried while the outage lasts: still nothing lost
            with pytest.raises(LedgerUnavailable):
                await down.flush()
    finally:
        await dead_db.dispose()
    assert await redis_client.xlen(USAGE_STREAM) == 8
    pending = await redis_client.xpending(USAGE_STREAM, LEDGER_GROUP)
    assert pending["pending"] == 5  # the failed batch waits, unacknowledged, in w1's pending list
    for rec in records[8:]:
        await append_usage(redis_client, rec)  # gateways keep appending during the outage
    up = UsageFlusher(redis_client, unit_of_work, consumer="w1", batch_size=5)
    result = await up.flush()
    assert result.inserted == 12 and result.dead == 0
    assert sorted(r.request_id for r in await ledger_rows(db_session, tenant.id)) == sorted(
        r.request_id for r in records)
    assert await redis_client.xlen(USAGE_STREAM) == 0
    assert (await redis_client.xpending(USAGE_STREAM, LEDGER_GROUP))["pending"] == 0


async def test_a_dead_consumers_pending_entries_are_claimed(db_session, redis_client, unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    for i in range(6):
        await append_usage(redis_client, record(tenant.id, f"claim-{i}"))
    crashed = UsageFlusher(redis_client, unit_of_work, consumer="crashed", batch_size=4)
    await crashed.ensure_group()
    # The crashed worker read four entries and died before inserting them.
    await redis_client.xreadgroup(LEDGER_GROUP, "crashed", {USAGE_STREAM: ">"}, count=4)
    patient = UsageFlusher(redis_client, unit_of_work, consumer="other", batch_size=100, claim_idle_ms=60_000)
    assert (await patient.flush()).inserted == 2  # not idle long enough yet: only the unread two
    taker = UsageFlusher(redis_client, unit_of_work, consumer="other", batch_size=100, claim_idle_ms=0)
    assert (await taker.flush()).inserted == 4
    assert len(await ledger_rows(db_session, tenant.id)) == 6
    assert (await redis_client.xpending(USAGE_STREAM, LEDGER_GROUP))["pending"] == 0


async def test_crash_between_commit_and_ack_does_not_double_bill(db_session, redis_client,
                                                                 unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    records = [record(tenant.id, f"twice-{i}") for i in range(3)]
    for rec in records:
        await append_usage(redis_client, rec)
    flusher = UsageFlusher(redis_client, unit_of_work, consumer="w1", batch_size=10)
    await flusher.ensure_group()
    await redis_client.xreadgroup(LEDGER_GROUP, "w1", {USAGE_STREAM: ">"}, count=10)
    async with unit_of_work() as session:  # the rows were committed, then the worker died
        await insert_usage_events(session, [r.row() for r in records])
    result = await flusher.flush()  # restarted: redelivers its pending entries
    assert (result.entries, result.inserted, result.duplicates) == (3, 0, 3)
    assert len(await ledger_rows(db_session, tenant.id)) == 3


async def test_unusable_records_go_to_the_dead_letter_stream(db_session, redis_client, unit_of_work) -> None:
    tenant = await create_tenant(db_session)
    await append_usage(redis_client, record(tenant.id, "good-1"))
    await append_usage(redis_client, record(10**12, "orphan"))  # no such tenant: the FK refuses it
    await redis_client.xadd(USAGE_STREAM, {b"r": b"{not json"})
    await append_usage(redis_client, record(tenant.id, "good-2"))
    result = await UsageFlusher(redis_client, unit_of_work, consumer="w1").flush()
    assert (result.inserted, result.dead) == (2, 2)
    assert [r.request_id for r in await ledger_rows(db_session, tenant.id)] == ["good-1", "good-2"]
    dead = await redis_client.xrange(DEAD_LETTER_STREAM)
    reasons = sorted(fields[b"reason"].decode().split(":")[0] for _, fields in dead)
    assert reasons == ["rejected by the database", "undecodable"]
    assert await redis_client.xlen(USAGE_STREAM) == 0


async def test_records_validate_their_columns() -> None:
    with pytest.raises(ValueError):
        record(1, "x", prompt=10, cached=11)
    with pytest.raises(ValueError):
        UsageRecord.of(request_id="x", tenant_id=1, api_key_id=None, model="m", request_class="interactive",
                    tier="default", prompt_tokens=1, cached_tokens=0, completion_tokens=0, cost_pico_usd=0,
                    status="completed", ttft_ms=None, tpot_ms=None, created_at=datetime(2026, 1, 1))
    for name in CACHE_TOKEN_FIELDS:
        with pytest.raises(ValueError, match=name):
            record(1, "x", prompt=10, cached=0, **{name: 11})
        with pytest.raises(ValueError, match=name):
            record(1, "x", **{name: -1})
    with pytest.raises(ValueError, match="cached_host_tokens"):
        record(1, "x", cached=100, host=60, disk=41)
    # Prediction tokens are completion tokens: non-negative integers, together at most the completion.
    with pytest.raises(ValueError, match="accepted_prediction_tokens"):
        record(1, "x", completion=50, accepted=40, rejected=11)
    for counts in ({"accepted": -1}, {"rejected": -1}, {"accepted": 1.0}, {"rejected": True}):
        with pytest.raises(ValueError, match="prediction_tokens must be a non-negative integer"):
            record(1, "x", **counts)  # type: ignore[arg-type]
    assert record(1, "x", completion=50, accepted=38, rejected=12).rejected_prediction_tokens == 12
    rec = record(1, "roundtrip", cache_write_tokens=16, cache_pinned_tokens=32, cache_retained_tokens=48,
                 host=16, disk=32, accepted=20, rejected=7)
    assert UsageRecord.from_json(rec.to_json()) == rec
    assert orjson.loads(rec.to_json())["rejected_prediction_tokens"] == 7
    optional = (*CACHE_TOKEN_FIELDS, "cached_host_tokens", "cached_disk_tokens", *PREDICTION_TOKEN_FIELDS)
    assert set(optional) == set(OPTIONAL_COUNTS)
    older = {k: v for k, v in orjson.loads(rec.to_json()).items() if k not in optional}
    # A gateway older than the cache, tier and prediction counts sent none: they read as 0.
    without = UsageRecord.of(**rec.fields() | dict.fromkeys(optional, 0))
    assert UsageRecord.from_json(orjson.dumps(older)) == without
    newer = orjson.loads(rec.to_json()) | {"reasoning_tokens": 7}  # written by a newer gateway
    assert UsageRecord.from_json(orjson.dumps(newer)) == rec
    with pytest.raises(KeyError):
        UsageRecord.from_json(orjson.dumps({k: v for k, v in newer.items() if k != "model"}))

