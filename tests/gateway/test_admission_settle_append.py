"""``AdmissionController.settle_and_append``: settle + usage record in one Redis round trip, the same
effects as ``settle`` then ``append_usage``, and a settle script Redis forgot is loaded again."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

import pytest

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from billing.spend import month_field, month_to_date_spend
from gateway.admission import AdmissionController, TenantLimits
from gateway.admission.controller import admission_keys
from tollgate.settings import Settings


def tenant(tenant_id: int) -> TenantLimits:
    return TenantLimits(tenant_id=tenant_id, tier="default", status="active", rpm_limit=None,
                        tpm_limit=10_000, max_concurrency=5, monthly_budget_pico_usd=None,
                        batch_tpd_limit=None)


def record(request_id: str, tenant_id: int, cost: int) -> UsageRecord:
    return UsageRecord.of(request_id=request_id, tenant_id=tenant_id, api_key_id=None, model="m",
                       request_class="interactive", tier="default", prompt_tokens=10, cached_tokens=0,
                       completion_tokens=5, cost_pico_usd=cost, status="completed", ttft_ms=1.0,
                       tpot_ms=None, created_at=datetime.now(UTC))


async def outbox_record(redis_client, request_id: str) -> UsageRecord | None:
    for _, fields in await redis_client.xrange(USAGE_STREAM):
        usage = UsageRecord.from_json(fields[RECORD_FIELD])
        if usage.request_id == request_id:
            return usage
    return None


@pytest.mark.parametrize("flush_scripts", [False, True])
async def test_settle_and_append_settles_and_meters(redis_client, settings: Settings,
                                                   flush_scripts: bool) -> None:
    controller = AdmissionController(redis_client, settings)
    tenant_id = 900_000 + secrets.randbelow(100_000)
    request_id = f"req_{secrets.token_hex(8)}"
    admission = await controller.admit(tenant(tenant_id), request_id, 1_000, 700)
    _, tpm_key, leases_key, _ = admission_keys(tenant_id)
    assert await redis_client.zcard(leases_key) == 1
    if flush_scripts:  # as after a Redis restart: EVALSHA answers NOSCRIPT
        await redis_client.script_flush()
    settle_error, append_error = await controller.settle_and_append(admission, 15, 600,
                                                                    record(request_id, tenant_id, 600))
    assert settle_error is None and append_error is None
    assert admission.settled
    assert await redis_client.zcard(leases_key) == 0  # the lease is released
    level = float(await redis_client.hget(tpm_key, "level"))
    assert level >= 10_000 - 15 - 1  # the unused reservation came back
    assert await month_to_date_spend(redis_client, tenant_id, month_field(datetime.now(UTC))) == 600
    stored = await outbox_record(redis_client, request_id)
    assert stored is not None and stored.cost_pico_usd == 600 and stored.tenant_id == tenant_id
    # A second call settles nothing more (the record is the caller's to not send twice).
    await controller.settle(admission, 15, 600)
    assert await month_to_date_spend(redis_client, tenant_id, month_field(datetime.now(UTC))) == 600
