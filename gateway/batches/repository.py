"""Every query on ``batches`` and ``batch_items``, in two kinds.

- ``BatchRepository`` (the public API's view) builds every statement from its tenant, so no endpoint
  can see or cancel another tenant's batch.
- The module functions are the runner's (system-wide: workers act for every tenant; each statement
  names the batch it touches).

Invariants of the runner's queries:
- A line is claimed with ``FOR UPDATE SKIP LOCKED`` (no two workers claim one line) and becomes
  ``running`` with a lease (owner, expiry) and one more attempt, in one statement.
- ``finish_item`` writes a result only while the caller still holds the lease (``status = 'running'``
  and ``lease_owner`` = the caller), and bumps the batch's counters in the same transaction, so a line
  completes at most once and the counters equal the items' states.
- ``sweep_expired_leases`` turns leases that ran out (the worker died) back into ``pending``, or into
  ``failed`` once ``attempts`` reached the limit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, cast

from sqlalchemy import case, delete, func, insert, literal, select, update
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.pagination import keyset_page
from tollgate.models import ApiKey, Batch, BatchItem, Tenant

INSERT_CHUNK = 1000
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True, slots=True)
class ClaimedLine:
    id: int
    line: int
    custom_id: str
    request_id: str
    body: dict[str, Any]
    attempts: int


async def lock_batch(session: AsyncSession, batch_id: str) -> Batch | None:
    return await session.scalar(select(Batch).where(Batch.id == batch_id).with_for_update())


async def get_batch(session: AsyncSession, batch_id: str) -> Batch | None:
    return await session.scalar(select(Batch).where(Batch.id == batch_id))


async def owner_of(session: AsyncSession, batch: Batch) -> tuple[Tenant, ApiKey | None]:
    tenant = await session.get_one(Tenant, batch.tenant_id)
    key = await session.get(ApiKey, batch.api_key_id) if batch.api_key_id is not None else None
    return tenant, key


async def insert_items(session: AsyncSession, rows: Sequence[dict[str, Any]]) -> None:
    for start in range(0, len(rows), INSERT_CHUNK):
        await session.execute(insert(BatchItem), list(rows[start:start + INSERT_CHUNK]))


async def claim_lines(session: AsyncSession, batch_id: str, owner: str, limit: int,
                      lease_until: datetime) -> list[ClaimedLine]:
    claimable = (select(BatchItem.id).where(BatchItem.batch_id == batch_id, BatchItem.status == "pending")
                 .order_by(BatchItem.line).limit(limit).with_for_update(skip_locked=True))
    rows = await session.execute(
        update(BatchItem).where(BatchItem.id.in_(claimable.scalar_subquery()))
        .values(status="running", lease_owner=owner, lease_expires_at=lease_until,
                attempts=BatchItem.attempts + 1)
        .returning(BatchItem.id, BatchItem.line, BatchItem.custom_id, BatchItem.request_id,
                   BatchItem.request_body, BatchItem.attempts))
    return sorted((ClaimedLine(*row) for row in rows), key=lambda c: c.line)


async def renew_leases(session: AsyncSession, ids: Sequence[int], owner: str,
                       lease_until: datetime) -> set[int]:
    """Extend our leases; returns the ids still ours (a lease lost to the sweeper is gone for good)."""
    if not ids:
        return set()
    rows = await session.scalars(
        update(BatchItem).where(BatchItem.id.in_(ids), BatchItem.lease_owner == owner,
                                BatchItem.status == "running")
        .values(lease_expires_at=lease_until).returning(BatchItem.id))
    return set(rows)


async def release_line(session: AsyncSession, item_id: int, owner: str, *, refund_attempt: bool,
                       cost_pico_usd: int = 0) -> None:
    """Put a line we hold back to ``pending`` (it did not start, or will be retried); ``cost_pico_usd``:
    what a stopped attempt of it was billed (kept on the line, whatever ends it)."""
    values: dict[str, Any] = {"status": "pending", "lease_owner": None, "lease_expires_at": None}
    if refund_attempt:
        values["attempts"] = BatchItem.attempts - 1
    if cost_pico_usd:
        values["cost_pico_usd"] = func.coalesce(BatchItem.cost_pico_usd, 0) + cost_pico_usd
    await session.execute(update(BatchItem).where(
        BatchItem.id == item_id, BatchItem.lease_owner == owner, BatchItem.status == "running")
        .values(**values))


async def finish_item(session: AsyncSession, batch_id: str, item_id: int, owner: str, *, status: str,
                      finished_at: datetime, response_status: int | None = None,
                      response: dict[str, Any] | None = None, error: dict[str, Any] | None = None,
                      served_pool: str | None = None, tokens: tuple[int, int, int] | None = None,
                      cost_pico_usd: int = 0) -> bool:
    """Record a line's result if we still hold it; returns whether it was recorded."""
    prompt, cached, completion = tokens or (0, 0, 0)
    done = await session.scalar(
        update(BatchItem).where(BatchItem.id == item_id, BatchItem.lease_owner == owner,
                                BatchItem.status == "running")
        .values(status=status, lease_owner=None, lease_expires_at=None, response_status=response_status,
                response=response, error=error, served_pool=served_pool, finished_at=finished_at,
                prompt_tokens=prompt if tokens else None, cached_tokens=cached if tokens else None,
                completion_tokens=completion if tokens else None, cost_pico_usd=cost_pico_usd)
        .returning(BatchItem.id))
    if done is None:
        return False
    succeeded = status == "completed"
    await session.execute(update(Batch).where(Batch.id == batch_id).values(
        request_completed=Batch.request_completed + int(succeeded),
        request_failed=Batch.request_failed + int(status == "failed"),
        prompt_tokens=Batch.prompt_tokens + (prompt if succeeded else 0),
        cached_tokens=Batch.cached_tokens + (cached if succeeded else 0),
        completion_tokens=Batch.completion_tokens + (completion if succeeded else 0),
        cost_pico_usd=Batch.cost_pico_usd + cost_pico_usd))
    return True


