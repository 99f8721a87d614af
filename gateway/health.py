"""``GET /health``: is this gateway process able to serve? (Used by ``tollgate up``, Docker, load
balancers and the Kubernetes readiness probe.)

Invariants: Postgres (``SELECT 1``) and Redis (``PING``) are checked concurrently, each bounded by
``settings.health_check_timeout_s``, on every call (nothing cached). Redis is the request path's own
dependency (admission, the usage outbox): without it, 503. Postgres is not on it once the gateway has its
price book (keys and prices are cached, usage goes through the outbox and is flushed by the worker):
without Postgres such a gateway still serves what it can, so 200 ``degraded`` naming it, rather than every
gateway leaving the Service at once during a database blip; a gateway that never loaded its prices (it
started during the outage) can serve nothing, so 503. Each failing component is named with why; no secret
or URL is ever included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


async def _check(probe: Awaitable[object], timeout: float) -> dict[str, str]:
    try:
        await asyncio.wait_for(probe, timeout)
    except TimeoutError:
        return {"status": "error", "error": f"no answer within {timeout:g}s"}
    except Exception as e:  # any failure of the dependency is the answer, not a 500
        return {"status": "error", "error": f"{type(e).__name__}: {e}"[:300]}
    return {"status": "ok"}


@router.get("/health", include_in_schema=False)
async def health(request: Request) -> JSONResponse:
    state = request.app.state
    timeout = state.settings.health_check_timeout_s
    postgres, redis = await asyncio.gather(_check(state.db.ping(), timeout),
                                           _check(state.redis.ping(), timeout))
    components = {"postgres": postgres, "redis": redis}
    failing = [name for name, result in components.items() if result["status"] != "ok"]
    runtime = getattr(state, "gateway", None)
    can_serve_without_postgres = runtime is not None and runtime.prices.loaded
    if "redis" in failing or (failing and not can_serve_without_postgres):
        return JSONResponse({"status": "unavailable", "failing": failing, "components": components},
                            status_code=503)
    if failing:
        return JSONResponse({"status": "degraded", "failing": failing, "components": components})
    return JSONResponse({"status": "ok", "components": components})
