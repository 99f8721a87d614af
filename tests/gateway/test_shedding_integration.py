"""SLO shedding end to end, real processes: ``tollgate gateway`` in front of a synthetic engine replica
that models prefill queueing (``prefill_tokens_per_s``: prompts prefilled one chunk at a time, best
priority first, the backlog reported by priority in ``GET /load``).

The replica is overloaded with flex-priority work (sent to it directly, as another gateway would):
about 20 s of prefill, far over the flex tier's 5 s TTFT objective, none of it ahead of the priority
tier. Through the gateway, a ``service_tier: "flex"`` request is then refused with 503 in OpenAI's error
body, ``x-should-retry: false`` and ``retry-after``, before any prefill is spent on it (the replica never
sees it: its prompt-token counter does not move), while a ``service_tier: "priority"`` request of the
same tenant is admitted and answered while the flex prompts sent before it still wait.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.factories import create_api_key, create_price, create_tenant
from tests.gateway.gateway_processes import MODEL, gateway_env, gateway_process, synthetic_engine
from tests.polling import eventually
from tollgate.db import Database
from tollgate.settings import default_tiers

pytestmark = pytest.mark.slow

PREFILL_TOKENS_PER_S = 1_000.0
CHUNK_TOKENS = 100                   # a priority request waits at most one chunk: 0.1 s
BACKLOG_REQUESTS, BACKLOG_PROMPT = 20, 1_000  # 20,000 flex tokens: 20 s at the rate
TIERS = {name: tier.model_dump() for name, tier in default_tiers().items()}  # real SLOs
FLEX_PRIORITY = TIERS["flex"]["engine_priority"]
METRICS_TOKEN = "shedding-metrics"


async def _seed(database_url: str) -> str:
    db = Database(database_url, pool_size=1)
    try:
        async with db.session() as session:
            await create_price(session, model=MODEL)
            _, key = await create_api_key(session, await create_tenant(session, tier="priority"))
        return key
    finally:
        await db.dispose()


def _engine_prompt_tokens(engine_url: str) -> float:
    text = httpx.get(f"{engine_url}/metrics", timeout=10.0).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "tollgate_engine_prompt_tokens_total")


def _gateway_flex_requests_ended(gateway_url: str) -> float:
    """Flex requests the gateway refused before any engine work, plus flex generations that ended."""
    text = httpx.get(f"{gateway_url}/metrics", timeout=10.0,
                     headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name in ("tollgate_gateway_rejections_total", "tollgate_gateway_generations_total")
               and s.labels.get("tier") == "flex")


async def _hold_backlog(client: httpx.AsyncClient, engine_url: str, i: int) -> None:
    prompt = [1 + (i + j) % 500 for j in range(BACKLOG_PROMPT)]
    body = {"request_id": f"backlog-{i}", "prompt_token_ids": prompt, "max_tokens": 1,
            "priority": FLEX_PRIORITY}
    async with client.stream("POST", f"{engine_url}/generate", json=body) as response:
        async for _ in response.aiter_lines():
            pass


def _chat(tier: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"a short {tier} question"}],
            "max_tokens": 3, "service_tier": tier}


async def test_flex_is_shed_before_any_prefill_while_priority_is_served(
        new_database: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    key = await _seed(new_database)
    headers = {"Authorization": f"Bearer {key}"}
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=0.005, ttft_s=0.0,
                          prefill_tokens_per_s=PREFILL_TOKENS_PER_S,
                          prefill_chunk_tokens=CHUNK_TOKENS) as engine:
        env = gateway_env(database_url=new_database, redis_url=redis_url, replicas=[engine.url],
                          tokenizer_dir=tiny_model_dir, tiers=TIERS, metrics_token=METRICS_TOKEN)
        with gateway_process(env, tmp_path / "gateway.log", api_key=key) as gw:
            async with httpx.AsyncClient(timeout=60.0) as client:
                backlog = [asyncio.create_task(_hold_backlog(client, engine.url, i))
                           for i in range(BACKLOG_REQUESTS)]
                try:
                    # The replica reports the flex backlog; the gateway polls /load every 0.2 s.
                    async def backlogged() -> dict[str, Any] | None:
                        load = (await client.get(f"{engine.url}/load")).json()
                        flex = load["pending_prefill_tokens_by_priority"].get(str(FLEX_PRIORITY), 0)
                        return load if flex > 15_000 and load["tokens_per_s"] > 0 else None

                    load = await eventually(backlogged, "the replica to report the flex backlog")
                    assert set(load["pending_prefill_tokens_by_priority"]) == {str(FLEX_PRIORITY)}

                    # Until the gateway's own poll has seen the backlog, a flex request is still admitted
                    # and queues behind it: such a probe is dropped after a second (the disconnect aborts
                    # it in the replica's queue, before any of its prefill) and the next one is sent.
                    probes = 0

                    async def probe() -> httpx.Response | None:
                        nonlocal probes
                        probes += 1
                        try:
                            response = await client.post(f"{gw.url}/v1/chat/completions", json=_chat("flex"),
                                                         headers=headers, timeout=1.0)
                        except httpx.TimeoutException:
                            return None
                        assert response.status_code in (200, 503), response.text
                        return response if response.status_code == 503 else None

                    shed = await eventually(probe, "the gateway to shed a flex request")
                    assert set(shed.json()) == {"error"}
                    error = shed.json()["error"]
                    assert set(error) == {"message", "type", "param", "code"}
                    assert error["code"] == "overloaded" and error["type"] == "server_error", error
                    assert "flex" in error["message"]
                    assert shed.headers["x-should-retry"] == "false"
                    assert int(shed.headers["retry-after"]) >= 1
                    # Refused before any engine work: the replica never sees a shed request's prompt
                    # (counted over a second one, once the gateway has ended every probe: each was
                    # either refused or a generation, which ends after the replica has let it go).
                    await eventually(lambda: _gateway_flex_requests_ended(gw.url) == probes,
                                     "every probe to end in the gateway")
                    before = _engine_prompt_tokens(engine.url)
                    shed = await client.post(f"{gw.url}/v1/chat/completions", json=_chat("flex"),
                                             headers=headers)
                    assert shed.status_code == 503, shed.text
                    assert _engine_prompt_tokens(engine.url) == before

                    served = await client.post(f"{gw.url}/v1/chat/completions", json=_chat("priority"),
                                               headers=headers)
                    assert served.status_code == 200, served.text
                    assert served.json()["service_tier"] == "priority"
                    assert served.json()["usage"]["completion_tokens"] == 3
                    assert _engine_prompt_tokens(engine.url) > before
                    # It jumped the 20 s flex queue: answered while flex prompts sent before it still wait.
                    load = (await client.get(f"{engine.url}/load")).json()
                    assert load["pending_prefill_tokens_by_priority"].get(str(FLEX_PRIORITY), 0) > 0, load
                    # Still overloaded for flex after that.
                    again = await client.post(f"{gw.url}/v1/chat/completions", json=_chat("flex"),
                                              headers=headers)
                    assert again.status_code == 503, again.text
                    assert json.loads(again.text)["error"]["code"] == "overloaded"
                finally:
                    for task in backlog:
                        task.cancel()
                    await asyncio.gather(*backlog, return_exceptions=True)