async def count_open_lines(session: AsyncSession, batch_id: str) -> tuple[int, int]:
    """(pending, running) lines of a batch."""
    rows = await session.execute(
        select(BatchItem.status, func.count()).where(BatchItem.batch_id == batch_id,
                                                     BatchItem.status.in_(("pending", "running")))
        .group_by(BatchItem.status))
    counts = dict(rows.tuples().all())
    return counts.get("pending", 0), counts.get("running", 0)


async def stop_pending_lines(session: AsyncSession, batch_id: str, status: str, error: dict[str, Any],
                             at: datetime, billed_error: dict[str, Any] | None = None) -> int:
    """The lines not running end as ``cancelled``/``expired``: with ``error`` if nothing of them was billed
    (they never started), with ``billed_error`` if a stopped attempt was (``release_line``)."""
    error_type = BatchItem.__table__.c.error.type
    chosen = error if billed_error is None else case(
        (func.coalesce(BatchItem.cost_pico_usd, 0) > 0, literal(billed_error, error_type)),
        else_=literal(error, error_type))
    result = cast(CursorResult[Any], await session.execute(
        update(BatchItem).where(BatchItem.batch_id == batch_id, BatchItem.status == "pending")
        .values(status=status, error=chosen, finished_at=at)))
    return result.rowcount or 0


async def items_in_order(session: AsyncSession, batch_id: str, *,
                         completed: bool) -> AsyncIterator[BatchItem]:
    """The batch's completed lines (``completed=True``) or all the others, in line order."""
    condition = BatchItem.status == "completed" if completed else BatchItem.status != "completed"
    result = await session.stream_scalars(
        select(BatchItem).where(BatchItem.batch_id == batch_id, condition).order_by(BatchItem.line)
        .execution_options(yield_per=500))
    async for item in result:
        yield item


async def sweep_expired_leases(session: AsyncSession, now: datetime, max_attempts: int,
                               gave_up: dict[str, Any]) -> tuple[set[str], int]:
    """Free leases that ran out: lines out of attempts fail with ``gave_up`` (the batches' failure
    counters bumped), the others go back to ``pending``. Returns (batches touched, lines freed)."""
    expired = (BatchItem.status == "running", BatchItem.lease_expires_at < now)
    failed_rows = list(await session.execute(
        update(BatchItem).where(*expired, BatchItem.attempts >= max_attempts)
        .values(status="failed", lease_owner=None, lease_expires_at=None, error=gave_up, finished_at=now)
        .returning(BatchItem.batch_id)))
    failed: dict[str, int] = {}
    for (batch_id,) in failed_rows:
        failed[batch_id] = failed.get(batch_id, 0) + 1
    for batch_id, count in failed.items():
        await session.execute(update(Batch).where(Batch.id == batch_id)
                              .values(request_failed=Batch.request_failed + count))
    freed = list(await session.scalars(
        update(BatchItem).where(*expired).values(status="pending", lease_owner=None, lease_expires_at=None)
        .returning(BatchItem.batch_id)))
    return set(failed) | set(freed), len(freed)


async def batches_in(session: AsyncSession, statuses: Sequence[str]) -> list[Batch]:
    return list(await session.scalars(select(Batch).where(Batch.status.in_(statuses))))


async def due_for_expiry(session: AsyncSession, now: datetime) -> list[str]:
    """Open batches past their window that are not marked yet (``expired_at`` is the mark)."""
    return list(await session.scalars(
        select(Batch.id).where(Batch.status.in_(("validating", "in_progress")), Batch.expires_at <= now,
                               Batch.expired_at.is_(None))))


async def delete_items_of_finished_batches(session: AsyncSession, finished_before: datetime) -> int:
    """Retention: a finished batch's lines (its outputs live in its files) after the retention period."""
    finished = select(Batch.id).where(
        func.coalesce(Batch.completed_at, Batch.failed_at, Batch.cancelled_at, Batch.expired_at)
        < finished_before, Batch.status.in_(("completed", "failed", "cancelled", "expired")))
    result = cast(CursorResult[Any], await session.execute(
        delete(BatchItem).where(BatchItem.batch_id.in_(finished))))
    return result.rowcount or 0


class BatchRepository:
    def __init__(self, session: AsyncSession, tenant_id: int) -> None:
        self.session = session
        self.tenant_id = tenant_id

    async def add(self, batch: Batch) -> Batch:
        if batch.tenant_id != self.tenant_id:
            raise ValueError("a batch must belong to the repository's tenant")
        self.session.add(batch)
        await self.session.flush()
        await self.session.refresh(batch)
        return batch

    async def get(self, batch_id: str, *, for_update: bool = False) -> Batch | None:
        statement = select(Batch).where(Batch.id == batch_id, Batch.tenant_id == self.tenant_id)
        if for_update:
            statement = statement.with_for_update()
        return await self.session.scalar(statement)

    async def page(self, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
        """Newest first; ``after`` is the id of the last batch of the previous page."""
        statement = select(Batch).where(Batch.tenant_id == self.tenant_id)
        cursor = None
        if after is not None:
            cursor = await self.get(after)
            if cursor is None:
                return [], False
        return await keyset_page(self.session, statement, Batch, cursor, limit=limit, descending=True)
