"""The ledger equals what clients were told, through a Postgres outage.

Real processes: a synthetic engine replica, ``tollgate gateway``, a Redis of the test's own, and a Postgres
server of the test's own (``tollgate.local_services``, as ``tollgate up`` runs it), which the test stops
while requests keep flowing. The outbox is copied into the ledger by billing's ``UsageFlusher``, the code
the Celery beat task runs.

A mixed run for three tenants: chat completions non-streamed and streamed (``include_usage``), responses
non-streamed and streamed, embeddings, streams the client abandons after a few tokens, and (before the
outage) a background response, run by the worker's code in this process and read back with ``GET``.
Afterwards, for each tenant, Postgres holds exactly one row per request, and:
- a request that completed has the tokens of the ``usage`` object its client received, and its cost is
  those tokens at the price in effect; so per-tenant sums of tokens and cost equal the clients' sums;
- an abandoned stream is billed, as ``cancelled``, for exactly the tokens the engine computed for it (its
  own count, which ``POST /abort`` reports after the end; at least what its client read) and its prompt, as
  the client's own tokenization of it counts it (docs/batch-and-billing.md, "Abandoned requests").
The second phase runs with Postgres stopped (the gateway needs no database on the hot path: keys and
prices are cached), then starts it again: nothing is missing afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from sqlalchemy import select

from billing.ledger import LedgerUnavailable, UsageFlusher
from billing.outbox import USAGE_STREAM
from billing.prices import Price, cost_pico_usd
from engine.tokenizer import Tokenizer
from tests.factories import (
    DEFAULT_INPUT_PRICE,
    DEFAULT_OUTPUT_PRICE,
    create_api_key,
    create_price,
    create_tenant,
)
from tests.gateway.gateway_processes import LOOSE_TIERS, MODEL, gateway_env, gateway_process, synthetic_engine
from tests.polling import eventually
from tollgate import schema
from tollgate.db import Database
from tollgate.local_services import POSTGRES_STOP_SIGNAL, LocalPostgres, find_server_binaries, free_port
from tollgate.models import UsageEvent
from tollgate.processes import spawn, stop
from tollgate.settings import ModelConfig, PoolConfig, Settings, TierConfig

# Not on the session's shared platform (tests/e2e/conftest.py), and in no xdist group: stopping Postgres
# under it would fail the other tests' requests, so this test runs a platform of its own (Postgres it
# may stop, Redis, gateway, a synthetic engine whose paced tokens let a client abandon a stream midway).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PRICE = Price.of(input=DEFAULT_INPUT_PRICE, output=DEFAULT_OUTPUT_PRICE)
TOKEN_INTERVAL_S = 0.1
ABANDON_AFTER = 3


class OwnPostgres:
    """A Postgres server this test may stop and start again (same data directory and port)."""

    def __init__(self, root: Path) -> None:
        self.server = LocalPostgres(root, find_server_binaries(Settings()).postgres_bin_dir, port=free_port(),
                                    password=secrets.token_hex(8), durable=False)
        self.server.prepare()
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = spawn(self.server.argv(), log_path=self.server.log_path, user=self.server.user,
                          cwd=self.server.root, parent_death_signal=POSTGRES_STOP_SIGNAL)
        self.server.wait_ready(self.proc, 60)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, sig=POSTGRES_STOP_SIGNAL, timeout=30)
            self.proc = None


@pytest.fixture
def own_postgres() -> Iterator[OwnPostgres]:
    root = Path(tempfile.mkdtemp(prefix="tollgate-ledger-e2e-"))  # not under pytest's 0700 basetemp
    os.chmod(root, 0o755)
    server = OwnPostgres(root / "pg")
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, for its tokenizer and chat template (the engine is synthetic)."""
    from engine.tiny import create_tiny_checkpoint

    return create_tiny_checkpoint(tmp_path_factory.mktemp("ledger_tiny"), arch="llama", seed=0)


