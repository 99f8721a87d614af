"""``POST /v1/responses`` against a real engine: the ``Response`` object and every stream event validate
against OpenAI's published schemas, events come in OpenAI's order with contiguous sequence numbers,
structured output and forced tool calls hold for a random model, a tool round trip works, usage is
metered once like a chat completion, and bad input gets OpenAI's 400."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.gateway.conftest import MODEL, GatewayUnderTest, TenantKey, usage_records, wait_for_usage
from tests.openai_schema import assert_conforms

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "strict": True,
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["tz"], "additionalProperties": False}}


def stream_events(body: str) -> list[dict[str, Any]]:
    """The events of a Responses stream: ``event: <type>`` then ``data: <json>``, the type repeated."""
    assert body.endswith("\n\n")
    events = []
    for block in body.strip("\n").split("\n\n"):
        name_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {event['type']}", block
        events.append(event)
    return events


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"] if part["type"] == "output_text")


async def test_plain_response_conforms_and_is_metered(client: httpx.AsyncClient, gateway: GatewayUnderTest,
                                                      tenant_key) -> None:
    r = await client.post("/responses", json={"model": MODEL, "input": "Say hello", "max_output_tokens": 6,
                                               "temperature": 0, "metadata": {"run": "1"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "Response")
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["model"] == MODEL
    assert body["metadata"] == {"run": "1"} and body["service_tier"] == "default"
    message = body["output"][0]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0]["type"] == "output_text" and message["content"][0]["text"]
    usage = body["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 6
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    if usage["output_tokens"] == 6:  # a random model rarely stops by itself
        assert body["status"] == "incomplete"
        assert body["incomplete_details"] == {"reason": "max_output_tokens"}
        assert message["status"] == "incomplete"
    else:
        assert body["status"] == "completed" and body["completed_at"] >= body["created_at"]
    records = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert len(records) == 1
    record = records[0]
    assert record["tenant_id"] == tenant_key.tenant_id and record["status"] == "completed"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (usage["input_tokens"],
                                                                      usage["output_tokens"])
    assert record["cost_pico_usd"] > 0


async def test_instructions_and_message_items_are_the_prompt(client: httpx.AsyncClient) -> None:
    items = {"model": MODEL, "max_output_tokens": 2, "temperature": 0, "instructions": "Be brief.",
             "input": [{"role": "developer", "content": "Answer in French."},
                       {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                       {"role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
                       {"role": "user", "content": "Again"}]}
    r = await client.post("/responses", json=items)
    assert r.status_code == 200, r.text
    assert_conforms(r.json(), "Response")
    shorter = await client.post("/responses", json={**items, "instructions": None})
    # The instructions are part of the prompt: billed as input.
    assert r.json()["usage"]["input_tokens"] > shorter.json()["usage"]["input_tokens"]
    assert r.json()["instructions"] == "Be brief." and shorter.json()["instructions"] is None


async def test_streamed_events_in_order_and_valid(client: httpx.AsyncClient) -> None:
    r = await client.post("/responses", json={"model": MODEL, "input": "Tell a story", "max_output_tokens": 8,
                                               "temperature": 0, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = stream_events(r.text)
    for event in events:
        assert_conforms(event, "ResponseStreamEvent")
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert deltas and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", kinds[-1]]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    text = "".join(d["delta"] for d in deltas)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert done["text"] == text == output_text(final)
    assert final["id"] == events[0]["response"]["id"] and final["usage"]["output_tokens"] > 0
    assert {d["item_id"] for d in deltas} == {final["output"][0]["id"]}


async def test_json_schema_format_is_valid_json(client: httpx.AsyncClient) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    r = await client.post("/responses", json={
        "model": MODEL, "input": "Weather in Paris as JSON", "max_output_tokens": 200, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "Response")
    assert body["status"] == "completed", body
    assert body["text"]["format"]["type"] == "json_schema" and body["text"]["format"]["name"] == "weather"
    jsonschema.validate(json.loads(output_text(body)), schema)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
async def test_forced_function_call(client: httpx.AsyncClient, tool_choice: Any) -> None:
    r = await client.post("/responses", json={"model": MODEL, "input": "Weather in Paris?", "temperature": 0,
                                               "max_output_tokens": 100, "tools": [WEATHER, TIME],
                                               "tool_choice": tool_choice})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "Response")
    assert body["status"] == "completed", body
    [call] = body["output"]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
    tools = {"get_weather": WEATHER, "get_time": TIME}
    if isinstance(tool_choice, dict):
        assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), tools[call["name"]]["parameters"])
    assert body["tool_choice"] == tool_choice and [t["name"] for t in body["tools"]] == ["get_weather",
                                                                                          "get_time"]


async def test_a_forced_call_cut_by_max_output_tokens_is_an_incomplete_call(
        client: httpx.AsyncClient) -> None:
    whole = (await client.post("/responses", json={
        "model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "temperature": 0,
        "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 100})).json()
    arguments = whole["output"][0]["arguments"]
    cut = await client.post("/responses", json={
        "model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "temperature": 0,
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": whole["usage"]["output_tokens"] - 3})
    body = cut.json()
    assert_conforms(body, "Response")
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    [call] = body["output"]  # the call, never text
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert call["status"] == "incomplete"
    compact = json.dumps(json.loads(arguments), separators=(",", ":"))
    assert compact.startswith(call["arguments"]) and call["arguments"] != compact


async def test_streamed_function_call_then_its_output_round_trip(client: httpx.AsyncClient) -> None:
    r = await client.post("/responses", json={"model": MODEL, "input": "Weather in Paris?", "temperature": 0,
                                               "max_output_tokens": 100, "tools": [WEATHER], "stream": True,
                                               "tool_choice": {"type": "function", "name": "get_weather"}})
    events = stream_events(r.text)
    for event in events:
        assert_conforms(event, "ResponseStreamEvent")
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    call = events[-1]["response"]["output"][0]
    assert events[4]["arguments"] == call["arguments"] == events[3]["delta"]
    assert events[4]["name"] == call["name"]
    # The agent runs the tool and sends the call and its output back.
    follow_up = await client.post("/responses", json={
        "model": MODEL, "max_output_tokens": 4, "tools": [WEATHER], "input": [
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call["call_id"], "name": call["name"],
             "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp": 21}'}]})
    assert follow_up.status_code == 200, follow_up.text
    assert_conforms(follow_up.json(), "Response")
    assert follow_up.json()["usage"]["input_tokens"] > events[-1]["response"]["usage"]["input_tokens"]


@pytest.mark.parametrize(("change", "param"), [
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True, "stream": True}, "stream"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"model": "nope"}, "model"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {"type": "string"}}}},
     "text.format"),
    ({"tools": [{**WEATHER, "parameters": {"type": "object", "properties": {}}}]}, "tools[0]"),
    # Each would change the answer, and neither exists here: refused rather than ignored.
    ({"conversation": "conv_123"}, "conversation"),
    ({"conversation": {"id": "conv_123"}}, "conversation"),
    ({"prompt": {"id": "pmpt_123", "version": "2"}}, "prompt"),
])  # fmt: skip
async def test_bad_requests_get_openai_400s(client: httpx.AsyncClient, change: dict[str, Any],
                                            param: str) -> None:
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, **change}
    r = await client.post("/responses", json=body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] is not None and error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error"


async def test_logprobs_come_when_include_asks_for_them(client: httpx.AsyncClient) -> None:
    """As at OpenAI: ``include: ["message.output_text.logprobs"]`` returns them, ``top_logprobs`` says
    how many alternatives each carries and alone returns none."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "temperature": 0, "top_logprobs": 2}

    def logprobs(response: dict[str, Any]) -> list[dict[str, Any]]:
        return [lp for item in response["output"] for part in item.get("content", [])
                for lp in part.get("logprobs") or []]

    alone = (await client.post("/responses", json=body)).json()
    assert logprobs(alone) == []
    include = ["message.output_text.logprobs"]
    asked = (await client.post("/responses", json={**body, "include": include})).json()
    assert_conforms(asked, "Response")
    assert logprobs(asked) and all(len(lp["top_logprobs"]) == 2 for lp in logprobs(asked))


