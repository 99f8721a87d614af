"""Traces as an operator's collector receives them (``gateway/tracing.py``, ``engine/tracing.py``).

A real OTLP/HTTP receiver (``tests/gateway/otlp_receiver.py``: protobuf bodies decoded as the
OpenTelemetry Collector does) on a free port; an engine subprocess and a gateway exporting to it through
the standard ``OTEL_*`` variables, as an operator sets them. One trace runs from the client's ``traceparent``
through the gateway's request span, its engine call, and the engine's span of the request; the GenAI
attributes are the usage the client was answered and the cost that was metered; no key, no prompt text.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from opentelemetry import trace
from opentelemetry.proto.trace.v1.trace_pb2 import Span as SpanProto

from gateway.tracing import TracingMiddleware, route_template
from tests.gateway.conftest import (
    MODEL,
    GatewayUnderTest,
    gateway_settings,
    make_tenant_key,
    run_engine,
    run_gateway,
    wait_for_usage,
)
from tests.gateway.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.polling import eventually

PROMPT = "Tell me about the lighthouse keeper's secret garden"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    receiving = OtlpReceiver()
    yield receiving
    receiving.close()


# A short batch delay: spans reach the receiver within ~50 ms of ending.
BATCH = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture(scope="module")
def traced_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
                  receiver: OtlpReceiver) -> Iterator[str]:
    # The base endpoint (the exporter appends /v1/traces); the gateway below names the traces endpoint.
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **BATCH}
    log = tmp_path_factory.mktemp("traced_engine") / "engine.log"
    with run_engine(tiny_model_dir, log, env=env) as (url, _):
        yield url


@pytest.fixture(scope="module")
async def traced_gateway(traced_engine: str, tiny_model_dir: Path, api_database_url: str, redis_url: str,
                         model_price: None, receiver: OtlpReceiver) -> AsyncIterator[GatewayUnderTest]:
    settings = gateway_settings([traced_engine], tiny_model_dir, api_database_url, redis_url)
    environ = {"OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/v1/traces", **BATCH}
    async with run_gateway(settings, environ=environ) as running:
        yield running


def api(gateway: GatewayUnderTest, headers: dict[str, str]) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=headers, timeout=60)


def _attribute_values(spans: list[ReceivedSpan]) -> str:
    return " ".join(repr(v) for s in spans for v in s.attributes.values())


async def test_one_trace_runs_from_the_gateway_through_the_engine(traced_gateway: GatewayUnderTest,
                                                                  receiver: OtlpReceiver) -> None:
    key = await make_tenant_key(traced_gateway)
    async with api(traced_gateway, key.headers) as client:
        r = await client.post("/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 5,
            "temperature": 0.7})
    assert r.status_code == 200, r.text
    body, request_id = r.json(), r.headers["x-request-id"]

    server = await eventually(lambda: receiver.of_request(request_id, "tollgate-gateway"),
                              "the gateway's request span")
    engine = await eventually(lambda: receiver.of_request(request_id, "tollgate-engine"),
                              "the engine's span of the request")
    spans = receiver.trace(server.trace_id)
    assert engine.trace_id == server.trace_id
    assert server.name == "POST /v1/chat/completions" and server.parent_span_id == ""
    children = {s.name: s for s in spans if s.parent_span_id == server.span_id}
    assert {"admission", "routing", "POST /generate"} <= set(children)
    call = children["POST /generate"]
    assert call.kind == SpanProto.SPAN_KIND_CLIENT and call.service == "tollgate-gateway"
    assert engine.parent_span_id == call.span_id
    [replica] = traced_gateway.settings.pools["interactive"].replicas
    assert call.attributes["url.full"] == f"{replica}/generate"
    phases = {s.name for s in spans if s.parent_span_id == engine.span_id}
    assert phases == {"queue", "prefill", "decode"}
    assert "first_token" in engine.events and "first_token" in server.events

    usage = body["usage"]
    [record] = await wait_for_usage(traced_gateway.settings.redis_url, request_id)
    a = server.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == MODEL
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0.7
    assert a["gen_ai.response.id"] == body["id"]
    assert a["gen_ai.response.finish_reasons"] == [c["finish_reason"] for c in body["choices"]]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a["tollgate.usage.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert a["tollgate.tenant.id"] == key.tenant_id
    assert a["tollgate.tier"] == record["tier"]
    assert a["tollgate.cost.pico_usd"] == record["cost_pico_usd"] > 0
    assert a["http.response.status_code"] == 200 and a["http.route"] == "/v1/chat/completions"
    assert engine.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert engine.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]

    # Ids, counts and names only: neither the key nor a word of the prompt or the answer.
    values = _attribute_values(spans)
    assert key.key not in values and "lighthouse" not in values
    answer = body["choices"][0]["message"]["content"].strip()
    assert len(answer) < 8 or answer not in values  # (a few random tokens could be "/" or "tiny")


async def test_a_streamed_request_continues_the_clients_trace(traced_gateway: GatewayUnderTest,
                                                              receiver: OtlpReceiver) -> None:
    key = await make_tenant_key(traced_gateway)
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    headers = {**key.headers, "traceparent": f"00-{trace_id}-{parent_id}-01"}
    chunks = []
    async with api(traced_gateway, headers) as client:
        async with client.stream("POST", "/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunks.append(orjson.loads(line[6:]))
    usage = chunks[-1]["usage"]

    server = await eventually(lambda: receiver.of_request(request_id, "tollgate-gateway"),
                              "the gateway's request span")
    engine = await eventually(lambda: receiver.of_request(request_id, "tollgate-engine"),
                              "the engine's span of the request")
    assert server.trace_id == engine.trace_id == trace_id
    assert server.parent_span_id == parent_id
    # The span lasted until the stream's end: the result that the last chunk reported is on it.
    assert server.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert server.attributes["gen_ai.response.id"] == chunks[0]["id"]


async def test_a_trace_the_client_did_not_sample_is_not_recorded(traced_gateway: GatewayUnderTest,
                                                                 receiver: OtlpReceiver) -> None:
    key = await make_tenant_key(traced_gateway)
    unsampled = secrets.token_hex(16)
    async with api(traced_gateway, key.headers) as client:
        not_sampled = {"traceparent": f"00-{unsampled}-{'1' * 16}-00"}
        skipped = await client.post("/chat/completions", headers=not_sampled, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert skipped.status_code == 200
        # A sampled request after it: once its spans are in, the unsampled one's would be too.
        after = await client.post("/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    request_id = after.headers["x-request-id"]
    await eventually(lambda: receiver.of_request(request_id, "tollgate-gateway"), "the gateway's span")
    await eventually(lambda: receiver.of_request(request_id, "tollgate-engine"), "the engine's span")
    assert receiver.trace(unsampled) == []
    assert receiver.of_request(skipped.headers["x-request-id"], "tollgate-engine") is None


async def test_tracing_off_sets_up_nothing_and_exports_nothing(traced_engine: str, tiny_model_dir: Path,
                                                               api_database_url: str, redis_url: str,
                                                               model_price: None,
                                                               receiver: OtlpReceiver) -> None:
    # An endpoint is set, but the exporter is "none": the gateway traces nothing.
    settings = gateway_settings([traced_engine], tiny_model_dir, api_database_url, redis_url)
    environ = {"OTEL_TRACES_EXPORTER": "none",
               "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{receiver.url}/v1/traces"}
    async with run_gateway(settings, environ=environ) as untraced:
        assert untraced.app.state.tracing is None and untraced.runtime.tracer is None
        assert not any(m.cls is TracingMiddleware for m in untraced.app.user_middleware)
        key = await make_tenant_key(untraced)
        client_trace = secrets.token_hex(16)
        headers = {**key.headers, "traceparent": f"00-{client_trace}-{'2' * 16}-01"}
        async with api(untraced, headers) as client:
            r = await client.post("/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200
    # No SDK provider anywhere in this process (the traced gateway's is its own, never the global one).
    assert type(trace.get_tracer_provider()).__name__ == "ProxyTracerProvider"
    # The (traced) engine's span of the request is a trace of its own: no traceparent reached it.
    request_id = r.headers["x-request-id"]
    engine = await eventually(lambda: receiver.of_request(request_id, "tollgate-engine"), "the engine's span")
    assert engine.parent_span_id == "" and engine.trace_id != client_trace
    assert receiver.of_request(request_id, "tollgate-gateway") is None
    assert receiver.trace(client_trace) == []


def test_unconfigured_gateway_app_has_no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    from tollgate.gateway_app import create_app
    from tollgate.settings import Settings

    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        monkeypatch.delenv(name)
    app = create_app(Settings(environment="test"))
    assert app.state.tracing is None
    assert not any(m.cls is TracingMiddleware for m in app.user_middleware)


@pytest.mark.parametrize(("route", "path", "params", "template"), [
    ("/chat/completions", "/v1/chat/completions", {}, "/v1/chat/completions"),  # under the /v1 router
    ("/v1/chat/completions", "/v1/chat/completions", {}, "/v1/chat/completions"),  # a route with its prefix
    ("/models/{model:path}", "/v1/models/org/tiny", {"model": "org/tiny"}, "/v1/models/{model}"),
    ("/{file_id}/content", "/v1/files/file-1/content", {"file_id": "file-1"}, "/v1/files/{file_id}/content"),
])
def test_span_names_use_the_route_template_not_the_ids(route: str, path: str, params: dict[str, str],
                                                       template: str) -> None:
    from starlette.routing import Route

    matched = Route(route, endpoint=lambda request: None)
    assert route_template({"route": matched, "path": path, "path_params": params}) == template
