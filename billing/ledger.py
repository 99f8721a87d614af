"""Outbox → ledger: copy ``tollgate:usage`` stream entries into ``usage_events``, exactly once in effect.

A flusher is one consumer of the consumer group ``ledger`` on the stream. Each batch:
1. collects up to ``batch_size`` entries: its own pending ones first (a batch that failed before),
   then entries other consumers left pending longer than ``claim_idle_ms`` (their process died:
   ``XAUTOCLAIM``), then new ones (``XREADGROUP >``);
2. inserts their rows in one transaction (request ids claimed with ``INSERT … ON CONFLICT (request_id)
   DO NOTHING`` in ``usage_request_ids``, since the monthly partitioned ``usage_events`` cannot carry that
   unique constraint), adds the rows inserted now to the hourly rollups (``billing.rollups``) in the
   same transaction, and commits;
3. only then acknowledges and deletes the entries (``XACK`` + ``XDEL``, one ``MULTI``).

Invariants:
- Nothing is lost: an entry leaves the stream only after its row (or an earlier row with the same
  ``request_id``) is committed. Postgres down → ``LedgerUnavailable``, the entries stay pending and the
  next flush retries them.
- Nothing is doubled: a crash between commit and ``XACK`` redelivers entries whose rows exist; the
  unique ``request_id`` makes their insert a no-op. Any number of flushers may run at once.
- A record that can never be inserted (undecodable, or rejected by a constraint such as an unknown
  tenant) does not block the stream: it is moved to ``tollgate:usage:dead`` with the reason, for an
  operator to repair and re-append.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError
from sqlalchemy.exc import DataError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from billing.repository import insert_usage_events
from billing.rollups import add_to_rollups, hold_writer_lock

LEDGER_GROUP = "ledger"
DEAD_LETTER_STREAM = "tollgate:usage:dead"

logger = logging.getLogger("tollgate.billing")

SessionFactory = Callable[[], AbstractAsyncContextManager[AsyncSession]]
Entry = tuple[str, dict[bytes, bytes] | None]


class LedgerUnavailable(RuntimeError):
    """Postgres could not be reached; the batch stays in the stream."""


@dataclass
class FlushResult:
    """Stream entries handled; rows inserted; records whose request already had a row (redelivery or
    a repeated append); records moved to the dead-letter stream."""

    entries: int = 0
    inserted: int = 0
    duplicates: int = 0
    dead: int = 0

    def __iadd__(self, other: FlushResult) -> FlushResult:
        self.entries += other.entries
        self.inserted += other.inserted
        self.duplicates += other.duplicates
        self.dead += other.dead
        return self


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _stream_entries(reply: Any) -> list[Entry]:
    """Entries of our one stream from an XREADGROUP reply (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        batches = list(reply.values())
    else:
        batches = [entries for _, entries in reply]
    out: list[Entry] = []
    for entries in batches:
        for entry in entries:
            entry_id, fields = entry[0], entry[1]
            out.append((_s(entry_id), fields or None))
    return out


async def _insert_and_roll_up(session: AsyncSession, rows: list[dict[str, Any]]) -> int:
    """Insert ledger rows and add the ones inserted now to the hourly rollups, in one transaction."""
    await hold_writer_lock(session)
    inserted = await insert_usage_events(session, rows)
    await add_to_rollups(session, inserted)
    return len(inserted)


class UsageFlusher:
    def __init__(self, redis: Redis, session_factory: SessionFactory, *, consumer: str,
                 batch_size: int = 500, claim_idle_ms: int = 60_000) -> None:
        if batch_size < 1 or claim_idle_ms < 0:
            raise ValueError("batch_size must be >= 1 and claim_idle_ms >= 0")
        self._redis = redis
        self._session_factory = session_factory
        self.consumer = consumer
        self._batch_size = batch_size
        self._claim_idle_ms = claim_idle_ms

    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(USAGE_STREAM, LEDGER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def flush(self, max_batches: int | None = None) -> FlushResult:
        """Flush batches until the stream has nothing more for us (or ``max_batches``)."""
        await self.ensure_group()
        total = FlushResult()
        batches = 0
        while max_batches is None or batches < max_batches:
            result = await self.flush_batch()
            total += result
            batches += 1
            if result.entries < self._batch_size:
                break
        return total

    async def flush_batch(self) -> FlushResult:
        entries = await self._next_entries()
        if not entries:
            return FlushResult()
        records: dict[str, UsageRecord] = {}
        dead: list[tuple[str, bytes, str]] = []
        decoded = 0
        for entry_id, fields in entries:
            raw = (fields or {}).get(RECORD_FIELD)
            if raw is None:
                continue  # deleted from the stream after its row was committed; just acknowledge it
            try:
                record = UsageRecord.from_json(raw)
            except (ValueError, TypeError, KeyError) as exc:
                dead.append((entry_id, raw, f"undecodable: {exc}"))
                continue
            decoded += 1
            records.setdefault(record.request_id, record)
        inserted, rejected = await self._insert(list(records.values()))
        for record, reason in rejected:
            dead.append(("", record.to_json(), reason))
        await self._acknowledge([entry_id for entry_id, _ in entries], dead)
        if dead:
            logger.error("usage outbox: %d record(s) moved to %s", len(dead), DEAD_LETTER_STREAM)
        return FlushResult(entries=len(entries), inserted=inserted,
                           duplicates=decoded - inserted - len(rejected), dead=len(dead))

    async def _next_entries(self) -> list[Entry]:
        want = self._batch_size
        seen: set[str] = set()
        entries: list[Entry] = []

        def take(batch: list[Entry]) -> None:
            for entry_id, fields in batch:
                if entry_id not in seen and len(entries) < want:
                    seen.add(entry_id)
                    entries.append((entry_id, fields))

        # Our own pending entries (a batch whose insert failed) come first.
        take(_stream_entries(await self._redis.xreadgroup(
            LEDGER_GROUP, self.consumer, {USAGE_STREAM: "0"}, count=want)))
        if len(entries) < want:
            reply = await self._redis.xautoclaim(USAGE_STREAM, LEDGER_GROUP, self.consumer,
                                                 self._claim_idle_ms, "0-0", count=want - len(entries))
            take([(_s(entry_id), fields or None) for entry_id, fields in reply[1]])
            take([(_s(entry_id), None) for entry_id in (reply[2] if len(reply) > 2 else [])])
        if len(entries) < want:
            take(_stream_entries(await self._redis.xreadgroup(
                LEDGER_GROUP, self.consumer, {USAGE_STREAM: ">"}, count=want - len(entries))))
        return entries

    async def _insert(self, records: list[UsageRecord]) -> tuple[int, list[tuple[UsageRecord, str]]]:
        """Insert and commit; returns (rows inserted, records no database will ever accept)."""
        if not records:
            return 0, []
        try:
            async with self._session_factory() as session:
                return await _insert_and_roll_up(session, [r.row() for r in records]), []
        except (IntegrityError, DataError):
            pass  # some row violates a constraint: find it, one row per transaction
        except (OperationalError, InterfaceError, OSError) as exc:
            raise LedgerUnavailable(f"ledger database unavailable: {exc}") from exc
        inserted = 0
        rejected: list[tuple[UsageRecord, str]] = []
        for record in records:
            try:
                async with self._session_factory() as session:
                    inserted += await _insert_and_roll_up(session, [record.row()])
            except (IntegrityError, DataError) as exc:
                rejected.append((record, f"rejected by the database: {exc.orig or exc}"))
            except (OperationalError, InterfaceError, OSError) as exc:
                raise LedgerUnavailable(f"ledger database unavailable: {exc}") from exc
        return inserted, rejected

    async def _acknowledge(self, entry_ids: list[str], dead: list[tuple[str, bytes, str]]) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            for entry_id, raw, reason in dead:
                pipe.xadd(DEAD_LETTER_STREAM, {RECORD_FIELD: raw, b"reason": reason.encode(),
                                               b"entry": entry_id.encode()})
            pipe.xack(USAGE_STREAM, LEDGER_GROUP, *entry_ids)
            pipe.xdel(USAGE_STREAM, *entry_ids)
            await pipe.execute()

    async def forget_idle_consumers(self, idle_ms: int) -> int:
        """Remove consumers (dead worker processes) with nothing pending that have been idle longer
        than ``idle_ms``, so the group's consumer list does not grow forever."""
        removed = 0
        for info in await self._redis.xinfo_consumers(USAGE_STREAM, LEDGER_GROUP):
            name = _s(info["name"])
            if name != self.consumer and info["pending"] == 0 and info["idle"] > idle_ms:
                removed += await self._redis.xgroup_delconsumer(USAGE_STREAM, LEDGER_GROUP, name)
        return removed
