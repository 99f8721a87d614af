"""Abandoned requests are billed what the engine computed for them (docs/batch-and-billing.md).

Real processes: a synthetic engine replica (tokens on a timer, so a client can leave midway) and
``tollgate gateway``, over the session's Postgres and Redis. Clients leave chat streams (n = 1 and
n = 2) and a Responses stream after a few tokens, and give up on a non-streamed request before its end.
Each request's usage record (what the ledger row gets) must say ``cancelled`` and carry exactly the
engine's own count of what it computed, which the test asks the engine for (``POST /abort`` answers with
it after the end), and that count is at least what the client read. The rule was decided because the
old one (bill what the client read) could not be met: a token in flight on the socket is computed,
sent and unread, and the test that asserted it failed now and then.

One gateway and engine per module, so ``pytest --count N`` (pytest-repeat) repeats the requests, not the
start-up: the rule's check is meant to pass every time, not most times.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from billing.prices import Price, cost_pico_usd
from tests.factories import DEFAULT_INPUT_PRICE, DEFAULT_OUTPUT_PRICE
from tests.gateway.gateway_processes import MODEL, gateway_env, gateway_process, synthetic_engine
from tests.gateway.test_drain import _seed
from tests.polling import eventually

pytestmark = pytest.mark.slow

TOKEN_INTERVAL_S = 0.02
PRICE = Price.of(input=DEFAULT_INPUT_PRICE, output=DEFAULT_OUTPUT_PRICE)


@dataclass
class Platform:
    gateway: str
    engine: str
    tenant_id: int
    key: str
    redis_url: str


@pytest.fixture(scope="module")
def platform(shared_servers, redis_url: str, tiny_model_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    logs = tmp_path_factory.mktemp("abandoned")
    with shared_servers.migrated_database("tollgate_abandoned") as database_url:
        tenant_id, key = asyncio.run(_seed(database_url))
        with synthetic_engine(logs / "engine.log", token_interval_s=TOKEN_INTERVAL_S, ttft_s=0.0) as engine:
            env = gateway_env(database_url=database_url, redis_url=redis_url, replicas=[engine.url],
                              tokenizer_dir=tiny_model_dir)
            with gateway_process(env, logs / "gateway.log", api_key=key) as gw:
                yield Platform(gw.url, engine.url, tenant_id, key, redis_url)


@dataclass
class Left:
    """A request its client left: the ledger's request id and the content tokens the client read."""

    request_id: str
    read: int


async def _leave_chat_stream(client: httpx.AsyncClient, after: int, n: int = 1) -> Left:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"leave after {after}"}],
            "max_tokens": 500, "n": n, "stream": True, "stream_options": {"include_usage": True}}
    read = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                read += sum(1 for c in json.loads(line[6:])["choices"] if c["delta"].get("content"))
                if read >= after:
                    break  # leaving the block closes the connection mid-stream
    return Left(response.headers["x-request-id"], read)


async def _leave_response_stream(client: httpx.AsyncClient, after: int) -> Left:
    body = {"model": MODEL, "input": f"leave the response after {after}", "max_output_tokens": 500,
            "stream": True}
    read = 0
    async with client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["type"] == "response.output_text.delta":
                read += 1
                if read >= after:
                    break
    return Left(response.headers["x-request-id"], read)


async def _give_up_waiting(client: httpx.AsyncClient) -> None:
    """A non-streamed request whose client times out: the gateway sees the disconnect and aborts. (Its
    request id never reached the client: the test finds its record as the tenant's one new unknown.)"""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "too slow for me"}], "max_tokens": 500}
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/chat/completions", json=body, timeout=0.5)


async def _engine_count(engine_url: str, request_id: str) -> dict:
    async with httpx.AsyncClient(timeout=30.0) as client:
        answer = (await client.post(f"{engine_url}/abort", json={"request_id": request_id})).json()
    assert answer["aborted"] is False, "the request should have ended already"
    assert answer["usage"] is not None, f"the engine forgot request {request_id}"
    return answer["usage"]


async def _tenant_records(platform: Platform) -> dict[str, UsageRecord]:
    client = aioredis.Redis.from_url(platform.redis_url)
    try:
        entries = await client.xrange(USAGE_STREAM)
    finally:
        await client.aclose()
    records = [UsageRecord.from_json(fields[RECORD_FIELD]) for _, fields in entries]
    return {r.request_id: r for r in records if r.tenant_id == platform.tenant_id}


async def test_an_abandoned_request_is_billed_what_the_engine_computed(platform: Platform) -> None:
    before = (await _tenant_records(platform)).keys()
    headers = {"Authorization": f"Bearer {platform.key}"}
    async with httpx.AsyncClient(base_url=platform.gateway, headers=headers, timeout=60.0) as client:
        *left, _ = await asyncio.gather(
            _leave_chat_stream(client, 1), _leave_chat_stream(client, 3), _leave_chat_stream(client, 7),
            _leave_chat_stream(client, 4, n=2), _leave_response_stream(client, 3), _give_up_waiting(client))

    async def all_recorded() -> dict[str, UsageRecord] | None:
        new = {k: v for k, v in (await _tenant_records(platform)).items() if k not in before}
        return new if len(new) == len(left) + 1 else None

    records = await eventually(all_recorded, "every request's usage record")
    known = {x.request_id for x in left}
    assert len(known) == len(left) and known <= records.keys()
    impatient = [Left(request_id, 0) for request_id in records.keys() - known]
    for request in [*left, *impatient]:
        record = records[request.request_id]
        engine = await _engine_count(platform.engine, request.request_id)
        assert record.status == "cancelled", record
        assert (record.prompt_tokens, record.completion_tokens) == (
            engine["prompt_tokens"], engine["completion_tokens"]), (record, engine)
        assert record.completion_tokens >= request.read
        assert record.completion_tokens < 500, "the abort stopped the engine"
        assert record.cost_pico_usd == cost_pico_usd(PRICE, record.prompt_tokens, record.cached_tokens,
                                                     record.completion_tokens, "interactive")
