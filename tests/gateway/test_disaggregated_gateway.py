"""Disaggregated serving through the gateway (#40): a model with a prefill replica (``--role prefill``)
and a decode replica (``--role decode``), real engine processes and KV blocks over TCP. Greedy answers
equal a colocated replica's; a long prompt is prefilled on the prefill replica and pulled, a short one
or one the decode replica holds runs there alone; the prompt is metered once; with the prefill replica
gone, requests still complete on the decode replica."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import (
    MODEL,
    GatewayUnderTest,
    gateway_settings,
    make_tenant_key,
    run_engine,
    run_gateway,
    wait_for_usage,
)
from tollgate.local_services import free_port
from tollgate.settings import PoolConfig

pytestmark = pytest.mark.xdist_group("disaggregated_gateway")

THRESHOLD = 48  # prompt tokens not cached on the decode replica, from which a prompt is prefilled remotely
LONG = ("A long briefing for the agent, to be read in full before it answers anything at all: "
        "the plan, the constraints, the tools, the history of the ticket and what the customer said. ")


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    logs = tmp_path_factory.mktemp("disaggregated")
    def role(name: str) -> tuple[str, ...]:
        return ("--num-kv-blocks", "256", "--role", name)

    with (run_engine(tiny_model_dir, logs / "prefill.log", options=role("prefill")) as (prefill_url, _),
          run_engine(tiny_model_dir, logs / "decode.log", options=role("decode")) as (decode_url, _)):
        yield prefill_url, decode_url


async def _gateway(pair: tuple[str, str], tiny_model_dir: Path, api_database_url: str, redis_url: str,
                   prefill_urls: list[str]) -> Any:
    _, decode_url = pair
    settings = gateway_settings([decode_url], tiny_model_dir, api_database_url, redis_url)
    settings.models[0].pools = ["interactive", "prefill"]
    settings.pools["prefill"] = PoolConfig(replicas=prefill_urls)
    settings.disagg_min_prompt_tokens = THRESHOLD
    return run_gateway(settings)


@pytest.fixture(scope="module")
async def split(pair: tuple[str, str], tiny_model_dir: Path, api_database_url: str, redis_url: str,
                model_price: None) -> AsyncIterator[GatewayUnderTest]:
    async with await _gateway(pair, tiny_model_dir, api_database_url, redis_url, [pair[0]]) as running:
        yield running


async def _transfer(url: str) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return (await client.get("/load")).json()["kv_transfer"]


async def _chat(gateway: GatewayUnderTest, key: str, content: str, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", timeout=120,
                                 headers={"Authorization": f"Bearer {key}"}) as client:
        return await client.post("/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0, **body})


async def test_a_long_prompt_is_prefilled_elsewhere_and_answered_as_a_colocated_replica_would(
        split: GatewayUnderTest, gateway: GatewayUnderTest, pair: tuple[str, str]) -> None:
    prefill_url, decode_url = pair
    key, reference = await make_tenant_key(split), await make_tenant_key(gateway)
    before = await _transfer(prefill_url)
    cases: list[tuple[str, dict[str, Any]]] = [  # distinct from their first block: nothing cached anywhere
        ("Plain. " + LONG * 3, {}), ("Twice. " + LONG * 5, {"n": 2}),
        ("Seeded. " + LONG * 2, {"temperature": 0.8, "seed": 7})]
    for content, extra in cases:
        answer = await _chat(split, key.key, content, **extra)
        expected = await _chat(gateway, reference.key, content, **extra)
        assert answer.status_code == 200, answer.text
        assert [c["message"]["content"] for c in answer.json()["choices"]] == \
            [c["message"]["content"] for c in expected.json()["choices"]]
        usage = answer.json()["usage"]
        assert usage["prompt_tokens"] == expected.json()["usage"]["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # new to the prefill replica: computed
        [record] = await wait_for_usage(split.settings.redis_url or "", answer.headers["x-request-id"])
        assert (record["prompt_tokens"], record["cached_tokens"], record["completion_tokens"]) == (
            usage["prompt_tokens"], 0, usage["completion_tokens"])
    after = await _transfer(prefill_url)
    assert after["leases"] - before.get("leases", 0) == 3
    assert after["delivered_leases"] - before.get("delivered_leases", 0) == 3
    assert after.get("held_blocks", 0) == 0
    assert (await _transfer(decode_url))["pulls"] >= 3


async def test_short_prompts_and_prompts_the_decode_replica_holds_run_there_alone(
        split: GatewayUnderTest, pair: tuple[str, str]) -> None:
    prefill_url, _ = pair
    key = await make_tenant_key(split)
    content = LONG * 3 + "Once more."
    first = await _chat(split, key.key, content)
    leases = (await _transfer(prefill_url))["leases"]
    again = await _chat(split, key.key, content)  # the decode replica holds the pulled blocks now
    text = first.json()["choices"][0]["message"]["content"]
    assert again.json()["choices"][0]["message"]["content"] == text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    short = await _chat(split, key.key, "Hi.")
    assert short.status_code == 200
    assert (await _transfer(prefill_url))["leases"] == leases


async def test_without_its_prefill_replica_the_decode_replica_serves_alone(
        pair: tuple[str, str], tiny_model_dir: Path, api_database_url: str, redis_url: str,
        model_price: None, gateway: GatewayUnderTest) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with await _gateway(pair, tiny_model_dir, api_database_url, redis_url, [dead]) as lonely:
        key, reference = await make_tenant_key(lonely), await make_tenant_key(gateway)
        content = LONG * 4 + "Alone."
        answer = await _chat(lonely, key.key, content)
        expected = await _chat(gateway, reference.key, content)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == \
            expected.json()["choices"][0]["message"]["content"]


async def test_streamed_and_structured_answers_through_a_prefill_replica(
        split: GatewayUnderTest, gateway: GatewayUnderTest, pair: tuple[str, str]) -> None:
    prefill_url, _ = pair
    key, reference = await make_tenant_key(split), await make_tenant_key(gateway)
    leases = (await _transfer(prefill_url)).get("leases", 0)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    structured = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "verdict", "schema": schema, "strict": True}},
                  "max_tokens": 12}
    content = "Structured. " + LONG * 3
    answer = await _chat(split, key.key, content, **structured)
    expected = await _chat(gateway, reference.key, content, **structured)
    assert answer.status_code == 200, answer.text
    verdict = answer.json()["choices"][0]["message"]["content"]
    assert verdict == expected.json()["choices"][0]["message"]["content"]

    async with httpx.AsyncClient(base_url=f"{split.url}/v1", timeout=120,
                                 headers={"Authorization": f"Bearer {key.key}"}) as client:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Streamed. " + LONG * 3}],
                "max_tokens": 8, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/chat/completions", json=body) as streamed:
            lines = [line async for line in streamed.aiter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    plain = await _chat(gateway, reference.key, "Streamed. " + LONG * 3)
    assert text == plain.json()["choices"][0]["message"]["content"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8
    assert (await _transfer(prefill_url))["leases"] - leases == 2


async def test_a_prediction_is_drafted_on_the_decode_replica(
        split: GatewayUnderTest, gateway: GatewayUnderTest, pair: tuple[str, str]) -> None:
    """Speculative decoding on the decode side: Predicted Outputs through a prefill replica give the
    colocated replica's tokens and the same accepted/rejected prediction counts."""
    prefill_url, _ = pair
    key, reference = await make_tenant_key(split), await make_tenant_key(gateway)
    content = "Predicted. " + LONG * 3
    plain = await _chat(gateway, reference.key, content, max_tokens=12)
    text = plain.json()["choices"][0]["message"]["content"]
    prediction = {"prediction": {"type": "content", "content": text}, "max_tokens": 12}
    leases = (await _transfer(prefill_url)).get("leases", 0)
    answer = await _chat(split, key.key, content, **prediction)
    expected = await _chat(gateway, reference.key, content, **prediction)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == text
    details, wanted = (r.json()["usage"]["completion_tokens_details"] for r in (answer, expected))
    assert details["accepted_prediction_tokens"] == wanted["accepted_prediction_tokens"] > 0
    assert (await _transfer(prefill_url))["leases"] - leases == 1


