"""Budget alerts at 80 % and 100 % (once per month each, signed webhooks retried until delivered) and the
cap itself: admission answers 429 insufficient_quota once the month's budget is spent, until it is raised."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import orjson
import pytest
from sqlalchemy import select

from billing.alerts import (
    SIGNATURE_HEADER,
    alerts_for_month,
    check_budgets,
    deliver_alert_webhooks,
    set_alert_webhook,
    verify,
)
from billing.spend import record_spend
from gateway.admission import AdmissionController
from gateway.admission.controller import AdmissionRejected
from gateway.admission.limits import TenantLimits
from tests.factories import create_tenant
from tollgate.models import BudgetAlert

BUDGET = 1_000_000_000  # $0.001


class Receiver:
    """A tenant's webhook endpoint: records what arrives, answers the queued statuses (then 200)."""

    def __init__(self) -> None:
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.statuses: list[int] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                receiver.received.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(receiver.statuses.pop(0) if receiver.statuses else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hooks/budget"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.stop()


async def alerts_of(db_session, tenant_id: int) -> list[BudgetAlert]:
    rows = await db_session.scalars(select(BudgetAlert).where(BudgetAlert.tenant_id == tenant_id)
                                    .order_by(BudgetAlert.threshold_percent))
    return list(rows.all())


async def test_alerts_at_80_and_100_percent_once_with_signed_retried_webhooks(
        db_session, redis_client, unit_of_work, receiver) -> None:
    tenant = await create_tenant(db_session, monthly_budget_pico_usd=BUDGET)
    quiet = await create_tenant(db_session, monthly_budget_pico_usd=BUDGET)  # no webhook URL: flag only
    secret = await set_alert_webhook(db_session, tenant.id, receiver.url)
    assert secret and secret.startswith("tgwhsec_")

    await record_spend(redis_client, tenant.id, BUDGET * 79 // 100)
    await record_spend(redis_client, quiet.id, BUDGET)
    created = await check_budgets(db_session, redis_client)
    assert [(a.tenant_id, a.threshold_percent) for a in created if a.tenant_id in (tenant.id, quiet.id)] == [
        (quiet.id, 80), (quiet.id, 100)]
    assert {a.webhook_status for a in await alerts_of(db_session, quiet.id)} == {"none"}

    await record_spend(redis_client, tenant.id, BUDGET // 100)  # now exactly 80 %
    assert [a.threshold_percent for a in await check_budgets(db_session, redis_client)] == [80]
    assert await check_budgets(db_session, redis_client) == []  # once per month, however often it runs

    receiver.statuses = [500]
    async with httpx.AsyncClient(timeout=5) as http:
        first = await deliver_alert_webhooks(unit_of_work, http)
        assert (first.delivered, first.retrying) == (0, 1)
        second = await deliver_alert_webhooks(unit_of_work, http)
        assert (second.delivered, second.retrying) == (1, 0)
        assert (await deliver_alert_webhooks(unit_of_work, http)).delivered == 0
    assert len(receiver.received) == 2
    headers, body = receiver.received[-1]
    assert verify(body, headers[SIGNATURE_HEADER.lower()], secret)
    assert not verify(body, headers[SIGNATURE_HEADER.lower()], "tgwhsec_someone_else")
    event = orjson.loads(body)
    assert event["type"] == "budget.threshold_reached"
    assert event["id"] == orjson.loads(receiver.received[0][1])["id"]  # stable across retries
    assert event["data"] | {"spend_usd": None} == {
        "tenant_id": tenant.id, "month": (await alerts_of(db_session, tenant.id))[0].month,
        "threshold_percent": 80, "spend_usd": None, "budget_usd": "0.001000000000",
        "spend_pico_usd": BUDGET * 80 // 100, "budget_pico_usd": BUDGET, "requests_blocked": False}
    [alert] = await alerts_of(db_session, tenant.id)
    assert (alert.webhook_status, alert.attempts) == ("delivered", 2)

    await record_spend(redis_client, tenant.id, BUDGET // 5)  # 100 %: requests are refused from now on
    assert [a.threshold_percent for a in await check_budgets(db_session, redis_client)] == [100]
    flags = await alerts_for_month(db_session, tenant_id=tenant.id)
    assert sorted(a.threshold_percent for a in flags) == [80, 100]


async def test_a_spent_budget_refuses_requests_until_it_is_raised(settings, redis_client) -> None:
    controller = AdmissionController(redis_client, settings)

    def limits(budget: int) -> TenantLimits:
        return TenantLimits(tenant_id=987_654, tier="default", status="active", rpm_limit=None,
                            tpm_limit=None, max_concurrency=None, monthly_budget_pico_usd=budget,
                            batch_tpd_limit=None)

    await record_spend(redis_client, 987_654, BUDGET)
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(limits(BUDGET), "req-over", 10, 1_000)
    assert rejected.value.status == 429 and rejected.value.code == "insufficient_quota"
    assert rejected.value.headers.get("x-should-retry") == "false"
    admitted = await controller.admit(limits(BUDGET * 2), "req-raised", 10, 1_000)  # the admin raised the cap
    await controller.settle(admitted, 10, 1_000)
