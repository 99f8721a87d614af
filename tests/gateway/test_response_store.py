"""The stored-response store against real Redis and Postgres: a response is readable the moment it is
stored (Redis), reaches ``responses`` with a flush, is read from Postgres once its Redis copy is gone,
a conversation spans both, a delete wins over a flush running at the same moment, a Postgres outage
postpones the flush without losing anything, and another tenant never sees a thing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from gateway.deps import GatewayRuntime
from gateway.responses.store import (
    FLUSH_GROUP,
    RECENT_S,
    RESPONSE_STREAM,
    ResponseFlusher,
    ResponseStore,
    response_key,
)
from gateway.responses.tasks import flush_responses
from tests.factories import create_api_key, create_tenant
from tests.gateway.conftest import gateway_settings
from tollgate.db import Database
from tollgate.models import ApiKey, StoredResponse
from tollgate.redis import create_redis


@pytest.fixture
async def runtime(api_database_url: str, redis_url: str, tmp_path: Path) -> AsyncIterator[GatewayRuntime]:
    settings = gateway_settings(["http://127.0.0.1:9"], tmp_path, api_database_url, redis_url)
    db = Database(api_database_url, pool_size=2)
    redis = create_redis(settings)
    await redis.delete(RESPONSE_STREAM)
    runtime = GatewayRuntime.create(settings, redis, db.sessionmaker)
    try:
        yield runtime
    finally:
        await runtime.stop()
        await redis.aclose()
        await db.dispose()


Owner = tuple[int, int]  # (tenant id, API key id)


@pytest.fixture
async def owner(runtime: GatewayRuntime) -> Owner:
    async with runtime.sessions() as session, session.begin():
        key, _ = await create_api_key(session, await create_tenant(session), settings=runtime.settings)
    return key.tenant_id, key.id


def stored(owner: Owner, number: int, previous: str | None = None, **columns: Any) -> StoredResponse:
    tenant_id, key_id = owner
    now = datetime.now(UTC)
    values: dict[str, Any] = {
        "id": f"resp_store_{tenant_id}_{number}", "tenant_id": tenant_id, "api_key_id": key_id,
        "previous_response_id": previous, "status": "completed", "model": "tiny",
        "input_items": [{"id": f"msg_{number}", "type": "message", "role": "user",
                         "content": [{"type": "input_text", "text": f"turn {number}"}]}],
        "body": {"id": f"resp_store_{tenant_id}_{number}", "object": "response", "status": "completed",
                 "output": [{"type": "message", "id": f"out_{number}", "role": "assistant", "content": []}]},
        "request": None, "created_at": now, "expires_at": now + timedelta(days=1)}
    return StoredResponse(**(values | columns))


async def flush(runtime: GatewayRuntime) -> dict[str, int]:
    return await flush_responses(runtime.redis, runtime.sessions, runtime.settings)


async def row_in_postgres(runtime: GatewayRuntime, response_id: str) -> StoredResponse | None:
    async with runtime.sessions() as session:
        return await session.scalar(select(StoredResponse).where(StoredResponse.id == response_id))


async def test_readable_at_once_then_flushed_then_read_from_postgres(runtime: GatewayRuntime,
                                                                      owner: Owner) -> None:
    store = ResponseStore(runtime, owner[0])
    row = stored(owner, 1)
    await store.put(row)
    assert (await store.get(row.id)).body == row.body  # type: ignore[union-attr]
    assert await row_in_postgres(runtime, row.id) is None
    assert (await flush(runtime))["inserted"] == 1
    flushed = await row_in_postgres(runtime, row.id)
    assert flushed is not None and flushed.body == row.body and flushed.input_items == row.input_items
    assert flushed.created_at == row.created_at and flushed.api_key_id == owner[1]
    # The Redis copy stays a little while for the conversation's next turn, then only the row is left.
    assert 0 < await runtime.redis.ttl(response_key(owner[0], row.id)) <= RECENT_S
    await runtime.redis.delete(response_key(owner[0], row.id))
    assert (await store.get(row.id)).body == row.body  # type: ignore[union-attr]
    assert (await flush(runtime))["entries"] == 0  # acknowledged and deleted from the stream
    assert await runtime.redis.xlen(RESPONSE_STREAM) == 0


async def test_a_nul_character_is_stored_as_a_replacement_and_holds_up_no_flush(runtime: GatewayRuntime,
                                                                                 owner: Owner) -> None:
    """Postgres' jsonb refuses U+0000, which JSON allows and a model may write. A response carrying one
    failed every flush, other tenants' responses with it; it is stored with U+FFFD instead."""
    store = ResponseStore(runtime, owner[0])
    poisoned = stored(owner, 1, input_items=[{"type": "message", "role": "user", "content": "a\x00b"}],
                      request={"input": "a\x00b"})
    poisoned.body = {**poisoned.body, "output_text": "x\x00y", "k\x00": 1}
    clean = stored(owner, 2)
    await store.put(poisoned)
    await store.put(clean)
    assert (await flush(runtime))["inserted"] == 2
    row = await row_in_postgres(runtime, poisoned.id)
    assert row is not None and row.input_items[0]["content"] == "a\ufffdb"
    assert row.body["output_text"] == "x\ufffdy" and row.body["k\ufffd"] == 1
    assert row.request == {"input": "a\ufffdb"}
    assert await row_in_postgres(runtime, clean.id) is not None


