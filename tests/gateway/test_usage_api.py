"""Tenant usage API (``/v1/organization/usage/completions``, ``/v1/organization/costs``) and admin statements
(``/admin/v1/statements``) through the gateway app on real Postgres and Redis: the ledger's numbers,
OpenAI's ``UsageResponse`` shape, pagination, and nothing of another tenant."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import Numeric, cast, func, select

import gateway.admin
import gateway.api
import gateway.usage
from billing.ledger import UsageFlusher
from billing.outbox import UsageRecord, append_usage
from billing.prices import CACHE_TOKEN_FIELDS, Price, cost_pico_usd
from gateway.admin.auth import generate_admin_token, hash_admin_token
from gateway.app import create_app
from tests.factories import create_admin, create_api_key, create_price, create_tenant
from tests.openai_schema import assert_conforms
from tollgate.db import Database
from tollgate.models import UsageEvent
from tollgate.settings import Settings

DAY = datetime(2026, 9, 14, tzinfo=UTC)
NONE = (0, 0, 0)
PRICES = {"alpha": Price.of(input=3_000_000, output=15_000_000, cache_write=3_750_000, cache_pin=300_000,
                            cache_retention=100_000),
          "beta": Price.of(input=500_000, output=700_001, cache_write=625_001, cache_retention=7)}
# (model, class, hour offset from DAY, prompt, cached, completion, (cache written, pinned, retained))
MINE = [("alpha", "interactive", 1, 1000, 200, 50, (784, 992, 992)),
        ("alpha", "interactive", 1, 10, 0, 5, NONE),
        ("beta", "batch", 1, 4000, 1000, 300, (2992, 0, 3984)),
        ("alpha", "interactive", 30, 77, 7, 7, (64, 64, 0)),
        ("beta", "interactive", 50, 12, 0, 1, NONE)]
THEIRS = [("alpha", "interactive", 1, 99_999, 0, 99_999, (99_984, 99_984, 0)),
          ("gamma", "interactive", 2, 5, 0, 5, NONE)]


@dataclass
class Setup:
    client: httpx.AsyncClient
    db: Database
    tenant_id: int
    other_id: int
    headers: dict[str, str]
    admin_headers: dict[str, str]
    other_headers: dict[str, str]


def record(tenant_id: int, i: int, row: tuple) -> UsageRecord:
    model, klass, hour, prompt, cached, completion, cache = row
    cache_tokens = dict(zip(CACHE_TOKEN_FIELDS, cache, strict=True))
    return UsageRecord.of(request_id=f"usage-api-{tenant_id}-{i}", tenant_id=tenant_id, api_key_id=None,
                       model=model, request_class=klass, tier="default", prompt_tokens=prompt,
                       cached_tokens=cached, completion_tokens=completion,
                       cost_pico_usd=cost_pico_usd(PRICES.get(model, PRICES["alpha"]), prompt, cached,
                                                   completion, klass, **cache_tokens),
                       status="completed", ttft_ms=None, tpot_ms=None,
                       created_at=DAY + timedelta(hours=hour, minutes=13 + i), **cache_tokens,
                       **predicted(completion))


def predicted(completion: int) -> dict[str, int]:
    """The prediction tokens of a row: a fifth of its output accepted, a tenth rejected."""
    return {"accepted_prediction_tokens": completion // 5, "rejected_prediction_tokens": completion // 10}


@asynccontextmanager
async def usage_app(database_url: str, redis_url: str, redis_client) -> AsyncIterator[Setup]:
    settings = Settings(environment="test", database_url=database_url, redis_url=redis_url,
                        database_pool_size=2)
    db = Database(database_url, pool_size=2)
    async with db.session() as session:
        tenant = await create_tenant(session)
        other = await create_tenant(session)
        for model, price in PRICES.items():
            await create_price(session, model=model, input=price.input, output=price.output,
                               cache_write=price.cache_write, cache_pin=price.cache_pin,
                               cache_retention=price.cache_retention)
        _, key = await create_api_key(session, tenant, settings=settings)
        _, other_key = await create_api_key(session, other, settings=settings)
        token = generate_admin_token()
        await create_admin(session, api_token_hash=hash_admin_token(token, settings))
    for i, row in enumerate(MINE):
        await append_usage(redis_client, record(tenant.id, i, row))
    for i, row in enumerate(THEIRS):
        await append_usage(redis_client, record(other.id, i, row))
    assert (await UsageFlusher(redis_client, db.session, consumer="usage-api").flush()).inserted == 7
    app = create_app(settings, (gateway.api, gateway.admin, gateway.usage))
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                yield Setup(client, db, tenant.id, other.id, {"Authorization": f"Bearer {key}"},
                            {"Authorization": f"Bearer {token}"}, {"Authorization": f"Bearer {other_key}"})
    finally:
        await db.dispose()


@pytest.fixture
async def setup(new_database, redis_url, redis_client) -> AsyncIterator[Setup]:
    async with usage_app(new_database, redis_url, redis_client) as s:
        yield s


def ts(at: datetime) -> int:
    return int(at.timestamp())


async def test_daily_usage_matches_the_ledger_and_shows_no_other_tenant(setup: Setup) -> None:
    response = await setup.client.get("/v1/organization/usage/completions", headers=setup.headers, params={
        "start_time": ts(DAY), "end_time": ts(DAY + timedelta(days=3))})
    assert response.status_code == 200, response.text
    body = response.json()
    assert_conforms(body, "UsageResponse")
    assert [b["start_time"] for b in body["data"]] == [ts(DAY + timedelta(days=d)) for d in range(3)]
    assert body["has_more"] is False and body["next_page"] is None
    totals = [b["results"][0] for b in body["data"]]
    day0 = [r for r in MINE if r[2] < 24]
    assert totals[0]["num_model_requests"] == len(day0)
    assert totals[0]["input_tokens"] == sum(r[3] for r in day0)
    assert totals[0]["input_cached_tokens"] == sum(r[4] for r in day0)
    assert totals[0]["output_tokens"] == sum(r[5] for r in day0)
    assert sum(t["num_model_requests"] for t in totals) == len(MINE)  # nothing of the other tenant
    assert sum(t["output_tokens"] for t in totals) == sum(r[5] for r in MINE)
    # Cache writes are part of the input, apart from the cached and the uncached input (OpenAI's split).
    assert totals[0]["input_cache_write_tokens"] == 784 + 2992
    assert totals[0]["input_uncached_tokens"] == sum(r[3] - r[4] - r[6][0] for r in day0)
    day = totals[0]
    assert day["input_tokens"] == (day["input_cached_tokens"] + day["input_cache_write_tokens"]
                                   + day["input_uncached_tokens"])
    assert (day["input_cache_pinned_tokens"], day["input_cache_retained_tokens"]) == (992, 992 + 3984)
    assert (totals[1]["input_cache_write_tokens"], totals[1]["input_cache_pinned_tokens"]) == (64, 64)
    assert totals[2]["input_cache_write_tokens"] == totals[2]["input_cache_retained_tokens"] == 0
    # Predicted Outputs: the output's accepted and rejected prediction tokens, per day.
    for day_index, total in enumerate(totals):
        rows = [r for r in MINE if r[2] // 24 == day_index]
        for name in ("accepted_prediction_tokens", "rejected_prediction_tokens"):
            assert total[f"output_{name}"] == sum(predicted(r[5])[name] for r in rows)
    day0 = totals[0]
    assert (day0["output_accepted_prediction_tokens"], day0["output_rejected_prediction_tokens"]) == (71, 35)


async def test_hourly_grouped_usage_pagination_and_filters(setup: Setup) -> None:
    params = {"start_time": ts(DAY), "end_time": ts(DAY + timedelta(hours=4)), "bucket_width": "1h",
              "group_by": ["model", "batch"], "limit": 3}
    first = (await setup.client.get("/v1/organization/usage/completions", headers=setup.headers,
                                    params=params)).json()
    assert_conforms(first, "UsageResponse")
    assert len(first["data"]) == 3 and first["has_more"] is True
    hour1 = first["data"][1]["results"]
    assert {(r["model"], r["batch"], r["num_model_requests"]) for r in hour1} == {
        ("alpha", False, 2), ("beta", True, 1)}
    second = (await setup.client.get("/v1/organization/usage/completions", headers=setup.headers,
                                     params={**params, "page": first["next_page"]})).json()
    assert [b["start_time"] for b in second["data"]] == [ts(DAY + timedelta(hours=3))]
    assert second["has_more"] is False
    only_batch = (await setup.client.get("/v1/organization/usage/completions", headers=setup.headers, params={
        "start_time": ts(DAY), "end_time": ts(DAY + timedelta(days=3)), "batch": "true",
        "models": ["beta"]})).json()
    assert sum(r["num_model_requests"] for b in only_batch["data"] for r in b["results"]) == 1
    minutes = (await setup.client.get("/v1/organization/usage/completions", headers=setup.headers, params={
        "start_time": ts(DAY + timedelta(hours=1)), "end_time": ts(DAY + timedelta(hours=1, minutes=20)),
        "bucket_width": "1m", "limit": 30})).json()
    assert_conforms(minutes, "UsageResponse")
    assert [b["start_time"] for b in minutes["data"] if b["results"]] == [
        ts(DAY + timedelta(hours=1, minutes=13 + i)) for i in range(3)]
    # Minute buckets read the ledger's cache counts.
    assert [(r["input_cache_write_tokens"], r["input_cache_pinned_tokens"], r["input_cache_retained_tokens"])
            for b in minutes["data"] for r in b["results"]] == [row[6] for row in MINE[:3]]
    assert [(r["output_accepted_prediction_tokens"], r["output_rejected_prediction_tokens"])
            for b in minutes["data"] for r in b["results"]] == [(10, 5), (1, 0), (60, 30)]


async def test_costs_equal_the_ledger_and_statements(setup: Setup) -> None:
    response = await setup.client.get("/v1/organization/costs", headers=setup.headers, params={
        "start_time": ts(DAY), "end_time": ts(DAY + timedelta(days=3)), "group_by": ["line_item"]})
    body = response.json()
    assert response.status_code == 200, body
    assert_conforms(body, "UsageResponse")
    lines = {r["line_item"]: r for r in body["data"][0]["results"]}
    assert set(lines) == {"alpha, input", "alpha, cached input", "alpha, output", "alpha, cache write",
                          "alpha, cache pin", "alpha, cache retention", "beta, batch input",
                          "beta, batch cached input", "beta, batch output", "beta, batch cache write",
                          "beta, batch cache retention"}  # no batch pin was bought: no line for it
    assert lines["alpha, output"]["quantity"] == 55 and lines["alpha, output"]["quantity_unit"] == "tokens"
    for item, tokens, price in (("alpha, cache write", 784, 3_750_000), ("alpha, cache pin", 992, 300_000),
                                ("alpha, cache retention", 992, 100_000),
                                ("beta, batch cache write", 2992, 312_500),
                                ("beta, batch cache retention", 3984, 3)):
        assert lines[item]["quantity"] == tokens
        assert lines[item]["amount"]["value"] == pytest.approx(tokens * price / 1e12, rel=1e-12)
    ungrouped = (await setup.client.get("/v1/organization/costs", headers=setup.headers, params={
        "start_time": ts(DAY), "end_time": ts(DAY + timedelta(days=3))})).json()
    day_totals = [b["results"][0]["amount"]["value"] if b["results"] else 0.0 for b in ungrouped["data"]]
    async with setup.db.session() as session:
        exact = int(await session.scalar(select(func.sum(cast(UsageEvent.cost_pico_usd, Numeric)))
                                         .where(UsageEvent.tenant_id == setup.tenant_id)))
    assert sum(day_totals) == pytest.approx(exact / 1e12, rel=1e-12)

    statement = await setup.client.get(f"/admin/v1/statements/{setup.tenant_id}", headers=setup.admin_headers,
                                       params={"month": "2026-09"})
    assert statement.status_code == 200, statement.text
    assert statement.json()["total_pico_usd"] == exact
    cache_lines = {(line["model"], line["request_class"], line["token_kind"]): (line["tokens"],
                                                                                line["amount_pico_usd"])
                   for line in statement.json()["lines"] if line["token_kind"].startswith("cache_")}
    assert cache_lines == {
        ("alpha", "interactive", "cache_write"): (784 + 64, (784 + 64) * 3_750_000),
        ("alpha", "interactive", "cache_pinned"): (992 + 64, (992 + 64) * 300_000),
        ("alpha", "interactive", "cache_retained"): (992, 992 * 100_000),
        ("beta", "batch", "cache_write"): (2992, 2992 * 312_500),
        ("beta", "batch", "cache_retained"): (3984, 3984 * 3)}
    csv_response = await setup.client.get(f"/admin/v1/statements/{setup.tenant_id}.csv",
                                          headers=setup.admin_headers, params={"month": "2026-09"})
    assert csv_response.headers["content-type"].startswith("text/csv")
    assert csv_response.text.strip().splitlines()[-1].split(",")[6] == str(exact)


async def test_errors_and_authorization(setup: Setup) -> None:
    url = "/v1/organization/usage/completions"
    assert (await setup.client.get(url, params={"start_time": 0})).status_code == 401
    bad = await setup.client.get(url, headers=setup.headers,
                                 params={"start_time": ts(DAY), "group_by": "user_id"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"
    missing = await setup.client.get(url, headers=setup.headers)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "start_time"
    page = await setup.client.get(url, headers=setup.headers, params={"start_time": ts(DAY), "page": "nope"})
    assert page.status_code == 400 and page.json()["error"]["param"] == "page"
    hourly_costs = await setup.client.get("/v1/organization/costs", headers=setup.headers,
                                          params={"start_time": ts(DAY), "bucket_width": "1h"})
    assert hourly_costs.status_code == 400
    # Times past the year 3000 are a 400 naming them (they were a 500: no datetime that far).
    for path, name, params in (
            (url, "start_time", {"start_time": 10**12}),
            ("/v1/organization/costs", "end_time", {"start_time": 0, "end_time": 2**63 - 1})):
        far = await setup.client.get(path, headers=setup.headers, params=params)
        assert far.status_code == 400 and far.json()["error"]["param"] == name, far.text
    # A tenant key never opens the admin statements; the other tenant sees only its own usage.
    statement = await setup.client.get(f"/admin/v1/statements/{setup.tenant_id}", headers=setup.headers,
                                       params={"month": "2026-09"})
    assert statement.status_code == 403
    theirs = (await setup.client.get(url, headers=setup.other_headers, params={
        "start_time": ts(DAY), "end_time": ts(DAY + timedelta(days=3))})).json()
    assert sum(r["num_model_requests"] for b in theirs["data"] for r in b["results"]) == len(THEIRS)
    unknown = await setup.client.get("/admin/v1/statements/nobody", headers=setup.admin_headers,
                                     params={"month": "2026-09"})
    assert unknown.status_code == 404


def test_a_page_lists_its_own_buckets_not_the_whole_range() -> None:
    """Fifty years in minutes, one page of 7: planned at once (listing the range first took seconds and a
    gigabyte, one request stalling the worker), with the cursor of the next page."""
    from gateway.usage.service import plan_page

    now = 1_999_999_980  # a whole minute
    page = plan_page(0, now, "1m", 7, None, (7, 1440), now=now)
    assert page.starts == [i * 60 for i in range(7)] and page.next_page is not None
    last = plan_page(now - 120, now, "1m", 7, None, (7, 1440), now=now)
    assert last.starts == [now - 120, now - 60] and last.next_page is None
