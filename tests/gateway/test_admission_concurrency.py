"""Many gateways at once: 200 concurrent admits over several Redis connections never admit more than
the limits allow (the Lua script is the only decision point)."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime

import pytest
import redis.asyncio as aioredis

from billing.spend import month_field, month_to_date_spend
from gateway.admission import AdmissionController, AdmissionRejected, TenantLimits
from tollgate.settings import Settings

CLIENTS = 4
REQUESTS = 200


def limits(**kwargs: int | None) -> TenantLimits:
    values: dict[str, int | None] = dict(rpm_limit=None, tpm_limit=None, max_concurrency=None,
                                         monthly_budget_pico_usd=None)
    values.update(kwargs)
    return TenantLimits(tenant_id=9, tier="default", status="active", batch_tpd_limit=None, **values)


@pytest.fixture
async def controllers(redis_client, redis_url: str, settings: Settings):
    """One controller per client, as if each were a separate gateway process."""
    clients = [aioredis.Redis.from_url(redis_url) for _ in range(CLIENTS)]
    yield [AdmissionController(client, settings) for client in clients]
    for client in clients:
        await client.aclose()


async def redis_seconds(client: aioredis.Redis) -> float:
    seconds, micros = await client.time()
    return seconds + micros / 1e6


async def admit_all(controllers, tenant: TenantLimits, sizes: list[int], costs: list[int]):
    async def one(i: int):
        try:
            return await controllers[i % CLIENTS].admit(tenant, f"req-{i}", sizes[i], costs[i])
        except AdmissionRejected:
            return None

    return await asyncio.gather(*(one(i) for i in range(REQUESTS)))


async def test_tokens_admitted_never_exceed_the_bucket(controllers, redis_client) -> None:
    rng = random.Random(7)
    capacity = 20_000
    sizes = [rng.randint(50, 800) for _ in range(REQUESTS)]  # ~85,000 tokens asked for in total
    start = await redis_seconds(redis_client)
    results = await admit_all(controllers, limits(tpm_limit=capacity), sizes, [0] * REQUESTS)
    elapsed = await redis_seconds(redis_client) - start
    admitted = sum(size for size, admission in zip(sizes, results, strict=True) if admission)
    refill = capacity * elapsed / 60.0
    assert admitted <= capacity + refill + max(sizes)
    assert admitted >= capacity - max(sizes)  # and the bucket was actually used, not refused wholesale
    assert any(admission is None for admission in results)


async def test_requests_admitted_never_exceed_rpm(controllers, redis_client) -> None:
    start = await redis_seconds(redis_client)
    results = await admit_all(controllers, limits(rpm_limit=50), [1] * REQUESTS, [0] * REQUESTS)
    elapsed = await redis_seconds(redis_client) - start
    admitted = sum(1 for admission in results if admission)
    assert 50 <= admitted <= 50 + int(50 * elapsed / 60.0) + 1


async def test_concurrency_cap_holds_under_a_burst(controllers) -> None:
    results = await admit_all(controllers, limits(max_concurrency=10), [1] * REQUESTS, [0] * REQUESTS)
    assert sum(1 for admission in results if admission) == 10


async def test_budget_overshoot_is_bounded_by_one_request_under_a_burst(controllers, redis_client) -> None:
    rng = random.Random(11)
    budget = 100_000
    costs = [rng.randint(1_000, 9_000) for _ in range(REQUESTS)]
    results = await admit_all(controllers, limits(monthly_budget_pico_usd=budget), [1] * REQUESTS, costs)
    admitted = [(admission, cost) for admission, cost in zip(results, costs, strict=True) if admission]
    held = sum(cost for _, cost in admitted)
    assert budget <= held < budget + max(costs)
    await asyncio.gather(*(controllers[0].settle(admission, 1, cost) for admission, cost in admitted))
    assert await month_to_date_spend(redis_client, 9, month_field(datetime.now(UTC))) == held