async def test_a_conversation_spans_postgres_and_redis(runtime: GatewayRuntime, owner: Owner) -> None:
    store = ResponseStore(runtime, owner[0])
    first, second = stored(owner, 1), stored(owner, 2, previous=f"resp_store_{owner[0]}_1")
    await store.put(first)
    await flush(runtime)
    await runtime.redis.delete(response_key(owner[0], first.id))  # only in Postgres now
    await store.put(second)  # only in Redis
    third = stored(owner, 3, previous=second.id)
    await store.put(third)
    assert [r.id for r in await store.conversation(third.id)] == [first.id, second.id, third.id]
    assert [r.id for r in await store.conversation(second.id)] == [first.id, second.id]
    # A deleted link ends the chain there, wherever it lives.
    assert await store.delete(second.id)
    assert [r.id for r in await store.conversation(third.id)] == [third.id]
    assert await store.conversation(second.id) == []


async def test_a_delete_during_a_flush_is_never_undone(runtime: GatewayRuntime, owner: Owner) -> None:
    store = ResponseStore(runtime, owner[0])
    row = stored(owner, 1)
    await store.put(row)
    flusher = ResponseFlusher(runtime.redis, runtime.sessions, consumer="racing")
    insert = flusher._insert

    async def delete_then_insert(rows: list[StoredResponse]) -> int:
        # The client's DELETE lands after the flusher read the Redis copy, before its INSERT commits.
        assert await store.delete(row.id)
        return await insert(rows)

    flusher._insert = delete_then_insert  # type: ignore[method-assign]
    await flusher.flush()
    assert await row_in_postgres(runtime, row.id) is None
    assert await store.get(row.id) is None
    assert not await store.delete(row.id)  # already gone: a 404 to the client


async def test_deleted_before_its_flush_is_never_inserted(runtime: GatewayRuntime, owner: Owner) -> None:
    store = ResponseStore(runtime, owner[0])
    row = stored(owner, 1)
    await store.put(row)
    assert await store.delete(row.id)
    assert (await flush(runtime)) == {"entries": 1, "inserted": 0, "postponed": 0}
    assert await row_in_postgres(runtime, row.id) is None


async def test_postgres_down_postpones_the_flush_and_loses_nothing(runtime: GatewayRuntime,
                                                                   owner: Owner) -> None:
    store = ResponseStore(runtime, owner[0])
    row = stored(owner, 1)
    await store.put(row)
    unreachable = Database("postgresql://tollgate@127.0.0.1:9/none", pool_size=1)
    try:
        result = await flush_responses(runtime.redis, unreachable.session, runtime.settings)
    finally:
        await unreachable.dispose()
    assert result["postponed"] == 1 and result["inserted"] == 0
    assert (await store.get(row.id)).body == row.body  # type: ignore[union-attr]  # still served
    pending = await runtime.redis.xpending(RESPONSE_STREAM, FLUSH_GROUP)
    assert pending["pending"] == 1
    # The next flush (this process's consumer: its own pending entries first) stores it.
    assert (await flush(runtime))["inserted"] == 1
    assert await row_in_postgres(runtime, row.id) is not None


async def test_a_key_revoked_and_deleted_before_the_flush_keeps_the_response(
        runtime: GatewayRuntime, owner: Owner) -> None:
    store = ResponseStore(runtime, owner[0])
    row = stored(owner, 1)
    await store.put(row)
    async with runtime.sessions() as session, session.begin():
        await session.delete(await session.get(ApiKey, owner[1]))
    assert (await flush(runtime))["inserted"] == 1
    flushed = await row_in_postgres(runtime, row.id)
    assert flushed is not None and flushed.api_key_id is None


async def test_another_tenant_sees_nothing_in_either_place(runtime: GatewayRuntime,
                                                           owner: Owner) -> None:
    async with runtime.sessions() as session, session.begin():
        other = (await create_tenant(session)).id
    mine, theirs = ResponseStore(runtime, owner[0]), ResponseStore(runtime, other)
    recent, flushed = stored(owner, 1), stored(owner, 2)
    await mine.put(flushed)
    await flush(runtime)
    await runtime.redis.delete(response_key(owner[0], flushed.id))
    await mine.put(recent)
    for response_id in (recent.id, flushed.id):
        assert await theirs.get(response_id) is None
        assert await theirs.conversation(response_id) == []
        assert not await theirs.delete(response_id)
        assert await mine.get(response_id) is not None  # their delete touched nothing of mine

