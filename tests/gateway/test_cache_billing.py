"""The prompt-cache products billed end to end (the session's gateway in front of a real engine with host
and disk tiers): a request that writes, pins and retains its prompt is held for those products at
admission, metered with the counts its answer reports and charged them at the price in effect; a
request that asks for no lifetime is held and charged for writes only; an embeddings request for none."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import delete

from billing.prices import CACHE_TOKEN_FIELDS, Price, cost_pico_usd, max_cost_pico_usd
from tests.factories import create_price
from tests.gateway.conftest import MODEL, GatewayUnderTest, wait_for_usage
from tollgate.models import Price as PriceRow

pytestmark = pytest.mark.slow

MAX_TOKENS = 4


@pytest.fixture
async def cache_price(gateway: GatewayUnderTest) -> AsyncIterator[Price]:
    """A price row for MODEL from now on that differs from the session's only in its cache products (so
    nothing else served meanwhile costs more or less), in the gateway's price book until the test ends;
    then removed again."""
    start = datetime.now(UTC)
    async with gateway.db.session() as session:
        await create_price(
            session,
            model=MODEL,
            effective_from=start,
            cache_write=3_750_000,
            cache_pin=300_000,
            cache_retention=100_003,
        )
    await gateway.runtime.prices.refresh()
    try:
        yield gateway.runtime.prices.price_for(MODEL)
    finally:
        async with gateway.db.session() as session:
            await session.execute(
                delete(PriceRow).where(PriceRow.model == MODEL, PriceRow.effective_from == start)
            )
        await gateway.runtime.prices.refresh()


@pytest.fixture
def holds(gateway: GatewayUnderTest, monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """What admission held against the monthly budget, by request id."""
    admission = gateway.runtime.admission
    admit = admission.admit
    held: dict[str, int] = {}

    async def recording(limits: Any, request_id: str, reserved_tokens: int, cost: int) -> Any:
        held[request_id] = cost
        return await admit(limits, request_id, reserved_tokens, cost)

    monkeypatch.setattr(admission, "admit", recording)
    return held


def chat(**fields: Any) -> dict[str, Any]:
    # A prompt no earlier request wrote: its whole blocks are written now.
    system = f"{uuid.uuid4()} " + " ".join(f"rule {i}: keep answers short." for i in range(10))
    return {
        "model": MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **fields,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Rule 3?"}],
    }


async def test_written_pinned_and_retained_tokens_are_held_metered_and_charged(
    client: httpx.AsyncClient, gateway: GatewayUnderTest, cache_price: Price, holds: dict[str, int]
) -> None:
    r = await client.post(
        "/chat/completions", json=chat(prompt_cache_options={"ttl": "30m"}, prompt_cache_retention="24h")
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    details = usage["prompt_tokens_details"]
    counts = {name: details[name] for name in CACHE_TOKEN_FIELDS}
    assert all(counts.values())  # the tiers held it all
    request_id = r.headers["x-request-id"]
    [record] = await wait_for_usage(gateway.settings.redis_url, request_id)
    assert {name: record[name] for name in CACHE_TOKEN_FIELDS} == counts
    prompt, cached, completion = usage["prompt_tokens"], details["cached_tokens"], usage["completion_tokens"]
    plain = cost_pico_usd(cache_price, prompt, cached, completion, "interactive")
    assert record["cost_pico_usd"] == cost_pico_usd(
        cache_price, prompt, cached, completion, "interactive", **counts
    )
    assert record["cost_pico_usd"] == plain + (
        counts["cache_write_tokens"] * 3_750_000
        + counts["cache_pinned_tokens"] * 300_000
        + counts["cache_retained_tokens"] * 100_003
    )
    assert holds[request_id] == max_cost_pico_usd(
        cache_price, prompt, MAX_TOKENS, "interactive", cache_pin=True, cache_retention=True
    )


async def test_without_lifetimes_only_the_writes_are_held_and_charged(
    client: httpx.AsyncClient, gateway: GatewayUnderTest, cache_price: Price, holds: dict[str, int]
) -> None:
    r = await client.post("/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    [record] = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert record["cache_write_tokens"] == usage["prompt_tokens_details"]["cache_write_tokens"] > 0
    assert record["cache_pinned_tokens"] == record["cache_retained_tokens"] == 0
    assert record["cost_pico_usd"] == cost_pico_usd(
        cache_price,
        usage["prompt_tokens"],
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["completion_tokens"],
        "interactive",
        cache_write_tokens=record["cache_write_tokens"],
    )
    hold = max_cost_pico_usd(cache_price, usage["prompt_tokens"], MAX_TOKENS, "interactive")
    assert holds[r.headers["x-request-id"]] == hold


async def test_without_max_tokens_the_hold_covers_the_rest_of_the_context(
    client: httpx.AsyncClient, gateway: GatewayUnderTest, cache_price: Price, holds: dict[str, int]
) -> None:
    """The engine may generate to the end of the context: held for the default reservation only, every
    request admitted beside it could overshoot the budget by what it generates past that."""
    body = chat()
    del body["max_tokens"]
    r = await client.post("/chat/completions", json={**body, "max_completion_tokens": None})
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    info = gateway.runtime.router.models[MODEL].info()
    assert info is not None and info.max_model_len > gateway.settings.default_max_tokens_reservation + prompt
    assert holds[r.headers["x-request-id"]] == max_cost_pico_usd(
        cache_price, prompt, info.max_model_len - prompt, "interactive")


async def test_embeddings_pay_no_cache_products(
    client: httpx.AsyncClient, gateway: GatewayUnderTest, cache_price: Price, holds: dict[str, int]
) -> None:
    text = f"{uuid.uuid4()} " + " ".join(f"an embedded sentence number {i}." for i in range(8))
    r = await client.post("/embeddings", json={"model": MODEL, "input": text})
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    [record] = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert [record[name] for name in CACHE_TOKEN_FIELDS] == [0, 0, 0]
    assert record["cost_pico_usd"] == prompt * cache_price.embedding_input
    assert holds[r.headers["x-request-id"]] == prompt * cache_price.embedding_input