# -- stored responses and conversation state -----------------------------------------------------------

LONG = " ".join(f"word{i}" for i in range(80))  # several prefix-cache blocks of prompt


async def test_stored_by_default_then_retrieved_listed_and_deleted(client: httpx.AsyncClient) -> None:
    created = await client.post("/responses", json={"model": MODEL, "max_output_tokens": 3, "input": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "One"},
        {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three"}]})
    assert created.status_code == 200, created.text
    body = created.json()
    assert body["store"] is True
    fetched = await client.get(f"/responses/{body['id']}")
    assert fetched.status_code == 200 and fetched.json() == body
    listed = (await client.get(f"/responses/{body['id']}/input_items")).json()
    assert_conforms(listed, "ResponseItemList")
    assert [(i["role"], i["content"][0]["text"]) for i in listed["data"]] == [
        ("user", "Three"), ("assistant", "Two"), ("user", "One"), ("developer", "Be brief.")]  # newest first
    assert listed["has_more"] is False and listed["first_id"] == listed["data"][0]["id"]
    page = (await client.get(f"/responses/{body['id']}/input_items",
                             params={"order": "asc", "limit": 2})).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["Be brief.", "One"] and page["has_more"]
    rest = (await client.get(f"/responses/{body['id']}/input_items",
                             params={"order": "asc", "after": page["last_id"]})).json()
    assert [i["content"][0]["text"] for i in rest["data"]] == ["Two", "Three"] and not rest["has_more"]
    deleted = await client.delete(f"/responses/{body['id']}")
    assert deleted.json() == {"id": body["id"], "object": "response", "deleted": True}
    url = f"/responses/{body['id']}"
    for gone in (await client.get(url), await client.delete(url), await client.get(f"{url}/input_items")):
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"


async def test_store_false_keeps_nothing_and_a_stream_is_stored_as_it_ended(
        client: httpx.AsyncClient) -> None:
    kept = await client.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                  "store": False})
    assert kept.json()["store"] is False
    assert (await client.get(f"/responses/{kept.json()['id']}")).status_code == 404
    streamed = await client.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3,
                                                     "stream": True})
    final = stream_events(streamed.text)[-1]["response"]
    fetched = (await client.get(f"/responses/{final['id']}")).json()
    assert fetched == final