@pytest.fixture(scope="module")
def forgetful_prefill(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A prefill replica whose leases lapse before any decode replica can pull them."""
    log = tmp_path_factory.mktemp("forgetful") / "prefill.log"
    with run_engine(tiny_model_dir, log, options=("--num-kv-blocks", "256", "--role", "prefill",
                                                  "--kv-lease-s", "0.001")) as (url, _):
        yield url


@pytest.mark.parametrize("mode", ["recompute", "fail"])
async def test_a_lapsed_lease_recomputes_or_fails_cleanly_and_bills_what_the_client_was_told(
        pair: tuple[str, str], forgetful_prefill: str, tiny_model_dir: Path, api_database_url: str,
        redis_url: str, model_price: None, gateway: GatewayUnderTest, mode: str) -> None:
    """The decode replica's pull finds the lease gone. ``recompute`` (the default): it computes the prompt
    itself and the answer is a colocated replica's, billed as computed there. ``fail``: the client gets
    an error and the ledger a failed request that bills nothing. No pull is left in flight."""
    _, decode_url = pair
    settings = gateway_settings([decode_url], tiny_model_dir, api_database_url, redis_url)
    settings.models[0].pools = ["interactive", "prefill"]
    settings.pools["prefill"] = PoolConfig(replicas=[forgetful_prefill])
    settings.disagg_min_prompt_tokens = THRESHOLD
    settings.disagg_on_failure = mode  # type: ignore[assignment]
    failed_before = (await _transfer(decode_url)).get("failed_pulls", 0)
    async with run_gateway(settings) as lapsing:
        key, reference = await make_tenant_key(lapsing), await make_tenant_key(gateway)
        content = f"Lapsed {mode}. " + LONG * 3
        answer = await _chat(lapsing, key.key, content)
        [record] = await wait_for_usage(lapsing.settings.redis_url or "", answer.headers["x-request-id"])
    if mode == "recompute":
        expected = await _chat(gateway, reference.key, content)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == \
            expected.json()["choices"][0]["message"]["content"]
        usage = answer.json()["usage"]
        billed = tuple(record[k] for k in ("status", "prompt_tokens", "cached_tokens", "completion_tokens"))
        assert billed == ("completed", usage["prompt_tokens"], 0, usage["completion_tokens"])
    else:
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "engine_error", answer.text
        billed = tuple(record[k] for k in ("status", "prompt_tokens", "completion_tokens", "cost_pico_usd"))
        assert billed == ("failed", 0, 0, 0)
    after = await _transfer(decode_url)
    assert after["failed_pulls"] == failed_before + 1 and after["pulls_in_flight"] == 0
