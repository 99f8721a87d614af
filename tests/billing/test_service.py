"""Price rows and the price book from Postgres, spend reconciliation from the ledger, the Celery task
bodies and the ``tollgate prices`` CLI."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
import redis
from click.testing import CliRunner
from sqlalchemy import func, select

from billing import tasks
from billing.outbox import USAGE_STREAM, UsageRecord, append_usage
from billing.price_cache import PriceBookCache, PricesNotLoaded, load_price_book
from billing.prices import Price, PriceNotFound
from billing.service import DEMO_PRICE, EPOCH, PriceConflict, ensure_price, reconcile_month_spend, set_price
from billing.spend import (
    MONTH_OF_LUA,
    drop_months_before,
    month_bounds,
    month_field,
    month_to_date_spend,
    raise_spend_to,
)
from billing.tasks import beat_schedule, flush_usage_once, reconcile_spend_once
from tests.factories import create_tenant, create_usage_event
from tests.polling import eventually
from tollgate.cli import main as cli
from tollgate.db import Database
from tollgate.models import UsageEvent
from tollgate.settings import get_settings

NOW = datetime(2026, 11, 15, 12, 0, tzinfo=UTC)


async def test_price_rows_load_into_a_book_with_effective_dates(db_session) -> None:
    old, new = Price.of(input=1_000_000, output=2_000_000), Price.of(input=3_000_000, output=6_000_000)
    await set_price(db_session, "svc-model", old, NOW - timedelta(days=10), now=NOW)
    await set_price(db_session, "svc-model", new, NOW + timedelta(days=10), now=NOW)
    book = await load_price_book(db_session)
    assert book.price_for("svc-model", NOW) == old
    assert book.price_for("svc-model", NOW + timedelta(days=11)) == new
    with pytest.raises(PriceNotFound):
        book.price_for("svc-model", NOW - timedelta(days=11))


async def test_a_price_in_effect_is_never_rewritten_but_a_future_one_may_be(db_session) -> None:
    price = Price.of(input=5, output=5)
    start = await set_price(db_session, "m2", price, NOW - timedelta(hours=1), now=NOW)
    with pytest.raises(PriceConflict):
        await set_price(db_session, "m2", Price.of(input=1, output=1), start, now=NOW)
    future = NOW + timedelta(days=1)
    await set_price(db_session, "m2", price, future, now=NOW)
    await set_price(db_session, "m2", Price.of(input=7, output=7), future, now=NOW)
    assert (await load_price_book(db_session)).price_for("m2", future).input == 7


async def test_ensure_price_seeds_only_an_unpriced_model(db_session) -> None:
    assert await ensure_price(db_session, "tiny-seed", DEMO_PRICE)
    assert not await ensure_price(db_session, "tiny-seed", Price.of(input=1, output=1))
    book = await load_price_book(db_session)
    assert book.price_for("tiny-seed", EPOCH) == DEMO_PRICE


async def test_price_book_cache_refreshes(db_sessionmaker) -> None:
    async with db_sessionmaker() as session:
        cache = PriceBookCache(lambda: db_sessionmaker(), refresh_interval_s=3600)
        await cache.start()
        with pytest.raises(PriceNotFound):
            cache.price_for("cached-model")
        await set_price(session, "cached-model", Price.of(input=9, output=9))
        await session.flush()
        await cache.refresh()
        assert cache.price_for("cached-model").input == 9


async def test_a_price_book_cache_started_without_its_database_prices_nothing_until_it_loads(
        db_sessionmaker) -> None:  # fmt: skip
    unreachable = Database("postgresql+psycopg://nobody@127.0.0.1:1/none", pool_size=1)
    factory = {"sessions": unreachable.session}
    tries: list[int] = []

    def sessions():  # noqa: ANN202
        tries.append(1)
        return factory["sessions"]()

    cache = PriceBookCache(sessions, refresh_interval_s=3600, retry_interval_s=0.05)
    try:
        await cache.start()  # logs, does not raise: a gateway worker starting in an outage comes up
        assert not cache.loaded
        with pytest.raises(PricesNotLoaded):  # never an empty book mistaken for a loaded one
            cache.price_for("anything")
        async with db_sessionmaker() as session:
            await set_price(session, "retried-model", Price.of(input=5, output=5))
            await session.commit()
        runner = asyncio.create_task(cache.run())
        await eventually(lambda: len(tries) >= 4, "three retries")
        assert not cache.loaded  # still retrying against the unreachable database
        factory["sessions"] = db_sessionmaker  # the database is back
        await eventually(lambda: cache.loaded, "the retried first load")
        assert cache.price_for("retried-model").input == 5
        runner.cancel()
    finally:
        await unreachable.dispose()


async def test_reconcile_raises_spend_to_the_ledger_and_never_lowers_it(db_session, redis_client) -> None:
    month = month_field(datetime.now(UTC))
    start, _ = month_bounds(month)
    a, b = await create_tenant(db_session), await create_tenant(db_session)
    await create_usage_event(db_session, a, cost_pico_usd=10**15)
    await create_usage_event(db_session, a, cost_pico_usd=10**15 + 1)  # sums beyond float precision
    await create_usage_event(db_session, a, cost_pico_usd=999, created_at=start - timedelta(seconds=1))
    await create_usage_event(db_session, b, cost_pico_usd=50)
    await raise_spend_to(redis_client, b.id, month, 80)  # Redis ahead of the ledger (outbox not flushed)
    await reconcile_month_spend(db_session, redis_client)
    assert await month_to_date_spend(redis_client, a.id, month) == 2 * 10**15 + 1
    assert await month_to_date_spend(redis_client, b.id, month) == 80


@pytest.mark.parametrize("when", ["1970-01-01T00:00:00", "2024-02-29T23:59:59", "2024-03-01T00:00:00",
                                  "2026-12-31T23:59:59", "2027-01-01T00:00:00", "2100-03-01T00:00:00"])
async def test_the_lua_month_agrees_with_python(redis_client, when: str) -> None:
    at = datetime.fromisoformat(when).replace(tzinfo=UTC)
    script = MONTH_OF_LUA + "return month_of(tonumber(ARGV[1]))"
    month = await redis_client.eval(script, 0, int(at.timestamp()))
    assert month.decode() == month_field(at)


async def test_month_helpers(redis_client) -> None:
    assert month_bounds("2026-12") == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    await raise_spend_to(redis_client, 5, "2026-09", 1)
    await raise_spend_to(redis_client, 5, "2026-10", 2)
    assert await drop_months_before(redis_client, 5, "2026-10") == 1
    assert await month_to_date_spend(redis_client, 5, "2026-09") == 0
    assert await month_to_date_spend(redis_client, 5, "2026-10") == 2


async def test_flush_and_reconcile_tasks_end_to_end(new_database, service_settings, redis_client) -> None:
    settings = service_settings.model_copy(update={"database_url": new_database})
    db = Database(new_database, pool_size=1)
    try:
        async with db.session() as session:
            tenant = await create_tenant(session)
        for i in range(7):
            await append_usage(redis_client, UsageRecord.of(
                request_id=f"task-{i}", tenant_id=tenant.id, api_key_id=None, model="tiny",
                request_class="batch", tier="flex", prompt_tokens=10, cached_tokens=0, completion_tokens=i,
                cost_pico_usd=1_000 + i, status="completed", ttft_ms=None, tpot_ms=None,
                created_at=datetime.now(UTC)))
        result = await flush_usage_once(settings)
        assert (result["inserted"], result["postponed"]) == (7, 0)
        assert await reconcile_spend_once(settings) == 1
        async with db.session() as session:
            assert await session.scalar(select(func.count()).select_from(UsageEvent)) == 7
        month = month_field(datetime.now(UTC))
        assert await month_to_date_spend(redis_client, tenant.id, month) == sum(1_000 + i for i in range(7))
        assert await redis_client.xlen(USAGE_STREAM) == 0
    finally:
        await db.dispose()
    schedule = beat_schedule(settings)
    assert schedule["billing.flush_usage"]["schedule"] == settings.usage_flush_interval_s


def test_prices_cli_sets_exact_prices_and_refuses_fractions(new_database, settings, monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    get_settings.cache_clear()
    runner = CliRunner()
    result = runner.invoke(cli, ["prices", "set", "cli-model", "--input", "3", "--output", "15",
                                 "--effective-from", "2099-01-01T00:00:00"])
    assert result.exit_code == 0, result.output
    assert "input=$3/Mtok cached_input=$0.3/Mtok output=$15/Mtok batch_input=$1.5/Mtok" in result.output
    result = runner.invoke(cli, ["prices", "list", "cli-model"])
    assert "2099-01-01T00:00:00+00:00" in result.output and "batch_output=$7.5/Mtok" in result.output
    result = runner.invoke(cli, ["prices", "set", "cli-model", "--input", "0.0000001", "--output", "1"])
    assert result.exit_code == 2 and "not a whole number of pico-USD" in result.output
    # A row not yet in effect may be replaced; a past start is refused like the admin API refuses it.
    result = runner.invoke(cli, ["prices", "set", "cli-model", "--input", "4", "--output", "16",
                                 "--effective-from", "2099-01-01T00:00:00Z"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["prices", "set", "cli-model", "--input", "5", "--output", "17",
                                 "--effective-from", "2026-01-01T00:00:00"])
    assert result.exit_code == 2 and "--effective-from" in result.output and "in the past" in result.output
    result = runner.invoke(cli, ["prices", "list", "cli-model"])
    assert result.output.count("cli-model") == 1 and "input=$4/Mtok" in result.output
    # Far enough ahead that a time zone carries it past year 9999: refused (stored, it broke every
    # gateway's price book refresh, and the admin API's list).
    result = runner.invoke(cli, ["prices", "set", "cli-model", "--input", "5", "--output", "17",
                                 "--effective-from", "9999-12-31T23:59:59-05:00"])
    assert result.exit_code == 2 and "--effective-from" in result.output and "before 3000" in result.output
    # Each price set is in the audit log, as the admin API's are.
    audited = asyncio.run(_audit_rows(new_database, "price.set"))
    assert [(a.startswith("cli:"), d["model"], d["pico_usd_per_token"]["input"]) for a, d in audited] == [
        (True, "cli-model", 3_000_000), (True, "cli-model", 4_000_000)]

    result = runner.invoke(cli, ["prices", "set", "cli-embedder", "--input", "3", "--output", "15",
                                 "--embedding-input", "0.02"])
    assert result.exit_code == 0, result.output
    assert "embedding_input=$0.02/Mtok batch_embedding_input=$0.01/Mtok" in result.output
    result = runner.invoke(cli, ["prices", "set", "cli-embedder", "--input", "3", "--output", "15",
                                 "--embedding-input", "0.02", "--batch-embedding-input", "0.018",
                                 "--effective-from", "2099-01-01T00:00:00"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(cli, ["prices", "list", "cli-embedder"])
    assert result.output.count("batch_embedding_input=$0.01/Mtok") == 1
    assert "batch_embedding_input=$0.018/Mtok" in result.output
    result = runner.invoke(cli, ["prices", "set", "cli-embedder", "--input", "3", "--output", "15",
                                 "--embedding-input", "0.0000001"])
    assert result.exit_code == 2 and "--embedding-input" in result.output


async def _audit_rows(database_url: str, action: str) -> list[tuple[str, dict]]:
    from tollgate.db import Database
    from tollgate.models import AuditLog

    db = Database(database_url)
    try:
        async with db.session() as session:
            rows = await session.scalars(select(AuditLog).where(AuditLog.action == action)
                                         .order_by(AuditLog.id))
            return [(row.actor, row.details) for row in rows]
    finally:
        await db.dispose()


def test_prices_cli_sets_the_cache_prices(new_database, settings, monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    get_settings.cache_clear()
    runner = CliRunner()
    result = runner.invoke(cli, ["prices", "set", "cli-cacher", "--input", "3", "--output", "15"])
    assert result.exit_code == 0, result.output
    assert ("cache_write=$0/Mtok cache_pin=$0/Mtok cache_retention=$0/Mtok batch_cache_write=$0/Mtok "
            "batch_cache_pin=$0/Mtok batch_cache_retention=$0/Mtok") in result.output
    result = runner.invoke(cli, ["prices", "set", "cli-cacher", "--input", "3", "--output", "15",
                                 "--cache-write", "3.75", "--cache-pin", "0.3", "--cache-retention", "0.1",
                                 "--batch-cache-pin", "0.2", "--effective-from", "2099-01-01T00:00:00"])
    assert result.exit_code == 0, result.output
    assert ("cache_write=$3.75/Mtok cache_pin=$0.3/Mtok cache_retention=$0.1/Mtok "
            "batch_cache_write=$1.875/Mtok batch_cache_pin=$0.2/Mtok batch_cache_retention=$0.05/Mtok"
            ) in result.output
    result = runner.invoke(cli, ["prices", "list", "cli-cacher"])
    assert result.output.count("cli-cacher") == 2 and "batch_cache_write=$1.875/Mtok" in result.output
    for flag in ("--cache-write", "--cache-pin", "--cache-retention", "--batch-cache-write",
                 "--batch-cache-pin", "--batch-cache-retention"):
        result = runner.invoke(cli, ["prices", "set", "cli-cacher", "--input", "3", "--output", "15",
                                     flag, "0.0000001"])
        assert result.exit_code == 2 and flag in result.output and "not a whole number" in result.output


def test_celery_tasks_run_in_a_worker_process_runtime(new_database, service_settings, monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    get_settings.cache_clear()

    async def seed() -> int:
        db = Database(new_database, pool_size=1)
        try:
            async with db.session() as session:
                return (await create_tenant(session)).id
        finally:
            await db.dispose()

    tenant_id = asyncio.run(seed())
    client = redis.Redis.from_url(service_settings.redis_url)
    client.flushdb()
    rec = UsageRecord.of(request_id="celery-1", tenant_id=tenant_id, api_key_id=None, model="tiny",
                      request_class="interactive", tier="default", prompt_tokens=5, cached_tokens=0,
                      completion_tokens=5, cost_pico_usd=42, status="completed", ttft_ms=None, tpot_ms=None,
                      created_at=datetime.now(UTC))
    client.xadd(USAGE_STREAM, {b"r": rec.to_json()})
    try:
        first = tasks.flush_usage_task.apply().get()
        client.xadd(USAGE_STREAM, {b"r": rec.to_json()})
        second = tasks.flush_usage_task.apply().get()  # same process runtime, reused connections
        assert (first["inserted"], second["inserted"], second["duplicates"]) == (1, 0, 1)
        assert tasks.reconcile_spend_task.apply().get() == 1
        assert client.hget(f"tollgate:spend:{{t{tenant_id}}}", month_field(datetime.now(UTC))) == b"42"
    finally:
        tasks.shutdown_process_runtime()
        client.close()
