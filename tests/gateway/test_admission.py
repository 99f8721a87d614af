"""Admission against a real Redis: RPM/TPM buckets, reservation reconcile, leases, monthly budget,
tenant status, headers.

The buckets refill with Redis ``TIME``, so time passing between two calls changes what a test reads. Where
a test asserts exact levels or retry times it freezes the bucket first (``freeze_bucket``), and where it
needs time to pass it moves the bucket's clock back (``backdate_bucket``, ``set_bucket_age``) instead of
sleeping: the results do not depend on how fast this machine runs the test.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from billing.spend import month_field, month_to_date_spend, record_spend
from gateway.admission import AdmissionController, AdmissionRejected, TenantLimits
from gateway.admission.controller import admission_keys
from gateway.errors import PermissionDeniedError, ServiceUnavailableError
from tollgate.settings import Settings


def limits(tenant_id: int = 1, *, rpm: int | None = None, tpm: int | None = None,
           concurrency: int | None = None, budget: int | None = None, status: str = "active") -> TenantLimits:
    return TenantLimits(tenant_id=tenant_id, tier="default", status=status, rpm_limit=rpm, tpm_limit=tpm,
                        max_concurrency=concurrency, monthly_budget_pico_usd=budget, batch_tpd_limit=None)


@pytest.fixture
def controller(redis_client, settings: Settings) -> AdmissionController:
    return AdmissionController(redis_client, settings)


async def backdate_bucket(redis_client, key: str, seconds: float) -> None:
    """Pretend the bucket was last touched ``seconds`` earlier (as if that much time had passed)."""
    ts = int(await redis_client.hget(key, "ts"))
    await redis_client.hset(key, "ts", ts - int(seconds * 1_000_000))


async def redis_now_us(redis_client) -> int:
    """Redis ``TIME`` in microseconds: the clock the admission scripts read."""
    seconds, micros = await redis_client.time()
    return int(seconds) * 1_000_000 + int(micros)


async def set_bucket_age(redis_client, key: str, seconds: float) -> int:
    """The bucket was last touched ``seconds`` before now (Redis ``TIME``, returned in microseconds)."""
    now = await redis_now_us(redis_client)
    await redis_client.hset(key, "ts", now - int(seconds * 1_000_000))
    return now


async def freeze_bucket(redis_client, key: str, level: int | None = None) -> None:
    """No refill from now on, however much time passes: the bucket's ``ts`` an hour ahead of Redis
    ``TIME`` (the scripts refill only for time past it, until one of them stores the bucket again), and
    no expiry. ``level``: set it too; otherwise the stored level stays."""
    fields = {"ts": await redis_now_us(redis_client) + 3600 * 1_000_000}
    if level is not None:
        fields["level"] = level
    await redis_client.hset(key, mapping=fields)
    await redis_client.persist(key)


async def test_unlimited_tenant_is_admitted_without_rate_limit_headers(controller) -> None:
    admission = await controller.admit(limits(), "req-1", 10**9, 0)
    assert admission.headers == {}
    await controller.settle(admission, 10, 0)


async def test_rpm_rejects_the_request_over_the_limit_with_retry_after(controller, redis_client) -> None:
    tenant = limits(rpm=3)
    rpm_key, _, _, _ = admission_keys(1)
    for i in range(3):
        admission = await controller.admit(tenant, f"req-{i}", 1, 0)
        assert admission.headers["x-ratelimit-remaining-requests"] == str(2 - i)
        assert admission.headers["x-ratelimit-limit-requests"] == "3"
        await freeze_bucket(redis_client, rpm_key)  # no refill between requests: it ends exactly empty
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(tenant, "req-4", 1, 0)
    error = rejected.value
    assert error.status == 429 and error.type == "requests" and error.code == "rate_limit_exceeded"
    assert "Limit 3" in error.message
    # One request refills in window/3 = 20 s: retry in that, never "no retry".
    assert error.headers["retry-after-ms"] == "20000"
    assert error.headers["retry-after"] == "20"
    assert "x-should-retry" not in error.headers
    assert error.headers["x-ratelimit-remaining-requests"] == "0"


async def test_tpm_bucket_refills_continuously(controller, redis_client) -> None:
    tenant = limits(tpm=6_000)  # refills 100 tokens per second with the 60 s window
    await controller.admit(tenant, "a", 6_000, 0)
    _, tpm_key, _, _ = admission_keys(1)
    await freeze_bucket(redis_client, tpm_key)  # empty, and it stays so
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(tenant, "b", 1_000, 0)
    assert rejected.value.type == "tokens"
    assert rejected.value.headers["retry-after-ms"] == "10000"
    since = await set_bucket_age(redis_client, tpm_key, 10.0)  # 10 s later: 1,000 tokens are back
    admission = await controller.admit(tenant, "b", 1_000, 0)
    meanwhile = (await redis_now_us(redis_client) - since) * 100 // 1_000_000  # 100 tokens per second
    assert int(admission.headers["x-ratelimit-remaining-tokens"]) <= meanwhile  # only what refilled since
    await backdate_bucket(redis_client, tpm_key, 3600.0)  # a long idle time never overfills
    admission = await controller.admit(tenant, "c", 1, 0)
    assert admission.headers["x-ratelimit-remaining-tokens"] == "5999"


@pytest.mark.settings(rate_limit_window_s=0.5)
async def test_retry_after_is_honest_with_a_shortened_window(controller, redis_client,
                                                             settings: Settings) -> None:
    tenant = limits(tpm=1_000)  # refills 2 tokens per millisecond with the 0.5 s window
    assert (await controller.admit(tenant, "a", 1_000, 0)).headers["x-ratelimit-remaining-tokens"] == "0"
    _, tpm_key, _, _ = admission_keys(1)
    # The empty bucket "a" left, frozen (set outright: with this window the key expires 1.5 s after "a").
    await freeze_bucket(redis_client, tpm_key, level=0)
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(tenant, "b", 500, 0)
    retry_ms = int(rejected.value.headers["retry-after-ms"])
    assert retry_ms == 250  # 500 tokens at 2 per ms: sub-second, not rounded up to a whole second
    # The client waits exactly what it was told: the bucket was last touched retry_ms ago.
    await set_bucket_age(redis_client, tpm_key, retry_ms / 1000)
    await controller.admit(tenant, "b", 500, 0)


async def test_request_larger_than_the_bucket_is_rejected_without_retry(controller) -> None:
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(limits(tpm=1_000), "big", 1_001, 0)
    assert rejected.value.headers["x-should-retry"] == "false"
    assert "retry-after" not in rejected.value.headers
    assert "Requested 1001" in rejected.value.message


async def test_settle_refunds_unused_reservation_and_charges_overshoot(controller, redis_client) -> None:
    tenant = limits(tpm=10_000)
    _, tpm_key, _, _ = admission_keys(1)
    # The bucket is frozen after every step that stores it: the levels below are exact (no refill).
    first = await controller.admit(tenant, "a", 4_000, 0)  # prompt 1,000 + max_tokens 3,000
    assert first.headers["x-ratelimit-remaining-tokens"] == "6000"
    await freeze_bucket(redis_client, tpm_key)
    await controller.settle(first, 1_500, 0)  # used 1,500: 2,500 come back
    await freeze_bucket(redis_client, tpm_key)
    second = await controller.admit(tenant, "b", 8_000, 0)
    assert second.headers["x-ratelimit-remaining-tokens"] == "500"
    await freeze_bucket(redis_client, tpm_key)
    await controller.settle(second, 9_500, 0)  # overshoot of 1,500 leaves the bucket in debt
    await freeze_bucket(redis_client, tpm_key)
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(tenant, "c", 1, 0)
    assert rejected.value.headers["x-ratelimit-remaining-tokens"] == "0"
    # Debt of 1,000 tokens + 1 at 10,000 per 60 s: 6.006 s.
    assert rejected.value.headers["retry-after-ms"] == "6006"
    await controller.settle(second, 0, 0)  # settling twice changes nothing
    with pytest.raises(AdmissionRejected):
        await controller.admit(tenant, "c", 1, 0)


async def test_refund_never_overfills_the_bucket(controller) -> None:
    tenant = limits(tpm=1_000)
    admission = await controller.admit(tenant, "a", 800, 0)
    await controller.settle(admission, 0, 0)
    again = await controller.admit(tenant, "b", 1, 0)
    assert again.headers["x-ratelimit-remaining-tokens"] == "999"


async def test_concurrency_cap_and_leases_released_at_settle(controller) -> None:
    tenant = limits(concurrency=2)
    a = await controller.admit(tenant, "a", 1, 0)
    await controller.admit(tenant, "b", 1, 0)
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(tenant, "c", 1, 0)
    assert "concurrent" in rejected.value.message and "retry-after" in rejected.value.headers
    await controller.settle(a, 1, 0)
    await controller.admit(tenant, "c", 1, 0)


async def test_leases_of_a_dead_gateway_expire_and_renewal_keeps_live_ones(controller, redis_client) -> None:
    tenant = limits(concurrency=2)
    dead = await controller.admit(tenant, "dead", 1, 0)
    live = await controller.admit(tenant, "live", 1, 0)
    _, _, leases_key, _ = admission_keys(1)
    before = await redis_client.zscore(leases_key, live.lease_id)
    await controller.renew_lease(live)
    assert await redis_client.zscore(leases_key, live.lease_id) >= before
    # The gateway holding `dead` stopped renewing; its lease's expiry passes.
    await redis_client.zadd(leases_key, {dead.lease_id: 1})
    await controller.admit(tenant, "next", 1, 0)
    assert await redis_client.zscore(leases_key, dead.lease_id) is None
    await controller.renew_lease(dead)  # a lapsed lease is not revived
    assert await redis_client.zscore(leases_key, dead.lease_id) is None
    assert await redis_client.zcard(leases_key) == 2


async def test_budget_admits_while_spent_is_below_and_overshoots_by_at_most_one_request(controller) -> None:
    tenant = limits(budget=1_000)
    spent = 0
    admitted = 0
    with pytest.raises(AdmissionRejected) as rejected:
        while True:
            admission = await controller.admit(tenant, f"r{admitted}", 10, 300)
            admitted += 1
            await controller.settle(admission, 10, 300)
            spent += 300
    assert admitted == 4 and spent == 1_200  # 900 < 1,000 admitted the 4th; 1,200 ≥ 1,000 stopped it
    assert await month_to_date_spend(controller._redis, 1, _month()) == 1_200
    error = rejected.value
    assert error.type == "insufficient_quota" and error.code == "insufficient_quota"
    assert error.headers["x-should-retry"] == "false" and "retry-after" not in error.headers


async def test_budget_counts_in_flight_requests_so_concurrency_cannot_overshoot_more(controller) -> None:
    tenant = limits(tenant_id=2, budget=1_000)
    held = [await controller.admit(tenant, f"r{i}", 10, 300) for i in range(4)]  # 0, 300, 600, 900 < 1,000
    with pytest.raises(AdmissionRejected):
        await controller.admit(tenant, "r5", 10, 300)
    for admission in held:
        await controller.settle(admission, 10, 250)  # cheaper than estimated
    assert await month_to_date_spend(controller._redis, 2, _month()) == 1_000
    with pytest.raises(AdmissionRejected):
        await controller.admit(tenant, "r6", 10, 1)


async def test_cost_held_by_a_dead_gateway_is_released_with_its_lease(controller, redis_client) -> None:
    tenant = limits(tenant_id=3, budget=1_000)
    dead = await controller.admit(tenant, "dead", 10, 1_000)
    with pytest.raises(AdmissionRejected):
        await controller.admit(tenant, "next", 10, 1)
    _, _, leases_key, _ = admission_keys(3)
    await redis_client.zadd(leases_key, {dead.lease_id: 1})
    await controller.admit(tenant, "next", 10, 1)


async def test_a_request_is_charged_to_the_month_it_was_admitted_in(controller) -> None:
    """Settled after midnight on the first of the month, a request admitted the month before is charged
    to that month's counter, where the ledger counts it (by its arrival), for interactive and batch."""
    admission = await controller.admit(limits(tenant_id=5), "r", 10, 300)
    assert admission.month == _month()
    admission.month = "2020-01"  # as if the month had turned since
    await controller.settle(admission, 10, 300)
    assert await month_to_date_spend(controller._redis, 5, "2020-01") == 300
    assert await month_to_date_spend(controller._redis, 5, _month()) == 0
    assert await record_spend(controller._redis, 5, 7, "2020-01") == ("2020-01", 307)


