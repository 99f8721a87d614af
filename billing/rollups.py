"""Hourly usage rollups (``usage_hourly``), maintained incrementally and proved equal to the ledger.

A rollup row is keyed by (tenant, UTC hour, model, request class) and holds, per token kind (``KINDS``:
input without its cached part, cached input, output, and the prompt-cache products: cache writes,
pinned, retained), the tokens and their exact pico-USD cost, plus the request count and the ledger cost
(``cost_pico_usd``, the sum of ``usage_events.cost_pico_usd``). The cache kinds count prompt tokens the
input kinds count too (they are charged on top, ``billing.prices``), so only the first three add up to
the prompt and output tokens. ``DETAIL_COLUMNS`` are sums of ledger counts that no price applies to:
the accepted and rejected prediction tokens (Predicted Outputs), part of the output tokens (the rejected
ones are billed as output, as OpenAI bills them).

Invariants:
- Incremental: ``add_to_rollups`` runs in the ledger flusher's transaction with exactly the rows that
  transaction inserted (``billing.repository.insert_usage_events`` returns them), as one
  ``INSERT … ON CONFLICT DO UPDATE SET x = x + excluded.x``, keys in a fixed order (no deadlocks
  between concurrent flushers). A redelivered record inserts no ledger row and adds nothing.
- Exact split: the six kind costs of a row add up to its ledger cost. The row was priced at
  admission, up to ``admission_window`` before it was recorded, so the price rows in effect during
  that window are tried, newest first, and the one that reproduces the ledger cost is used. Each is
  tried as a generation and, for a row without completion or cache tokens, as an embeddings request
  (its whole prompt at the embedding price: all of the cost is input, none cached, whatever its cached
  tokens). If none does (a row written by hand, or without any price), the cost is apportioned to the
  kinds by the newest price's weights (token counts without a price) with the largest-remainder method,
  so the split still adds up exactly.
- Reconcile: ``reconcile_rollups`` takes the exclusive form of ``ROLLUP_LOCK`` (writers hold the
  shared form for their transaction), compares the rollups with ``GROUP BY`` sums of the ledger over a
  time range and rewrites every bucket that differs (missing, extra or wrong). While it holds the lock
  no ledger insert is in flight, so what it writes is the ledger's truth at its commit.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import Numeric, Select, and_, cast, delete, func, or_, select, tuple_
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from billing.outbox import PREDICTION_TOKEN_FIELDS
from billing.prices import CACHE_TOKEN_FIELDS, Price
from billing.repository import all_prices
from tollgate.models import UsageEvent, UsageHourly

# pg_advisory_xact_lock key: ledger writers hold it shared, the reconciler exclusive.
ROLLUP_LOCK = 0x70_11_6A_7E_0001
DEFAULT_ADMISSION_WINDOW = timedelta(hours=1)

# Token kinds, and the usage_hourly columns of their tokens and of their costs, in that order.
CACHE_KINDS = ("cache_write", "cache_pinned", "cache_retained")
KINDS = ("input", "cached_input", "output", *CACHE_KINDS)
KIND_TOKEN_COLUMNS = ("input_tokens", "cached_input_tokens", "output_tokens", *CACHE_TOKEN_FIELDS)
KIND_COST_COLUMNS = tuple(f"{kind}_cost_pico_usd" for kind in KINDS)
# Ledger counts summed as they are (the same name in usage_events and usage_hourly), never priced apart.
DETAIL_COLUMNS = PREDICTION_TOKEN_FIELDS
_SUM_COLUMNS = ("requests", *KIND_TOKEN_COLUMNS, *KIND_COST_COLUMNS, "cost_pico_usd", *DETAIL_COLUMNS)

Key = tuple[int, datetime, str, str]
Split = tuple[int, ...]  # one per kind, in the order of KINDS


def hour_of(at: datetime) -> datetime:
    if at.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def _apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split ``total`` in proportion to ``weights`` exactly (largest remainder)."""
    weight_sum = sum(weights)
    if weight_sum <= 0:
        return [total] + [0] * (len(weights) - 1)
    shares = [total * w // weight_sum for w in weights]
    remainders = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % weight_sum), i))
    for i in remainders[: total - sum(shares)]:
        shares[i] += 1
    return shares


