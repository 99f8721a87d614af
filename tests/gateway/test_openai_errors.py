"""Bad input is a 4xx in OpenAI's error body (never a 500), naming the parameter; every response carries
``x-request-id``."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from tests.gateway.conftest import MODEL, GatewayUnderTest, make_tenant_key
from tests.openai_schema import assert_conforms

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MSG}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

# (body, expected param); each must be a 400 invalid_request_error.
INVALID_CHAT = [
    ({"messages": MSG}, "model"),
    ({"model": MODEL}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0]"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user"}]}, "messages[0].content"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({**CHAT, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({**CHAT, "messages": [{"role": "assistant"}]}, "messages[0]"),
    ({**CHAT, "temperature": 2.5}, "temperature"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "n": 129}, "n"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": -1}, "max_completion_tokens"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({**CHAT, "frequency_penalty": -2.1}, "frequency_penalty"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "stop": 5}, "stop"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
    ({**CHAT, "logit_bias": {"50": 5}}, "logit_bias"),
    ({**CHAT, "logit_bias": {"50": 500}}, "logit_bias"),
    ({**CHAT, "response_format": {"type": "xml"}}, "response_format"),
    ({**CHAT, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "bad name!"}}},
     "response_format.json_schema.name"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({**CHAT, "tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0]"),
    ({**CHAT, "tool_choice": "sometimes"}, "tool_choice"),
    ({**CHAT, "tool_choice": "required"}, "tool_choice"),
    # Tool settings need tools, and tools at least one (OpenAI's rules).
    ({**CHAT, "tool_choice": "auto"}, "tool_choice"),
    ({**CHAT, "tool_choice": "none"}, "tool_choice"),
    ({**CHAT, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({**CHAT, "tools": []}, "tools"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "a"}}],
      "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
          {"type": "function", "function": {"name": "b"}}]}}}, "tool_choice.allowed_tools.tools[0]"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "a"}}],
      "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}},
     "tool_choice.allowed_tools.mode"),
    ({**CHAT, "tool_choice": {"type": "function", "name": "a"}}, "tool_choice.function"),
    # A tool message answers a call of the assistant message before it; every call is answered.
    ({**CHAT, "messages": [{"role": "tool", "tool_call_id": "call_zzz", "content": "sunny"}]},
     "messages[0].tool_call_id"),
    ({**CHAT, "messages": [*MSG, {"role": "assistant", "tool_calls": [CALL]}, *MSG]}, "messages[1].role"),
    ({**CHAT, "messages": [*MSG, {"role": "assistant", "tool_calls": [CALL]}]}, "messages[1].role"),
    ({**CHAT, "messages": [*MSG, {"role": "assistant", "tool_calls": [CALL]}, *MSG,
                           {"role": "tool", "tool_call_id": "call_1", "content": "late"}]},
     "messages[1].role"),
    # strict: true takes OpenAI's subset: every object closed and all its properties required.
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "strict": True,
        "schema": {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}},
     "response_format.json_schema"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                                               "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False}}}]}, "tools[0].function"),
    # JSON mode needs the word "json" somewhere in the messages.
    ({**CHAT, "response_format": {"type": "json_object"}}, "messages"),
    ({**CHAT, "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({**CHAT, "metadata": {"k": {"nested": True}}}, "metadata.k"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "a"}}],
      "tool_choice": {"type": "function", "function": {"name": "b"}}}, "tool_choice"),
    ({**CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
    ({**CHAT, "service_tier": "gold"}, "service_tier"),
    ({**CHAT, "seed": 2**70}, "seed"),
    ({**CHAT, "modalities": ["text", "audio"]}, "modalities"),
    ({**CHAT, "audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ({**CHAT, "max_tokens": 5000}, "messages"),  # beyond the model's 2048-token context
    # Refused by the engine's grammar compiler, passed on as a 400 naming the client's parameter.
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}}, "response_format"),
    ({**CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "nonsense"}}}]}, "tools"),
]

INVALID_COMPLETION = [
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
    ({"model": MODEL, "prompt": [[]]}, "prompt"),
    ({"model": MODEL, "prompt": [-1]}, "prompt"),
    ({"model": MODEL, "prompt": [999999]}, "prompt"),
    ({"model": MODEL, "prompt": "x", "suffix": "y"}, "suffix"),
    ({"model": MODEL, "prompt": "x", "best_of": 3}, "best_of"),
    ({"model": MODEL, "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
]


def check_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["x-request-id"].startswith("req_")
    body = r.json()
    assert_conforms(body, "ErrorResponse")
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


@pytest.mark.parametrize(("body", "param"), INVALID_CHAT,
                         ids=[p + str(i) for i, (_, p) in enumerate(INVALID_CHAT)])
async def test_invalid_chat_params_are_400(client: httpx.AsyncClient, body: dict, param: str) -> None:
    error = check_error(await client.post("/chat/completions", json=body), 400, param)
    assert error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(("change", "param"), [
    ({"logit_bias": {"50": 5}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0]"),
])
async def test_what_the_platform_does_not_do_is_refused_as_unsupported(client: httpx.AsyncClient,
                                                                        change: dict, param: str) -> None:
    """A refusal of something OpenAI has and this platform does not says so in its code, so that a
    client can tell it from a value it got wrong."""
    error = check_error(await client.post("/chat/completions", json={**CHAT, **change}), 400, param)
    assert error["code"] == "unsupported_parameter", error


@pytest.mark.parametrize(("change", "param"), [
    ({"max_tokens": "2"}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"n": "2"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"logprobs": "true"}, "logprobs"),
    ({"n": 2.0}, "n"),
])
async def test_values_of_the_wrong_json_type_are_refused_not_converted(client: httpx.AsyncClient,
                                                                       change: dict, param: str) -> None:
    """As at OpenAI: a string is not taken for a number or a boolean (a client bug surfaces here, not
    later against OpenAI); an integer is a number."""
    error = check_error(await client.post("/chat/completions", json={**CHAT, **change}), 400, param)
    assert error["code"] == "invalid_type", error
    ok = await client.post("/chat/completions", json={**CHAT, "max_tokens": 1, "temperature": 1, "top_p": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("body", "param"), INVALID_COMPLETION,
                         ids=[p + str(i) for i, (_, p) in enumerate(INVALID_COMPLETION)])
async def test_invalid_completion_params_are_400(client: httpx.AsyncClient, body: dict, param: str) -> None:
    check_error(await client.post("/completions", json=body), 400, param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b'"text"', b"null", b"\xff\xfe"])
async def test_malformed_bodies_are_400(client: httpx.AsyncClient, raw: bytes) -> None:
    r = await client.post("/chat/completions", content=raw, headers={"content-type": "application/json"})
    check_error(r, 400)


async def test_a_tool_round_trip_and_json_mode_named_in_any_message_are_accepted(
    client: httpx.AsyncClient,
) -> None:
    """The valid shapes beside the refused ones: every call answered right after its assistant message
    (in any order), and "JSON" in any message (any case) for JSON mode."""
    second = {**CALL, "id": "call_2"}
    messages = [{"role": "system", "content": "Answer in Json."}, *MSG,
                {"role": "assistant", "tool_calls": [CALL, second]},
                {"role": "tool", "tool_call_id": "call_2", "content": "b"},
                {"role": "tool", "tool_call_id": "call_1", "content": "a"}, *MSG]
    r = await client.post("/chat/completions", json={
        **CHAT, "messages": messages, "max_tokens": 1, "response_format": {"type": "json_object"},
        "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"})
    assert r.status_code == 200, r.text


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient) -> None:
    r = await client.post("/chat/completions", json={**CHAT, "max_tokens": 1, "some_future_field": {"a": 1},
                                                     "metadata": {"k": "v"}, "store": False})
    assert r.status_code == 200, r.text


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    for path, body in (("/chat/completions", {**CHAT, "model": "gpt-9"}),
                       ("/completions", {"model": "gpt-9", "prompt": "x"})):
        error = check_error(await client.post(path, json=body), 404, "model")
        assert error["code"] == "model_not_found"


@pytest.mark.parametrize("auth", [None, "Bearer", "Basic abc", "Bearer sk-nope",
                                  "Bearer sk-tg-aaaaaaaaaaaa-" + "A" * 43])
async def test_bad_keys_are_401(gateway: GatewayUnderTest, auth: str | None) -> None:
    headers = {"Authorization": auth} if auth is not None else {}
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=headers) as c:
        for r in (await c.post("/chat/completions", json=CHAT), await c.get("/models")):
            check_error(r, 401)


async def test_revoked_and_expired_keys_are_401(gateway: GatewayUnderTest) -> None:
    for columns in ({"revoked_at": datetime(2024, 1, 1, tzinfo=UTC)},):
        tk = await make_tenant_key(gateway, **columns)
        async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers) as c:
            check_error(await c.get("/models"), 401)


async def test_unknown_route_and_method(client: httpx.AsyncClient) -> None:
    check_error(await client.get("/nope"), 404)
    check_error(await client.get("/chat/completions"), 405)


async def test_body_too_large_is_413(client: httpx.AsyncClient, gateway: GatewayUnderTest) -> None:
    limit = gateway.settings.max_request_body_bytes
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * (limit + 10)}]}
    check_error(await client.post("/chat/completions", json=big), 413)

    async def chunks():  # no content-length: the limit must hold on the bytes actually received
        for _ in range(limit // 1000 + 2):
            yield b" " * 1000

    r = await client.post("/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    check_error(r, 413)


async def test_suspended_tenant_is_refused(gateway: GatewayUnderTest) -> None:
    for reason, status in (("admin", 403), ("billing", 429)):
        tk = await make_tenant_key(gateway, status="suspended", suspended_reason=reason)
        async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers, timeout=30) as c:
            check_error(await c.post("/chat/completions", json={**CHAT, "max_tokens": 1}), status)
