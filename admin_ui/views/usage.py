"""Usage over time, overall or for one tenant: tokens (input / cached / output), cost, cache hit rate,
prompt-cache products (tokens written / pinned / retained and their cost), Predicted Outputs (accepted /
rejected prediction tokens), requests and rejections by reason, for a date range; and the same as CSV.

Numbers come from ``admin_ui.usage_data`` (the ledger through the admin service, plus the gateway's
rejection counters). The chart data is embedded as JSON and drawn by ``static/dashboard.js`` with the
vendored Chart.js.
"""

from __future__ import annotations

import csv
import io
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from admin_ui.session import CurrentAdmin
from admin_ui.usage_data import UsageRange, parse_range, tenant_breakdown, usage_csv_rows, usage_series
from admin_ui.web import SECURITY_HEADERS, render
from gateway.admin import service
from gateway.errors import GatewayError
from tollgate.models import BIGINT_MAX

router = APIRouter(prefix="/admin")
TenantFilter = Annotated[int | None, Query(ge=1, le=BIGINT_MAX)]
Day = Annotated[str | None, Query(max_length=10)]
Granularity = Annotated[str | None, Query(max_length=4)]


@router.get("/usage", include_in_schema=False)
async def usage(request: Request, admin: CurrentAdmin, tenant_id: TenantFilter = None, start: Day = None,
                end: Day = None, granularity: Granularity = None) -> Response:
    settings = request.app.state.settings
    error, data, tenant, by_tenant = None, None, None, None
    try:
        rng: UsageRange = parse_range(start, end, granularity)
    except ValueError as exc:
        error, rng = str(exc), parse_range(None, None, None)
    try:
        async with request.app.state.db.session() as session:
            if tenant_id is not None:
                tenant = await service.get_tenant(session, tenant_id, settings=settings)
            data = await usage_series(session, request.app.state.redis, settings, rng, tenant_id)
            if tenant_id is None:
                by_tenant = await tenant_breakdown(session, request.app.state.redis, settings, rng)
    except GatewayError as exc:
        return render(request, "error.html", {"title": "Usage", "message": exc.message},
                      status=exc.status, admin=admin)
    return render(request, "usage.html", {
        "title": f"Usage — {tenant.name}" if tenant else "Usage — all tenants", "tenant": tenant,
        "range": rng, "data": data, "error": error, "by_tenant": by_tenant,
        "csv_query": {**rng.query(), **({"tenant_id": str(tenant_id)} if tenant_id else {})},
    }, admin=admin, status=400 if error else 200)


@router.get("/usage.csv", include_in_schema=False)
async def usage_csv(request: Request, admin: CurrentAdmin, tenant_id: TenantFilter = None,
                    start: Day = None, end: Day = None, granularity: Granularity = None) -> Response:
    try:
        rng = parse_range(start, end, granularity)
        async with request.app.state.db.session() as session:
            rows = await usage_csv_rows(session, request.app.state.redis, request.app.state.settings, rng,
                                        tenant_id)
    except ValueError as exc:
        return Response(f"{exc}\n", status_code=400, media_type="text/plain", headers=SECURITY_HEADERS)
    except GatewayError as exc:
        return Response(f"{exc.message}\n", status_code=exc.status, media_type="text/plain",
                        headers=SECURITY_HEADERS)
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerows(rows)
    scope = f"tenant-{tenant_id}" if tenant_id else "all"
    filename = f"tollgate-usage-{scope}-{rng.first_day}-{rng.last_day}-{rng.granularity}.csv"
    return Response(buffer.getvalue(), media_type="text/csv; charset=utf-8",
                    headers={**SECURITY_HEADERS, "content-disposition": f'attachment; filename="{filename}"'})