def _kind_tokens(row: Mapping[str, Any]) -> Split:
    """The tokens of a ledger row per kind (``KINDS``)."""
    cached = row["cached_tokens"]
    cache_write, pinned, retained = (row[name] for name in CACHE_TOKEN_FIELDS)
    return row["prompt_tokens"] - cached, cached, row["completion_tokens"], cache_write, pinned, retained


def _per_token(price: Price, request_class: str) -> Split:
    return (*price.for_class(request_class), *price.cache_for_class(request_class))


def _priced_splits(price: Price, request_class: str, kinds: Split) -> list[Split]:
    """The kind costs of a row with ``kinds`` tokens at ``price``: as a generation, then (no completion
    or cache tokens) as an embeddings request, whose whole cost is input."""
    per_token = _per_token(price, request_class)
    splits = [tuple(n * p for n, p in zip(kinds, per_token, strict=True))]
    if not any(kinds[2:]):
        splits.append(((kinds[0] + kinds[1]) * price.embedding_for_class(request_class), 0, 0, 0, 0, 0))
    return splits


class PriceHistory:
    """Every price row per model, to find the one a ledger row was priced with."""

    def __init__(self, rows: Iterable[tuple[str, datetime, Price]],
                 admission_window: timedelta = DEFAULT_ADMISSION_WINDOW) -> None:
        self.window = admission_window
        by_model: dict[str, list[tuple[datetime, Price]]] = {}
        for model, start, price in rows:
            by_model.setdefault(model, []).append((start, price))
        self._starts = {m: [s for s, _ in sorted(e, key=lambda x: x[0])] for m, e in by_model.items()}
        self._prices = {m: [p for _, p in sorted(e, key=lambda x: x[0])] for m, e in by_model.items()}

    @classmethod
    async def load(cls, session: AsyncSession,
                   admission_window: timedelta = DEFAULT_ADMISSION_WINDOW) -> PriceHistory:
        return cls(await all_prices(session), admission_window)

    def candidates(self, model: str, at: datetime) -> list[Price]:
        """Prices in effect at some moment of ``[at - window, at]``, newest first."""
        starts = self._starts.get(model, [])
        newest = bisect.bisect_right(starts, at) - 1
        out: list[Price] = []
        i = newest
        while i >= 0:
            out.append(self._prices[model][i])
            if starts[i] <= at - self.window:
                break
            i -= 1
        return out

    def split(self, row: Mapping[str, Any]) -> Split:
        """The cost of one ledger row per kind (``KINDS``); they add up to its cost."""
        kinds = _kind_tokens(row)
        cost = row["cost_pico_usd"]
        candidates = self.candidates(row["model"], row["created_at"])
        for price in candidates:
            for parts in _priced_splits(price, row["request_class"], kinds):
                if sum(parts) == cost:
                    return parts
        if candidates:
            per_token = _per_token(candidates[0], row["request_class"])
            weights = [n * p for n, p in zip(kinds, per_token, strict=True)]
        else:
            weights = list(kinds)
        return tuple(_apportion(cost, weights))


@dataclass
class Bucket:
    """The sums of one rollup row (``_SUM_COLUMNS``)."""

    sums: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_SUM_COLUMNS, 0))

    def add(self, row: Mapping[str, Any], split: Split) -> None:
        self.sums["requests"] += 1
        kinds = zip(KIND_TOKEN_COLUMNS, _kind_tokens(row), KIND_COST_COLUMNS, split, strict=True)
        for name, tokens, cost_name, cost in kinds:
            self.sums[name] += tokens
            self.sums[cost_name] += cost
        self.sums["cost_pico_usd"] += row["cost_pico_usd"]
        for name in DETAIL_COLUMNS:
            self.sums[name] += row.get(name) or 0

    def values(self) -> dict[str, int]:
        return dict(self.sums)


