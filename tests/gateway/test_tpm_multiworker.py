"""TPM admission across 4 real gateway worker processes (``tollgate gateway --workers 4``) in front of a
synthetic engine, under 200 concurrent clients asking for far more tokens than the tenant may use.

The tenant's bucket: capacity ``TPM`` refilled at ``TPM / window`` per second (the window shortened to
``WINDOW_S`` through ``TOLLGATE_RATE_LIMIT_WINDOW_S``). Over a run from ``t0`` to ``t1`` it allows
``TPM + TPM / WINDOW_S * (t1 - t0)`` tokens. What the tenant must see:
- never more than that plus one request (the admission decision is atomic in Redis, shared by all
  workers, so workers cannot jointly overshoot);
- refills: more admitted than the bucket's capacity, the rest refused with 429 (refused clients retry as
  the SDKs do, after ``retry-after-ms``, plus think time so the test stays cheap).
Every synthetic completion generates exactly ``max_tokens``, so a reservation equals the real usage.
The window is read from the gateway's side (the usage records' ``created_at``, taken just before each
admission), so the clients' connection set-up and response latency on a loaded machine do not blur it.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from tests.factories import create_api_key, create_price, create_tenant
from tests.gateway.gateway_processes import MODEL, gateway_env, gateway_process, synthetic_engine
from tollgate.db import Database

pytestmark = pytest.mark.slow

# Refill 1,000 tokens/s. A bucket of several seconds of refill keeps the allowance from overflowing
# while a loaded 2-core machine stalls the gateway for a moment; ~620-token requests keep the demand
# at 10x with a few hundred attempts.
TPM = 6000
WINDOW_S = 6.0
RUN_S = 6.0
CLIENTS = 200
MAX_TOKENS = 600
THINK_S = (0.5, 1.5)


async def _seed(database_url: str) -> tuple[str, int, str]:
    db = Database(database_url, pool_size=1)
    try:
        async with db.session() as session:
            await create_price(session, model=MODEL)
            _, warm_key = await create_api_key(session, await create_tenant(session))
            tenant = await create_tenant(session, tpm_limit=TPM)
            _, key = await create_api_key(session, tenant)
        return warm_key, tenant.id, key
    finally:
        await db.dispose()


async def test_tpm_bucket_holds_across_four_workers(new_database: str, redis_url: str, tiny_model_dir: Path,
                                                    tmp_path: Path) -> None:
    # Tenant ids restart in every fresh database while the Redis stream is shared by the xdist worker's
    # tests: records are this test's by tenant *and* time.
    since = time.time()
    warm_key, tenant_id, key = await _seed(new_database)
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=0.001, ttft_s=0.0) as engine:
        env = gateway_env(database_url=new_database, redis_url=redis_url, replicas=[engine.url],
                          tokenizer_dir=tiny_model_dir, rate_limit_window_s=WINDOW_S)
        with gateway_process(env, tmp_path / "gateway.log", workers=4, api_key=warm_key) as gw:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "spend tokens"}],
                    "max_tokens": MAX_TOKENS}
            admitted: list[int] = []
            statuses: dict[int, int] = {}
            # Idle connections dropped before uvicorn's 5 s keep-alive timeout closes them under us.
            limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS,
                                  keepalive_expiry=4.0)
            async with httpx.AsyncClient(base_url=gw.url, timeout=120.0, limits=limits,
                                         headers={"Authorization": f"Bearer {key}"}) as client:
                stop_at = time.monotonic() + RUN_S

                async def tenant_client() -> None:
                    while time.monotonic() < stop_at:
                        try:
                            response = await client.post("/v1/chat/completions", json=body)
                        except httpx.TransportError:
                            # A kept-alive connection closed under a starved client: retry, as the SDKs
                            # do. (Were it admitted anyway, the usage records below still count it.)
                            statuses[0] = statuses.get(0, 0) + 1
                            continue
                        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                        if response.status_code == 200:
                            admitted.append(response.json()["usage"]["total_tokens"])
                            continue
                        assert response.status_code == 429, response.text
                        assert response.json()["error"]["type"] == "tokens"
                        wait = int(response.headers["retry-after-ms"]) / 1000
                        # A client honouring retry-after-ms (plus think time), as the SDKs do.
                        await asyncio.sleep(max(wait, random.uniform(*THINK_S)))  # not a wait: pacing

                await asyncio.gather(*(tenant_client() for _ in range(CLIENTS)))

    per_request = admitted[0]
    assert all(t == per_request for t in admitted)
    # When the gateway admitted each request (the usage record's created_at is taken just before the
    # admission call), so client-side connection set-up and response latency do not blur the window.
    records = [r for r in await _usage_records(redis_url, tenant_id) if r.created_at.timestamp() >= since]
    metered = [r.prompt_tokens + r.completion_tokens for r in records]
    # Every 200 was metered; extra records (a response lost to a broken connection: cancelled, billed
    # for what was generated) are at most the transport errors the clients saw.
    assert sum(1 for r in records if r.status == "completed") >= len(admitted)
    assert len(metered) - len(admitted) <= statuses.get(0, 0)
    first = min(r.created_at.timestamp() for r in records)
    last = max(r.created_at.timestamp() for r in records)
    rate = TPM / WINDOW_S
    used = sum(metered)
    # Upper bound: what the bucket allowed from the first admission to the last, plus one request.
    allowed_while_admitting = TPM + rate * (last - first)
    assert used <= allowed_while_admitting + per_request, (used, allowed_while_admitting, statuses)
    # The bucket refills: more was admitted than its capacity, and the rest was refused with 429s (how
    # much of the allowance a loaded machine's clients manage to use is a measurement, not a property).
    assert len(admitted) > TPM // per_request and statuses.get(429, 0) > 0, (len(admitted), statuses)


async def _usage_records(redis_url: str, tenant_id: int) -> list[UsageRecord]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = await client.xrange(USAGE_STREAM)
    finally:
        await client.aclose()
    records = [UsageRecord.from_json(fields[RECORD_FIELD]) for _, fields in entries]
    return [r for r in records if r.tenant_id == tenant_id]