async def test_a_stream_the_client_abandons_is_stored_with_the_usage_it_was_billed(
        client: httpx.AsyncClient, gateway: GatewayUnderTest) -> None:
    """The client reads a few events and goes away: the stored object is cancelled and shows the engine's
    count until the abort, the usage its ledger row bills (it showed zeros)."""
    import json as jsonlib

    from tests.polling import eventually

    body = {"model": MODEL, "input": "Tell a long story", "max_output_tokens": 1500, "stream": True,
            "text": {"format": {"type": "json_schema", "name": "essay", "schema": {
                "type": "object", "properties": {"essay": {"type": "string", "minLength": 1400}},
                "required": ["essay"], "additionalProperties": False}}}}
    response_id = None
    async with client.stream("POST", "/responses", json=body) as streamed:
        request_id = streamed.headers["x-request-id"]
        deltas = 0
        async for line in streamed.aiter_lines():
            if line.startswith("data: "):
                event = jsonlib.loads(line[6:])
                response_id = response_id or event.get("response", {}).get("id")
                deltas += event["type"] == "response.output_text.delta"
                if deltas >= 5:
                    break
    assert response_id is not None

    async def stored() -> dict[str, Any] | None:
        got = await client.get(f"/responses/{response_id}")
        return got.json() if got.status_code == 200 else None

    kept = await eventually(stored, "the abandoned response stored")
    [record] = await wait_for_usage(gateway.settings.redis_url, request_id)
    assert kept["status"] == record["status"] == "cancelled"
    assert record["completion_tokens"] >= 5
    assert (kept["usage"]["input_tokens"], kept["usage"]["output_tokens"]) == (
        record["prompt_tokens"], record["completion_tokens"])


async def test_previous_response_id_continues_the_conversation_from_the_cache(
        client: httpx.AsyncClient) -> None:
    first = (await client.post("/responses", json={"model": MODEL, "input": LONG, "max_output_tokens": 4,
                                                    "temperature": 0})).json()
    follow = await client.post("/responses", json={"model": MODEL, "input": "And then?",
                                                    "previous_response_id": first["id"],
                                                    "max_output_tokens": 4, "temperature": 0})
    assert follow.status_code == 200, follow.text
    body = follow.json()
    assert_conforms(body, "Response")
    assert body["previous_response_id"] == first["id"]
    # The earlier turn is part of the prompt, and its tokens are served from the prefix cache.
    assert body["usage"]["input_tokens"] > first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert body["usage"]["input_tokens_details"]["cached_tokens"] >= 16
    # Its own input items only; the conversation is the chain.
    items = (await client.get(f"/responses/{body['id']}/input_items")).json()["data"]
    assert [i["content"][0]["text"] for i in items] == ["And then?"]
    third = (await client.post("/responses", json={"model": MODEL, "input": "Finally?",
                                                    "previous_response_id": body["id"],
                                                    "max_output_tokens": 2})).json()
    assert third["usage"]["input_tokens"] > body["usage"]["input_tokens"]