async def test_batch_lines_and_interactive_requests_count_each_others_holds(controller, redis_client) -> None:
    """A batch line holds its estimate until it settles, as an interactive request does, and each side
    counts the other's holds: lines in flight (2 chains x 8 of them) cannot overshoot the budget by more
    than one request's cost, and neither can the interactive requests admitted beside them."""
    from gateway.admission.controller import batch_hold_keys
    from gateway.batches.runtime import BatchAdmission, BatchDeferred

    batch = BatchAdmission(redis_client, hold_ttl_s=60)
    tenant = limits(tenant_id=6, budget=1_000)
    lines = [await batch.admit(tenant, f"line-{i}", 10, 300) for i in range(3)]  # 900 held
    with pytest.raises(BatchDeferred):
        await batch.admit(tenant, "line-3", 10, 300)  # 900 + 300 > 1,000
    interactive = await controller.admit(tenant, "interactive", 10, 150)  # 900 < 1,000: 1,050 held
    with pytest.raises(AdmissionRejected):
        await controller.admit(tenant, "next", 10, 1)  # the lines' holds count: 1,050 >= 1,000
    with pytest.raises(BatchDeferred):
        await batch.admit(tenant, "line-4", 10, 10)  # and the interactive one's
    await batch.settle(lines[0], 10, 250)  # its hold released, its cost spent: 250 + 750 held
    await controller.settle(interactive, 10, 100)  # 350 spent + 600 held
    await batch.admit(tenant, "line-0", 10, 40)  # a retry: 990
    with pytest.raises(BatchDeferred):
        await batch.admit(tenant, "line-5", 10, 20)
    _, holds = batch_hold_keys(6)
    await batch.admit(tenant, "line-1", 10, 5)  # admitted again, a line replaces its own hold
    assert int(await redis_client.hget(holds, "_total")) == 40 + 5 + 300


