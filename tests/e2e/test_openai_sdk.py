"""The official ``openai`` SDK, unchanged, against the whole platform started by ``tollgate up``.

The session's shared platform (``tests/e2e/conftest.py``: ``tollgate up``'s gateway, worker and beat, and
a tiny engine replica); the SDK reads nothing but ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the
``env`` file ``tollgate up`` writes (its demo key). Usage must reach the Postgres ledger through the
outbox and the worker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psycopg
import pydantic
import pytest

from tests.e2e.platform_harness import ENGINE_TENSOR_PARALLEL_SIZE, MODEL, PLATFORM_GROUP, Platform
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(PLATFORM_GROUP)]


@pytest.fixture
def client(platform: Platform) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=platform.openai_base_url, api_key=platform.api_key, max_retries=0)
    yield c
    c.close()


def test_chat_plain_and_streamed(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello"}],
                                           max_tokens=6)
    assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_the_engine_serving_the_platform_splits_its_model_over_two_ranks(client: openai.OpenAI,
                                                                         platform: Platform) -> None:
    info = httpx.get(f"{platform.engine_url}/info", timeout=10).json()
    assert info["tensor_parallel_size"] == ENGINE_TENSOR_PARALLEL_SIZE == 2
    messages = [{"role": "user", "content": "Count from one to twenty, in words, one number per line."}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                           temperature=0)  # fmt: skip
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,  # type: ignore[arg-type]
                                           temperature=0)  # fmt: skip
    assert reply.choices[0].message.content == again.choices[0].message.content
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the prefix cache, on both ranks


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    sunny: bool


def test_structured_output_parse(client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                           response_format=Weather, max_tokens=200, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Weather)


def test_responses_create_stream_and_parse(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=6, temperature=0)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output_text and response.usage is not None and response.usage.output_tokens > 0
    with client.responses.stream(model=MODEL, input="Say hello", max_output_tokens=6,
                                 temperature=0) as stream:
        events = list(stream)
    # A random model rarely stops by itself: cut by max_output_tokens, the stream ends "incomplete"
    # (the SDK's get_final_response() waits for "completed" only, as with OpenAI).
    assert events[-1].type in ("response.completed", "response.incomplete")
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == events[-1].response.output_text == response.output_text  # greedy
    parsed = client.responses.parse(model=MODEL, input="Weather?", text_format=Weather,
                                    max_output_tokens=200, temperature=0)
    assert isinstance(parsed.output_parsed, Weather)


def test_responses_tool_round_trip(client: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool], temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    max_output_tokens=100)
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    answer = client.responses.create(model=MODEL, tools=[tool], max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}])
    assert answer.output[0].type == "message" and answer.output_text


def test_responses_conversation_retrieve_and_delete(client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Tell me about Paris", max_output_tokens=4)
    follow = client.responses.create(model=MODEL, input="And Rome?", previous_response_id=first.id,
                                     max_output_tokens=4)
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    items = list(client.responses.input_items.list(follow.id))
    assert [item.content[0].text for item in items] == ["And Rome?"]
    client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(follow.id)


def test_a_stored_response_reaches_postgres_through_the_worker(client: openai.OpenAI,
                                                               platform: Platform) -> None:
    response = client.responses.create(model=MODEL, input="Keep me", max_output_tokens=3)
    with psycopg.connect(platform.database_url, autocommit=True) as conn:
        def row() -> tuple | None:
            return conn.execute("SELECT status, body->>'id' FROM responses WHERE id = %s",
                                (response.id,)).fetchone()

        flushed = wait_until(row, "beat's responses.flush to copy the response")
    assert flushed == (response.status, response.id)


def _finished(client: openai.OpenAI, response_id: str) -> Any:
    response = client.responses.retrieve(response_id)
    return response if response.status not in ("queued", "in_progress") else None


def test_responses_in_the_background_polled_and_cancelled(client: openai.OpenAI) -> None:
    queued = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=4, background=True)
    assert queued.status == "queued" and queued.background
    # tollgate up's Celery worker runs it; the client polls, as OpenAI's docs show.
    done = wait_until(lambda: _finished(client, queued.id), "the background response to finish")
    assert done.status in ("completed", "incomplete") and done.output_text and done.service_tier == "flex"
    # A schema that needs a long answer (a random model could otherwise stop at once): the worker takes
    # far longer than the client takes to cancel.
    essay = {"type": "object", "properties": {"essay": {"type": "string", "minLength": 1500}},
             "required": ["essay"], "additionalProperties": False}
    long = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=1800, background=True,
                                   text={"format": {"type": "json_schema", "name": "essay", "schema": essay}})
    assert client.responses.cancel(long.id).status == "cancelled"
    stopped = wait_until(lambda: _finished(client, long.id), "the cancelled response to stop")
    assert stopped.status == "cancelled"


def test_embeddings(client: openai.OpenAI) -> None:
    # The SDK asks for base64 unless told otherwise and decodes it: both must give the same floats.
    packed = client.embeddings.create(model=MODEL, input=["The cat sat.", "The cat sat."])
    floats = client.embeddings.create(model=MODEL, input="The cat sat.", encoding_format="float")
    assert [len(d.embedding) for d in packed.data] == [len(floats.data[0].embedding)] * 2
    assert packed.data[0].embedding == pytest.approx(floats.data[0].embedding, abs=1e-6)
    assert packed.usage.prompt_tokens == 2 * floats.usage.prompt_tokens
    short = client.embeddings.create(model=MODEL, input="The cat sat.", dimensions=8)
    assert len(short.data[0].embedding) == 8


def test_tools_completions_models_and_errors(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=100,
        temperature=0, tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"]}}}],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.tool_calls[0].function.name == "get_weather"
    text = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=4)
    assert text.object == "text_completion" and text.usage.completion_tokens > 0
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=1)


def _ledger_row(platform: Platform, request_id: str) -> tuple:
    """The ledger row of ``request_id`` once the worker has flushed it from the outbox."""
    with psycopg.connect(platform.database_url, autocommit=True) as conn:
        def row() -> tuple | None:
            return conn.execute(
                "SELECT status, prompt_tokens, cached_tokens, completion_tokens, cost_pico_usd, created_at"
                " FROM usage_events WHERE request_id = %s", (request_id,)).fetchone()

        return wait_until(row, f"the usage of {request_id} to reach the ledger", interval_s=0.05)


def _price_at(platform: Platform, when: object) -> tuple[int, int, int]:
    with psycopg.connect(platform.database_url, autocommit=True) as conn:
        row = conn.execute("SELECT input, cached_input, output FROM prices WHERE model = %s"
                           " AND effective_from <= %s ORDER BY effective_from DESC LIMIT 1",
                           (MODEL, when)).fetchone()
    assert row is not None
    return row


def test_usage_reaches_the_ledger(client: openai.OpenAI, platform: Platform) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "ledger"}], max_tokens=3)
    usage = raw.parse().usage
    row = _ledger_row(platform, raw.headers["x-request-id"])
    assert (row[0], row[1], row[3]) == ("completed", usage.prompt_tokens, usage.completion_tokens)
    assert row[4] > 0


def test_repeated_long_prompt_is_billed_at_the_cached_price(client: openai.OpenAI,
                                                            platform: Platform) -> None:
    prompt = "An agent resends its long instructions every turn. " * 20
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=2)
    usage = raw.parse().usage
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < usage.prompt_tokens

    status, prompt_tokens, ledger_cached, completion_tokens, cost, created_at = _ledger_row(
        platform, raw.headers["x-request-id"])
    assert (status, prompt_tokens, ledger_cached, completion_tokens) == (
        "completed", usage.prompt_tokens, cached, usage.completion_tokens)
    input_price, cached_price, output_price = _price_at(platform, created_at)
    assert cached_price < input_price
    assert cost == ((prompt_tokens - cached) * input_price + cached * cached_price
                    + completion_tokens * output_price)


def test_a_prediction_through_the_sdk_is_reported_and_billed_as_the_client_was_told(
        client: openai.OpenAI, platform: Platform) -> None:
    """Predicted Outputs with the SDK's own ``prediction`` parameter, plain and streamed: the same answer,
    accepted and rejected prediction tokens in the usage, and the ledger bills the completion tokens the
    client was told (rejected prediction tokens included) at the output price."""
    messages = [{"role": "user", "content": "Rewrite the file"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    text = plain.choices[0].message.content or ""
    edited = text[:5] + "#" + text[6:]  # a small edit: a few drafts rejected, most accepted
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0,
        prediction={"type": "content", "content": edited})
    answer = raw.parse()
    assert answer.choices[0].message.content == text
    details = answer.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0
    rejected = details.rejected_prediction_tokens or 0
    assert answer.usage.completion_tokens == plain.usage.completion_tokens + rejected
    status, prompt_tokens, cached, completion_tokens, cost, created_at = _ledger_row(
        platform, raw.headers["x-request-id"])
    assert (status, completion_tokens) == ("completed", answer.usage.completion_tokens)
    input_price, cached_price, output_price = _price_at(platform, created_at)
    assert cost == ((prompt_tokens - cached) * input_price + cached * cached_price
                    + completion_tokens * output_price)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}, prediction={"type": "content", "content": text}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    final = chunks[-1].usage
    assert final is not None and final.completion_tokens_details is not None
    assert final.completion_tokens_details.accepted_prediction_tokens > 0


def test_rate_limited_tenant_gets_rate_limit_error_with_headers(platform: Platform) -> None:
    platform.cli("tenants", "create", "one-rpm", "--rpm", "1")
    key = platform.cli("keys", "create", "one-rpm").strip().splitlines()[-1]
    limited = openai.OpenAI(base_url=platform.openai_base_url, api_key=key, max_retries=0)
    try:
        first = limited.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert first.headers["x-ratelimit-limit-requests"] == "1"
        assert first.headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(openai.RateLimitError) as caught:
            limited.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=1)
    finally:
        limited.close()
    error = caught.value
    assert error.code == "rate_limit_exceeded"
    assert float(error.response.headers["retry-after"]) > 0
    assert error.response.headers["x-ratelimit-limit-requests"] == "1"
    assert error.response.headers["x-ratelimit-reset-requests"]


def test_cache_lifetimes_through_the_sdk_are_held_and_metered(client: openai.OpenAI,
                                                              platform: Platform) -> None:
    """On a replica with host and disk tiers (as ``tollgate up`` starts its own), a ttl and a 24h
    retention asked for with the SDK's own parameters are held, reported and written to the ledger;
    explicit breakpoints work through the Responses API."""
    rules = "Every tenant's ledger closes at midnight UTC and is audited the next morning. " * 10
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2, prompt_cache_options={"ttl": "30m"}, prompt_cache_retention="24h",
        messages=[{"role": "system", "content": rules}, {"role": "user", "content": "When?"}])
    usage = raw.parse().usage
    details = usage.prompt_tokens_details
    whole_blocks = usage.prompt_tokens // 16 * 16
    assert details.cache_write_tokens == whole_blocks
    assert details.model_extra == {"cache_pinned_tokens": whole_blocks, "cache_retained_tokens": whole_blocks}
    _ledger_row(platform, raw.headers["x-request-id"])
    with psycopg.connect(platform.database_url, autocommit=True) as conn:
        counts = conn.execute("SELECT cache_write_tokens, cache_pinned_tokens, cache_retained_tokens"
                              " FROM usage_events WHERE request_id = %s",
                              (raw.headers["x-request-id"],)).fetchone()
    assert counts == (whole_blocks, whole_blocks, whole_blocks)

    marked = [{"role": "user", "content": [
        {"type": "input_text", "text": rules, "prompt_cache_breakpoint": {"mode": "explicit"}},
        {"type": "input_text", "text": " Who audits it?"}]}]
    first = client.responses.create(model=MODEL, input=marked, max_output_tokens=2,
                                    prompt_cache_options={"mode": "explicit"})
    assert first.prompt_cache_options is not None
    assert (first.prompt_cache_options.ttl, first.prompt_cache_options.mode) == ("30m", "explicit")
    again = client.responses.create(model=MODEL, input=marked, max_output_tokens=2,
                                    prompt_cache_options={"mode": "explicit"})
    # The marked rules' whole blocks are cached (read or written by the first response), nothing after them.
    details = first.usage.input_tokens_details
    held = details.cached_tokens + details.cache_write_tokens
    assert 0 < held < first.usage.input_tokens - 16
    assert again.usage.input_tokens_details.cached_tokens == held
