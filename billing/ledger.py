"""Outbox → ledger: copy ``tollgate:usage`` stream entries into ``usage_events``, exactly once in effect.

A flusher is one consumer of the consumer group ``ledger`` on the stream. Each batch:
1. collects up to ``batch_size`` entries (``tollgate.streams.StreamGroup``): its own pending ones first,
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
- A record without per-kind costs (appended by a gateway older than them, kept in its spool, or repaired
  by hand from the dead letters) is charged here at the price in effect when it was created, as a
  generation or, having no output and no cache products, as an embeddings request: the price and the way
  that gateway charged it. When neither reproduces its total (no price then, a hand-made record), the
  total is apportioned to the kinds by that price's weights (by tokens without a price), largest
  remainder first: the ledger keeps the cost it was given, exactly, and a split that adds up to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from sqlalchemy.exc import DataError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord
from billing.prices import Charge, Price, PriceBook, PriceNotFound, charge
from billing.repository import all_prices, insert_usage_events
from billing.rollups import add_to_rollups, hold_writer_lock
from engine.usage import SURCHARGE_KINDS
from tollgate.streams import StreamGroup

LEDGER_GROUP = "ledger"
DEAD_LETTER_STREAM = "tollgate:usage:dead"

logger = logging.getLogger("tollgate.billing")

SessionFactory = Callable[[], AbstractAsyncContextManager[AsyncSession]]


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


async def _insert_and_roll_up(session: AsyncSession, rows: list[dict[str, Any]]) -> int:
    """Insert ledger rows and add the ones inserted now to the hourly rollups, in one transaction."""
    await hold_writer_lock(session)
    inserted = await insert_usage_events(session, rows)
    await add_to_rollups(session, inserted)
    return len(inserted)


def _recharge(record: UsageRecord, book: PriceBook) -> Charge:
    """The per-kind costs of a record without them (see the module invariants)."""
    usage = record.usage
    try:
        price: Price | None = book.price_for(record.model, record.created_at)
    except PriceNotFound:
        price = None
    weights = dict(usage.billed())  # without a price: by tokens
    if price is not None:
        ways = [False]
        if not usage.completion_tokens and not any(usage[k] for k in SURCHARGE_KINDS):
            ways.append(True)  # an embeddings request
        for embedding in ways:
            costs = charge(usage, price, record.request_class, embedding=embedding)
            if costs.total == record.cost_pico_usd:
                return costs
        weights = dict(charge(usage, price, record.request_class).costs)
    return Charge(dict(zip(weights, apportion(record.cost_pico_usd, list(weights.values())), strict=True)))


def apportion(total: int, weights: list[int]) -> list[int]:
    """``total`` split in proportion to ``weights``, exactly (largest remainder; all on the first without
    any weight)."""
    weight_sum = sum(weights)
    if weight_sum <= 0:
        return [total] + [0] * (len(weights) - 1)
    shares = [total * w // weight_sum for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % weight_sum), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


class UsageFlusher:
    def __init__(self, redis: Redis, session_factory: SessionFactory, *, consumer: str,
                 batch_size: int = 500, claim_idle_ms: int = 60_000) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        self._group = StreamGroup(redis, USAGE_STREAM, LEDGER_GROUP, consumer=consumer,
                                  claim_idle_ms=claim_idle_ms)
        self._session_factory = session_factory
        self.consumer = consumer
        self._batch_size = batch_size

    async def ensure_group(self) -> None:
        await self._group.ensure_group()

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
        entries = await self._group.next_entries(self._batch_size)
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

        def to_dead_letters(pipe: Pipeline) -> None:
            for entry_id, raw, reason in dead:
                pipe.xadd(DEAD_LETTER_STREAM, {RECORD_FIELD: raw, b"reason": reason.encode(),
                                               b"entry": entry_id.encode()})

        await self._group.acknowledge([entry_id for entry_id, _ in entries], to_dead_letters)
        if dead:
            logger.error("usage outbox: %d record(s) moved to %s (first: %s)", len(dead), DEAD_LETTER_STREAM,
                         dead[0][2])
        return FlushResult(entries=len(entries), inserted=inserted,
                           duplicates=decoded - inserted - len(rejected), dead=len(dead))

    async def _insert(self, records: list[UsageRecord]) -> tuple[int, list[tuple[UsageRecord, str]]]:
        """Insert and commit; returns (rows inserted, records no database will ever accept)."""
        if not records:
            return 0, []
        return await self._insert_priced(await self._with_costs(records))

    async def _with_costs(self, records: list[UsageRecord]) -> list[UsageRecord]:
        """The records, each with its per-kind costs (see the module invariants)."""
        if all(r.costs is not None for r in records):
            return records
        try:
            async with self._session_factory() as session:
                book = PriceBook(await all_prices(session))
        except (OperationalError, InterfaceError, OSError) as exc:
            raise LedgerUnavailable(f"ledger database unavailable: {exc}") from exc
        return [r if r.costs is not None else r.with_costs(_recharge(r, book)) for r in records]

    async def _insert_priced(self, records: list[UsageRecord]) -> tuple[int, list[tuple[UsageRecord, str]]]:
        """Insert and commit records with their costs; returns (rows inserted, records refused)."""
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

    async def forget_idle_consumers(self, idle_ms: int) -> int:
        return await self._group.forget_idle_consumers(idle_ms)