def aggregate(rows: Iterable[Mapping[Any, Any]], prices: PriceHistory) -> dict[Key, Bucket]:
    buckets: dict[Key, Bucket] = {}
    for row in rows:
        key = (row["tenant_id"], hour_of(row["created_at"]), row["model"], row["request_class"])
        buckets.setdefault(key, Bucket()).add(row, prices.split(row))
    return buckets


async def hold_writer_lock(session: AsyncSession) -> None:
    """Taken by every ledger writer for its transaction: waits while a reconcile runs."""
    await session.execute(select(func.pg_advisory_xact_lock_shared(ROLLUP_LOCK)))


async def add_to_rollups(session: AsyncSession, rows: Sequence[Mapping[str, Any]],
                         prices: PriceHistory | None = None) -> int:
    """Add freshly inserted ledger rows to their buckets; returns how many buckets changed."""
    if not rows:
        return 0
    prices = prices or await PriceHistory.load(session)
    buckets = aggregate(rows, prices)
    values = [{"tenant_id": k[0], "hour": k[1], "model": k[2], "request_class": k[3], **b.values()}
              for k, b in sorted(buckets.items())]
    stmt = insert(UsageHourly).values(values)
    update = {name: getattr(UsageHourly, name) + getattr(stmt.excluded, name) for name in _SUM_COLUMNS}
    await session.execute(stmt.on_conflict_do_update(
        index_elements=["tenant_id", "hour", "model", "request_class"],
        set_={**update, "updated_at": func.now()}))
    return len(values)


@dataclass
class ReconcileResult:
    buckets_checked: int = 0
    repaired: list[Key] = field(default_factory=list)
    removed: list[Key] = field(default_factory=list)


def _ledger_sums(start: datetime, end: datetime, tenant_ids: Sequence[int] | None) -> Select[Any]:
    hour = func.date_trunc("hour", UsageEvent.created_at, "UTC").label("hour")
    stmt = (select(UsageEvent.tenant_id, hour, UsageEvent.model, UsageEvent.request_class,
                   func.count().label("requests"),
                   func.sum(cast(UsageEvent.prompt_tokens - UsageEvent.cached_tokens, Numeric)),
                   func.sum(cast(UsageEvent.cached_tokens, Numeric)),
                   func.sum(cast(UsageEvent.completion_tokens, Numeric)),
                   *(func.sum(cast(getattr(UsageEvent, name), Numeric)) for name in CACHE_TOKEN_FIELDS),
                   func.sum(cast(UsageEvent.cost_pico_usd, Numeric)),
                   *(func.sum(cast(getattr(UsageEvent, name), Numeric)) for name in DETAIL_COLUMNS))
            .where(UsageEvent.created_at >= start, UsageEvent.created_at < end)
            .group_by(UsageEvent.tenant_id, hour, UsageEvent.model, UsageEvent.request_class))
    if tenant_ids is not None:
        stmt = stmt.where(UsageEvent.tenant_id.in_(tenant_ids))
    return stmt


def _hour_range(start: datetime, end: datetime) -> tuple[datetime, datetime]:
    """The whole hours covering ``[start, end)``."""
    return hour_of(start), hour_of(end + timedelta(hours=1) - timedelta(microseconds=1))