async def test_a_batch_hold_lapses_with_its_worker(controller, redis_client) -> None:
    """A line whose worker died never settles: its hold lapses after the ttl instead of blocking the
    tenant's budget for good."""
    from gateway.admission.controller import batch_hold_keys
    from gateway.batches.runtime import BatchAdmission, BatchDeferred

    batch = BatchAdmission(redis_client, hold_ttl_s=60)
    tenant = limits(tenant_id=7, budget=1_000)
    await batch.admit(tenant, "dead", 10, 1_000)
    with pytest.raises(BatchDeferred):
        await batch.admit(tenant, "next", 10, 1)
    leases, _ = batch_hold_keys(7)
    await redis_client.zadd(leases, {"dead": 1})  # its ttl passed
    await batch.admit(tenant, "next", 10, 1)
    await controller.admit(tenant, "interactive", 10, 1)


async def test_batch_spend_counts_against_the_same_budget(controller) -> None:
    tenant = limits(tenant_id=4, budget=1_000)
    month, total = await record_spend(controller._redis, 4, 1_000)
    assert (month, total) == (_month(), 1_000)
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(tenant, "r", 1, 1)
    assert rejected.value.code == "insufficient_quota"


async def test_suspended_tenants(controller) -> None:
    with pytest.raises(PermissionDeniedError) as denied:
        await controller.admit(limits(status="suspended"), "r", 1, 0)
    assert denied.value.status == 403 and denied.value.code == "account_deactivated"
    with pytest.raises(AdmissionRejected) as rejected:
        await controller.admit(limits(status="suspended_billing"), "r", 1, 0)
    assert rejected.value.code == "insufficient_quota"
    assert rejected.value.headers["x-should-retry"] == "false"


