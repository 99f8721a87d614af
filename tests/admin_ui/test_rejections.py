"""The rejection counters behind the dashboard's "rejections by reason": every refusal admission and
shedding raise maps to its reason, is counted per tenant and UTC hour in Redis, and reads back by range;
counting never changes the error the client gets."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from admin_ui.usage_data import parse_range
from gateway.admission import AdmissionController
from gateway.admission.limits import TenantLimits
from gateway.admission.rejections import (
    count_rejections,
    record_rejection,
    rejection_counts,
    rejection_reason,
)
from gateway.admission.shedding import ShedDecision
from gateway.errors import GatewayError, ServiceUnavailableError
from tollgate.settings import Settings


def _limits(tenant_id: int = 7, **overrides: Any) -> TenantLimits:
    fields: dict[str, Any] = {"tenant_id": tenant_id, "tier": "default", "status": "active",
                              "rpm_limit": None, "tpm_limit": None, "max_concurrency": None,
                              "monthly_budget_pico_usd": None, "batch_tpd_limit": None}
    return TenantLimits(**{**fields, **overrides})


async def _refusal(controller: AdmissionController, limits: TenantLimits, *, admits: int = 1,
                   tokens: int = 10, cost: int = 1) -> GatewayError:
    for _ in range(admits - 1):
        await controller.admit(limits, "req", tokens, cost)
    with pytest.raises(GatewayError) as caught:
        await controller.admit(limits, "req", tokens, cost)
    return caught.value


async def test_every_admission_refusal_has_its_reason(redis_client: Any, settings: Settings) -> None:
    controller = AdmissionController(redis_client, settings)
    cases = [
        (_limits(1, rpm_limit=1), 2, "rpm"),
        (_limits(2, rpm_limit=0), 1, "rpm"),
        (_limits(3, tpm_limit=100), 1, "tpm"),  # larger than the bucket
        (_limits(4, max_concurrency=1), 2, "concurrency"),
        (_limits(5, monthly_budget_pico_usd=0), 1, "budget"),
        (_limits(6, status="suspended_billing"), 1, "budget"),
        (_limits(8, status="suspended"), 1, "suspended"),
    ]
    for limits, admits, reason in cases:
        error = await _refusal(controller, limits, admits=admits, tokens=500 if reason == "tpm" else 10)
        assert rejection_reason(error) == reason, (limits, error.message)
    shed = ShedDecision(tier="default", limiting_tier="default", predicted_ttft_ms=900, slo_ms=700,
                        retry_after_ms=1000).error()
    assert rejection_reason(shed) == "overloaded"
    assert rejection_reason(ServiceUnavailableError("no replica")) == "unavailable"
    assert rejection_reason(GatewayError("bad input", status=400)) is None


async def test_counted_per_tenant_reason_and_hour(redis_client: Any, settings: Settings) -> None:
    controller = AdmissionController(redis_client, settings)
    limits = _limits(11, rpm_limit=1)
    async with count_rejections(redis_client, limits.tenant_id, "interactive"):
        await controller.admit(limits, "req", 10, 1)  # admitted: nothing counted
    for _ in range(2):
        with pytest.raises(GatewayError) as caught:
            async with count_rejections(redis_client, limits.tenant_id, "interactive"):
                await controller.admit(limits, "req", 10, 1)
        assert caught.value.status == 429
    hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    earlier = hour - timedelta(hours=5)
    await record_rejection(redis_client, 12, "tpm", now=earlier.timestamp() + 59)
    counts = await rejection_counts(redis_client, hour - timedelta(days=1), hour + timedelta(hours=1))
    assert {(c.hour, c.tenant_id, c.reason, c.count) for c in counts} == {
        (hour, 11, "rpm", 2), (earlier, 12, "tpm", 1)}
    only = await rejection_counts(redis_client, hour - timedelta(days=1), hour + timedelta(hours=1), 12)
    assert [(c.tenant_id, c.count) for c in only] == [(12, 1)]
    assert await rejection_counts(redis_client, earlier + timedelta(minutes=1), hour) == []
    assert 0 < await redis_client.ttl(f"tollgate:rejections:{int(hour.timestamp())}") <= 40 * 24 * 3600


async def test_batch_refusals_are_not_counted_and_errors_pass_through(redis_client: Any) -> None:
    error = GatewayError("Rate limit reached", status=429, type="requests")
    with pytest.raises(GatewayError) as caught:
        async with count_rejections(redis_client, 5, "batch"):
            raise error
    assert caught.value is error
    assert await redis_client.keys("tollgate:rejections:*") == []


async def test_counting_failure_keeps_the_original_error(private_redis: Any) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(private_redis.url)
    private_redis.stop()
    error = GatewayError("Rate limit reached", status=429, type="requests")
    with pytest.raises(GatewayError) as caught:
        async with count_rejections(client, 5, "interactive"):
            raise error
    assert caught.value is error
    await client.aclose()


def test_usage_ranges() -> None:
    today = datetime(2026, 3, 10, tzinfo=UTC).date()
    default = parse_range(None, None, None, today=today)
    assert (default.first_day.isoformat(), default.last_day.isoformat(), default.granularity) == (
        "2026-03-04", "2026-03-10", "day")
    short = parse_range("2026-03-09", "2026-03-10", None, today=today)
    assert short.granularity == "hour" and len(short.buckets()) == 48
    assert short.end == datetime(2026, 3, 11, tzinfo=UTC)
    for bad in [("2026-03-10", "2026-03-01", None), ("yesterday", None, None), ("2025-01-01", None, "day"),
                ("2026-01-01", None, "hour"), (None, None, "week"),
                ("9999-12-30", "9999-12-31", None)]:  # its end, a day later, is no datetime (a 500 before)
        with pytest.raises(ValueError):
            parse_range(*bad, today=today)