@dataclass
class TenantBook:
    """What one tenant's clients were told."""

    key: str
    tenant_id: int
    background_id: str = ""
    completed: dict[str, dict] = field(default_factory=dict)  # request id -> usage object
    abandoned: dict[str, tuple[int, int]] = field(default_factory=dict)  # request id -> (prompt, received)
    computed: dict[str, int] = field(default_factory=dict)  # abandoned request id -> the engine's count


async def _engine_counts(engine_url: str, books: list[TenantBook]) -> None:
    """What the engine computed for each abandoned stream (it keeps the final usage of ended requests)."""
    async with httpx.AsyncClient(base_url=engine_url, timeout=30) as client:
        for book in books:
            for request_id in book.abandoned.keys() - book.computed.keys():
                answer = (await client.post("/abort", json={"request_id": request_id})).json()
                book.computed[request_id] = answer["usage"]["completion_tokens"]


def _messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Ledger check {tag}"}]


async def _plain(client: httpx.AsyncClient, book: TenantBook, tag: str, max_tokens: int) -> None:
    response = await client.post("/v1/chat/completions", headers={"Authorization": f"Bearer {book.key}"},
                                 json={"model": MODEL, "messages": _messages(tag), "max_tokens": max_tokens})
    assert response.status_code == 200, response.text
    book.completed[response.headers["x-request-id"]] = response.json()["usage"]


