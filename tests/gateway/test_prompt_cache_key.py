"""``prompt_cache_key`` on chat, completions and responses, end to end: the gateway app under uvicorn in
front of two synthetic engine replicas, real Postgres and Redis.

Which replica served a request is read from the replicas themselves: each one's prompt-token counter
(``GET /metrics``) moves by the request's prompt tokens on exactly one of them. Requests of one tenant
with one key land on one replica whatever their prompts (the same prompts without a key spread over
both: prefix routing); a key that is not a string is refused with a 400 in OpenAI's error body.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import create_api_key, create_price, create_tenant
from tests.gateway.conftest import run_gateway
from tests.gateway.gateway_processes import LOOSE_TIERS, MODEL, synthetic_engine
from tests.polling import eventually
from tollgate.db import Database
from tollgate.settings import ModelConfig, PoolConfig, Settings, TierConfig

pytestmark = pytest.mark.slow


@dataclass
class TwoReplicas:
    replica_urls: list[str]
    client: httpx.AsyncClient  # the gateway, with an API key of one tenant
    other_tenant: httpx.AsyncClient

    async def prompt_tokens(self) -> list[float]:
        """Each replica's count of prompt tokens it accepted."""
        counts = []
        for url in self.replica_urls:
            text = (await self.client.get(f"{url}/metrics")).text
            counts.append(next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                               if s.name == "tollgate_engine_prompt_tokens_total"))
        return counts

    async def served_by(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
        """Send one request; the URL of the replica that ran it."""
        before = await self.prompt_tokens()
        limit = {"max_output_tokens": 2} if path == "/v1/responses" else {"max_tokens": 2}
        response = await client.post(path, json={"model": MODEL, **limit, **body})
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        moved = [(url, after - b) for url, b, after in
                 zip(self.replica_urls, before, await self.prompt_tokens(), strict=True) if after != b]
        assert len(moved) == 1, moved
        url, tokens = moved[0]
        assert tokens == usage.get("prompt_tokens", usage.get("input_tokens"))
        return url


@pytest.fixture(scope="module")
async def replicas(shared_servers: Any, redis_url: str, tiny_model_dir: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TwoReplicas]:
    logs = tmp_path_factory.mktemp("prompt_cache_key")
    with shared_servers.migrated_database(f"tollgate_cache_key_{uuid.uuid4().hex[:8]}") as database_url:
        db = Database(database_url, pool_size=1)
        async with db.session() as session:
            await create_price(session, model=MODEL)
            _, key = await create_api_key(session, await create_tenant(session))
            _, other_key = await create_api_key(session, await create_tenant(session))
        await db.dispose()
        with (synthetic_engine(logs / "engine-0.log", token_interval_s=0.0, ttft_s=0.0) as first,
              synthetic_engine(logs / "engine-1.log", token_interval_s=0.0, ttft_s=0.0) as second):
            settings = Settings(
                environment="test", database_url=database_url, redis_url=redis_url,
                models=[ModelConfig(name=MODEL, path=str(tiny_model_dir))],
                pools={"interactive": PoolConfig(replicas=[first.url, second.url])},
                tiers={name: TierConfig(**tier) for name, tier in LOOSE_TIERS.items()},
                health_poll_interval_s=0.2, key_cache_ttl_s=5.0)
            async with run_gateway(settings) as gateway:
                router = gateway.runtime.router
                await eventually(lambda: all(r.healthy for r in router.replicas), "both replicas up")
                async with (httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                              headers={"Authorization": f"Bearer {key}"}) as client,
                            httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                              headers={"Authorization": f"Bearer {other_key}"}) as other):
                    yield TwoReplicas([first.url, second.url], client, other)


def _prompt(i: int) -> str:
    # The number comes first, so the prompts differ within their first block (16 tokens).
    return f"{i} is the number of this document. " + "It has a long and unremarkable body. " * 4


async def test_without_a_key_different_prompts_spread_over_both_replicas(replicas: TwoReplicas) -> None:
    served = {await replicas.served_by(replicas.client, "/v1/completions", {"prompt": _prompt(i)})
              for i in range(20)}
    assert served == set(replicas.replica_urls)


async def test_one_key_keeps_a_tenant_on_one_replica_whatever_the_prompt(replicas: TwoReplicas) -> None:
    for client in (replicas.client, replicas.other_tenant):
        served = set()
        for i in range(100, 116):
            served.add(await replicas.served_by(client, "/v1/completions",
                                                {"prompt": _prompt(i), "prompt_cache_key": "conversation-1"}))
        for i in range(4):
            served.add(await replicas.served_by(client, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": _prompt(200 + i)}],
                "prompt_cache_key": "conversation-1"}))
        for i in range(4):
            served.add(await replicas.served_by(client, "/v1/responses", {
                "input": _prompt(300 + i), "prompt_cache_key": "conversation-1"}))
        assert len(served) == 1, served


@pytest.mark.parametrize("value", [123, ["conversation-1"], {"key": "conversation-1"}, True])
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi"}),
])
async def test_a_key_that_is_not_a_string_is_a_400(replicas: TwoReplicas, path: str, body: dict[str, Any],
                                                     value: Any) -> None:
    response = await replicas.client.post(path, json={"model": MODEL, **body, "prompt_cache_key": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "prompt_cache_key"


async def test_a_null_key_is_no_key(replicas: TwoReplicas) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        await replicas.served_by(replicas.client, path, {**body, "prompt_cache_key": None})
