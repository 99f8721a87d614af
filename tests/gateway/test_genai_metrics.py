"""The GenAI server metrics as an operator's collector receives them (``engine/otel_metrics.py``, recorded by
``gateway/generation/service.py``).

A gateway exports to a real OTLP/HTTP receiver (``tests/gateway/otlp_receiver.py``) every 50 ms, turned on
through the standard ``OTEL_*`` variables only. Each request a client makes shows in the cumulative
histograms exactly once: the token counts are the ``usage`` the client was answered, the time to first
token lies within what the client itself measured, the time per output token is the one metered in the
ledger, and a refused request counts in the request duration only, with its ``error.type``. Unconfigured, or
with ``OTEL_METRICS_EXPORTER=none`` while traces are on, nothing reaches ``/v1/metrics``.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from opentelemetry import metrics

from engine.otel_metrics import (
    INSTRUMENTS,
    REQUEST_DURATION,
    TIME_PER_OUTPUT_TOKEN,
    TIME_TO_FIRST_TOKEN,
    TOKEN_USAGE,
)
from tests.gateway.conftest import (
    MODEL,
    GatewayUnderTest,
    gateway_settings,
    make_tenant_key,
    run_gateway,
    wait_for_usage,
)
from tests.gateway.otlp_receiver import OtlpReceiver, ReceivedHistogram, SeriesKey
from tests.polling import eventually
from tollgate.settings import Settings

GATEWAY = "tollgate-gateway"
PROMPT = "Tell me about the lighthouse keeper's secret garden"
# Cumulative, every 50 ms: each request is in the receiver's latest points within a few exports.
EXPORT = {"OTEL_METRIC_EXPORT_INTERVAL": "50"}
CUMULATIVE = 2  # opentelemetry.proto.metrics.v1.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiving = OtlpReceiver()
    yield receiving
    receiving.close()


@pytest.fixture(scope="module")
async def metered_gateway(engine_url: str, tiny_model_dir: Path, api_database_url: str, redis_url: str,
                          model_price: None, receiver: OtlpReceiver) -> AsyncIterator[GatewayUnderTest]:
    settings = gateway_settings([engine_url], tiny_model_dir, api_database_url, redis_url)
    # The metrics endpoint alone: metrics on, traces off (they have no endpoint of their own).
    environ = {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": f"{receiver.url}/v1/metrics", **EXPORT}
    async with run_gateway(settings, environ=environ) as running:
        yield running


def api(gateway: GatewayUnderTest, headers: dict[str, str]) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=headers, timeout=60)


def series(metric: str, attributes: dict[str, Any]) -> SeriesKey:
    return metric, frozenset(attributes.items())


def tokens(attributes: dict[str, Any], token_type: str) -> SeriesKey:
    return series(TOKEN_USAGE, {**attributes, "gen_ai.token.type": token_type})


def expected_attributes(operation: str, tier: str) -> dict[str, Any]:
    return {"gen_ai.operation.name": operation, "gen_ai.provider.name": "tollgate",
            "gen_ai.request.model": MODEL, "gen_ai.response.model": MODEL, "tollgate.tier": tier}


class Since:
    """The gateway's histograms from now on: each series' count and sum less what it held before."""

    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        self.before = receiver.latest_histograms(GATEWAY)

    def changed(self) -> dict[SeriesKey, tuple[int, float]]:
        changes = {}
        for key, point in self.receiver.latest_histograms(GATEWAY).items():
            was = self.before.get(key)
            count, total = point.count - (was.count if was else 0), point.sum - (was.sum if was else 0.0)
            if count:
                changes[key] = (count, total)
        return changes

    async def until(self, expected_counts: dict[SeriesKey, int]) -> dict[SeriesKey, tuple[int, float]]:
        """The changes once every expected series has its count (failing if any other series changed)."""
        def arrived() -> dict[SeriesKey, tuple[int, float]] | None:
            changes = self.changed()
            counts = {key: count for key, (count, _) in changes.items()}
            return changes if all(counts.get(k) == n for k, n in expected_counts.items()) else None

        changes = await eventually(arrived, "the requests' metrics")
        assert {key: count for key, (count, _) in changes.items()} == expected_counts
        return changes

    def points(self) -> list[ReceivedHistogram]:
        return list(self.receiver.latest_histograms(GATEWAY).values())


async def test_a_streamed_chat_is_counted_as_its_client_saw_it(metered_gateway: GatewayUnderTest,
                                                               receiver: OtlpReceiver) -> None:
    key = await make_tenant_key(metered_gateway)
    since = Since(receiver)
    chunks = []
    async with api(metered_gateway, key.headers) as client:
        text_at: list[float] = []  # when each chunk carrying text arrived
        sent_at = time.perf_counter()
        async with client.stream("POST", "/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6,
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    chunks.append(chunk)
                    if any(c["delta"].get("content") for c in chunk["choices"]):
                        text_at.append(time.perf_counter())
        ended_at = time.perf_counter()
    assert text_at, "no chunk carried text"
    usage = chunks[-1]["usage"]
    [record] = await wait_for_usage(metered_gateway.settings.redis_url, request_id)

    attributes = expected_attributes("chat", record["tier"])
    expected = {series(REQUEST_DURATION, attributes): 1, series(TIME_TO_FIRST_TOKEN, attributes): 1,
                tokens(attributes, "input"): 1,
                tokens(attributes, "output"): 1}
    if record["tpot_ms"]:  # two tokens or more: a time per token after the first
        expected[series(TIME_PER_OUTPUT_TOKEN, attributes)] = 1
    changes = await since.until(expected)

    # Tokens: what the client's usage said, one request in each histogram.
    assert changes[tokens(attributes, "input")] == (
        1, usage["prompt_tokens"])
    assert changes[tokens(attributes, "output")] == (
        1, usage["completion_tokens"])
    # Times: the gateway's intervals lie inside the client's (it saw the request later and its first and last
    # token earlier), whatever the machine's speed: a bound between two measurements, not a speed.
    _, ttft = changes[series(TIME_TO_FIRST_TOKEN, attributes)]
    _, duration = changes[series(REQUEST_DURATION, attributes)]
    client_ttft, client_total = text_at[0] - sent_at, ended_at - sent_at
    assert 0 < ttft <= client_ttft
    assert ttft <= duration <= client_total
    if record["tpot_ms"]:
        _, tpot = changes[series(TIME_PER_OUTPUT_TOKEN, attributes)]
        assert tpot == pytest.approx(record["tpot_ms"] / 1000)

    # As the conventions define the instruments: units, advised buckets, cumulative.
    for point in since.points():
        unit, _, buckets = INSTRUMENTS[point.name]
        assert (point.unit, point.explicit_bounds, point.temporality) == (unit, list(buckets), CUMULATIVE)


async def test_each_operation_is_named_and_embeddings_count_input_only(metered_gateway: GatewayUnderTest,
                                                                       receiver: OtlpReceiver) -> None:
    key = await make_tenant_key(metered_gateway)
    since = Since(receiver)
    async with api(metered_gateway, key.headers) as client:
        completion = await client.post("/completions", json={"model": MODEL, "prompt": PROMPT,
                                                              "max_tokens": 3, "temperature": 0})
        embedding = await client.post("/embeddings", json={"model": MODEL, "input": ["The cat.", "Dogs."]})
    assert completion.status_code == 200 and embedding.status_code == 200, (completion.text, embedding.text)
    [record] = await wait_for_usage(metered_gateway.settings.redis_url, completion.headers["x-request-id"])

    text = expected_attributes("text_completion", record["tier"])
    vectors = expected_attributes("embeddings", record["tier"])
    expected = {series(REQUEST_DURATION, text): 1, series(TIME_TO_FIRST_TOKEN, text): 1,
                tokens(text, "input"): 1,
                tokens(text, "output"): 1,
                # An embedding generates nothing: no first token, no output tokens.
                series(REQUEST_DURATION, vectors): 1,
                tokens(vectors, "input"): 1}
    if record["tpot_ms"]:
        expected[series(TIME_PER_OUTPUT_TOKEN, text)] = 1
    changes = await since.until(expected)
    usage = completion.json()["usage"]
    assert changes[tokens(text, "input")][1] == usage["prompt_tokens"]
    assert changes[tokens(text, "output")][1] == usage["completion_tokens"]
    embedded = embedding.json()["usage"]["prompt_tokens"]
    assert changes[tokens(vectors, "input")][1] == embedded


async def test_a_refused_request_counts_as_an_error_with_no_tokens(metered_gateway: GatewayUnderTest,
                                                                   receiver: OtlpReceiver) -> None:
    key = await make_tenant_key(metered_gateway, rpm_limit=0)
    since = Since(receiver)
    async with api(metered_gateway, key.headers) as client:
        r = await client.post("/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    failed = {**expected_attributes("chat", "default"), "error.type": error["code"] or error["type"]}
    # The request's duration with its error, and nothing else: no first token, no tokens.
    await since.until({series(REQUEST_DURATION, failed): 1})


@pytest.fixture
def unmetered_settings(engine_url: str, tiny_model_dir: Path, api_database_url: str, redis_url: str,
                       model_price: None, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    return gateway_settings([engine_url], tiny_model_dir, api_database_url, redis_url)


@pytest.fixture
def own_receiver() -> Iterator[OtlpReceiver]:
    receiving = OtlpReceiver()
    yield receiving
    receiving.close()


async def test_unconfigured_gateway_exports_no_metrics(unmetered_settings: Settings,
                                                       own_receiver: OtlpReceiver) -> None:
    # Traces on (their own endpoint), metrics not asked for.
    await _serve_one_request(own_receiver, unmetered_settings, {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{own_receiver.url}/v1/traces", **EXPORT})


async def test_metrics_exporter_none_keeps_metrics_off_while_traces_stay_on(
        unmetered_settings: Settings, own_receiver: OtlpReceiver) -> None:
    # The base endpoint would turn both signals on; OTEL_METRICS_EXPORTER=none keeps metrics off.
    await _serve_one_request(own_receiver, unmetered_settings, {
        "OTEL_EXPORTER_OTLP_ENDPOINT": own_receiver.url, "OTEL_METRICS_EXPORTER": "none", **EXPORT})


async def _serve_one_request(receiver: OtlpReceiver, settings: Settings, environ: dict[str, str]) -> None:
    """A gateway made under ``environ`` (traces on, metrics not) serves a request and stops: its request
    span reaches the receiver, and no metrics request ever does, not even the flush at shutdown."""
    async with run_gateway(settings, environ=environ) as gateway:
        assert gateway.app.state.genai_metrics is None and gateway.runtime.genai_metrics is None
        assert gateway.app.state.tracing is not None
        key = await make_tenant_key(gateway)
        async with api(gateway, key.headers) as client:
            r = await client.post("/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        await eventually(lambda: receiver.of_request(r.headers["x-request-id"], GATEWAY),
                         "the gateway's request span")
    assert receiver.metric_exports == 0 and receiver.histograms == []
    # No SDK meter provider anywhere in this process (a metered gateway's is its own, never the global one).
    assert type(metrics.get_meter_provider()).__name__ == "_ProxyMeterProvider"
