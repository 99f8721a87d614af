"""Predicted Outputs from the client's usage to the ledger and what is built on it, against a real engine,
Postgres and Redis: chat completions with a ``prediction`` (streamed and not) leave ledger rows whose
accepted and rejected prediction tokens are what the client was told; the hourly rollups equal the
ledger; the tenant Usage API, the admin usage API and the statement show them. A prediction longer than
the model's context is a 400 naming ``prediction``, before anything is admitted or billed."""

from __future__ import annotations

import json
from datetime import UTC, timedelta
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from billing.ledger import UsageFlusher
from billing.outbox import PREDICTION_TOKEN_FIELDS
from billing.rollups import find_rollup_mismatches, hour_of
from gateway.admin.auth import generate_admin_token, hash_admin_token
from tests.factories import create_admin
from tests.gateway.conftest import MODEL, GatewayUnderTest, TenantKey, usage_records, wait_for_usage
from tests.openai_schema import assert_conforms
from tollgate.models import UsageEvent, UsageHourly

pytestmark = pytest.mark.slow

HELLO = [{"role": "user", "content": "Say hello"}]


def _details(usage: dict[str, Any]) -> dict[str, int]:
    details = usage["completion_tokens_details"]
    return {name: details[name] for name in PREDICTION_TOKEN_FIELDS}


async def _predicted(client: httpx.AsyncClient, request: dict[str, Any], prediction: str, *,
                     stream: bool = False) -> tuple[str, dict[str, Any]]:
    """(request id, the usage the client was told) of one chat completion with ``prediction``."""
    body = {**request, "prediction": {"type": "content", "content": prediction}}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = await client.post("/chat/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [e.removeprefix("data: ") for e in response.text.strip("\n").split("\n\n")]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
    else:
        usage = response.json()["usage"]
    return response.headers["x-request-id"], usage


async def test_prediction_tokens_reach_the_ledger_rollups_usage_apis_and_statement(
        client: httpx.AsyncClient, gateway: GatewayUnderTest, tenant_key: TenantKey) -> None:
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 24, "temperature": 0}
    plain = (await client.post("/chat/completions", json=request)).json()
    text = plain["choices"][0]["message"]["content"]
    half = len(text) // 2
    told: dict[str, dict[str, Any]] = {}  # request id -> the usage the client was told
    for prediction, stream in ((text, False),  # all of it right
                               (text[:half] + "~" + text[half + 1:], False),  # one character edited
                               ("zebra quartz " * 8, False),  # wrong from the start
                               (text, True)):  # streamed: the usage comes in the last chunk
        request_id, usage = await _predicted(client, request, prediction, stream=stream)
        told[request_id] = usage
    assert all(_details(u)["accepted_prediction_tokens"] > 0 for u in list(told.values())[:2])
    assert sum(_details(u)["rejected_prediction_tokens"] for u in told.values()) > 0
    for usage in told.values():  # rejected prediction tokens are completion tokens, billed as output
        assert usage["completion_tokens"] == (plain["usage"]["completion_tokens"]
                                              + _details(usage)["rejected_prediction_tokens"])

    redis = gateway.runtime.redis
    for request_id in told:
        await wait_for_usage(gateway.settings.redis_url, request_id)
    flushed = await UsageFlusher(redis, gateway.db.session, consumer="prediction-billing").flush()
    assert flushed.inserted >= len(told)
    assert [await usage_records(redis, request_id) for request_id in told] == [[]] * len(told)  # all ledgered
    async with gateway.db.session() as session:
        rows = {r.request_id: r for r in await session.scalars(
            select(UsageEvent).where(UsageEvent.request_id.in_(list(told))))}
    assert set(rows) == set(told)
    for request_id, usage in told.items():
        row = rows[request_id]
        assert row.tenant_id == tenant_key.tenant_id and row.request_class == "interactive"
        assert row.completion_tokens == usage["completion_tokens"]
        assert {name: getattr(row, name) for name in PREDICTION_TOKEN_FIELDS} == _details(usage)
    expected = {name: sum(_details(u)[name] for u in told.values()) for name in PREDICTION_TOKEN_FIELDS}

    # The hourly rollups equal the ledger, prediction counts included.
    start = min(hour_of(r.created_at) for r in rows.values())
    end = max(hour_of(r.created_at) for r in rows.values()) + timedelta(hours=1)
    async with gateway.db.session() as session:
        await session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        assert await find_rollup_mismatches(session, start, end, tenant_ids=[tenant_key.tenant_id]) == []
        hourly = (await session.scalars(select(UsageHourly).where(
            UsageHourly.tenant_id == tenant_key.tenant_id))).all()
    assert {name: sum(getattr(h, name) for h in hourly) for name in PREDICTION_TOKEN_FIELDS} == expected

    # The tenant's Usage API: hourly buckets read the rollups, minute buckets the ledger.
    for width in ("1h", "1m"):
        params = {"start_time": int(start.timestamp()), "end_time": int(end.timestamp()),
                  "bucket_width": width, "limit": 60 if width == "1m" else 24}
        page = await client.get("/organization/usage/completions", params=params)
        assert page.status_code == 200, page.text
        assert_conforms(page.json(), "UsageResponse")
        results = [r for b in page.json()["data"] for r in b["results"]]
        if width == "1m" and end - start > timedelta(hours=1):
            continue  # the minute page covers the first hour only
        shown = {name: sum(r[f"output_{name}"] for r in results) for name in PREDICTION_TOKEN_FIELDS}
        assert shown == expected

    # The admin usage API (ledger sums) and the statement's output lines.
    token = generate_admin_token()
    async with gateway.db.session() as session:
        await create_admin(session, api_token_hash=hash_admin_token(token, gateway.settings))
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                 headers={"Authorization": f"Bearer {token}"}) as admin:
        report = await admin.get(f"/admin/v1/tenants/{tenant_key.tenant_id}/usage",
                                 params={"start": start.isoformat(), "end": end.isoformat()})
        assert report.status_code == 200, report.text
        assert {name: report.json()["totals"][name] for name in PREDICTION_TOKEN_FIELDS} == expected
        months = sorted({r.created_at.astimezone(UTC).strftime("%Y-%m") for r in rows.values()})
        statements = [(await admin.get(f"/admin/v1/statements/{tenant_key.tenant_id}",
                                       params={"month": month})).json() for month in months]
    outputs = [line for s in statements for line in s["lines"] if line["token_kind"] == "output"]
    assert {name: sum(line[name] for line in outputs) for name in PREDICTION_TOKEN_FIELDS} == expected
    assert {name: sum(s[name] for s in statements) for name in PREDICTION_TOKEN_FIELDS} == expected


async def test_a_prediction_longer_than_the_context_is_a_400_and_bills_nothing(
        client: httpx.AsyncClient, gateway: GatewayUnderTest) -> None:
    # The tiny model's context is 2048 tokens; each "x" is one token of its byte-level tokenizer.
    response = await client.post("/chat/completions", json={
        "model": MODEL, "messages": HELLO, "max_tokens": 4,
        "prediction": {"type": "content", "content": "x" * 2100}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "prediction",
                                                              "invalid_value")
    ok = await client.post("/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    await wait_for_usage(gateway.settings.redis_url, ok.headers["x-request-id"])  # appended by now
    assert await usage_records(gateway.runtime.redis, response.headers["x-request-id"]) == []
