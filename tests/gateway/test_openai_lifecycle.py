"""What happens around a request: client disconnects, key revocation, a replica dying mid-stream, and
the official ``openai`` SDK driving the gateway unchanged."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from sqlalchemy import update

from billing.outbox import RECORD_FIELD, USAGE_STREAM
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
from tests.polling import eventually
from tollgate.models import ApiKey
from tollgate.redis import publish_invalidation

pytestmark = pytest.mark.slow

# seed 1 makes the tiny model talk for all 1500 tokens (no early EOS), so the request is surely running.
LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 1500,
        "seed": 1,
        "temperature": 1.0, "stream": True}


async def _engine_load(engine_url: str) -> dict:
    async with httpx.AsyncClient(timeout=30) as c:
        return (await c.get(f"{engine_url}/load")).json()


async def wait_engine_idle(engine_url: str) -> None:
    """Until the engine runs and queues nothing (the aborted request is gone from it)."""

    async def idle() -> bool:
        load = await _engine_load(engine_url)
        return load["running"] == 0 and load["waiting"] == 0

    await eventually(idle, "the engine to run and queue nothing", interval_s=0.05)


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
    await wait_engine_idle(engine_url)


async def test_non_streamed_disconnect_is_cancelled(gateway: GatewayUnderTest, tenant_key: TenantKey,
                                                    engine_url: str) -> None:
    body = {**LONG, "stream": False}
    await wait_engine_idle(engine_url)  # so that the request running below is this one
    redis = aioredis.Redis.from_url(gateway.settings.redis_url)
    try:
        # Only records appended from here on: tenant ids repeat across the databases of other tests'
        # gateways, which share this Redis stream.
        last = await redis.xrevrange(USAGE_STREAM, count=1)
        since = last[0][0].decode() if last else "0-0"
        async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tenant_key.headers,
                                     timeout=60) as c:
            post = asyncio.create_task(c.post("/chat/completions", json=body))

            async def generating() -> bool:
                if post.done():  # a response (or an error) before the engine ran it: fail with it
                    raise AssertionError(f"the request ended before it was cancelled: {post.result()}")
                return (await _engine_load(engine_url))["running"] > 0

            await eventually(generating, "the request to run on the engine")
            post.cancel()  # the client gives up: its connection closes mid-response
            with pytest.raises(asyncio.CancelledError):
                await post

        async def usage() -> list[dict]:
            entries = await redis.xrange(USAGE_STREAM, min=f"({since}")
            records = [json.loads(fields[RECORD_FIELD]) for _, fields in entries]
            return [r for r in records if r["tenant_id"] == tenant_key.tenant_id]

        found = await eventually(usage, "the usage record of the cancelled request", interval_s=0.05)
    finally:
        await redis.aclose()
    assert len(found) == 1 and found[0]["status"] == "cancelled"
    assert found[0]["completion_tokens"] < 1500
    await wait_engine_idle(engine_url)


async def test_revocation_reaches_the_gateway_through_the_invalidation(
        gateway: GatewayUnderTest, monkeypatch: pytest.MonkeyPatch) -> None:
    # Entries cached from here on live a day: far longer than the wait below, so a 401 can only come
    # from the invalidation, never from the entry's expiry.
    monkeypatch.setattr(gateway.runtime.auth, "_ttl", 24 * 3600.0)
    tk = await make_tenant_key(gateway)
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers, timeout=30) as c:
        assert (await c.get("/models")).status_code == 200  # now cached for a day
        async with gateway.db.session() as session:
            await session.execute(update(ApiKey).where(ApiKey.id == tk.api_key_id)
                                  .values(revoked_at=datetime.now(UTC)))
        redis = aioredis.Redis.from_url(gateway.settings.redis_url)
        try:
            await publish_invalidation(redis, api_key_id=tk.api_key_id)
        finally:
            await redis.aclose()

        async def refused() -> int:
            status = (await c.get("/models")).status_code
            return status if status != 200 else 0

        assert await eventually(refused, "the gateway to refuse the revoked key") == 401


@pytest.mark.usefixtures("model_price")
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
                async def unavailable() -> httpx.Response | None:
                    r = await c.post("/chat/completions", json={**LONG, "stream": False, "max_tokens": 1})
                    return r if r.status_code == 503 else None

                r = await eventually(unavailable, "a 503 for the model whose only replica died")
                assert_conforms(r.json(), "ErrorResponse")


@pytest.mark.usefixtures("model_price")
async def test_dying_replica_fails_a_plain_request_and_bills_nothing(
        tiny_model_dir: Path, api_database_url: str, redis_url: str, tmp_path: Path) -> None:
    """A non-streamed request whose replica dies while it generates: the client gets an error in OpenAI's
    body (never a 500) and no token, so the ledger's record says failed and bills nothing."""
    with run_engine(tiny_model_dir, tmp_path / "engine.log") as (url, proc):
        settings = gateway_settings([url], tiny_model_dir, api_database_url, redis_url)
        async with run_gateway(settings) as gw:
            tk = await make_tenant_key(gw)
            async with httpx.AsyncClient(base_url=f"{gw.url}/v1", headers=tk.headers, timeout=60) as c:
                plain = asyncio.create_task(c.post("/chat/completions", json={**LONG, "stream": False}))

                async def generating() -> bool:
                    async with httpx.AsyncClient(timeout=5) as probe:
                        load = (await probe.get(f"{url}/load")).json()
                    return load["running"] >= 1 and load["tokens_per_s"] > 0

                await eventually(generating, "the request to be generating on the replica")
                proc.kill()
                response = await plain
            assert response.status_code in (502, 503), response.text
            assert_conforms(response.json(), "ErrorResponse")
            records = await wait_for_usage(redis_url, response.headers["x-request-id"])
            assert len(records) == 1 and records[0]["status"] == "failed"
            assert (records[0]["prompt_tokens"], records[0]["completion_tokens"],
                    records[0]["cost_pico_usd"]) == (0, 0, 0)


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