async def test_zero_limits_block_without_retry(controller) -> None:
    for tenant in (limits(rpm=0), limits(tpm=0), limits(concurrency=0)):
        with pytest.raises(AdmissionRejected) as rejected:
            await controller.admit(tenant, "r", 1, 0)
        assert rejected.value.headers["x-should-retry"] == "false"


async def test_headers_report_limits_remaining_and_reset(controller) -> None:
    admission = await controller.admit(limits(rpm=60, tpm=60_000), "r", 30_000, 0)
    h = admission.headers
    assert (h["x-ratelimit-limit-requests"], h["x-ratelimit-remaining-requests"]) == ("60", "59")
    assert (h["x-ratelimit-limit-tokens"], h["x-ratelimit-remaining-tokens"]) == ("60000", "30000")
    assert h["x-ratelimit-reset-requests"] in ("1s", "999ms")
    assert h["x-ratelimit-reset-tokens"] in ("30s", "29.999s")


async def test_redis_down_fails_closed_with_503(private_redis, settings: Settings) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(private_redis.url, socket_connect_timeout=1)
    controller = AdmissionController(client, settings)
    await controller.settle(await controller.admit(limits(tpm=10), "r", 1, 0), 1, 0)
    private_redis.stop()
    with pytest.raises(ServiceUnavailableError) as unavailable:
        await controller.admit(limits(tpm=10), "r2", 1, 0)
    assert unavailable.value.status == 503 and "retry-after" in unavailable.value.headers
    await client.aclose()


def _month() -> str:
    return month_field(datetime.now(UTC))
