"""The prompt cache: per tenant, how much of its prompts the cache served and from which tier (device
pool, host memory, disk), and what it wrote, pinned and retained; per replica, its cache by tier as the
replica reports it, and what the routing index says it holds.

- Tenants: sums of ``usage_events`` over the window (the ledger: ``cached_tokens`` and, of those,
  ``cached_host_tokens`` / ``cached_disk_tokens``; the rest came from the device pool), the tenants with
  the most prompt tokens first (``MAX_TENANTS``). A hit rate is cached / prompt tokens; a tier's share
  is its part of the cached tokens.
- Replicas: the router's registry (``replica.load.cache``: ``engine.protocol.CacheReport``, as last
  polled from the replica's ``GET /load``; ``replica.kv``: the routing index). A replica's hit rate by
  tier is the prompt tokens each tier served since the replica started over those it looked up; its
  lower tiers show blocks held / capacity and the blocks pinned (ttl) or retained (24h) in them, and
  the blocks and bytes moved between tiers.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import Numeric, cast, func, select
from starlette.responses import Response

from admin_ui.session import CurrentAdmin
from admin_ui.web import render
from engine.usage import CACHE_TIERS, KINDS, SURCHARGE_KINDS, TIER_KINDS, TokenKind
from tollgate.models import Tenant, UsageEvent

router = APIRouter(prefix="/admin/cache")
WINDOWS = {"1h": 3600, "24h": 24 * 3600, "7d": 7 * 24 * 3600}
MAX_TENANTS = 100
TIERS = CACHE_TIERS
# The ledger counts the page sums: the prompt, the cached part and its tiers, and the cache products.
SUMS = tuple(KINDS[k].field for k in (TokenKind.INPUT, TokenKind.CACHED_INPUT, *TIER_KINDS.values(),
                                      *SURCHARGE_KINDS))
MOVES = (("offloaded_blocks", "offloaded to host"), ("loaded_blocks", "loaded from host"),
         ("persisted_blocks", "written to disk"), ("disk_read_blocks", "read from disk"),
         ("host_evicted_blocks", "dropped from host"), ("disk_evicted_blocks", "dropped from disk"))


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


async def tenant_rows(session: Any, window_s: int) -> list[dict[str, Any]]:
    """One row per tenant with usage in the window: its sums, hit rate and hits by tier."""
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    prompt = func.sum(cast(UsageEvent.prompt_tokens, Numeric))
    stmt = (select(UsageEvent.tenant_id, Tenant.name, func.count(),
                   *(func.sum(cast(getattr(UsageEvent, name), Numeric)) for name in SUMS))
            .join(Tenant, Tenant.id == UsageEvent.tenant_id)
            .where(UsageEvent.created_at >= since)
            .group_by(UsageEvent.tenant_id, Tenant.name)
            .order_by(prompt.desc(), UsageEvent.tenant_id).limit(MAX_TENANTS))
    rows = []
    for tenant_id, name, requests, *sums in (await session.execute(stmt)).all():
        totals = {key: int(value or 0) for key, value in zip(SUMS, sums, strict=True)}
        cached = totals["cached_tokens"]
        device = cached - totals["cached_host_tokens"] - totals["cached_disk_tokens"]
        rows.append({"tenant_id": tenant_id, "name": name, "requests": int(requests), **totals,
                     "hit_rate": _share(cached, totals["prompt_tokens"]),
                     "by_tier": {"device": _share(device, cached),
                                 "host": _share(totals["cached_host_tokens"], cached),
                                 "disk": _share(totals["cached_disk_tokens"], cached)}})
    return rows


def replica_rows(request: Request) -> list[dict[str, Any]] | None:
    """The router's replicas with their cache reports (None: this process routes nothing)."""
    runtime = getattr(request.app.state, "gateway", None)
    if runtime is None:
        return None
    rows = []
    for route in runtime.router.models.values():
        for replica in route.replicas:
            cache = replica.load.cache if replica.load is not None else None
            row: dict[str, Any] = {"url": replica.url, "model": route.name, "pool": replica.pool,
                                   "healthy": replica.healthy, "index": dict(replica.kv.blocks),
                                   "cache": None}
            if cache is not None:
                hits = cache.hit_tokens_by_tier
                row["cache"] = {
                    "hit_rate": _share(sum(hits.values()), cache.query_tokens),
                    "by_tier": {tier: _share(hits.get(tier, 0), cache.query_tokens) for tier in TIERS},
                    "tiers": [{"tier": tier, "blocks": cache.tier_blocks.get(tier, 0),
                               "capacity": cache.tier_capacity.get(tier, 0),
                               "pinned": cache.pinned_blocks.get(tier, 0)}
                              for tier in ("host", "disk") if cache.tier_capacity.get(tier)],
                    "moves": [{"what": label, "blocks": cache.moved_blocks.get(key, 0),
                               "bytes": cache.moved_blocks.get(key, 0) * cache.block_bytes}
                              for key, label in MOVES if key in cache.moved_blocks],
                }
            rows.append(row)
    return rows


@router.get("", include_in_schema=False)
async def cache(request: Request, admin: CurrentAdmin,
                window: Annotated[str, Query(pattern="^(1h|24h|7d)$")] = "24h") -> Response:
    async with request.app.state.db.session() as session:
        tenants = await tenant_rows(session, WINDOWS[window])
    return render(request, "cache.html", {
        "title": "Prompt cache", "window": window, "windows": list(WINDOWS), "tenants": tenants,
        "replicas": replica_rows(request), "tiers": TIERS,
    }, admin=admin)