async def _compare(session: AsyncSession, start: datetime, end: datetime,
                   tenant_ids: Sequence[int] | None) -> tuple[int, list[Key], list[Key]]:
    """(buckets seen, buckets the rollups lack or have wrong, rollup buckets the ledger has no rows for)."""
    ledger: dict[Key, tuple[int, ...]] = {}
    for tenant_id, hour, model, klass, *sums in (await session.execute(
            _ledger_sums(start, end, tenant_ids))).all():
        ledger[(tenant_id, hour_of(hour), model, klass)] = tuple(int(v) for v in sums)
    stmt = select(UsageHourly).where(UsageHourly.hour >= start, UsageHourly.hour < end)
    if tenant_ids is not None:
        stmt = stmt.where(UsageHourly.tenant_id.in_(tenant_ids))
    rolled: dict[Key, tuple[int, ...]] = {}
    for r in (await session.scalars(stmt)).all():
        rolled[(r.tenant_id, hour_of(r.hour), r.model, r.request_class)] = tuple(
            getattr(r, name) for name in ("requests", *KIND_TOKEN_COLUMNS, "cost_pico_usd", *DETAIL_COLUMNS))
    wrong = sorted(k for k, sums in ledger.items() if rolled.get(k) != sums)
    stale = sorted(k for k in rolled if k not in ledger)
    return len(ledger.keys() | rolled.keys()), wrong, stale


async def find_rollup_mismatches(session: AsyncSession, start: datetime, end: datetime, *,
                                 tenant_ids: Sequence[int] | None = None) -> list[Key]:
    """Buckets of ``[start, end)`` where rollups and ledger differ, without blocking ledger writers.

    Run it in a ``REPEATABLE READ`` transaction: both reads then see one snapshot, and since a writer
    commits its ledger rows and their rollup change together, a snapshot never shows half of one; so
    an empty answer proves equality and a non-empty one names buckets for ``reconcile_rollups``."""
    start, end = _hour_range(start, end)
    _, wrong, stale = await _compare(session, start, end, tenant_ids)
    return sorted(wrong + stale)


async def reconcile_rollups(session: AsyncSession, start: datetime, end: datetime, *,
                            tenant_ids: Sequence[int] | None = None,
                            admission_window: timedelta = DEFAULT_ADMISSION_WINDOW) -> ReconcileResult:
    """Make the rollups of the whole hours in ``[start, end)`` equal to the ledger; returns what it fixed.
    Holds ``ROLLUP_LOCK`` exclusively until the caller's transaction ends (ledger writers wait)."""
    start, end = _hour_range(start, end)
    await session.execute(select(func.pg_advisory_xact_lock(ROLLUP_LOCK)))
    checked, wrong, stale = await _compare(session, start, end, tenant_ids)
    result = ReconcileResult(buckets_checked=checked)
    if stale:
        await session.execute(delete(UsageHourly).where(
            tuple_(UsageHourly.tenant_id, UsageHourly.hour, UsageHourly.model, UsageHourly.request_class)
            .in_(stale)))
        result.removed = stale
    if wrong:
        prices = await PriceHistory.load(session, admission_window)
        conditions = [and_(UsageEvent.tenant_id == t, UsageEvent.created_at >= h,
                           UsageEvent.created_at < h + timedelta(hours=1), UsageEvent.model == m,
                           UsageEvent.request_class == c) for t, h, m, c in wrong]
        rows = (await session.execute(select(
            UsageEvent.tenant_id, UsageEvent.model, UsageEvent.request_class, UsageEvent.prompt_tokens,
            UsageEvent.cached_tokens, UsageEvent.completion_tokens, UsageEvent.cost_pico_usd,
            UsageEvent.created_at, *(getattr(UsageEvent, name) for name in CACHE_TOKEN_FIELDS),
            *(getattr(UsageEvent, name) for name in DETAIL_COLUMNS))
            .where(or_(*conditions)))).mappings().all()
        buckets = aggregate(rows, prices)
        values = [{"tenant_id": k[0], "hour": k[1], "model": k[2], "request_class": k[3], **b.values()}
                  for k, b in sorted(buckets.items())]
        ins = insert(UsageHourly).values(values)
        await session.execute(ins.on_conflict_do_update(
            index_elements=["tenant_id", "hour", "model", "request_class"],
            set_={**{name: getattr(ins.excluded, name) for name in _SUM_COLUMNS}, "updated_at": func.now()}))
        result.repaired = wrong
    return result


