"""The official ``openai`` SDK, unchanged, against the whole platform started by ``tollgate up``.

One ``tollgate up`` per module (private Postgres and Redis, tiny engine, gateway, worker, beat) in a
fresh data directory; the SDK reads nothing but ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` from the
``env`` file it writes. Usage must reach the Postgres ledger through the outbox and the worker.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import psycopg
import pydantic
import pytest

from tollgate.local_services import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STARTUP_TIMEOUT_S = 240.0
MODEL = "tiny"


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = value
    return env


@pytest.fixture(scope="module")
def platform() -> Iterator[dict[str, str]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    # Not under pytest's basetemp (0700), which the postgres user could not enter.
    root = Path(tempfile.mkdtemp(prefix="tollgate-sdk-e2e-"))
    os.chmod(root, 0o755)
    data_dir = root / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOLLGATE_", "OPENAI_"))}
    out = root / "up.out"
    with out.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tollgate", "up", "--data-dir", str(data_dir),
                                 "--port", str(free_port()), "--engine-port", str(free_port())],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while "tollgate is up" not in out.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"tollgate up did not start:\n{out.read_text(errors='replace')[-4000:]}")
            time.sleep(0.2)
        platform_env = _env_file(data_dir / "env")
        yield platform_env
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def client(platform: dict[str, str]) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=platform["OPENAI_BASE_URL"], api_key=platform["OPENAI_API_KEY"], max_retries=0)
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


class Weather(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    sunny: bool


def test_structured_output_parse(client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                           response_format=Weather, max_tokens=200, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, Weather)


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


def _ledger_row(platform: dict[str, str], request_id: str) -> tuple:
    """The ledger row of ``request_id`` once the worker has flushed it from the outbox."""
    deadline = time.monotonic() + 60
    with psycopg.connect(platform["TOLLGATE_DATABASE_URL"], autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT status, prompt_tokens, cached_tokens, completion_tokens, cost_pico_usd, created_at"
                " FROM usage_events WHERE request_id = %s", (request_id,)).fetchone()
            if row is not None:
                return row
            time.sleep(0.2)
    raise AssertionError(f"usage of {request_id} never reached the ledger")


def _price_at(platform: dict[str, str], when: object) -> tuple[int, int, int]:
    with psycopg.connect(platform["TOLLGATE_DATABASE_URL"], autocommit=True) as conn:
        row = conn.execute("SELECT input, cached_input, output FROM prices WHERE model = %s"
                           " AND effective_from <= %s ORDER BY effective_from DESC LIMIT 1",
                           (MODEL, when)).fetchone()
    assert row is not None
    return row


def _cli(platform: dict[str, str], *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOLLGATE_", "OPENAI_"))}
    done = subprocess.run([sys.executable, "-m", "tollgate", *args], env={**env, **platform},
                          check=True, capture_output=True, text=True)
    return done.stdout


def test_usage_reaches_the_ledger(client: openai.OpenAI, platform: dict[str, str]) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "ledger"}], max_tokens=3)
    usage = raw.parse().usage
    row = _ledger_row(platform, raw.headers["x-request-id"])
    assert (row[0], row[1], row[3]) == ("completed", usage.prompt_tokens, usage.completion_tokens)
    assert row[4] > 0


def test_repeated_long_prompt_is_billed_at_the_cached_price(client: openai.OpenAI,
                                                            platform: dict[str, str]) -> None:
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


def test_rate_limited_tenant_gets_rate_limit_error_with_headers(platform: dict[str, str]) -> None:
    _cli(platform, "tenants", "create", "one-rpm", "--rpm", "1")
    key = _cli(platform, "keys", "create", "one-rpm").strip().splitlines()[-1]
    limited = openai.OpenAI(base_url=platform["OPENAI_BASE_URL"], api_key=key, max_retries=0)
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
