"""Rollups equal the ledger after concurrent flushers (and a reconcile running among them), the reconcile
repairs gaps, the kind split (the prompt-cache products included) is exact across a price change,
statements add up to the ledger to the pico-USD with cents carried, the accepted and rejected prediction
tokens are summed like the other counts (rollups, reconcile, statements' output lines), and the monthly
partitions take rows out of the default partition."""

from __future__ import annotations

import asyncio
import csv
import io
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta

from sqlalchemy import Numeric, cast, delete, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from billing.ledger import UsageFlusher
from billing.outbox import PREDICTION_TOKEN_FIELDS, UsageRecord, append_usage
from billing.partitions import ensure_usage_partitions
from billing.prices import CACHE_TOKEN_FIELDS, Price, charge, cost_pico_usd
from billing.rollups import find_rollup_mismatches, hour_of, reconcile_rollups
from billing.statements import TOKEN_KINDS, build_statement, carry_rounding, usd_exact
from engine.usage import COST_FIELDS, PRICED_KINDS, Usage
from tests.factories import create_price, create_tenant, create_usage_event
from tollgate.db import Database
from tollgate.models import UsageEvent, UsageHourly

PRICES = {"alpha": Price.of(input=3_000_000, output=15_000_000, cache_write=3_750_001, cache_pin=300_000,
                            cache_retention=100_003),
          "beta": Price.of(input=250_000, output=1_250_003, cached_input=31_111)}
CACHE_PRICE_FIELDS = ("cache_write", "cache_pin", "cache_retention")
MONTH_START = datetime(2026, 10, 1, tzinfo=UTC)