async def test_a_tool_result_continues_a_stored_call(client: httpx.AsyncClient) -> None:
    first = (await client.post("/responses", json={
        "model": MODEL, "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 100,
        "temperature": 0, "tool_choice": {"type": "function", "name": "get_weather"}})).json()
    call = first["output"][0]
    answer = await client.post("/responses", json={
        "model": MODEL, "previous_response_id": first["id"], "tools": [WEATHER], "max_output_tokens": 3,
        "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": '{"temp": 21}'}]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"][0]["type"] == "message"


async def test_another_tenant_can_neither_read_continue_nor_delete(client: httpx.AsyncClient,
                                                                   gateway: GatewayUnderTest) -> None:
    from tests.gateway.conftest import make_tenant_key

    mine = (await client.post("/responses", json={"model": MODEL, "input": "secret",
                                                   "max_output_tokens": 2})).json()
    other = await make_tenant_key(gateway)
    url = f"/responses/{mine['id']}"
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=other.headers, timeout=60) as theirs:
        for r in (await theirs.get(url), await theirs.delete(url), await theirs.get(f"{url}/input_items")):
            assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
        continued = await theirs.post("/responses", json={"model": MODEL, "input": "more",
                                                          "previous_response_id": mine["id"]})
        assert continued.status_code == 400
        assert continued.json()["error"]["param"] == "previous_response_id"
    assert (await client.get(f"/responses/{mine['id']}")).status_code == 200  # still there for its owner


async def test_expired_responses_are_gone_and_deleted_by_retention(
        client: httpx.AsyncClient, gateway: GatewayUnderTest, tenant_key: TenantKey) -> None:
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import select, update

    from gateway.responses.repository import delete_expired
    from gateway.responses.store import response_key
    from gateway.responses.tasks import flush_responses
    from tollgate.models import StoredResponse

    old = (await client.post("/responses", json={"model": MODEL, "input": "old",
                                                  "max_output_tokens": 2})).json()
    runtime = gateway.runtime
    assert (await flush_responses(runtime.redis, gateway.db.session, gateway.settings))["inserted"] >= 1
    # Its retention ends: the Redis copy expires (its TTL) and the row's expires_at passes.
    await runtime.redis.delete(response_key(tenant_key.tenant_id, old["id"]))
    async with gateway.db.session() as session, session.begin():
        await session.execute(update(StoredResponse).where(StoredResponse.id == old["id"])
                              .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
    assert (await client.get(f"/responses/{old['id']}")).status_code == 404
    follow = await client.post("/responses", json={"model": MODEL, "input": "x",
                                                    "previous_response_id": old["id"]})
    assert follow.status_code == 400
    async with gateway.db.session() as session, session.begin():
        assert await delete_expired(session, datetime.now(UTC)) >= 1
        assert await session.scalar(select(StoredResponse).where(StoredResponse.id == old["id"])) is None


# -- background responses ------------------------------------------------------------------------------

async def test_background_is_queued_then_run_by_a_worker(client: httpx.AsyncClient,
                                                         gateway: GatewayUnderTest) -> None:
    from sqlalchemy import select

    from gateway.responses.background import run_background
    from tollgate.models import StoredResponse

    queued = await client.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                                    "background": True})
    assert queued.status_code == 200, queued.text
    body = queued.json()
    assert_conforms(body, "Response")
    assert body["status"] == "queued" and body["background"] is True and body["service_tier"] == "flex"
    assert (await client.get(f"/responses/{body['id']}")).json()["status"] == "queued"
    assert await run_background(gateway.runtime, body["id"]) in ("completed", "incomplete")
    assert await run_background(gateway.runtime, body["id"]) is None  # claimed once
    async with gateway.db.session() as session:  # metered: the copy kept with the final state is gone
        assert await session.scalar(select(StoredResponse.usage_pending)
                                    .where(StoredResponse.id == body["id"])) is None
    done = (await client.get(f"/responses/{body['id']}")).json()
    assert_conforms(done, "Response")
    assert done["id"] == body["id"] and done["created_at"] == body["created_at"]
    assert done["status"] in ("completed", "incomplete") and done["usage"]["output_tokens"] > 0
    assert output_text(done)
    # Cancelling a finished response changes nothing.
    assert (await client.post(f"/responses/{body['id']}/cancel")).json() == done


