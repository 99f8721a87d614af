"""``POST /v1/chat/completions`` against a real engine: bodies and chunks validate against OpenAI's
published schema, usage is metered once, structured output and tool calls hold for a random model."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest

from tests.gateway.conftest import MODEL, GatewayUnderTest, wait_for_usage
from tests.openai_schema import assert_conforms

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Say hello"}]


def sse_events(body: str) -> list[str]:
    """The ``data:`` payloads of an SSE body, checking the framing on the way."""
    assert body.endswith("\n\n")
    payloads = []
    for event in body.strip("\n").split("\n\n"):
        assert event.startswith("data: "), event
        payloads.append(event.removeprefix("data: "))
    return payloads


async def test_chat_completion_conforms_and_is_metered(client: httpx.AsyncClient, gateway: GatewayUnderTest,
                                                       tenant_key) -> None:
    r = await client.post("/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 8,
                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "CreateChatCompletionResponse")
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and body["service_tier"] == "default"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and 0 < usage["completion_tokens"] <= 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    request_id = r.headers["x-request-id"]
    assert request_id.startswith("req_")
    records = await wait_for_usage(gateway.settings.redis_url, request_id)
    assert len(records) == 1
    rec = records[0]
    assert rec["status"] == "completed" and rec["tenant_id"] == tenant_key.tenant_id
    assert rec["api_key_id"] == tenant_key.api_key_id and rec["model"] == MODEL
    assert rec["prompt_tokens"] == usage["prompt_tokens"]
    assert rec["completion_tokens"] == usage["completion_tokens"]
    assert rec["cost_pico_usd"] > 0


async def test_greedy_is_deterministic_and_n_choices(client: httpx.AsyncClient) -> None:
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 6, "temperature": 0}
    a = (await client.post("/chat/completions", json=req)).json()
    b = (await client.post("/chat/completions", json=req)).json()
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    r = await client.post("/chat/completions", json={**req, "n": 3, "temperature": 1.0, "seed": 7})
    body = r.json()
    assert_conforms(body, "CreateChatCompletionResponse")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]


async def test_stream_with_usage_follows_openai(client: httpx.AsyncClient, gateway: GatewayUnderTest) -> None:
    r = await client.post("/chat/completions", json={
        "model": MODEL, "messages": HELLO, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert_conforms(chunk, "CreateChatCompletionStreamResponse")
        assert chunk["object"] == "chat.completion.chunk"
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    first, finish, usage_chunk = chunks[0], chunks[-2], chunks[-1]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert finish["choices"][0]["finish_reason"] in ("stop", "length") and finish["choices"][0]["delta"] == {}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-2]]
    assert all(set(d) == {"content"} and d["content"] for d in deltas)
    records = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert len(records) == 1 and records[0]["completion_tokens"] == usage_chunk["usage"]["completion_tokens"]
    assert records[0]["status"] == "completed"


async def test_stream_with_several_choices(client: httpx.AsyncClient) -> None:
    r = await client.post("/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 4,
                                                     "n": 2, "stream": True, "seed": 3})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    for chunk in chunks:
        assert_conforms(chunk, "CreateChatCompletionStreamResponse")
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert mine[-1]["finish_reason"] in ("stop", "length")
        assert all(c["finish_reason"] is None for c in mine[:-1])


async def test_stream_without_usage_has_no_usage_field(client: httpx.AsyncClient) -> None:
    r = await client.post("/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 3,
                                                     "stream": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert all("usage" not in c for c in chunks)
    for chunk in chunks:
        assert_conforms(chunk, "CreateChatCompletionStreamResponse")


async def test_json_schema_response_format_is_valid_json(client: httpx.AsyncClient) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = await client.post("/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris as JSON"}],
        "max_tokens": 200, "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema,
                                                                   "strict": True}},
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "CreateChatCompletionResponse")
    assert body["choices"][0]["finish_reason"] == "stop", body
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


async def test_json_object_response_format(client: httpx.AsyncClient) -> None:
    # JSON mode needs the word in the messages, as at OpenAI (test_openai_errors: without it, a 400).
    r = await client.post("/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello in JSON"}], "max_tokens": 40,
        "response_format": {"type": "json_object"},
    })
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                   "required": ["city"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}},
    "required",
    # Only get_weather may be called, and one call is required: as the named choice.
    {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "get_weather"}}]}},
])
async def test_forced_tool_call(client: httpx.AsyncClient, tool_choice) -> None:
    r = await client.post("/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 100,
        "tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": tool_choice, "temperature": 0,
    })
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "CreateChatCompletionResponse")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    call = choice["message"]["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    tools = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}
    if isinstance(tool_choice, dict):  # named, or the only one allowed
        assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]),
                        tools[call["function"]["name"]]["function"]["parameters"])
    assert choice["message"]["content"] is None


async def test_forced_tool_call_streamed_and_tool_round_trip(client: httpx.AsyncClient) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 100,
           "temperature": 0,
           "tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
           "stream": True}
    r = await client.post("/chat/completions", json=req)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    for chunk in chunks:
        assert_conforms(chunk, "CreateChatCompletionStreamResponse")
    calls = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # Send the call and its result back, as an agent loop does.
    follow_up = {"model": MODEL, "max_tokens": 5, "tools": [WEATHER_TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": calls[0]["id"], "type": "function",
                                                               "function": calls[0]["function"]}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temp": 21}'},
    ]}
    r = await client.post("/chat/completions", json=follow_up)
    assert r.status_code == 200, r.text
    assert_conforms(r.json(), "CreateChatCompletionResponse")


CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Buenos Aires", "Reykjavik"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
# Every arguments text the grammar can generate for CITY_TOOL (compact, in the schema's order).
CITY_ARGUMENTS = [json.dumps({"city": c, "unit": u}, separators=(",", ":"))
                  for c in ("Paris", "Buenos Aires", "Reykjavik") for u in ("celsius", "fahrenheit")]


def assert_arguments_so_far(arguments: str) -> None:
    assert isinstance(arguments, str)
    assert any(whole.startswith(arguments) for whole in CITY_ARGUMENTS), arguments


async def test_forced_tool_call_cut_by_max_tokens_is_still_the_call(client: httpx.AsyncClient) -> None:
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "temperature": 0,
           "tools": [CITY_TOOL, TIME_TOOL],
           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = (await client.post("/chat/completions", json={**req, "max_tokens": 100})).json()
    assert whole["choices"][0]["finish_reason"] == "tool_calls", whole
    generated = whole["usage"]["completion_tokens"]
    inside_arguments = []
    for max_tokens in range(1, generated - 1):
        r = await client.post("/chat/completions", json={**req, "max_tokens": max_tokens})
        assert r.status_code == 200, r.text
        body = r.json()
        assert_conforms(body, "CreateChatCompletionResponse")
        choice = body["choices"][0]
        assert choice["finish_reason"] == "length", choice
        assert body["usage"]["completion_tokens"] == max_tokens
        [call] = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert choice["message"]["content"] is None
        assert_arguments_so_far(call["function"]["arguments"])
        if call["function"]["arguments"] not in ("", *CITY_ARGUMENTS):
            inside_arguments.append(max_tokens)
    assert inside_arguments, "no max_tokens cut the arguments themselves"

    r = await client.post("/chat/completions",
                          json={**req, "max_tokens": inside_arguments[0], "stream": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    for chunk in chunks:
        assert_conforms(chunk, "CreateChatCompletionStreamResponse")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": "", "refusal": None}
    assert not any(d.get("content") for d in deltas), deltas
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    assert_arguments_so_far(calls[0]["function"]["arguments"])
    assert calls[0]["function"]["arguments"] not in ("", *CITY_ARGUMENTS)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and deltas[-1] == {}


async def test_logprobs(client: httpx.AsyncClient) -> None:
    r = await client.post("/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 4,
                                                     "logprobs": True, "top_logprobs": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "CreateChatCompletionResponse")
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(t["top_logprobs"]) == 3 and t["logprob"] <= 0 for t in content)


async def test_repeated_long_prompt_reports_cached_tokens(client: httpx.AsyncClient,
                                                          gateway: GatewayUnderTest) -> None:
    system = "You are a careful assistant. " * 40
    req = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "system", "content": system},
                                                        {"role": "user", "content": "Hello"}]}
    first = (await client.post("/chat/completions", json=req)).json()
    second = await client.post("/chat/completions", json=req)
    usage = second.json()["usage"]
    assert first["usage"]["prompt_tokens"] == usage["prompt_tokens"] > 64
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 64
    # The first request wrote the prompt's full blocks to the cache; the second found them there.
    written = first["usage"]["prompt_tokens_details"]["cache_write_tokens"]
    assert written == first["usage"]["prompt_tokens"] // 16 * 16
    assert usage["prompt_tokens_details"]["cache_write_tokens"] == 0
    records = await wait_for_usage(gateway.settings.redis_url, second.headers["x-request-id"])
    assert records[0]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]


async def test_prefix_cache_is_not_shared_between_tenants(gateway: GatewayUnderTest) -> None:
    from tests.gateway.conftest import make_tenant_key

    req = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": "Tenant isolation check prompt, long enough to fill blocks. " * 12},
        {"role": "user", "content": "Hello"}]}
    cached = []
    for _ in range(2):
        tk = await make_tenant_key(gateway)
        async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers, timeout=60) as c:
            cached.append((await c.post("/chat/completions", json=req)).json()["usage"]
                          ["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 0]


async def test_service_tier_can_go_down_not_up(client: httpx.AsyncClient) -> None:
    base = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    served = []
    for asked in ("flex", "priority", "auto"):
        r = await client.post("/chat/completions", json={**base, "service_tier": asked})
        served.append(r.json()["service_tier"])
    assert served == ["flex", "default", "default"]


async def test_rate_limit_headers(gateway: GatewayUnderTest) -> None:
    from tests.gateway.conftest import make_tenant_key

    tk = await make_tenant_key(gateway, rpm_limit=2, tpm_limit=100_000)
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers, timeout=60) as c:
        req = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
        r = await c.post("/chat/completions", json=req)
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "2"
        assert "x-ratelimit-remaining-tokens" in r.headers
        await c.post("/chat/completions", json=req)
        r = await c.post("/chat/completions", json=req)
        assert r.status_code == 429
        assert_conforms(r.json(), "ErrorResponse")
        assert r.json()["error"]["code"] == "rate_limit_exceeded" and "retry-after" in r.headers


async def test_concurrent_mixed_requests_all_succeed(client: httpx.AsyncClient) -> None:
    async def one(i: int) -> httpx.Response:
        return await client.post("/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": f"Hello number {i}"}], "max_tokens": 6,
            "stream": i % 2 == 0})

    responses = await asyncio.gather(*(one(i) for i in range(24)))
    assert [r.status_code for r in responses] == [200] * 24


async def test_a_prediction_changes_no_answer_and_reports_its_tokens(client: httpx.AsyncClient,
                                                                      gateway: GatewayUnderTest) -> None:
    """Predicted Outputs: the same answer as without (greedy), the accepted and rejected prediction
    tokens in the usage, the rejected ones counted (and billed) as completion tokens."""
    req = {"model": MODEL, "messages": HELLO, "max_tokens": 24, "temperature": 0}
    plain = (await client.post("/chat/completions", json=req)).json()
    text = plain["choices"][0]["message"]["content"]
    assert plain["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] == 0
    for prediction in (text, [{"type": "text", "text": text[: len(text) // 2]},
                              {"type": "text", "text": "~" + text[len(text) // 2 + 1:]}]):
        r = await client.post("/chat/completions", json={**req, "prediction": {"type": "content",
                                                                              "content": prediction}})
        assert r.status_code == 200, r.text
        body = r.json()
        assert_conforms(body, "CreateChatCompletionResponse")
        assert body["choices"][0]["message"]["content"] == text
        usage, details = body["usage"], body["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] > 0
        generated = plain["usage"]["completion_tokens"]
        assert usage["completion_tokens"] == generated + details["rejected_prediction_tokens"]
        records = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
        assert records[0]["completion_tokens"] == usage["completion_tokens"]
    stream = await client.post("/chat/completions", json={**req, "stream": True,
                                                          "stream_options": {"include_usage": True},
                                                          "prediction": {"type": "content", "content": text}})
    chunks = [json.loads(e) for e in sse_events(stream.text)[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
    assert chunks[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0


@pytest.mark.parametrize(("extra", "param"), [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"prediction": {"type": "file", "content": "x"}}, "prediction"),
    ({"prediction": {"type": "content", "content": [{"type": "image_url", "image_url": {}}]}}, "prediction"),
])  # fmt: skip
async def test_a_prediction_with_what_openai_refuses_is_a_400(client: httpx.AsyncClient, extra: dict,
                                                               param: str) -> None:
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 4,
            "prediction": {"type": "content", "content": "Hello there"}, **extra}
    r = await client.post("/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param)
