"""A tenant's LoRA adapter end to end with the official ``openai`` SDK, unchanged, against the session's
shared platform (``tollgate up``'s gateway, worker and beat; a tensor-parallel tiny engine replica that
serves adapters from the store the gateway writes): upload the bundle as a file and register it, list
it, call it by chat, Responses and batch, see it billed at its own price in the ledger and the Usage
API, see another tenant refused everywhere, delete it."""

from __future__ import annotations

import io
import json
import time
import zipfile
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import select

from billing.prices import PRICE_FIELDS, Price, charge
from engine.usage import Usage
from gateway.batches.lines import line_request_id
from tests.e2e.platform_harness import MODEL, PLATFORM_GROUP, Platform
from tests.e2e.test_batch_e2e import jsonl, ledger_rows, sdk, wait_for_batch
from tests.engine.test_lora_serving import strong_bundle
from tests.polling import eventually
from tollgate.db import Database
from tollgate.models import Price as PriceRow
from tollgate.models import UsageEvent

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.xdist_group(PLATFORM_GROUP)]

PROMPT = "Summarise the ticket in one line: the printer on floor three is jammed again."


def bundle_zip(platform: Platform, out: Path) -> bytes:
    model_dir = Path(json.loads(platform.env["TOLLGATE_MODELS"])[0]["path"])
    bundle = strong_bundle(model_dir, out, 11, ["q_proj", "v_proj", "o_proj", "down_proj"], 4)
    data = io.BytesIO()
    with zipfile.ZipFile(data, "w") as zf:
        for path in bundle.iterdir():
            zf.write(path, path.name)
    return data.getvalue()


async def adapter_price(db: Database, model: str) -> Price:
    async with db.session() as session:
        row = (await session.scalars(select(PriceRow).where(PriceRow.model == model))).one()
    return Price(**{name: getattr(row, name) for name in PRICE_FIELDS})


def billed_at(row: UsageEvent, price: Price, request_class: str = "interactive") -> int:
    usage = Usage.of(prompt_tokens=row.prompt_tokens, cached_tokens=row.cached_tokens,
                     completion_tokens=row.completion_tokens)
    return charge(usage, price, request_class).total


async def test_a_tenants_adapter_through_the_official_sdk(platform: Platform, platform_db: Database,
                                                          tmp_path: Path) -> None:
    owner, stranger = await platform.tenant(platform_db), await platform.tenant(platform_db)
    client, other = sdk(platform, owner.key), sdk(platform, stranger.key)
    upload = await client.files.create(file=("adapter.zip", bundle_zip(platform, tmp_path / "b")),
                                       purpose="fine-tune")
    body = {"file_id": upload.id, "name": "tickets", "base_model": MODEL}
    created = await client.post("/models", body=body, cast_to=openai.types.Model)
    model = created.id
    assert model.startswith(f"ft:{MODEL}:") and ":tickets:" in model
    assert model in [m.id async for m in client.models.list()]
    assert (await client.models.retrieve(model)).id == model

    # Its own price, set by the operator; the gateways pick it up with their price book.
    platform.cli("prices", "set", model, "--input", "7", "--output", "21")
    price = await adapter_price(platform_db, model)

    async def billed_at_its_price() -> str | None:
        raw = await client.chat.completions.with_raw_response.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=6, temperature=0)
        request_id = raw.headers["x-request-id"]
        row = (await ledger_rows(platform_db, {request_id}))[0]
        return request_id if row.cost_pico_usd == billed_at(row, price) else None

    chat_id = await eventually(billed_at_its_price, "a chat request billed at the adapter's price",
                               timeout_s=60.0, interval_s=0.5)
    raw = await client.chat.completions.with_raw_response.create(
        model=model, temperature=0, max_tokens=6, messages=[{"role": "user", "content": PROMPT}])
    tuned = raw.parse()
    base = await client.chat.completions.create(model=MODEL, temperature=0, max_tokens=6,
                                                messages=[{"role": "user", "content": PROMPT}])
    assert tuned.model == model and tuned.choices[0].message.content != base.choices[0].message.content
    response = await client.responses.with_raw_response.create(model=model, input=PROMPT, max_output_tokens=6)
    assert response.parse().model == model

    batch_file = await client.files.create(file=("lines.jsonl", jsonl([
        {"custom_id": "t1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}}])),
        purpose="batch")
    batch = await client.batches.create(input_file_id=batch_file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    done = await wait_for_batch(client.batches.retrieve, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 1, done
    output = json.loads((await client.files.content(done.output_file_id)).text)
    assert output["response"]["status_code"] == 200 and output["response"]["body"]["model"] == model

    # The ledger names the adapter's model and holds what its price says, batch lines at the batch price.
    request_ids = {chat_id, raw.headers["x-request-id"], response.headers["x-request-id"],
                   line_request_id(batch.id, "t1")}
    rows = await ledger_rows(platform_db, request_ids)
    for row in rows:
        assert row.model == model and row.cost_pico_usd == billed_at(row, price, row.request_class), row
    assert sorted(r.request_class for r in rows) == ["batch", "interactive", "interactive", "interactive"]

    # The Usage API groups by it.
    async with httpx.AsyncClient(base_url=platform.openai_base_url, timeout=30,
                                 headers={"Authorization": f"Bearer {owner.key}"}) as api:
        async def usage_of_model() -> dict[str, Any] | None:
            page = (await api.get("/organization/usage/completions", params={
                "start_time": int(time.time()) - 3600, "bucket_width": "1d", "group_by": "model"})).json()
            results = [r for b in page["data"] for r in b["results"] if r["model"] == model]
            requests = sum(r["num_model_requests"] for r in results)
            return results[0] if results and requests >= len(request_ids) else None

        usage = await eventually(usage_of_model, "the adapter's model in the Usage API", timeout_s=60.0)
        assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0

    # Another tenant: it does not exist, on every endpoint and in a batch.
    message = [{"role": "user", "content": "x"}]
    for call in (lambda: other.models.retrieve(model),
                 lambda: other.chat.completions.create(model=model, messages=message),
                 lambda: other.responses.create(model=model, input="x"),
                 lambda: other.models.delete(model)):
        with pytest.raises(openai.NotFoundError) as refused:
            await call()
        assert refused.value.code == "model_not_found"
    their_file = await other.files.create(file=("lines.jsonl", jsonl([
        {"custom_id": "s1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}}])),
        purpose="batch")
    theirs = await other.batches.create(input_file_id=their_file.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    failed = await wait_for_batch(other.batches.retrieve, theirs.id)
    assert failed.status == "failed" and failed.errors.data[0].code == "model_not_found"

    # Deleted: 404 from then on.
    deleted = await client.models.delete(model)
    assert deleted.deleted and deleted.id == model
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}])
    assert model not in [m.id async for m in client.models.list()]
    await client.close()
    await other.close()
