"""Gateway observability with real processes: ``tollgate gateway --workers 2`` in front of a synthetic
engine. ``/metrics`` answers the same merged view from either worker (Prometheus multiprocess mode), its
token counters equal the ``usage`` objects clients were given, rejections are counted by reason and
tier, and the logs are JSON lines that carry the request id the client saw in ``x-request-id``."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.logging import JsonFormatter
from gateway.middleware import request_id_var
from tests.factories import create_api_key, create_price, create_tenant
from tests.gateway.gateway_processes import MODEL, gateway_env, gateway_process, synthetic_engine
from tests.polling import wait_until
from tollgate.db import Database

pytestmark = pytest.mark.slow

METRICS_TOKEN = "prometheus-scrape-token"


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """One scrape on a fresh connection, with the metrics token as Prometheus sends it:
    {(sample name, sorted labels): value}."""
    response = httpx.get(f"{url}/metrics", timeout=10.0, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert response.status_code == 200, response.text
    text = response.text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def without_scrapes(samples: dict) -> dict:
    return {k: v for k, v in samples.items() if ("route", "/metrics") not in k[1]
            and k[0] != "tollgate_gateway_requests_in_flight"}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def _seed(database_url: str) -> tuple[str, str]:
    db = Database(database_url, pool_size=1)
    try:
        async with db.session() as session:
            await create_price(session, model=MODEL)
            tenant = await create_tenant(session, tier="default")
            _, key = await create_api_key(session, tenant)
            limited = await create_tenant(session, tier="flex", rpm_limit=1)
            _, limited_key = await create_api_key(session, limited)
        return key, limited_key
    finally:
        await db.dispose()


def test_formatter_writes_one_json_line_with_the_request_id() -> None:
    token = request_id_var.set("req_abc")
    try:
        try:
            raise ValueError("boom\nsecond line")
        except ValueError:
            record = logging.LogRecord("tollgate.x", logging.ERROR, __file__, 1, "failed %s", ("here",),
                                       exc_info=__import__("sys").exc_info())
        line = JsonFormatter().format(record)
    finally:
        request_id_var.reset(token)
    assert "\n" not in line
    body = json.loads(line)
    assert body["request_id"] == "req_abc" and body["message"] == "failed here"
    assert body["level"] == "ERROR" and body["exc_type"] == "ValueError" and "boom" in body["traceback"]


async def test_metrics_merge_workers_and_match_usage(new_database: str, redis_url: str,
                                                     tiny_model_dir: Path, tmp_path: Path) -> None:
    key, limited_key = await _seed(new_database)
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=0.002, ttft_s=0.005) as engine:
        env = gateway_env(database_url=new_database, redis_url=redis_url, replicas=[engine.url],
                          tokenizer_dir=tiny_model_dir, metrics_token=METRICS_TOKEN)
        with gateway_process(env, tmp_path / "gateway.log", workers=2, api_key=key) as gw:
            unauthenticated = httpx.get(f"{gw.url}/metrics", timeout=10.0)
            assert unauthenticated.status_code == 401 and "error" in unauthenticated.json()
            before = scrape(gw.url)
            usages = []

            async def call(i: int) -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"count {i}"}],
                        "max_tokens": 3 + i % 5}
                async with httpx.AsyncClient(timeout=30.0) as client:  # a connection per request
                    headers = {"Authorization": f"Bearer {key}"}
                    if i % 2:
                        body |= {"stream": True, "stream_options": {"include_usage": True}}
                        async with client.stream("POST", f"{gw.url}/v1/chat/completions", json=body,
                                                 headers=headers) as response:
                            assert response.status_code == 200
                            last = None
                            async for line in response.aiter_lines():
                                if line.startswith("data: {"):
                                    last = json.loads(line[6:])
                            usages.append(last["usage"])
                    else:
                        response = await client.post(f"{gw.url}/v1/chat/completions", json=body,
                                                     headers=headers)
                        assert response.status_code == 200, response.text
                        usages.append(response.json()["usage"])

            await asyncio.gather(*(call(i) for i in range(16)))
            limited = {"Authorization": f"Bearer {limited_key}"}
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            statuses = [httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=limited,
                                   timeout=30.0).status_code for _ in range(2)]
            assert statuses == [200, 429]

            def completed(samples: dict) -> float:
                return value(samples, "tollgate_gateway_generations_total", model=MODEL, tier="default",
                             status="completed")

            def settled() -> dict | None:
                """A scrape once both workers wrote their final values (a worker may still be finishing
                a request after its response went out): every generation counted, only the scrape itself
                in flight."""
                samples = scrape(gw.url)
                idle = value(samples, "tollgate_gateway_requests_in_flight") == 1
                return samples if idle and completed(samples) - completed(before) >= 16 else None

            after = wait_until(settled, "the 16 generations counted and nothing but the scrape in flight",
                               interval_s=0.05)
            # Either worker answers the same view (scrapes count themselves: leave those out).
            assert without_scrapes(scrape(gw.url)) == without_scrapes(after)

            def delta(name: str, **labels: str) -> float:
                return value(after, name, **labels) - value(before, name, **labels)

            assert completed(after) - completed(before) == 16
            for kind, field in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
                assert delta("tollgate_gateway_tokens_total", kind=kind, model=MODEL, tier="default") == sum(
                    u[field] for u in usages)
            cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
            assert delta("tollgate_gateway_tokens_total", kind="cached", model=MODEL,
                         tier="default") == cached
            assert delta("tollgate_gateway_ttft_seconds_count", model=MODEL, tier="default") == 16
            assert delta("tollgate_gateway_tpot_seconds_count", model=MODEL, tier="default") == 16
            assert delta("tollgate_gateway_requests_total", route="/v1/chat/completions", method="POST",
                         status="200") == 17, [k for k in after if k[0] == "tollgate_gateway_requests_total"]
            assert delta("tollgate_gateway_requests_total", route="/v1/chat/completions", method="POST",
                         status="429") == 1
            assert delta("tollgate_gateway_rejections_total", reason="rpm", tier="flex") == 1
            httpx.get(f"{gw.url}/no/such/path/{'x' * 8}", timeout=10.0)
            assert value(scrape(gw.url), "tollgate_gateway_requests_total", route="unmatched", method="GET",
                         status="404") >= 1

            # A stream whose engine dies: the warning in the log carries the client's request id.
            with httpx.stream("POST", f"{gw.url}/v1/chat/completions", timeout=30.0,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"model": MODEL, "messages": [{"role": "user", "content": "long"}],
                                    "max_tokens": 5000, "stream": True}) as response:
                request_id = response.headers["x-request-id"]
                lines = response.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                engine.kill()
                rest = list(lines)
            assert any('"error"' in line for line in rest)
            logged = gw.log_lines()
    assert logged and all("level" in r and "message" in r for r in logged)
    mine = [r for r in logged if r.get("request_id") == request_id]
    assert any("engine failed" in r["message"] for r in mine), mine
