"""SLOs and engines: per tier, TTFT and TPOT p50/p95 from the ledger against the tier's SLO and the
goodput (share of requests meeting both); per replica, the load the gateway's router last polled from
the engine's ``GET /load`` (KV usage, queue, prefix hit rate, throughput) and the block hashes the
router's index says it holds per tier (device / host / disk, ``gateway.kv_index``), its role (``both``,
``prefill``, ``decode``) and the tenants' adapters it holds read, refreshed live.

- Latencies are ``usage_events.ttft_ms`` / ``tpot_ms`` of completed interactive requests in the chosen
  window (Postgres ``percentile_cont``). A request with no TPOT (a single output token) meets the TPOT
  objective by definition; goodput counts requests with ``ttft <= ttft_slo`` and ``tpot <= tpot_slo``.
- Replicas are this gateway process's ``gateway.routing.Router`` registry (``app.state.gateway``): the
  same state requests are routed on, polled every ``health_poll_interval_s``. ``/admin/engines/live``
  returns it as JSON; the page polls it (``static/dashboard.js``). Without the public API extension the
  gateway has no router and the page says so.
- Replicas of other configured pools (the batch pool), which this gateway does not route to, are probed
  directly (``GET /load`` through the runtime's engine client, concurrently, with its probe timeout)
  on each refresh, so the page shows every engine.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from sqlalchemy import and_, func, or_, select
from starlette.responses import JSONResponse, Response

from admin_ui.session import CurrentAdmin
from admin_ui.web import SECURITY_HEADERS, render
from engine.protocol import LoadReport
from gateway.engine_client import EngineUnavailable
from tollgate.models import UsageEvent
from tollgate.settings import Settings

router = APIRouter(prefix="/admin/engines")
WINDOWS = {"1h": 3600, "24h": 24 * 3600, "7d": 7 * 24 * 3600}
LIVE_REFRESH_MS = 2000


async def tier_slos(session: Any, settings: Settings, window_s: int) -> list[dict[str, Any]]:
    """One row per configured tier (best first): requests, TTFT/TPOT p50/p95 (ms), SLOs, goodput."""
    rows = []
    since = datetime.now(UTC) - timedelta(seconds=window_s)
    for name, tier in sorted(settings.tiers.items(), key=lambda item: -item[1].rank):
        meets = and_(UsageEvent.ttft_ms <= tier.ttft_slo_ms,
                     or_(UsageEvent.tpot_ms.is_(None), UsageEvent.tpot_ms <= tier.tpot_slo_ms))
        stmt = select(
            func.count(),
            func.percentile_cont(0.5).within_group(UsageEvent.ttft_ms),
            func.percentile_cont(0.95).within_group(UsageEvent.ttft_ms),
            func.percentile_cont(0.5).within_group(UsageEvent.tpot_ms),
            func.percentile_cont(0.95).within_group(UsageEvent.tpot_ms),
            func.count().filter(meets),
        ).where(UsageEvent.created_at >= since, UsageEvent.tier == name,
                UsageEvent.request_class == "interactive", UsageEvent.status == "completed",
                UsageEvent.ttft_ms.is_not(None))
        count, ttft50, ttft95, tpot50, tpot95, good = (await session.execute(stmt)).one()
        rows.append({
            "tier": name, "requests": int(count), "ttft_slo_ms": tier.ttft_slo_ms,
            "tpot_slo_ms": tier.tpot_slo_ms,
            "ttft_p50": ttft50, "ttft_p95": ttft95, "tpot_p50": tpot50, "tpot_p95": tpot95,
            "goodput": (int(good) / int(count)) if count else None,
        })
    return rows


def _row(url: str, model: str, pool: str, healthy: bool, load: LoadReport | None, *,
         inflight: int | None = None, last_error: str | None = None,
         kv_index: dict[str, int] | None = None, role: str | None = None) -> dict[str, Any]:
    return {
        "kv_index": kv_index, "role": role,
        # Tenants' LoRA adapters the replica holds read (``LoadReport.adapters``).
        "adapters": len(load.adapters) if load else None,
        "url": url, "model": model, "pool": pool, "healthy": healthy, "inflight": inflight,
        "last_error": last_error, "waiting": load.waiting if load else None,
        "running": load.running if load else None, "kv_usage": load.kv_usage if load else None,
        "prefix_hit_rate": load.prefix_hit_rate if load else None,
        "tokens_per_s": load.tokens_per_s if load else None,
        "pending_prefill_tokens": load.pending_prefill_tokens if load else None,
        "num_preemptions": load.num_preemptions if load else None,
    }


async def _probe(runtime: Any, url: str, pool: str) -> dict[str, Any]:
    try:
        load = await runtime.engine.load(url)
    except EngineUnavailable as exc:
        return _row(url, "", pool, False, None, last_error=exc.message)
    return _row(url, load.model, pool, True, load)


async def replica_snapshot(request: Request) -> dict[str, Any]:
    """Every engine replica with its load: the router's (as last polled), then other pools' (probed)."""
    runtime = getattr(request.app.state, "gateway", None)
    if runtime is None:
        return {"available": False, "replicas": []}
    replicas, routed = [], set()
    for route in runtime.router.models.values():
        for replica in route.replicas:
            routed.add(replica.url)
            replicas.append(_row(replica.url, route.name, replica.pool, replica.healthy, replica.load,
                                 inflight=replica.inflight, last_error=replica.last_error,
                                 kv_index=dict(replica.kv.blocks),
                                 role=replica.info.role if replica.info else None))
    others = [(url.rstrip("/"), pool) for pool, cfg in request.app.state.settings.pools.items()
              for url in cfg.replicas if url.rstrip("/") not in routed]
    replicas += await asyncio.gather(*(_probe(runtime, url, pool) for url, pool in others))
    return {"available": True, "replicas": replicas}


@router.get("", include_in_schema=False)
async def engines(request: Request, admin: CurrentAdmin,
                  window: Annotated[str, Query(pattern="^(1h|24h|7d)$")] = "24h") -> Response:
    async with request.app.state.db.session() as session:
        tiers = await tier_slos(session, request.app.state.settings, WINDOWS[window])
    return render(request, "engines.html", {
        "title": "SLOs & engines", "tiers": tiers, "window": window, "windows": list(WINDOWS),
        "live": await replica_snapshot(request), "refresh_ms": LIVE_REFRESH_MS,
    }, admin=admin)


@router.get("/live", include_in_schema=False)
async def live(request: Request, admin: CurrentAdmin) -> Response:
    return JSONResponse(await replica_snapshot(request), headers=SECURITY_HEADERS)
