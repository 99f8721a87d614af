"""What happens around a request: client disconnects, key revocation, a replica dying mid-stream, and
the official ``openai`` SDK driving the gateway unchanged."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from sqlalchemy import update

from tests.gateway.conftest import (
    MODEL,
    GatewayUnderTest,
    TenantKey,
    gateway_settings,
    make_tenant_key,
    run_engine,
    run_gateway,
    wait_for_usage,
)
from tests.openai_schema import assert_conforms
from tollgate.models import ApiKey
from tollgate.redis import publish_invalidation

pytestmark = pytest.mark.slow

# seed 1 makes the tiny model talk for all 1500 tokens (no early EOS), so the request is surely running.
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 1500,
        "seed": 1,
        "temperature": 1.0, "stream": True}


async def _engine_idle(engine_url: str, timeout_s: float = 10.0) -> bool:
    async with httpx.AsyncClient() as c:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            load = (await c.get(f"{engine_url}/load")).json()
            if load["running"] == 0 and load["waiting"] == 0:
                return True
            await asyncio.sleep(0.05)
    return False


async def test_client_disconnect_aborts_and_bills_what_was_generated(gateway: GatewayUnderTest,
                                                                      tenant_key: TenantKey,
                                                                      engine_url: str) -> None:
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tenant_key.headers, timeout=60) as c:
        async with c.stream("POST", "/chat/completions", json=LONG) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            received = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    received += 1
                if received >= 5:
                    break
    records = await wait_for_usage(gateway.settings.redis_url, request_id)
    assert len(records) == 1
    assert records[0]["status"] == "cancelled"
    assert 4 <= records[0]["completion_tokens"] < 1500
    assert await _engine_idle(engine_url)


async def test_non_streamed_disconnect_is_cancelled(gateway: GatewayUnderTest, tenant_key: TenantKey,
                                                    engine_url: str) -> None:
    body = {**LONG, "stream": False}
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tenant_key.headers,
                                 timeout=httpx.Timeout(60, read=0.5)) as c:
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/chat/completions", json=body)
    redis = aioredis.Redis.from_url(gateway.settings.redis_url)
    try:
        deadline = time.monotonic() + 10
        found = []
        while not found and time.monotonic() < deadline:
            entries = await redis.xrange("tollgate:usage")
            found = [json.loads(f[b"r"]) for _, f in entries
                     if json.loads(f[b"r"])["tenant_id"] == tenant_key.tenant_id]
            await asyncio.sleep(0.05)
    finally:
        await redis.aclose()
    assert len(found) == 1 and found[0]["status"] == "cancelled"
    assert found[0]["completion_tokens"] < 1500
    assert await _engine_idle(engine_url)


async def test_revocation_reaches_the_gateway_within_a_second(gateway: GatewayUnderTest) -> None:
    tk = await make_tenant_key(gateway)
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers, timeout=30) as c:
        assert (await c.get("/models")).status_code == 200  # now cached for key_cache_ttl_s (5 s)
        async with gateway.db.session() as session:
            await session.execute(update(ApiKey).where(ApiKey.id == tk.api_key_id)
                                  .values(revoked_at=datetime.now(UTC)))
        redis = aioredis.Redis.from_url(gateway.settings.redis_url)
        try:
            await publish_invalidation(redis, api_key_id=tk.api_key_id)
        finally:
            await redis.aclose()
        deadline = time.monotonic() + 1.0
        status = 200
        while status == 200 and time.monotonic() < deadline:
            status = (await c.get("/models")).status_code
        assert status == 401


async def test_dying_replica_ends_stream_with_error_and_bills(tiny_model_dir: Path, api_database_url: str,
                                                              redis_url: str, tmp_path: Path) -> None:
    with run_engine(tiny_model_dir, tmp_path / "engine.log") as (url, proc):
        settings = gateway_settings([url], tiny_model_dir, api_database_url, redis_url)
        async with run_gateway(settings) as gw:
            tk = await make_tenant_key(gw)
            async with httpx.AsyncClient(base_url=f"{gw.url}/v1", headers=tk.headers, timeout=60) as c:
                async with c.stream("POST", "/chat/completions", json=LONG) as r:
                    request_id = r.headers["x-request-id"]
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line.removeprefix("data: "))
                            if len(lines) == 4:
                                proc.kill()
                last = json.loads(lines[-1])
                assert "error" in last and lines[-1] != "[DONE]"
                assert_conforms(last, "ErrorResponse")
                records = await wait_for_usage(redis_url, request_id)
                assert len(records) == 1 and records[0]["status"] == "failed"
                assert records[0]["completion_tokens"] >= 3
                # The replica is gone: new requests get a 503 in OpenAI's body, not a hang or a 500.
                deadline = time.monotonic() + 5
                r = await c.post("/chat/completions", json={**LONG, "stream": False, "max_tokens": 1})
                while r.status_code != 503 and time.monotonic() < deadline:
                    r = await c.post("/chat/completions", json={**LONG, "stream": False, "max_tokens": 1})
                assert r.status_code == 503
                assert_conforms(r.json(), "ErrorResponse")


async def test_openai_sdk_works_unchanged(gateway: GatewayUnderTest, tenant_key: TenantKey) -> None:
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=tenant_key.key, max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
        assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens > 0
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        assert chunks[-1].usage is not None and chunks[-1].choices == []
        parsed = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "weather?"}], max_tokens=100, temperature=0,
            tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"]}}}],
            tool_choice="required")
        call = parsed.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
        text = await client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        assert text.choices[0].text is not None
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        with pytest.raises(openai.BadRequestError) as err:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                 temperature=9)
        assert err.value.param == "temperature"
    finally:
        await client.close()
    bad = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong", max_retries=0)
    try:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
    finally:
        await bad.close()


async def test_key_use_is_recorded_in_batches(gateway: GatewayUnderTest) -> None:
    from sqlalchemy import select

    tk = await make_tenant_key(gateway)
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers, timeout=30) as c:
        assert (await c.get("/models")).status_code == 200
    await gateway.runtime.auth.flush_last_used()
    async with gateway.db.session() as session:
        used = await session.scalar(select(ApiKey.last_used_at).where(ApiKey.id == tk.api_key_id))
    assert used is not None
