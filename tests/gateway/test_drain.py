"""Graceful drain: SIGTERM to a real ``tollgate gateway --workers 2`` with streams open on a real engine.

What a client and the ledger must see: new connections are refused at once; a stream that ends within
``drain_timeout_s`` ends normally (``[DONE]``, usage) and so does a non-streamed request; a stream still
running at the deadline is cut, and is billed exactly once, as ``cancelled``, for exactly the tokens the
engine computed for it (its own count, at least what the client received); a non-streamed request still
running then gets a 503 to retry and is billed nothing; then every worker and the parent exit with status 0.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from tests.factories import create_api_key, create_price, create_tenant
from tests.gateway.gateway_processes import MODEL, gateway_env, gateway_process, synthetic_engine
from tests.polling import eventually
from tollgate.db import Database

pytestmark = pytest.mark.slow

DRAIN_S = 3
TOKEN_INTERVAL_S = 0.1


async def _seed(database_url: str) -> tuple[int, str]:
    db = Database(database_url, pool_size=1)
    try:
        async with db.session() as session:
            await create_price(session, model=MODEL)
            tenant = await create_tenant(session)
            _, key = await create_api_key(session, tenant)
        return tenant.id, key
    finally:
        await db.dispose()


async def _records_all(redis_url: str) -> list[UsageRecord]:
    client = aioredis.Redis.from_url(redis_url)
    try:
        entries = await client.xrange(USAGE_STREAM)
    finally:
        await client.aclose()
    return [UsageRecord.from_json(fields[RECORD_FIELD]) for _, fields in entries]


async def _records(redis_url: str, request_ids: set[str]) -> list[UsageRecord]:
    return [r for r in await _records_all(redis_url) if r.request_id in request_ids]


async def _records_if(redis_url: str, request_ids: set[str], count: int) -> list[UsageRecord] | None:
    records = await _records(redis_url, request_ids)
    return records if len(records) >= count else None


async def _engine_running(engine_url: str, count: int) -> bool:
    async with httpx.AsyncClient(timeout=5.0) as client:
        return (await client.get(f"{engine_url}/load")).json()["running"] >= count


async def _refuses(url: str) -> bool:
    async with httpx.AsyncClient(timeout=1.0) as client:
        try:
            await client.get(f"{url}/health")
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
            return True  # refused, or queued by the kernel before the listener closed and then reset
    return False


class StreamResult:
    def __init__(self) -> None:
        self.request_id = ""
        self.tokens = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.first = asyncio.Event()


async def _stream(url: str, key: str, max_tokens: int, out: StreamResult) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "drain me"}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=60.0) as client:
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                                     headers={"Authorization": f"Bearer {key}"}) as response:
                assert response.status_code == 200
                out.request_id = response.headers["x-request-id"]
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        out.done = True
                    elif line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            out.usage = chunk["usage"]
                        for choice in chunk.get("choices", []):
                            if choice["delta"].get("content"):
                                out.tokens += 1  # the synthetic engine sends one token per delta
                                out.first.set()
        except httpx.HTTPError:
            pass  # the cut stream: the server closed the connection


async def test_sigterm_drains_streams_then_bills_the_cut_ones(new_database: str, redis_url: str,
                                                              tiny_model_dir: Path, tmp_path: Path) -> None:
    tenant_id, key = await _seed(new_database)
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=TOKEN_INTERVAL_S, ttft_s=0.0) as engine:
        env = gateway_env(database_url=new_database, redis_url=redis_url, replicas=[engine.url],
                          tokenizer_dir=tiny_model_dir, drain_timeout_s=DRAIN_S)
        with gateway_process(env, tmp_path / "gateway.log", workers=2, api_key=key) as gw:
            short, long = StreamResult(), StreamResult()
            # ~1 s: ends inside the drain window; ~100 s: still running at its deadline.
            tasks = [asyncio.create_task(_stream(gw.url, key, 10, short)),
                     asyncio.create_task(_stream(gw.url, key, 1000, long))]
            await asyncio.wait_for(asyncio.gather(short.first.wait(), long.first.wait()), 30)
            async with httpx.AsyncClient(timeout=60.0) as client:
                def post(max_tokens: int) -> asyncio.Task[httpx.Response]:
                    return asyncio.create_task(client.post(
                        f"{gw.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": max_tokens}))

                plain, slow_plain = post(8), post(1000)
                # Both plain requests are in the engine (with the two streams) before the signal.
                await eventually(lambda: _engine_running(engine.url, 4), "4 requests running in the engine")
                tokens_at_signal = long.tokens
                gw.terminate()
                # No new connections while draining (the signal takes a moment to arrive). A connection
                # the kernel queued before the listener closed is dropped unanswered: refused too.
                await eventually(lambda: _refuses(gw.url), "the gateway to refuse new connections")
                assert gw.proc.poll() is None and not long.done, "refusing while the long stream drains"
                plain_response, cut_plain = await plain, await slow_plain
            await asyncio.wait_for(asyncio.gather(*tasks), 60)
            assert gw.proc.wait(timeout=60) == 0
        async with httpx.AsyncClient(timeout=30.0) as client:  # what the engine computed for the cut one
            computed = (await client.post(f"{engine.url}/abort", json={"request_id": long.request_id})).json()

    assert plain_response.status_code == 200
    # Not started when cut: an answer the SDKs retry (elsewhere), not a 500.
    assert cut_plain.status_code == 503 and cut_plain.headers["retry-after"] == "1"
    assert cut_plain.json()["error"]["code"] == "server_shutting_down"
    assert short.done and short.usage is not None and short.usage["completion_tokens"] == short.tokens == 10
    assert not long.done and 0 < long.tokens < 1000
    assert long.tokens > tokens_at_signal  # the long stream went on streaming in its drain window
    ids = {short.request_id, long.request_id, plain_response.headers["x-request-id"]}
    records = await eventually(lambda: _records_if(redis_url, ids, 3), "3 usage records")
    by_id = {r.request_id: r for r in records}
    assert len(records) == len(by_id) == 3, "exactly one usage record per request"
    # The cut non-streamed request (answered 503 for the client to retry) was metered once, as failed,
    # and billed nothing: the client received nothing from it.
    cut_id = cut_plain.headers["x-request-id"]
    voided = [r for r in await _records_all(redis_url) if r.request_id == cut_id]
    assert len(voided) == 1, voided
    assert voided[0].status == "failed" and voided[0].tenant_id == tenant_id
    assert (voided[0].prompt_tokens, voided[0].cached_tokens, voided[0].completion_tokens,
            voided[0].cost_pico_usd) == (0, 0, 0, 0)
    assert by_id[short.request_id].status == "completed"
    assert by_id[short.request_id].completion_tokens == short.tokens
    cut = by_id[long.request_id]
    # Billed what the engine computed until the gateway's abort took effect: at least what the client read.
    assert cut.status == "cancelled" and cut.completion_tokens == computed["usage"]["completion_tokens"]
    assert cut.completion_tokens >= long.tokens
    assert cut.prompt_tokens == short.usage["prompt_tokens"] and cut.cost_pico_usd > 0
    assert by_id[plain_response.headers["x-request-id"]].status == "completed"
    logged = [r for r in gw.log_lines() if "traceback" in r]
    assert not logged, logged
