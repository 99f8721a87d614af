"""Usage series for the dashboard's charts and CSV export, from the ledger and the rejection counters.

- Tokens, requests and cost are ``gateway.admin.service.usage`` (exact sums of ``usage_events`` by UTC
  hour or day, the admin API's numbers). Input tokens are split into uncached input
  (``prompt - cached``), cached input and output; the cache hit rate of a bucket is cached / prompt.
- The prompt-cache products (``engine.usage.SURCHARGE_KINDS``: prompt tokens written to the cache,
  pinned for a ttl, retained for 24h; counted in the input tokens too) come with their tokens from the
  ledger and their cost from the hourly rollups (``usage_hourly``, which ``billing.rollups`` keeps equal
  to the ledger, whose rows carry each kind's cost).
- Predicted Outputs (``PREDICTION_TOKEN_FIELDS``): the accepted and rejected prediction tokens from the
  ledger, output tokens counted in the output too (the rejected ones are billed as output); shown next
  to the other counts, never priced apart.
- Rejections are ``gateway.admission.rejections`` counts (kept ``RETENTION_S``; older hours read 0).
- Every bucket of the range is present (zeros where nothing happened), so charts have a true time axis.
- Costs stay integer pico-USD; the float USD in the chart data is for drawing only, totals and CSV carry
  the exact amount.
- A range is whole UTC days ``[start 00:00, end + 1 day 00:00)``; at most ``MAX_RANGE_DAYS``. The
  default granularity is hourly up to ``HOURLY_MAX_DAYS`` and daily beyond.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

from redis.asyncio import Redis
from sqlalchemy import Numeric, cast, func, literal_column, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.outbox import PREDICTION_TOKEN_FIELDS
from billing.prices import CACHE_TOKEN_FIELDS
from engine.usage import SURCHARGE_KINDS, cost_field
from gateway.admin import service
from gateway.admin.schemas import usd_string
from gateway.admission.rejections import REASONS, RETENTION_S, rejection_counts
from tollgate.models import LATEST_TIME, Tenant, UsageHourly
from tollgate.settings import Settings

MAX_RANGE_DAYS = 366
HOURLY_MAX_DAYS = 3
MAX_HOURLY_DAYS = 31
DEFAULT_DAYS = 7
PICO_PER_USD = 10**12
CACHE_COST_FIELDS = tuple(cost_field(kind) for kind in SURCHARGE_KINDS)


@dataclass(frozen=True, slots=True)
class UsageRange:
    first_day: date
    last_day: date
    granularity: str

    @property
    def start(self) -> datetime:
        return datetime(self.first_day.year, self.first_day.month, self.first_day.day, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        return self.start + timedelta(days=(self.last_day - self.first_day).days + 1)

    @property
    def step(self) -> timedelta:
        return timedelta(hours=1) if self.granularity == "hour" else timedelta(days=1)

    def buckets(self) -> list[datetime]:
        out, at = [], self.start
        while at < self.end:
            out.append(at)
            at += self.step
        return out

    def query(self) -> dict[str, str]:
        return {"start": self.first_day.isoformat(), "end": self.last_day.isoformat(),
                "granularity": self.granularity}


def parse_range(start: str | None, end: str | None, granularity: str | None, *,
                today: date | None = None) -> UsageRange:
    """The range of the query (``YYYY-MM-DD`` days, both included); ``ValueError`` explains a bad one."""
    today = today or datetime.now(UTC).date()
    try:
        last = date.fromisoformat(end) if end else today
        first = date.fromisoformat(start) if start else last - timedelta(days=DEFAULT_DAYS - 1)
    except ValueError:
        raise ValueError("dates must look like 2026-01-31") from None
    if first > last:
        raise ValueError("the start date must not be after the end date")
    if last >= LATEST_TIME.date():  # the range's end (a day later) must stay a datetime
        raise ValueError(f"dates must be before {LATEST_TIME.date().isoformat()}")
    days = (last - first).days + 1
    if days > MAX_RANGE_DAYS:
        raise ValueError(f"at most {MAX_RANGE_DAYS} days at once")
    if granularity not in (None, "", "hour", "day"):
        raise ValueError("granularity must be hour or day")
    chosen = granularity or ("hour" if days <= HOURLY_MAX_DAYS else "day")
    if chosen == "hour" and days > MAX_HOURLY_DAYS:
        raise ValueError(f"hourly buckets for at most {MAX_HOURLY_DAYS} days; choose daily")
    return UsageRange(first, last, chosen)


def _label(at: datetime, granularity: str) -> str:
    return at.strftime("%Y-%m-%d %H:00") if granularity == "hour" else at.strftime("%Y-%m-%d")


def _bucket_of(at: datetime, granularity: str) -> datetime:
    at = at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return at if granularity == "hour" else at.replace(hour=0)


async def _rejections(redis: Redis, rng: UsageRange, tenant_id: int | None,
                      ) -> dict[tuple[datetime, int], dict[str, int]]:
    """``(bucket, tenant) -> {reason: count}`` within the counters' retention."""
    start = max(rng.start, datetime.now(UTC) - timedelta(seconds=RETENTION_S))
    out: dict[tuple[datetime, int], dict[str, int]] = defaultdict(lambda: defaultdict(int))
    if start >= rng.end:
        return out
    for count in await rejection_counts(redis, start, rng.end, tenant_id):
        out[(_bucket_of(count.hour, rng.granularity), count.tenant_id)][count.reason] += count.count
    return out