async def _stream(client: httpx.AsyncClient, book: TenantBook, tag: str, max_tokens: int,
                  tokenizer: Tokenizer, *, abandon: bool) -> None:
    body = {"model": MODEL, "messages": _messages(tag), "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    received = 0
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {book.key}"}) as response:
        assert response.status_code == 200
        request_id = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                book.completed[request_id] = chunk["usage"]
            received += sum(1 for c in chunk["choices"] if c["delta"].get("content"))  # one token each
            if abandon and received == ABANDON_AFTER:
                break  # leaving the block closes the connection mid-stream
    if abandon:
        book.abandoned[request_id] = (len(tokenizer.encode_chat(_messages(tag))), received)


def _chat_usage(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """A Responses or embeddings usage object as chat's, which the checks below read."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _response_usage(usage: dict[str, Any]) -> dict[str, Any]:
    return _chat_usage(usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"],
                       usage["output_tokens"])


async def _response(client: httpx.AsyncClient, book: TenantBook, tag: str, max_tokens: int) -> None:
    response = await client.post("/v1/responses", headers={"Authorization": f"Bearer {book.key}"},
                                 json={"model": MODEL, "input": f"Ledger check {tag}",
                                       "max_output_tokens": max_tokens})
    assert response.status_code == 200, response.text
    book.completed[response.headers["x-request-id"]] = _response_usage(response.json()["usage"])


async def _response_stream(client: httpx.AsyncClient, book: TenantBook, tag: str, max_tokens: int) -> None:
    body = {"model": MODEL, "input": f"Ledger check {tag}", "max_output_tokens": max_tokens, "stream": True}
    async with client.stream("POST", "/v1/responses", json=body,
                             headers={"Authorization": f"Bearer {book.key}"}) as response:
        assert response.status_code == 200
        final = None
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                final = json.loads(line[6:])
    assert final is not None and final["type"] in ("response.completed", "response.incomplete"), final
    book.completed[response.headers["x-request-id"]] = _response_usage(final["response"]["usage"])


async def _embeddings(client: httpx.AsyncClient, book: TenantBook, tag: str) -> None:
    # Inputs unlike any other prompt in their first block: nothing is served from the prefix cache
    # (the embeddings usage object, as OpenAI's, does not report cached tokens).
    response = await client.post("/v1/embeddings", headers={"Authorization": f"Bearer {book.key}"},
                                 json={"model": MODEL, "input": [f"{tag} one", f"{tag} two"]})
    assert response.status_code == 200, response.text
    book.completed[response.headers["x-request-id"]] = _chat_usage(response.json()["usage"]["prompt_tokens"],
                                                                    0, 0)


REQUESTS_PER_TENANT = 10  # of one _mixed_run


async def _mixed_run(url: str, books: list[TenantBook], tokenizer: Tokenizer, phase: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60.0) as client:
        jobs = []
        for t, book in enumerate(books):
            for i in range(3):
                tag = f"{phase}-{t}-{i}"
                jobs += [_plain(client, book, f"{tag}-plain", 2 + i),
                         _stream(client, book, f"{tag}-stream", 3 + i, tokenizer, abandon=False)]
            jobs += [_response(client, book, f"{phase}-{t}-response", 3),
                     _response_stream(client, book, f"{phase}-{t}-response-stream", 4),
                     _embeddings(client, book, f"{phase}-{t}-embeddings")]
            jobs.append(_stream(client, book, f"{phase}-{t}-abandoned", 50, tokenizer, abandon=True))
        await asyncio.gather(*jobs)


async def _background(url: str, book: TenantBook, settings: Settings, redis_url: str, db: Database) -> None:
    """A background response, queued over HTTP, run by the worker's code here, read back with GET."""
    from gateway.responses.background import BackgroundRuntime, run_background

    headers = {"Authorization": f"Bearer {book.key}"}
    async with httpx.AsyncClient(base_url=url, timeout=60.0, headers=headers) as client:
        body = {"model": MODEL, "input": "Ledger check later", "max_output_tokens": 3, "background": True}
        queued = (await client.post("/v1/responses", json=body)).json()
        redis = aioredis.Redis.from_url(redis_url)
        runtime = BackgroundRuntime.create(settings, redis, db.sessionmaker)
        await runtime.start()
        try:
            assert await run_background(runtime, queued["id"]) in ("completed", "incomplete")
        finally:
            await runtime.stop()
            await redis.aclose()
        done = (await client.get(f"/v1/responses/{queued['id']}")).json()
        book.background_id = queued["id"]
    # The worker's request id is the ledger's: the one row of this tenant not told over HTTP yet.
    await _flush_all(redis_url, db)
    async with db.session() as session:
        rows = (await session.scalars(select(UsageEvent.request_id).where(
            UsageEvent.tenant_id == book.tenant_id))).all()
    told = book.completed.keys() | book.abandoned.keys()
    book.completed[_only(set(rows) - told)] = _response_usage(done["usage"])


def _only(ids: set[str]) -> str:
    assert len(ids) == 1, ids
    return next(iter(ids))


async def _flush_all(redis_url: str, db: Database) -> None:
    """Flush until the outbox is empty (retrying while Postgres is still coming back)."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        flusher = UsageFlusher(redis, db.session, consumer="ledger-equality")

        async def drained() -> bool:
            try:
                await flusher.flush()
            except LedgerUnavailable:
                pass
            return await redis.xlen(USAGE_STREAM) == 0

        await eventually(drained, "the outbox to drain into the ledger", interval_s=0.2)
    finally:
        await redis.aclose()


async def _xlen_at_least(redis: aioredis.Redis, count: int) -> bool:
    return await redis.xlen(USAGE_STREAM) >= count


async def _assert_ledger_matches(db: Database, books: list[TenantBook], tenant_ids: list[int]) -> None:
    async with db.session() as session:
        rows = (await session.scalars(select(UsageEvent).where(UsageEvent.tenant_id.in_(tenant_ids)))).all()
    by_id = {row.request_id: row for row in rows}
    assert len(by_id) == len(rows), "one ledger row per request"
    for tenant_id, book in zip(tenant_ids, books, strict=True):
        mine = [r for r in rows if r.tenant_id == tenant_id]
        assert {r.request_id for r in mine} == book.completed.keys() | book.abandoned.keys()
        for request_id, usage in book.completed.items():
            row = by_id[request_id]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert (row.status, row.prompt_tokens, row.cached_tokens, row.completion_tokens) == (
                "completed", usage["prompt_tokens"], cached, usage["completion_tokens"])
            assert row.cost_pico_usd == cost_pico_usd(PRICE, usage["prompt_tokens"], cached,
                                                      usage["completion_tokens"], "interactive")
        for request_id, (prompt, received) in book.abandoned.items():
            row = by_id[request_id]
            computed = book.computed[request_id]
            assert (row.status, row.prompt_tokens, row.completion_tokens) == ("cancelled", prompt, computed)
            assert computed >= received
            expected = cost_pico_usd(PRICE, prompt, row.cached_tokens, computed, "interactive")
            assert row.cost_pico_usd == expected
        # Per-tenant totals: the ledger's sums are the clients' sums.
        told_tokens = sum(u["total_tokens"] for u in book.completed.values()) + sum(
            p + book.computed[rid] for rid, (p, _) in book.abandoned.items())
        assert sum(r.prompt_tokens + r.completion_tokens for r in mine) == told_tokens
        told_cost = sum(cost_pico_usd(PRICE, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                                      u["completion_tokens"], "interactive") for u in book.completed.values())
        assert sum(r.cost_pico_usd for r in mine if r.status == "completed") == told_cost


async def test_ledger_equals_what_clients_were_told(own_postgres: OwnPostgres, private_redis: Any,
                                                    tiny_model_dir: Path, tmp_path: Path) -> None:
    pg = own_postgres.server
    pg.create_database("tollgate")
    database_url = pg.url("tollgate")
    schema.upgrade(database_url)
    db = Database(database_url, pool_size=2)
    try:
        async with db.session() as session:
            await create_price(session, model=MODEL)
            tenants = [await create_tenant(session) for _ in range(3)]
            keys = [(await create_api_key(session, t))[1] for t in tenants]
        tenant_ids = [t.id for t in tenants]
        books = [TenantBook(key, tenant.id) for key, tenant in zip(keys, tenants, strict=True)]
        tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
        engine_log = tmp_path / "engine.log"
        with synthetic_engine(engine_log, token_interval_s=TOKEN_INTERVAL_S, ttft_s=0.0) as engine:
            # Keys stay cached through the outage (the gateway's only database read on the hot path).
            env = gateway_env(database_url=database_url, redis_url=private_redis.url, replicas=[engine.url],
                              tokenizer_dir=tiny_model_dir, key_cache_ttl_s=600)
            with gateway_process(env, tmp_path / "gateway.log", workers=1) as gw:
                async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                    for book in books:  # warm each key into the (single) worker's cache
                        await _plain(client, book, "warm", 1)
                await _mixed_run(gw.url, books, tokenizer, "before")
                await _engine_counts(engine.url, books)
                await _flush_all(private_redis.url, db)
                settings = Settings(environment="test", database_url=database_url,
                                    redis_url=private_redis.url,
                                    models=[ModelConfig(name=MODEL, path=str(tiny_model_dir))],
                                    pools={"interactive": PoolConfig(replicas=[engine.url])},
                                    tiers={n: TierConfig(**t) for n, t in LOOSE_TIERS.items()})
                await _background(gw.url, books[0], settings, private_redis.url, db)
                await _assert_ledger_matches(db, books, tenant_ids)

                own_postgres.stop()
                await _mixed_run(gw.url, books, tokenizer, "outage")  # requests keep flowing
                await _engine_counts(engine.url, books)
                async with httpx.AsyncClient(base_url=gw.url, timeout=30,
                                             headers={"Authorization": f"Bearer {books[0].key}"}) as client:
                    # Stored responses need the database: a 503 to retry, never a 500.
                    stored = await client.get(f"/v1/responses/{books[0].background_id}")
                    assert stored.status_code == 503, stored.text
                    assert stored.json()["error"]["code"] == "store_unavailable"
                redis = aioredis.Redis.from_url(private_redis.url)
                try:
                    # Every request of the outage is waiting in the outbox (an abandoned stream's record
                    # lands a moment after its client hung up: wait for it).
                    expected = REQUESTS_PER_TENANT * len(books)
                    await eventually(lambda: _xlen_at_least(redis, expected),
                                     "every record of the outage in the outbox")
                    assert await redis.xlen(USAGE_STREAM) == expected
                    flusher = UsageFlusher(redis, db.session, consumer="ledger-equality")
                    with pytest.raises(LedgerUnavailable):
                        await flusher.flush()
                finally:
                    await redis.aclose()
                own_postgres.start()
                await _flush_all(private_redis.url, db)
        await _assert_ledger_matches(db, books, tenant_ids)
    finally:
        await db.dispose()
