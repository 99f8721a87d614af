"""Cache lifetimes through the API (the session's gateway in front of a real engine with host and disk
tiers): ``prompt_cache_options`` and ``prompt_cache_retention`` on chat, completions and responses,
what the answers say was held, what the engine really holds (its ``/kv/events`` snapshot, read with the
tenant's salted block hashes), explicit breakpoints limiting the cached prefix, and bad values refused
with OpenAI's error body."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engine.kv.block_hash import prefix_block_hashes
from engine.kv.events import TIER_BITS
from engine.tokenizer import Tokenizer
from gateway.tenants.cache_salt import cache_salt
from tests.gateway.conftest import MODEL, GatewayUnderTest, TenantKey
from tests.gateway.test_openai_errors import check_error
from tests.openai_schema import assert_conforms

pytestmark = pytest.mark.slow

BLOCK = 16
SYSTEM = " ".join(f"rule {i}: answer briefly and cite section {i * 7}." for i in range(12))


def chat(system_parts: list[dict[str, Any]], question: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 2, "temperature": 0, **fields,
            "messages": [{"role": "system", "content": system_parts}, {"role": "user", "content": question}]}


async def holdings(engine_url: str) -> dict[bytes, int]:
    async with httpx.AsyncClient() as http:
        page = (await http.get(f"{engine_url}/kv/events", params={"after": 0})).json()
    return {bytes.fromhex(d): bits for d, bits in page["snapshot"].items()}


def prompt_hashes(gateway: GatewayUnderTest, tenant: TenantKey, body: dict[str, Any]) -> list[bytes]:
    tokenizer = Tokenizer.from_pretrained(gateway.settings.models[0].path)
    tokens = tokenizer.encode_chat(body["messages"])
    salt = cache_salt(gateway.settings.key_hash_secret.get_secret_value(), tenant.tenant_id)
    return prefix_block_hashes(tokens, BLOCK, salt)


async def test_ttl_and_retention_are_held_and_reported(client: httpx.AsyncClient, gateway: GatewayUnderTest,
                                                       tenant_key: TenantKey, engine_url: str) -> None:
    body = chat([{"type": "text", "text": SYSTEM}], "Which rule comes first?",
                prompt_cache_options={"ttl": "30m"}, prompt_cache_retention="24h")
    r = await client.post("/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert_conforms(r.json(), "CreateChatCompletionResponse")
    usage = r.json()["usage"]
    whole_blocks = usage["prompt_tokens"] // BLOCK * BLOCK
    details = usage["prompt_tokens_details"]
    assert details["cache_write_tokens"] == whole_blocks
    assert details["cache_pinned_tokens"] == details["cache_retained_tokens"] == whole_blocks
    held = await holdings(engine_url)
    hashes = prompt_hashes(gateway, tenant_key, body)
    assert len(hashes) == whole_blocks // BLOCK
    assert all(held[d] & TIER_BITS["disk"] for d in hashes)  # on disk already: written at once
    async with httpx.AsyncClient() as http:
        cache = (await http.get(f"{engine_url}/load")).json()["cache"]
    assert cache["tier_capacity"]["host"] > 0 and cache["tier_capacity"]["disk"] > 0
    assert cache["pinned_blocks"]["host"] >= len(hashes) and cache["pinned_blocks"]["disk"] >= len(hashes)


async def test_without_lifetimes_the_usage_is_openais_alone(client: httpx.AsyncClient) -> None:
    r = await client.post("/chat/completions", json=chat([{"type": "text", "text": "hi"}], "hello"))
    assert set(r.json()["usage"]["prompt_tokens_details"]) == {"cached_tokens", "audio_tokens",
                                                                "cache_write_tokens"}


async def test_explicit_mode_caches_up_to_the_last_breakpoint(client: httpx.AsyncClient) -> None:
    marked = [{"type": "text", "text": SYSTEM, "prompt_cache_breakpoint": {"mode": "explicit"}},
              {"type": "text", "text": " Today's note: the moon is full."}]
    explicit = {"prompt_cache_options": {"mode": "explicit"}}
    first = (await client.post("/chat/completions", json=chat(marked, "First?", **explicit))).json()["usage"]
    again = (await client.post("/chat/completions", json=chat(marked, "Second?", **explicit))).json()["usage"]
    written = first["prompt_tokens_details"]["cache_write_tokens"]
    # The system text alone is cached (whole blocks of it): not the note after the breakpoint.
    assert 0 < written < first["prompt_tokens"] - BLOCK and written % BLOCK == 0
    assert again["prompt_tokens_details"]["cached_tokens"] == written
    unmarked = [{"type": "text", "text": SYSTEM + " other"}]
    none = (await client.post("/chat/completions", json=chat(unmarked, "x", **explicit))).json()["usage"]
    repeat = (await client.post("/chat/completions", json=chat(unmarked, "x", **explicit))).json()["usage"]
    assert none["prompt_tokens_details"]["cache_write_tokens"] == 0  # no breakpoint: no caching at all
    assert repeat["prompt_tokens_details"]["cached_tokens"] == 0


async def test_responses_repeat_the_options_and_keep_breakpoints_on_stored_parts(
        client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "max_output_tokens": 2, "temperature": 0,
            "prompt_cache_options": {"ttl": "30m", "mode": "explicit"}, "prompt_cache_retention": "in_memory",
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": SYSTEM, "prompt_cache_breakpoint": {"mode": "explicit"}},
                {"type": "input_text", "text": " What is rule 3?"}]}]}
    r = await client.post("/responses", json=body)
    assert r.status_code == 200, r.text
    response = r.json()
    assert_conforms(response, "Response")
    assert response["prompt_cache_options"] == {"ttl": "30m", "mode": "explicit"}
    assert response["prompt_cache_retention"] == "in_memory"
    details = response["usage"]["input_tokens_details"]
    assert details["cache_pinned_tokens"] == details["cache_write_tokens"] > 0
    assert details["cache_retained_tokens"] == 0  # in_memory: never on disk
    items = (await client.get(f"/responses/{response['id']}/input_items")).json()["data"]
    parts = items[0]["content"]
    assert parts[0]["prompt_cache_breakpoint"] == {"mode": "explicit"}
    assert "prompt_cache_breakpoint" not in parts[1]
    follow = (await client.post("/responses", json={
        "model": MODEL, "max_output_tokens": 2, "previous_response_id": response["id"],
        "prompt_cache_options": {"mode": "explicit"}, "input": "And rule 4?"})).json()
    # The breakpoint stored with the first turn still marks the cacheable prefix of the conversation.
    assert follow["usage"]["input_tokens_details"]["cached_tokens"] == details["cache_write_tokens"]


async def test_completions_accept_lifetimes(client: httpx.AsyncClient) -> None:
    r = await client.post("/completions", json={"model": MODEL, "prompt": SYSTEM, "max_tokens": 2,
                                                "prompt_cache_options": {"ttl": "30m"}})
    assert r.status_code == 200, r.text
    details = r.json()["usage"]["prompt_tokens_details"]
    assert details["cache_pinned_tokens"] == r.json()["usage"]["prompt_tokens"] // BLOCK * BLOCK


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options.ttl"),
    ({"prompt_cache_options": {"mode": "always"}}, "prompt_cache_options.mode"),
    ({"prompt_cache_options": "30m"}, "prompt_cache_options"),
    ({"prompt_cache_retention": "7d"}, "prompt_cache_retention"),
])
async def test_bad_lifetimes_are_400_on_every_endpoint(client: httpx.AsyncClient, fields: dict[str, Any],
                                                       param: str) -> None:
    plain = [{"type": "text", "text": "hi"}]
    check_error(await client.post("/chat/completions", json=chat(plain, "x", **fields)), 400, param)
    check_error(await client.post("/completions", json={"model": MODEL, "prompt": "x", **fields}), 400, param)
    check_error(await client.post("/responses", json={"model": MODEL, "input": "x", **fields}), 400, param)
    marked = [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "implicit"}}]
    check_error(await client.post("/chat/completions", json=chat(marked, "x")), 400)


async def test_a_breakpoint_on_an_assistant_turn_is_kept(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "max_output_tokens": 2, "prompt_cache_options": {"mode": "explicit"},
            "input": [{"role": "user", "content": SYSTEM},
                      {"role": "assistant", "content": [{"type": "input_text", "text": "Noted.",
                                                         "prompt_cache_breakpoint": {"mode": "explicit"}}]},
                      {"role": "user", "content": "Rule 5?"}]}
    response = (await client.post("/responses", json=body)).json()
    items = (await client.get(f"/responses/{response['id']}/input_items")).json()["data"]
    assistant = next(item for item in items if item["role"] == "assistant")
    assert assistant["content"][0]["prompt_cache_breakpoint"] == {"mode": "explicit"}
    # Explicit mode caches up to the assistant's "Noted." (without the breakpoint: nothing at all).
    assert response["usage"]["input_tokens_details"]["cache_write_tokens"] > 0