def _hit_rate(cached: int, prompt: int) -> float | None:
    return round(cached / prompt, 6) if prompt else None


async def _cache_costs(session: AsyncSession, rng: UsageRange, tenant_id: int | None,
                       ) -> dict[tuple[datetime, int], tuple[int, ...]]:
    """``(bucket, tenant) -> cost per cache kind`` (pico-USD, ``CACHE_COST_FIELDS`` order)."""
    # The unit is one of two constants, inlined so the SELECT and GROUP BY expressions are identical.
    bucket = func.date_trunc(literal_column(f"'{rng.granularity}'"), UsageHourly.hour,
                             literal_column("'UTC'")).label("bucket")
    stmt = (select(bucket, UsageHourly.tenant_id,
                   *(func.sum(cast(getattr(UsageHourly, name), Numeric)) for name in CACHE_COST_FIELDS))
            .where(UsageHourly.hour >= rng.start, UsageHourly.hour < rng.end)
            .group_by(bucket, UsageHourly.tenant_id))
    if tenant_id is not None:
        stmt = stmt.where(UsageHourly.tenant_id == tenant_id)
    return {(at, tenant): tuple(int(v) for v in costs)
            for at, tenant, *costs in (await session.execute(stmt)).all()}


def _cache_fields(row: Any, costs: Sequence[int]) -> dict[str, int]:
    """The cache kinds' tokens (from a ledger sum, or none) and costs, by column name."""
    tokens = {name: getattr(row, name) if row else 0 for name in CACHE_TOKEN_FIELDS}
    return {**tokens, **dict(zip(CACHE_COST_FIELDS, costs, strict=True)), "cache_cost_pico_usd": sum(costs)}


def _prediction_fields(row: Any) -> dict[str, int]:
    """The accepted and rejected prediction tokens of a ledger sum (0 without one)."""
    return {name: getattr(row, name) if row else 0 for name in PREDICTION_TOKEN_FIELDS}


def _sum_costs(costs: Iterable[Sequence[int]]) -> tuple[int, ...]:
    return tuple(sum(column) for column in zip(*costs, strict=True)) or (0,) * len(SURCHARGE_KINDS)