async def test_cancel_a_queued_and_a_running_background_response(client: httpx.AsyncClient,
                                                                  gateway: GatewayUnderTest,
                                                                  engine_url: str) -> None:
    import asyncio
    import dataclasses

    from gateway.responses.background import run_background
    from tests.polling import eventually

    queued = (await client.post("/responses", json={"model": MODEL, "input": "Hi", "background": True,
                                                     "max_output_tokens": 4})).json()
    cancelled = await client.post(f"/responses/{queued['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert await run_background(gateway.runtime, queued["id"]) is None  # never started

    # A worker that polls for cancellation often; a long answer, cancelled once it runs in the engine.
    runtime = dataclasses.replace(gateway.runtime, settings=gateway.runtime.settings.model_copy(
        update={"responses_cancel_poll_s": 0.02}))
    # A schema that needs a long answer: the model cannot end it early (a random model may stop anywhere).
    essay = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 1500}},
             "required": ["essay"], "additionalProperties": False}
    running = (await client.post("/responses", json={
        "model": MODEL, "input": "Hi", "background": True, "max_output_tokens": 1800,
        "text": {"format": {"type": "json_schema", "name": "essay", "schema": essay}}})).json()
    response_id = running["id"]
    worker = asyncio.create_task(run_background(runtime, response_id))

    async def generating() -> bool:
        if worker.done():  # it ended before it ran: say why
            stored = (await client.get(f"/responses/{response_id}")).json()
            raise AssertionError(f"the worker ended first: {worker.result()!r}, {stored}")
        async with httpx.AsyncClient() as engine:
            return (await engine.get(f"{engine_url}/load")).json()["running"] > 0

    await eventually(generating, "the background response running in the engine")
    assert (await client.post(f"/responses/{running['id']}/cancel")).json()["status"] == "cancelled"
    assert await worker == "cancelled"
    stored = (await client.get(f"/responses/{running['id']}")).json()
    assert_conforms(stored, "Response")
    assert stored["status"] == "cancelled" and stored["usage"]["output_tokens"] < 1800
    # The stored object shows what the run was billed: the engine's count until its abort.
    from gateway.responses.background import request_id_of

    [record] = await wait_for_usage(gateway.settings.redis_url, request_id_of(response_id))
    assert record["status"] == "cancelled" and record["prompt_tokens"] > 0
    assert (stored["usage"]["input_tokens"], stored["usage"]["output_tokens"]) == (
        record["prompt_tokens"], record["completion_tokens"])


