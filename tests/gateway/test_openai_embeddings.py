"""``POST /v1/embeddings`` against a real engine: bodies validate against OpenAI's
``CreateEmbeddingResponse``, vectors are the engine's pooled hidden states (equal inputs embed equally,
normalised), ``base64`` carries the same floats, ``dimensions`` shortens and re-normalises, token-id
inputs work, usage is metered once with input tokens only, ``/v1/models`` says which models embed, and
bad input gets OpenAI's 400."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from sqlalchemy import delete

from tests.factories import DEFAULT_INPUT_PRICE, create_price
from tests.gateway.conftest import MODEL, GatewayUnderTest, wait_for_usage
from tests.openai_schema import assert_conforms
from tollgate.models import Price

pytestmark = pytest.mark.slow

DIMENSIONS = 128  # the tiny checkpoint's hidden size


def _norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


async def test_embeddings_conform_and_are_metered(client: httpx.AsyncClient, gateway: GatewayUnderTest,
                                                  tenant_key) -> None:
    r = await client.post("/embeddings", json={"model": MODEL, "input": ["The cat sat.", "A dog ran.",
                                                                          "The cat sat."]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "CreateEmbeddingResponse")
    assert body["model"] == MODEL and [d["index"] for d in body["data"]] == [0, 1, 2]
    vectors = [d["embedding"] for d in body["data"]]
    assert all(len(v) == DIMENSIONS and abs(_norm(v) - 1.0) < 1e-5 for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-6) and vectors[0] != pytest.approx(vectors[1])
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"]
    [record] = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert record["tenant_id"] == tenant_key.tenant_id and record["status"] == "completed"
    assert (record["prompt_tokens"], record["completion_tokens"]) == (usage["prompt_tokens"], 0)
    assert record["cost_pico_usd"] > 0


@pytest.fixture
async def embedding_price(gateway: GatewayUnderTest) -> AsyncIterator[int]:
    """A price row for MODEL from now on that differs from the session's only in its embedding prices
    (so nothing else served meanwhile costs more or less), in the gateway's price book until the test
    ends; then removed again."""
    price = 7_000  # pico-USD per token: $0.007 per million tokens, not the chat input price
    start = datetime.now(UTC)
    async with gateway.db.session() as session:
        await create_price(session, model=MODEL, effective_from=start, embedding_input=price)
    await gateway.runtime.prices.refresh()
    try:
        yield price
    finally:
        async with gateway.db.session() as session:
            await session.execute(delete(Price).where(Price.model == MODEL, Price.effective_from == start))
        await gateway.runtime.prices.refresh()


async def test_embeddings_are_billed_at_the_embedding_price(client: httpx.AsyncClient,
                                                             gateway: GatewayUnderTest,
                                                             embedding_price: int) -> None:
    r = await client.post("/embeddings", json={"model": MODEL, "input": ["Priced per token.", "Again."]})
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    [record] = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert (record["prompt_tokens"], record["completion_tokens"]) == (prompt_tokens, 0)
    assert record["cost_pico_usd"] == prompt_tokens * embedding_price != prompt_tokens * DEFAULT_INPUT_PRICE


async def test_base64_dimensions_and_token_ids(client: httpx.AsyncClient) -> None:
    text = "Embeddings are vectors."
    plain = (await client.post("/embeddings", json={"model": MODEL, "input": text})).json()
    vector = plain["data"][0]["embedding"]
    packed = (await client.post("/embeddings", json={"model": MODEL, "input": text,
                                                      "encoding_format": "base64"})).json()
    # (OpenAI's published schema types ``embedding`` as an array only, though its API sends base64
    # strings exactly like this; the SDKs decode them.)
    raw = base64.b64decode(packed["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vector, abs=1e-6)
    short = (await client.post("/embeddings", json={"model": MODEL, "input": text, "dimensions": 16})).json()
    cut = short["data"][0]["embedding"]
    assert len(cut) == 16 and abs(_norm(cut) - 1.0) < 1e-5
    assert cut == pytest.approx([v / _norm(vector[:16]) for v in vector[:16]], abs=1e-5)
    ids = list(range(10, 30))
    by_ids = (await client.post("/embeddings", json={"model": MODEL, "input": ids})).json()
    lists = (await client.post("/embeddings", json={"model": MODEL, "input": [ids, ids[:5]]})).json()
    assert by_ids["usage"]["prompt_tokens"] == 20 and len(lists["data"]) == 2
    assert lists["data"][0]["embedding"] == pytest.approx(by_ids["data"][0]["embedding"], abs=1e-6)


async def test_models_say_they_embed(client: httpx.AsyncClient) -> None:
    model = (await client.get(f"/models/{MODEL}")).json()
    assert_conforms(model, "Model")
    assert model["capabilities"]["embeddings"] is True
    assert model["capabilities"]["embedding_dimensions"] == DIMENSIONS


@pytest.mark.parametrize(("change", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": [10**9]}, "input[0]"),
    ({"input": "x" * 20_000}, "input[0]"),
    ({"dimensions": DIMENSIONS + 1}, "dimensions"),
    ({"dimensions": 0}, "dimensions"),
    ({"encoding_format": "int8"}, "encoding_format"),
    ({"model": "nope"}, "model"),
])  # fmt: skip
async def test_bad_requests_get_openai_400s(client: httpx.AsyncClient, change: dict[str, Any],
                                            param: str) -> None:
    r = await client.post("/embeddings", json={"model": MODEL, "input": "Hi", **change})
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] is not None and error["param"].startswith(param), error