async def usage_series(session: AsyncSession, redis: Redis, settings: Settings, rng: UsageRange,
                       tenant_id: int | None) -> dict[str, Any]:
    """Chart data and totals of one tenant (or all) over ``rng`` (JSON-serialisable)."""
    result = await service.usage(session, start=rng.start, end=rng.end, tenant_id=tenant_id,
                                 granularity=rng.granularity, settings=settings)
    by_bucket = {row.bucket_start: row for row in result.rows}
    rejected: dict[datetime, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for (bucket, _tenant), reasons in (await _rejections(redis, rng, tenant_id)).items():
        for reason, count in reasons.items():
            rejected[bucket][reason] += count
    cache_costs = await _cache_costs(session, rng, tenant_id)
    cache_cost_by_bucket: dict[datetime, int] = defaultdict(int)
    for (bucket, _tenant), costs in cache_costs.items():
        cache_cost_by_bucket[bucket] += sum(costs)
    buckets = rng.buckets()
    series: dict[str, list[Any]] = defaultdict(list)
    for at in buckets:
        row = by_bucket.get(at)
        prompt, cached = (row.prompt_tokens, row.cached_tokens) if row else (0, 0)
        cost = int(row.cost_pico_usd) if row else 0
        series["input_tokens"].append(prompt - cached)
        series["cached_tokens"].append(cached)
        series["output_tokens"].append(row.completion_tokens if row else 0)
        series["requests"].append(row.requests if row else 0)
        series["cost_pico_usd"].append(str(cost))
        series["cost_usd"].append(cost / PICO_PER_USD)
        series["cache_hit_rate"].append(_hit_rate(cached, prompt))
        for name in (*CACHE_TOKEN_FIELDS, *PREDICTION_TOKEN_FIELDS):
            series[name].append(getattr(row, name) if row else 0)
        series["cache_cost_usd"].append(cache_cost_by_bucket[at] / PICO_PER_USD)
    present = [r for r in REASONS if any(rejected[at].get(r) for at in buckets)]
    totals = result.totals
    total_rejections = {r: sum(rejected[at].get(r, 0) for at in buckets) for r in present}
    cache = _cache_fields(totals, _sum_costs(cache_costs.values()))
    return {
        "granularity": rng.granularity,
        "labels": [_label(at, rng.granularity) for at in buckets],
        **series,
        "rejections": {r: [rejected[at].get(r, 0) for at in buckets] for r in present},
        "totals": {
            "requests": totals.requests, "prompt_tokens": totals.prompt_tokens,
            "input_tokens": totals.prompt_tokens - totals.cached_tokens,
            "cached_tokens": totals.cached_tokens, "output_tokens": totals.completion_tokens,
            "cost_pico_usd": totals.cost_pico_usd, "cost_usd": totals.cost_usd,
            "cache_hit_rate": _hit_rate(totals.cached_tokens, totals.prompt_tokens),
            **_prediction_fields(totals),
            "rejections": total_rejections, "rejected": sum(total_rejections.values()),
            # Exact pico-USD as strings, like cost_pico_usd (sums can exceed 2^53).
            **{name: str(value) if name.endswith("_pico_usd") else value for name, value in cache.items()},
            "cache_cost_usd": usd_string(cache["cache_cost_pico_usd"]),
        },
    }


async def tenant_breakdown(session: AsyncSession, redis: Redis, settings: Settings, rng: UsageRange, *,
                           limit: int = 50) -> list[dict[str, Any]]:
    """The tenants with the highest cost over ``rng`` (then most rejected), with their totals."""
    result = await service.usage(session, start=rng.start, end=rng.end, group_by=["tenant_id"],
                                 settings=settings)
    rejected: dict[int, int] = defaultdict(int)
    for (_bucket, tenant), reasons in (await _rejections(redis, rng, None)).items():
        rejected[tenant] += sum(reasons.values())
    cache_costs: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for (_bucket, tenant), costs in (await _cache_costs(session, rng, None)).items():
        cache_costs[tenant].append(costs)
    rows: dict[int, dict[str, Any]] = {}
    for row in result.rows:
        tenant = int(row.tenant_id or 0)
        rows[tenant] = {"tenant_id": tenant, "requests": row.requests,
                        "input_tokens": row.prompt_tokens - row.cached_tokens,
                        "cached_tokens": row.cached_tokens, "output_tokens": row.completion_tokens,
                        "cost_pico_usd": int(row.cost_pico_usd),
                        "cache_hit_rate": _hit_rate(row.cached_tokens, row.prompt_tokens),
                        **_cache_fields(row, _sum_costs(cache_costs[tenant])), **_prediction_fields(row)}
    for tenant in rejected:
        rows.setdefault(tenant, {"tenant_id": tenant, "requests": 0, "input_tokens": 0, "cached_tokens": 0,
                                 "output_tokens": 0, "cost_pico_usd": 0, "cache_hit_rate": None,
                                 **_cache_fields(None, _sum_costs(())), **_prediction_fields(None)})
    for tenant, entry in rows.items():
        entry["rejected"] = rejected.get(tenant, 0)
    top = sorted(rows.values(), key=lambda r: (-r["cost_pico_usd"], -r["rejected"], r["tenant_id"]))[:limit]
    names = dict((await session.execute(
        select(Tenant.id, Tenant.name).where(Tenant.id.in_([r["tenant_id"] for r in top])))).tuples().all())
    for entry in top:
        entry["name"] = names.get(entry["tenant_id"], f"tenant {entry['tenant_id']}")
    return top


CSV_COLUMNS = ("bucket_start", "tenant_id", "requests", "prompt_tokens", "input_tokens", "cached_tokens",
               "output_tokens", *CACHE_TOKEN_FIELDS, *CACHE_COST_FIELDS, "cache_hit_rate", "cost_pico_usd",
               "cost_usd", *(f"rejected_{reason}" for reason in REASONS), *PREDICTION_TOKEN_FIELDS)


async def usage_csv_rows(session: AsyncSession, redis: Redis, settings: Settings, rng: UsageRange,
                         tenant_id: int | None) -> list[list[str]]:
    """One row per bucket and tenant that had usage or rejections (header first), exact integers."""
    result = await service.usage(session, start=rng.start, end=rng.end, tenant_id=tenant_id,
                                 group_by=["tenant_id"], granularity=rng.granularity, settings=settings)
    rejected = await _rejections(redis, rng, tenant_id)
    cache_costs = await _cache_costs(session, rng, tenant_id)
    rows_by_key = {(row.bucket_start, row.tenant_id): row for row in result.rows}
    keys = sorted(set(rows_by_key) | set(rejected), key=lambda k: (k[0], k[1]))
    out = [list(CSV_COLUMNS)]
    for bucket, tenant in keys:
        row = rows_by_key.get((bucket, tenant))
        prompt, cached = (row.prompt_tokens, row.cached_tokens) if row else (0, 0)
        cost = int(row.cost_pico_usd) if row else 0
        rate = _hit_rate(cached, prompt)
        reasons = rejected.get((bucket, tenant), {})  # type: ignore[arg-type]
        cache = _cache_fields(row, cache_costs.get((bucket, tenant), _sum_costs(())))  # type: ignore[arg-type]
        out.append([
            bucket.isoformat() if bucket else "", str(tenant), str(row.requests if row else 0), str(prompt),
            str(prompt - cached), str(cached), str(row.completion_tokens if row else 0),
            *(str(cache[name]) for name in (*CACHE_TOKEN_FIELDS, *CACHE_COST_FIELDS)),
            "" if rate is None else f"{rate:.6f}", str(cost), usd_string(cost),
            *(str(reasons.get(reason, 0)) for reason in REASONS),
            *(str(value) for value in _prediction_fields(row).values()),
        ])
    return out