def make_records(tenant_ids: list[int], count: int, seed: int) -> list[UsageRecord]:
    rng = random.Random(seed)
    records = []
    for i in range(count):
        model = rng.choice(list(PRICES))
        klass = rng.choice(["interactive", "interactive", "batch"])
        prompt = rng.randint(0, 5000)
        cached = rng.randint(0, prompt)
        completion = rng.randint(0, 900)
        held = rng.choice([0, prompt // 16 * 16])
        cache_tokens = {"cache_write_tokens": (prompt - cached) // 16 * 16, "cache_pinned_tokens": held,
                        "cache_retained_tokens": rng.choice([0, held])}
        # Some requests had a prediction: of the completion, some accepted and some rejected tokens.
        rejected = rng.choice([0, rng.randint(0, completion)])
        predicted = {"accepted_prediction_tokens": rng.choice([0, rng.randint(0, completion - rejected)]),
                     "rejected_prediction_tokens": rejected}
        at = MONTH_START + timedelta(days=rng.choice([0, 14, 30]), hours=rng.randint(0, 3),
                                     seconds=rng.randint(0, 3599))
        records.append(UsageRecord.of(
            request_id=f"r{seed}-{i}", tenant_id=rng.choice(tenant_ids), api_key_id=None, model=model,
            request_class=klass, tier="default", prompt_tokens=prompt, cached_tokens=cached,
            completion_tokens=completion,
            cost_pico_usd=cost_pico_usd(PRICES[model], prompt, cached, completion, klass, **cache_tokens),
            status="completed", ttft_ms=None, tpot_ms=None, created_at=at, **cache_tokens, **predicted))
    return records


async def ledger_buckets(session, tenant_ids: list[int]) -> dict[tuple, tuple]:
    hour = func.date_trunc("hour", UsageEvent.created_at, "UTC")
    rows = await session.execute(
        select(UsageEvent.tenant_id, hour, UsageEvent.model, UsageEvent.request_class, func.count(),
               func.sum(UsageEvent.prompt_tokens - UsageEvent.cached_tokens),
               func.sum(UsageEvent.cached_tokens),
               func.sum(UsageEvent.completion_tokens),
               *(func.sum(getattr(UsageEvent, name)) for name in CACHE_TOKEN_FIELDS),
               func.sum(cast(UsageEvent.cost_pico_usd, Numeric)),
               *(func.sum(getattr(UsageEvent, name)) for name in PREDICTION_TOKEN_FIELDS))
        .where(UsageEvent.tenant_id.in_(tenant_ids))
        .group_by(UsageEvent.tenant_id, hour, UsageEvent.model, UsageEvent.request_class))
    return {(t, hour_of(h), m, c): tuple(int(v) for v in rest) for t, h, m, c, *rest in rows.all()}


async def rollup_buckets(session, tenant_ids: list[int]) -> dict[tuple, tuple]:
    rows = (await session.scalars(select(UsageHourly).where(UsageHourly.tenant_id.in_(tenant_ids)))).all()
    for r in rows:  # the kind split always adds up to the ledger cost
        assert sum(getattr(r, name) for name in COST_FIELDS) == r.cost_pico_usd
    return {(r.tenant_id, hour_of(r.hour), r.model, r.request_class):
            (r.requests, r.prompt_tokens - r.cached_tokens, r.cached_tokens, r.completion_tokens,
             *(getattr(r, name) for name in (*CACHE_TOKEN_FIELDS, "cost_pico_usd", *PREDICTION_TOKEN_FIELDS)))
            for r in rows}


async def cache_costs_by_kind(session, tenant_ids: list[int]) -> dict[tuple, list[int]]:
    """Per (tenant, hour, model, class): the cache products' rolled-up costs."""
    rows = (await session.scalars(select(UsageHourly).where(UsageHourly.tenant_id.in_(tenant_ids)))).all()
    return {(r.tenant_id, hour_of(r.hour), r.model, r.request_class):
            [getattr(r, name) for name in COST_FIELDS[3:]] for r in rows}


async def test_rollups_equal_the_ledger_after_concurrent_writers_and_reconciles(new_database,
                                                                                 redis_client) -> None:
    db = Database(new_database, pool_size=8)
    try:
        async with db.session() as session:
            tenants = [(await create_tenant(session)).id for _ in range(3)]
            for model, price in PRICES.items():
                await create_price(session, model=model, input=price.input, output=price.output,
                                   cached_input=price.cached_input,
                                   **{name: getattr(price, name) for name in CACHE_PRICE_FIELDS})
        records = make_records(tenants, 600, seed=1)
        for rec in records + records[:50]:  # some appended twice (gateway retries)
            await append_usage(redis_client, rec)
        # Every flusher transaction is counted; after the first one commits, the flushers start no other
        # until a reconcile run has begun: so at least one run happens amid the flush, with some batches
        # committed and others not, whatever the speed of the machine.
        commits = 0
        changed = asyncio.Event()  # a flusher committed, or the flush is over
        reconciled_amid_flush = asyncio.Event()

        @asynccontextmanager
        async def flusher_session() -> AsyncIterator[AsyncSession]:
            nonlocal commits
            if commits:
                await reconciled_amid_flush.wait()
            async with db.session() as session:
                yield session
            commits += 1
            changed.set()

        flushers = [UsageFlusher(redis_client, flusher_session, consumer=f"w{i}", batch_size=25)
                    for i in range(4)]
        done = asyncio.Event()
        runs: list[int] = []  # flusher commits before each reconcile run began
        seen_mismatches: list = []

        async def reconcile_meanwhile() -> None:
            while True:  # a run at once, another after each new commit, and a last one after the flush
                changed.clear()
                over = done.is_set()
                runs.append(commits)
                if commits:
                    reconciled_amid_flush.set()
                async with db.session() as session:  # the lock-free check never sees half a write
                    await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
                    seen_mismatches.extend(await find_rollup_mismatches(
                        session, MONTH_START, MONTH_START + timedelta(days=32)))
                async with db.session() as session:
                    await reconcile_rollups(session, MONTH_START, MONTH_START + timedelta(days=32))
                if over:
                    return
                await changed.wait()

        reconciler = asyncio.create_task(reconcile_meanwhile())
        results = await asyncio.gather(*(f.flush() for f in flushers))
        done.set()
        changed.set()
        await reconciler
        assert seen_mismatches == []
        assert runs[0] == 0 and any(0 < n < commits for n in runs) and runs[-1] == commits
        assert sum(r.inserted for r in results) == 600
        # Each cache product's cost, as the gateways billed it: its tokens at its (batch) price.
        cache_costs: dict[tuple, list[int]] = {}
        for rec in records:
            key = (rec.tenant_id, hour_of(rec.created_at), rec.model, rec.request_class)
            per_token = PRICES[rec.model].cache_for_class(rec.request_class)
            costs = cache_costs.setdefault(key, [0, 0, 0])
            for i, (name, price) in enumerate(zip(CACHE_TOKEN_FIELDS, per_token, strict=True)):
                costs[i] += getattr(rec, name) * price
        async with db.session() as session:
            ledger = await ledger_buckets(session, tenants)
            assert await rollup_buckets(session, tenants) == ledger
            assert sum(v[-3] for v in ledger.values()) == sum(r.cost_pico_usd for r in records)
            for i, name in enumerate(PREDICTION_TOKEN_FIELDS, start=-2):  # the prediction counts too
                assert sum(v[i] for v in ledger.values()) == sum(getattr(r, name) for r in records) > 0
            assert await cache_costs_by_kind(session, tenants) == cache_costs
            clean = await reconcile_rollups(session, MONTH_START, MONTH_START + timedelta(days=32),
                                            tenant_ids=tenants)
            assert (clean.repaired, clean.removed) == ([], [])

        # A gap (a lost bucket), a wrong bucket, one wrong only in a prediction count and a stray one: the
        # reconcile finds and repairs all four.
        async with db.session() as session:
            keys = sorted(ledger)
            lost, wrong, mispredicted = keys[0], keys[1], keys[2]
            rejected = UsageHourly.rejected_prediction_tokens
            await session.execute(update(UsageHourly).where(UsageHourly.tenant_id == mispredicted[0],
                                                            UsageHourly.hour == mispredicted[1],
                                                            UsageHourly.model == mispredicted[2],
                                                            UsageHourly.request_class == mispredicted[3])
                                  .values(rejected_prediction_tokens=rejected + 1))
            await session.execute(delete(UsageHourly).where(UsageHourly.tenant_id == lost[0],
                                                            UsageHourly.hour == lost[1],
                                                            UsageHourly.model == lost[2],
                                                            UsageHourly.request_class == lost[3]))
            await session.execute(update(UsageHourly).where(UsageHourly.tenant_id == wrong[0],
                                                            UsageHourly.hour == wrong[1],
                                                            UsageHourly.model == wrong[2],
                                                            UsageHourly.request_class == wrong[3])
                                  .values(cost_pico_usd=UsageHourly.cost_pico_usd + 1))
            session.add(UsageHourly(tenant_id=tenants[0], hour=MONTH_START + timedelta(days=5), model="alpha",
                                    request_class="batch", requests=1, prompt_tokens=1,
                                    input_cost_pico_usd=5, cost_pico_usd=5))
        async with db.session() as session:
            found = await find_rollup_mismatches(session, MONTH_START, MONTH_START + timedelta(days=32))
            assert len(found) == 4
        async with db.session() as session:
            fixed = await reconcile_rollups(session, MONTH_START, MONTH_START + timedelta(days=32))
            assert sorted(fixed.repaired) == sorted([lost, wrong, mispredicted])
            assert [k[1] for k in fixed.removed] == [MONTH_START + timedelta(days=5)]
        async with db.session() as session:
            assert await rollup_buckets(session, tenants) == ledger

            # Statements: totals equal the ledger exactly; shown cents carry the rounding to the total.
            for tenant_id in tenants:
                statement = await build_statement(session, tenant_id, "2026-10")
                exact = await session.scalar(select(func.sum(cast(UsageEvent.cost_pico_usd, Numeric))).where(
                    UsageEvent.tenant_id == tenant_id, UsageEvent.created_at >= MONTH_START,
                    UsageEvent.created_at < datetime(2026, 11, 1, tzinfo=UTC)))
                assert statement.total_pico_usd == int(exact)
                assert sum(line.amount_cents for line in statement.lines) == statement.total_cents
                assert statement.total_cents == (int(exact) + 5 * 10**9) // 10**10
                rows = list(csv.reader(io.StringIO(statement.to_csv())))
                assert rows[-1][2] == "TOTAL" and int(rows[-1][6]) == statement.total_pico_usd
                assert {line.token_kind for line in statement.lines} == set(TOKEN_KINDS)
                for i, kind in enumerate(("cache_write", "cache_pinned", "cache_retained")):
                    lines = [line for line in statement.lines if line.token_kind == kind]
                    assert sum(line.amount_pico_usd for line in lines) == sum(
                        costs[i] for key, costs in cache_costs.items() if key[0] == tenant_id)
                    assert sum(line.tokens for line in lines) == sum(
                        getattr(r, CACHE_TOKEN_FIELDS[i]) for r in records if r.tenant_id == tenant_id)
                assert {line.request_class for line in statement.lines} <= {"interactive", "batch"}
                # Output lines say how many of their tokens were accepted and rejected prediction tokens.
                mine = [r for r in records if r.tenant_id == tenant_id]
                outputs = {(line.model, line.request_class): line for line in statement.lines
                           if line.token_kind == "output"}
                for (model, klass), line in outputs.items():
                    of_line = [r for r in mine if (r.model, r.request_class) == (model, klass)]
                    assert line.tokens == sum(r.completion_tokens for r in of_line)
                    for name in PREDICTION_TOKEN_FIELDS:
                        assert getattr(line, name) == sum(getattr(r, name) for r in of_line)
                        assert line.as_dict()[name] == getattr(line, name)
                totals = {name: sum(getattr(r, name) for r in mine) for name in PREDICTION_TOKEN_FIELDS}
                assert statement.detail_totals() == totals
                assert {k: statement.as_dict()[k] for k in totals} == totals
                assert all(name not in line.as_dict() for line in statement.lines
                           if line.token_kind != "output" for name in PREDICTION_TOKEN_FIELDS)
                assert rows[0][-2:] == list(PREDICTION_TOKEN_FIELDS)
                assert [int(v) for v in rows[-1][-2:]] == list(totals.values())
                assert sum(int(row[-1] or 0) for row in rows[1:-1]) == totals["rejected_prediction_tokens"]
    finally:
        await db.dispose()


def test_cents_carry_the_rounding_to_the_total() -> None:
    # Three lines of 0.4 cent each: shown 0, 1, 0 cents, total 1 cent (rounding 0.4 each would show 0).
    assert carry_rounding([4 * 10**9] * 3) == [0, 1, 0]
    assert carry_rounding([5 * 10**9, 5 * 10**9]) == [1, 0]
    assert sum(carry_rounding([123_456_789_012, 987_654_321, 55])) == (123_456_789_012 + 987_654_321 + 55
                                                                        + 5 * 10**9) // 10**10


def test_exact_amounts_have_twelve_decimals_zero_included() -> None:
    assert [usd_exact(p) for p in (0, 1_234_567, 5 * 10**12 + 1)] == [
        "0.000000000000", "0.000001234567", "5.000000000001"]  # zero was "0E-12"


def test_a_charge_splits_the_cost_by_kind_at_the_price_given() -> None:
    old, new = Price.of(input=3_000_000, output=15_000_000), Price.of(input=2_000_000, output=9_000_000)
    usage = Usage.of(prompt_tokens=100, cached_tokens=40, completion_tokens=7)
    assert tuple(charge(usage, old, "interactive").costs.values()) == (
        60 * 3_000_000, 40 * 300_000, 7 * 15_000_000, 0, 0, 0)
    assert tuple(charge(usage, new, "interactive").costs.values()) == (
        60 * 2_000_000, 40 * 200_000, 7 * 9_000_000, 0, 0, 0)
    assert charge(usage, old, "interactive").total == cost_pico_usd(old, 100, 40, 7, "interactive")


def test_an_embeddings_charge_is_all_input_at_the_embedding_price() -> None:
    price = Price.of(input=3_000_000, output=15_000_000, embedding_input=20_000)
    usage = Usage.of(prompt_tokens=100, cached_tokens=40)
    embedding = charge(usage, price, "batch", embedding=True)
    assert tuple(embedding.costs.values()) == (100 * 10_000, 0, 0, 0, 0, 0)
    # a generation that stopped at once
    assert tuple(charge(usage, price, "batch").costs.values()) == (60 * 1_500_000, 40 * 150_000, 0, 0, 0, 0)


def test_the_cache_products_are_charged_at_their_prices() -> None:
    old = Price.of(input=3_000_000, output=15_000_000, cache_write=3_750_000, cache_pin=300_000,
                   cache_retention=100_000)
    new = Price.of(input=3_000_000, output=15_000_000, cache_write=1_000_000, cache_pin=500_000)
    assert [k.value for k in PRICED_KINDS] == ["input", "cached_input", "output", "cache_write",
                                               "cache_pinned", "cache_retained"]
    usage = Usage.of(prompt_tokens=100, cached_tokens=40, cache_write_tokens=48, cache_pinned_tokens=96,
                     cache_retained_tokens=80)
    assert tuple(charge(usage, old, "batch").costs.values()) == (
        60 * 1_500_000, 40 * 150_000, 0, 48 * 1_875_000, 96 * 150_000, 80 * 50_000)
    assert tuple(charge(usage, new, "batch").costs.values()) == (
        60 * 1_500_000, 40 * 150_000, 0, 48 * 500_000, 96 * 250_000, 0)


async def test_monthly_partitions_take_their_rows_out_of_the_default_partition(db_session) -> None:
    tenant = await create_tenant(db_session)
    far = datetime(2031, 3, 15, tzinfo=UTC)
    event = await create_usage_event(db_session, tenant, created_at=far)
    where = text("SELECT tableoid::regclass::text FROM usage_events WHERE id = :id")
    assert (await db_session.scalar(where, {"id": event.id})) == "usage_partitions.usage_events_default"
    created = await ensure_usage_partitions(db_session, at=far, months_ahead=1)
    assert created == ["usage_events_2031_03", "usage_events_2031_04"]
    assert (await db_session.scalar(where, {"id": event.id})) == "usage_partitions.usage_events_2031_03"
    assert await ensure_usage_partitions(db_session, at=far, months_ahead=1) == []
