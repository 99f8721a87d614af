"""Usage export to Stripe, driven through the real ``stripe`` SDK against a local server that behaves like
Stripe (``fake_stripe``): every (tenant, hour) once, totals within a micro-USD of the ledger, exactly one
accepted event per identifier through 500s and lost answers, late usage as a new revision, corrections
as balance credits, and a second run that sends nothing."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import delete, func, select

from billing.rollups import hour_of
from billing.stripe_billing import attach_tenant, make_client, setup_stripe
from billing.stripe_export import export_to_stripe, identifier_for, plan_exports, send_pending
from tests.billing.fake_stripe import FakeStripe
from tests.factories import create_tenant, create_usage_event
from tollgate.models import StripeExport, UsageEvent
from tollgate.settings import Settings

NOW = datetime.now(UTC)
BASE = hour_of(NOW) - timedelta(hours=12)
# Costs that are not whole micro-USD, so the carried remainder matters (pico-USD).
COSTS = [1_234_567_891, 7_654_321, 999_999, 3_000_000_000_001, 500_000, 42]


@pytest.fixture
def fake_stripe() -> Iterator[FakeStripe]:
    fake = FakeStripe().start()
    yield fake
    fake.stop()


@pytest.fixture
def stripe_settings(fake_stripe: FakeStripe) -> Settings:
    return Settings(environment="test", stripe_api_key="sk_test_tollgate", stripe_api_base=fake_stripe.url,
                    stripe_max_network_retries=0)


async def attached_tenant(db_session, client, *, since: datetime = BASE):
    tenant = await create_tenant(db_session)
    await attach_tenant(db_session, client, tenant.name, now=since)
    return tenant


async def usage(db_session, tenant, hour_offset: int, cost: int, minute: int = 7) -> UsageEvent:
    return await create_usage_event(db_session, tenant, cost_pico_usd=cost,
                                    created_at=BASE + timedelta(hours=hour_offset, minutes=minute))


async def ledger_total(db_session, tenant_id: int) -> int:
    return int(await db_session.scalar(select(func.coalesce(func.sum(UsageEvent.cost_pico_usd), 0))
                                       .where(UsageEvent.tenant_id == tenant_id)))


def events_by_identifier(fake: FakeStripe) -> Counter[str]:
    return Counter(e["identifier"] for e in fake.meter_events)


async def test_every_tenant_hour_once_totals_within_a_micro_usd_and_a_second_run_sends_nothing(
        db_session, unit_of_work, fake_stripe, stripe_settings) -> None:
    client = make_client(stripe_settings)
    await setup_stripe(db_session, client, stripe_settings)
    tenants = [await attached_tenant(db_session, client) for _ in range(2)]
    unattached = await create_tenant(db_session)
    expected: set[str] = set()
    for t_index, tenant in enumerate(tenants):
        for offset, cost in enumerate(COSTS):
            hour = offset * 2 + t_index
            await usage(db_session, tenant, hour, cost)
            await usage(db_session, tenant, hour, cost // 3 + 1, minute=50)
            expected.add(identifier_for(tenant.id, BASE + timedelta(hours=hour), 1))
    await usage(db_session, unattached, 1, 10**12)
    before_attach = await create_usage_event(db_session, tenants[0], cost_pico_usd=10**12,
                                             created_at=BASE - timedelta(minutes=1))
    assert before_attach.created_at < BASE  # usage before the tenant was attached is not exported

    result = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (result.planned, result.sent, result.failed) == (len(expected), len(expected), 0)
    assert events_by_identifier(fake_stripe) == Counter({identifier: 1 for identifier in expected})
    for tenant in tenants:
        ledger = await ledger_total(db_session, tenant.id) - 10**12 * (tenant is tenants[0])
        sent_micro = fake_stripe.meter_total(tenant.stripe_customer_id)
        assert 0 <= ledger - sent_micro * 1_000_000 < 1_000_000
    assert {e["payload"]["stripe_customer_id"] for e in fake_stripe.meter_events} == {
        t.stripe_customer_id for t in tenants}

    requests_before = len(fake_stripe.requests)
    again = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (again.planned, again.sent, again.failed) == (0, 0, 0)
    assert len(fake_stripe.requests) == requests_before


async def test_server_errors_and_lost_answers_still_give_one_event_per_identifier(
        db_session, unit_of_work, fake_stripe, stripe_settings) -> None:
    client = make_client(stripe_settings)
    await setup_stripe(db_session, client, stripe_settings)
    tenant = await attached_tenant(db_session, client)
    for offset, cost in enumerate(COSTS):
        await usage(db_session, tenant, offset, cost)

    fake_stripe.fail_next(2)  # two 500s: not processed by Stripe
    fake_stripe.drop_after_processing(1)  # accepted by Stripe, answer lost (crash before recording)
    first = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (first.planned, first.sent, first.failed) == (len(COSTS), len(COSTS) - 3, 3)
    pending = (await db_session.scalars(select(StripeExport).where(StripeExport.status == "pending"))).all()
    assert len(pending) == 3 and all(row.attempts == 1 and row.last_error for row in pending)
    assert len(fake_stripe.meter_events) == len(COSTS) - 2  # the lost answer's event is at Stripe

    # The retry resends the same Idempotency-Key: Stripe replays the accepted answer, nothing doubles.
    second = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (second.planned, second.sent, second.failed) == (0, 3, 0)
    assert set(events_by_identifier(fake_stripe).values()) == {1}
    assert len(fake_stripe.meter_events) == len(COSTS)
    assert fake_stripe.rejected_identifiers == []

    # Lost answer again, and by the retry Stripe has forgotten the key: the identifier itself is refused
    # as a duplicate, which proves the event was accepted; the row is marked sent, nothing doubles.
    await usage(db_session, tenant, 0, 5_555_555_555)
    fake_stripe.drop_after_processing(1)
    third = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (third.planned, third.sent, third.failed) == (1, 0, 1)
    fake_stripe.forget_idempotency_keys()
    fourth = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (fourth.sent, fourth.failed) == (1, 0)
    assert fake_stripe.rejected_identifiers == [identifier_for(tenant.id, BASE, 2)]
    assert set(events_by_identifier(fake_stripe).values()) == {1}
    ledger = await ledger_total(db_session, tenant.id)
    assert 0 <= ledger - fake_stripe.meter_total(tenant.stripe_customer_id) * 1_000_000 < 1_000_000


async def test_rows_that_keep_failing_do_not_hold_back_new_ones(db_session, unit_of_work, fake_stripe,
                                                                stripe_settings) -> None:
    """A run sends the least tried rows first: rows refused again and again stay pending with their error,
    and a run limited to fewer rows than them still sends the new one."""
    client = make_client(stripe_settings)
    await setup_stripe(db_session, client, stripe_settings)
    tenant = await attached_tenant(db_session, client)
    for offset in range(3):
        await usage(db_session, tenant, offset, COSTS[offset])
    fake_stripe.fail_next(3)
    first = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (first.planned, first.sent, first.failed) == (3, 0, 3)
    await usage(db_session, tenant, 5, COSTS[3])
    async with unit_of_work() as session:
        assert len((await plan_exports(session, until=NOW)).rows) == 1
    sent = await send_pending(unit_of_work, client, limit=1)
    assert (sent.sent, sent.failed) == (1, 0)
    newest = identifier_for(tenant.id, BASE + timedelta(hours=5), 1)
    assert list(events_by_identifier(fake_stripe)) == [newest]


async def test_sdk_retries_a_lost_answer_with_the_same_idempotency_key(db_session, unit_of_work, fake_stripe,
                                                                       stripe_settings) -> None:
    client = make_client(stripe_settings.model_copy(update={"stripe_max_network_retries": 2}))
    await setup_stripe(db_session, client, stripe_settings)
    tenant = await attached_tenant(db_session, client)
    await usage(db_session, tenant, 3, 123_456_789_012)
    fake_stripe.drop_after_processing(1)
    fake_stripe.fail_next(1)
    result = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (result.sent, result.failed) == (1, 0)
    assert events_by_identifier(fake_stripe) == Counter({identifier_for(tenant.id, BASE + timedelta(hours=3),
                                                                        1): 1})
    assert fake_stripe.meter_events[0]["payload"]["value"] == "123456"


async def test_late_usage_is_a_delta_under_the_next_revision(db_session, unit_of_work, fake_stripe,
                                                             stripe_settings) -> None:
    client = make_client(stripe_settings)
    await setup_stripe(db_session, client, stripe_settings)
    tenant = await attached_tenant(db_session, client)
    await usage(db_session, tenant, 1, 2_500_000_700)  # 2500.0007 micro-USD
    await usage(db_session, tenant, 2, 1_000_000_400)
    # The running hour is exported too, with what it has so far.
    running = await create_usage_event(db_session, tenant, cost_pico_usd=3_000_000,
                                       created_at=NOW - timedelta(seconds=1))
    await export_to_stripe(unit_of_work, client, until=NOW)
    values = {e["identifier"]: int(e["payload"]["value"]) for e in fake_stripe.meter_events}
    assert values == {identifier_for(tenant.id, BASE + timedelta(hours=1), 1): 2500,
                      identifier_for(tenant.id, BASE + timedelta(hours=2), 1): 1000,  # carry 0.0011 micro
                      identifier_for(tenant.id, hour_of(running.created_at), 1): 3}

    await usage(db_session, tenant, 1, 999_000, minute=59)  # arrives after hour 1 was exported
    late = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (late.planned, late.sent) == (1, 1)
    delta = fake_stripe.meter_events[-1]
    assert delta["identifier"] == identifier_for(tenant.id, BASE + timedelta(hours=1), 2)
    assert delta["payload"]["value"] == "1"  # 0.999 + 0.0011 carried → 1 whole micro-USD
    assert set(events_by_identifier(fake_stripe).values()) == {1}
    ledger = await ledger_total(db_session, tenant.id)
    assert 0 <= ledger - fake_stripe.meter_total(tenant.stripe_customer_id) * 1_000_000 < 1_000_000
    assert (await export_to_stripe(unit_of_work, client, until=NOW)).planned == 0


async def test_a_negative_correction_becomes_a_balance_credit_never_a_duplicate(
        db_session, unit_of_work, fake_stripe, stripe_settings) -> None:
    client = make_client(stripe_settings)
    await setup_stripe(db_session, client, stripe_settings)
    tenant = await attached_tenant(db_session, client)
    await usage(db_session, tenant, 1, 10_000_000_000)
    wrong = await usage(db_session, tenant, 1, 25_000_000_000, minute=30)  # 2.5 cents, to be corrected
    await export_to_stripe(unit_of_work, client, until=NOW)
    assert fake_stripe.meter_total(tenant.stripe_customer_id) == 35_000

    await db_session.execute(delete(UsageEvent).where(UsageEvent.id == wrong.id))  # operator correction
    result = await export_to_stripe(unit_of_work, client, until=NOW)
    assert (result.planned, result.sent) == (1, 1)
    assert len(fake_stripe.meter_events) == 1
    [credit] = fake_stripe.balance_transactions
    assert (credit["amount"], credit["customer"]) == (-2, tenant.stripe_customer_id)  # two whole cents
    row = await db_session.scalar(select(StripeExport).where(StripeExport.revision == 2))
    assert (row.kind, row.amount_pico_usd, row.value_micro_usd) == ("credit", -25_000_000_000, -20_000)
    # The half cent still owed back is absorbed by the next usage: it reports 0 until it is used up.
    await usage(db_session, tenant, 2, 4_000_000_000)  # 4000 micro-USD < 5000 owed
    await usage(db_session, tenant, 3, 3_000_000_000)
    await export_to_stripe(unit_of_work, client, until=NOW)
    values = [int(e["payload"]["value"]) for e in fake_stripe.meter_events]
    assert values == [35_000, 0, 2_000]
    net_micro = sum(values) + sum(t["amount"] for t in fake_stripe.balance_transactions) * 10_000
    assert net_micro * 1_000_000 == await ledger_total(db_session, tenant.id)


async def test_setup_and_attach_create_stripe_objects_once(db_session, fake_stripe, stripe_settings) -> None:
    client = make_client(stripe_settings)
    first = await setup_stripe(db_session, client, stripe_settings)
    second = await setup_stripe(db_session, client, stripe_settings)
    assert first.created and not second.created and first.price_id == second.price_id
    assert (len(fake_stripe.meters), len(fake_stripe.products), len(fake_stripe.prices)) == (1, 1, 1)
    price = fake_stripe.prices[first.price_id]
    assert price["recurring"]["meter"] == first.meter_id and price["unit_amount_decimal"] == "0.0001"
    meter = fake_stripe.meters[first.meter_id]
    assert meter["event_name"] == "tollgate_usage" and meter["default_aggregation"]["formula"] == "sum"
    tenant = await create_tenant(db_session)
    a = await attach_tenant(db_session, client, tenant.name)
    b = await attach_tenant(db_session, client, str(tenant.id))
    assert a.created and not b.created and a.customer_id == b.customer_id
    assert (len(fake_stripe.customers), len(fake_stripe.subscriptions)) == (1, 1)