async def test_a_background_response_whose_worker_died_runs_again(client: httpx.AsyncClient,
                                                                    gateway: GatewayUnderTest) -> None:
    """A worker that dies mid-run leaves its response in_progress without a lease: the requeue sweep
    queues it and sends it again (and a response with a live lease is left alone); after MAX_ATTEMPTS
    deaths it fails instead of waiting forever."""
    from sqlalchemy import type_coerce, update
    from sqlalchemy.dialects.postgresql import JSONB

    from gateway.responses.background import MAX_ATTEMPTS, lease_key, requeue_orphans, run_background
    from tollgate.models import StoredResponse

    async def die_running(response_id: str) -> None:
        """As a worker that claimed it and was SIGKILLed: in_progress, its lease gone."""
        async with gateway.db.session() as session:
            await session.execute(update(StoredResponse).where(StoredResponse.id == response_id).values(
                status="in_progress",
                body=StoredResponse.body.op("||")(type_coerce({"status": "in_progress"}, JSONB))))
        await gateway.runtime.redis.delete(lease_key(response_id))

    sent: list[str] = []

    async def send(response_id: str) -> None:
        sent.append(response_id)

    orphan = (await client.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                                     "background": True})).json()["id"]
    alive = (await client.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                                    "background": True})).json()["id"]
    await die_running(orphan)
    await die_running(alive)
    await gateway.runtime.redis.set(lease_key(alive), "a worker still running it", px=60_000)
    await requeue_orphans(gateway.db.session, gateway.runtime.redis, send)
    assert sent == [orphan]
    assert (await client.get(f"/responses/{orphan}")).json()["status"] == "queued"
    # Queued a while, its task perhaps held by a dead worker: sent again, once per lease period.
    sent.clear()
    await requeue_orphans(gateway.db.session, gateway.runtime.redis, send, resend_after_ms=0)
    await requeue_orphans(gateway.db.session, gateway.runtime.redis, send, resend_after_ms=0)
    assert orphan in sent and sent.count(orphan) == 1 and alive not in sent
    assert (await client.get(f"/responses/{alive}")).json()["status"] == "in_progress"
    assert await run_background(gateway.runtime, orphan) in ("completed", "incomplete")

    await gateway.runtime.redis.delete(lease_key(alive))
    for _ in range(MAX_ATTEMPTS - 1):
        await requeue_orphans(gateway.db.session, gateway.runtime.redis, send)
        await die_running(alive)
    await requeue_orphans(gateway.db.session, gateway.runtime.redis, send)
    failed = (await client.get(f"/responses/{alive}")).json()
    assert failed["status"] == "failed" and "stopped" in failed["error"]["message"]
    assert sent.count(alive) == MAX_ATTEMPTS - 1


class _Killed(BaseException):
    """The worker's death, right where it raises (no ``except Exception`` stops it)."""


class _DiesBeforeMetering:
    """The runtime's admission, except that metering kills the worker."""

    def __init__(self, admission: Any) -> None:
        self._admission = admission

    def __getattr__(self, name: str) -> Any:
        return getattr(self._admission, name)

    async def settle_and_append(self, *args: Any) -> Any:
        raise _Killed


async def test_a_worker_killed_between_storing_and_metering_loses_no_usage(client: httpx.AsyncClient,
                                                                           gateway: GatewayUnderTest) -> None:
    """The end of a background response is stored with the usage record its worker meters next. A worker
    killed in between leaves a response its tenant reads, with its usage: the requeue sweep meters the
    record once the worker's lease is gone, once."""
    import dataclasses

    import redis.asyncio as aioredis

    from gateway.responses.background import lease_key, request_id_of, requeue_orphans, run_background

    queued = (await client.post("/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 4,
                                                     "background": True})).json()
    doomed = dataclasses.replace(gateway.runtime, admission=_DiesBeforeMetering(gateway.runtime.admission))
    with pytest.raises(_Killed):
        await run_background(doomed, queued["id"])
    stored = (await client.get(f"/responses/{queued['id']}")).json()
    assert stored["status"] in ("completed", "incomplete") and stored["usage"]["output_tokens"] > 0
    redis = aioredis.Redis.from_url(gateway.settings.redis_url)
    try:
        assert await usage_records(redis, request_id_of(queued["id"])) == []  # not metered
        sent: list[str] = []

        async def send(response_id: str) -> None:
            sent.append(response_id)

        # While the worker's lease lives, the sweep leaves the record to it.
        await redis.set(lease_key(queued["id"]), "the worker, not yet known dead", px=60_000)
        assert (await requeue_orphans(gateway.db.session, redis, send))["metered"] == 0
        await redis.delete(lease_key(queued["id"]))
        assert (await requeue_orphans(gateway.db.session, redis, send))["metered"] == 1
        assert (await requeue_orphans(gateway.db.session, redis, send))["metered"] == 0  # once
        assert sent == []  # it ended: nothing to run again
        records = await usage_records(redis, request_id_of(queued["id"]))
    finally:
        await redis.aclose()
    assert len(records) == 1
    record = records[0]
    assert record["status"] == "completed" and record["request_class"] == "interactive"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (stored["usage"]["input_tokens"],
                                                                      stored["usage"]["output_tokens"])
    assert record["cost_pico_usd"] > 0


async def test_only_background_responses_can_be_cancelled(client: httpx.AsyncClient) -> None:
    plain = (await client.post("/responses", json={"model": MODEL, "input": "Hi",
                                                     "max_output_tokens": 2})).json()
    r = await client.post(f"/responses/{plain['id']}/cancel")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    r = await client.post("/responses", json={"model": MODEL, "input": "Hi", "background": True,
                                               "store": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"
