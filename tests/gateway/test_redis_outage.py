"""A Redis outage under a running gateway loses no usage record.

Real processes: ``tollgate gateway``, a synthetic engine replica, a Redis of the test's own (which it kills
and starts again, same append-only files) and the session's Postgres. A stream admitted before the outage
finishes during it: its client gets the whole answer and its usage, and the record, which Redis cannot
take, waits in the gateway's usage spool on disk (``billing.usage_spool``) until Redis is back, then lands
in the outbox with exactly the usage the client was told. New requests meanwhile are refused with 503
(admission fails closed: unmetered traffic would be unbillable), and so is a background response (its
task cannot be queued), never a 500.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from tests.gateway.gateway_processes import MODEL, gateway_env, gateway_process, synthetic_engine
from tests.gateway.test_drain import _seed
from tests.polling import eventually

pytestmark = pytest.mark.slow

TOKEN_INTERVAL_S = 0.05


async def _stream(url: str, key: str, first: asyncio.Event) -> tuple[str, dict[str, Any]]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "outlive the outage"}],
            "max_tokens": 60, "stream": True, "stream_options": {"include_usage": True}}
    usage: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=60.0) as client, client.stream(
            "POST", f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                first.set()
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    return r.headers["x-request-id"], usage


async def _outbox(redis_url: str, request_id: str) -> UsageRecord | None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        for _, fields in await client.xrange(USAGE_STREAM):
            record = UsageRecord.from_json(fields[RECORD_FIELD])
            if record.request_id == request_id:
                return record
        return None
    except OSError:
        return None
    finally:
        await client.aclose()


async def test_usage_of_a_request_finished_during_a_redis_outage_is_kept(
        new_database: str, private_redis: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    _, key = await _seed(new_database)
    spool = tmp_path / "spool"
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=TOKEN_INTERVAL_S, ttft_s=0.0) as engine:
        env = gateway_env(database_url=new_database, redis_url=private_redis.url, replicas=[engine.url],
                          tokenizer_dir=tiny_model_dir, usage_spool_dir=str(spool), usage_spool_retry_s=0.2,
                          key_cache_ttl_s=600)
        with gateway_process(env, tmp_path / "gateway.log", api_key=key) as gw:
            first = asyncio.Event()
            stream = asyncio.create_task(_stream(gw.url, key, first))
            await asyncio.wait_for(first.wait(), 30)
            private_redis.stop(signal.SIGKILL)
            async with httpx.AsyncClient(timeout=30.0) as client:
                refused = await client.post(f"{gw.url}/v1/chat/completions",
                                            headers={"Authorization": f"Bearer {key}"},
                                            json={"model": MODEL, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "now?"}]})
                # A background response cannot be queued (the broker is Redis): 503 too, and nothing kept.
                background = {"model": MODEL, "input": "later", "background": True, "max_output_tokens": 2}
                queued = await client.post(f"{gw.url}/v1/responses", json=background,
                                           headers={"Authorization": f"Bearer {key}"})
            assert refused.status_code == 503 and refused.json()["error"]["type"], refused.text
            assert queued.status_code == 503, queued.text
            request_id, usage = await asyncio.wait_for(stream, 60)
            assert usage["completion_tokens"] == 60
            await eventually(lambda: any(p.stat().st_size for p in spool.glob("usage-*.jsonl")),
                             "the record in the spool")
            private_redis.start()
            record = await eventually(lambda: _outbox(private_redis.url, request_id),
                                      "the record in the outbox")
            assert (record.status, record.prompt_tokens, record.completion_tokens) == (
                "completed", usage["prompt_tokens"], usage["completion_tokens"])
            await eventually(lambda: not any(p.stat().st_size for p in spool.glob("usage-*")),
                             "the spool to empty")
