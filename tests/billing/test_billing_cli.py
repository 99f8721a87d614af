"""``tollgate billing setup-stripe|attach|export-stripe`` against the local Stripe double, and
``tollgate statements`` (table, JSON, CSV) on a committed database."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import orjson
import pytest
from click.testing import CliRunner

from billing.ledger import UsageFlusher
from billing.outbox import UsageRecord, append_usage
from billing.prices import Price, cost_pico_usd
from tests.billing.fake_stripe import FakeStripe
from tests.factories import create_price, create_tenant
from tollgate.cli import main as cli
from tollgate.db import Database
from tollgate.redis import create_redis
from tollgate.settings import get_settings

PRICE = Price.of(input=3_000_000, output=15_000_000)


@pytest.fixture
def fake_stripe() -> Iterator[FakeStripe]:
    fake = FakeStripe().start()
    yield fake
    fake.stop()


async def _seed(database_url: str, name: str) -> int:
    settings = get_settings()
    db, redis = Database(database_url, pool_size=2), create_redis(settings)
    try:
        async with db.session() as session:
            tenant = await create_tenant(session, name=name)
            await create_price(session, model="tiny")
        now = datetime.now(UTC)
        for i, (klass, prompt, cached, completion) in enumerate(
                [("interactive", 1200, 300, 80), ("batch", 5000, 0, 700), ("interactive", 33, 33, 1)]):
            await append_usage(redis, UsageRecord.of(
                request_id=f"cli-{name}-{i}", tenant_id=tenant.id, api_key_id=None, model="tiny",
                request_class=klass, tier="default", prompt_tokens=prompt, cached_tokens=cached,
                completion_tokens=completion,
                cost_pico_usd=cost_pico_usd(PRICE, prompt, cached, completion, klass), status="completed",
                ttft_ms=None, tpot_ms=None, created_at=now - timedelta(seconds=5)))
        assert (await UsageFlusher(redis, db.session, consumer="cli-test").flush()).inserted == 3
        return tenant.id
    finally:
        await redis.aclose()
        await db.dispose()


def test_billing_commands_and_statements(new_database, service_settings, fake_stripe, monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    monkeypatch.setenv("TOLLGATE_STRIPE_API_KEY", "sk_test_cli")
    monkeypatch.setenv("TOLLGATE_STRIPE_API_BASE", fake_stripe.url)
    get_settings.cache_clear()
    tenant_id = asyncio.run(_seed(new_database, "acme-cli"))
    runner = CliRunner()

    result = runner.invoke(cli, ["billing", "attach", "acme-cli"])
    assert result.exit_code == 1 and "setup-stripe" in result.output  # not provisioned yet
    result = runner.invoke(cli, ["billing", "setup-stripe"])
    assert result.exit_code == 0 and result.output.startswith("created: meter mtr_"), result.output
    assert runner.invoke(cli, ["billing", "setup-stripe"]).output.startswith("already provisioned")
    result = runner.invoke(cli, ["billing", "attach", "acme-cli"])
    assert result.exit_code == 0 and f"tenant {tenant_id} attached: customer cus_" in result.output
    assert len(fake_stripe.customers) == len(fake_stripe.subscriptions) == 1

    result = runner.invoke(cli, ["billing", "export-stripe"])  # the beat's horizon: this hour is not over
    assert result.exit_code == 0 and result.output.startswith("planned 0, sent 0"), result.output
    result = runner.invoke(cli, ["billing", "export-stripe", "--until", "now"])
    assert result.exit_code == 0 and result.output.startswith("planned 1, sent 1"), result.output
    assert runner.invoke(cli, ["billing", "export-stripe", "--until", "now"]).output.startswith("planned 0")
    [event] = fake_stripe.meter_events

    month = datetime.now(UTC).strftime("%Y-%m")
    result = runner.invoke(cli, ["statements", "acme-cli", "--month", month, "--format", "json"])
    assert result.exit_code == 0, result.output
    statement = orjson.loads(result.output)
    expected = sum(cost_pico_usd(PRICE, p, c, o, k) for k, p, c, o in
                   [("interactive", 1200, 300, 80), ("batch", 5000, 0, 700), ("interactive", 33, 33, 1)])
    assert statement["total_pico_usd"] == expected
    assert int(event["payload"]["value"]) == expected // 1_000_000
    assert sum(line["amount_cents"] for line in statement["lines"]) == statement["total_cents"]
    assert [(line["request_class"], line["token_kind"]) for line in statement["lines"]] == [
        ("interactive", "input"), ("interactive", "cached_input"), ("interactive", "output"),
        ("batch", "input"), ("batch", "output")]

    rows = list(csv.reader(io.StringIO(runner.invoke(
        cli, ["statements", str(tenant_id), "--month", month, "--format", "csv"]).output)))
    assert rows[0][:3] == ["tenant", "month", "model"] and rows[-1][2] == "TOTAL"
    assert int(rows[-1][6]) == expected
    table = runner.invoke(cli, ["statements", "acme-cli", "--month", month]).output
    assert f"exact total: {expected} pico-USD" in table
    assert runner.invoke(cli, ["statements", "nobody", "--month", month]).exit_code == 1
    assert runner.invoke(cli, ["statements", "acme-cli", "--month", "2026-13"]).exit_code == 1

    result = runner.invoke(cli, ["billing", "alert-webhook", "acme-cli", "https://hooks.example.com/budget"])
    assert result.exit_code == 0 and "signing secret: tgwhsec_" in result.output, result.output
    assert runner.invoke(cli, ["billing", "alert-webhook", "acme-cli", "ftp://nope"]).exit_code == 1
    assert runner.invoke(cli, ["billing", "alert-webhook", "acme-cli", "--clear"]).output.startswith(
        "alert webhook cleared")


def test_an_exporter_killed_after_stripe_accepted_is_retried_without_a_second_event(
        new_database, service_settings, fake_stripe, monkeypatch) -> None:
    monkeypatch.setenv("TOLLGATE_DATABASE_URL", new_database)
    monkeypatch.setenv("TOLLGATE_STRIPE_API_KEY", "sk_test_crash")
    monkeypatch.setenv("TOLLGATE_STRIPE_API_BASE", fake_stripe.url)
    monkeypatch.setenv("TOLLGATE_STRIPE_MAX_NETWORK_RETRIES", "0")
    get_settings.cache_clear()
    asyncio.run(_seed(new_database, "acme-crash"))
    runner = CliRunner()
    assert runner.invoke(cli, ["billing", "setup-stripe"]).exit_code == 0
    assert runner.invoke(cli, ["billing", "attach", "acme-crash"]).exit_code == 0

    # Stripe accepts the event, and the exporter process dies before it hears back and records it.
    fake_stripe.hold_after_processing(1)
    proc = subprocess.Popen([sys.executable, "-c", "from tollgate.cli import main; main()", "billing",
                             "export-stripe", "--until", "now"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        assert fake_stripe.holding.wait(timeout=60), "the exporter never reached Stripe"
    finally:
        proc.kill()
        proc.wait()
    [accepted] = fake_stripe.meter_events

    result = runner.invoke(cli, ["billing", "export-stripe", "--until", "now"])  # the next run
    assert result.exit_code == 0 and result.output.startswith("planned 0, sent 1"), result.output
    assert fake_stripe.meter_events == [accepted]  # the retry was answered from the Idempotency-Key
    assert fake_stripe.replays == 1
    assert runner.invoke(cli, ["billing", "export-stripe", "--until", "now"]).output.startswith(
        "planned 0, sent 0")
