"""Batches of every tenant with their progress, and cancelling one.

The list reads the ``batches`` table (newest first, filterable by status and tenant). Cancelling goes
through the batch tier's own ``gateway.batches.service.BatchService`` bound to the batch's tenant — the
same code as ``POST /v1/batches/{id}/cancel`` — records ``batch.cancel`` in the audit log in the same
transaction, and after the commit tells the runner (``app.state.batch_dispatch``) to finalize, as the
public endpoint does. If that message cannot be sent, beat's sweep finalizes the batch.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Path, Query, Request
from sqlalchemy import select
from starlette.responses import Response

from admin_ui.session import CurrentAdmin, check_csrf
from admin_ui.web import redirect, render, unit_of_work
from gateway.admin.auth import AdminPrincipal
from gateway.batches.service import CANCELLABLE, BatchService
from gateway.errors import GatewayError
from gateway.tenants.repository import AuditLogRepository
from tollgate.models import BATCH_STATUSES, BIGINT_MAX, Batch, Tenant

logger = logging.getLogger("tollgate.admin_ui.batches")

router = APIRouter(prefix="/admin/batches")
PAGE_SIZE = 100
NOTICES = {"cancelling": "Cancellation requested: running lines finish, the rest are not started."}


async def _page(request: Request, admin: AdminPrincipal, *, status: str | None, tenant_id: int | None,
                notice: str | None = None, error: str | None = None, code: int = 200) -> Response:
    stmt = (select(Batch, Tenant.name).join(Tenant, Tenant.id == Batch.tenant_id)
            .order_by(Batch.created_at.desc(), Batch.id.desc()).limit(PAGE_SIZE))
    if status:
        stmt = stmt.where(Batch.status == status)
    if tenant_id is not None:
        stmt = stmt.where(Batch.tenant_id == tenant_id)
    async with request.app.state.db.session() as session:
        rows = (await session.execute(stmt)).all()
    batches = []
    for batch, tenant_name in rows:
        done = batch.request_completed + batch.request_failed
        batches.append({"row": batch, "tenant_name": tenant_name, "done": done,
                        "percent": 100.0 * done / batch.request_total if batch.request_total else 0.0,
                        "cancellable": batch.status in CANCELLABLE})
    return render(request, "batches.html", {
        "title": "Batches", "batches": batches, "status": status or "", "statuses": BATCH_STATUSES,
        "tenant_id": tenant_id, "notice": notice, "error": error, "page_size": PAGE_SIZE,
    }, admin=admin, status=code)


@router.get("", include_in_schema=False)
async def batches(request: Request, admin: CurrentAdmin,
                  status: Annotated[str | None, Query(max_length=16)] = None,
                  tenant_id: Annotated[int | None, Query(ge=1, le=BIGINT_MAX)] = None,
                  done: Annotated[str | None, Query(max_length=16)] = None) -> Response:
    status = status if status in BATCH_STATUSES else None
    return await _page(request, admin, status=status, tenant_id=tenant_id, notice=NOTICES.get(done or ""))


@router.post("/{batch_id}/cancel", include_in_schema=False)
async def cancel(request: Request, admin: CurrentAdmin,
                 batch_id: Annotated[str, Path(max_length=64)]) -> Response:
    await check_csrf(request)
    try:
        async with unit_of_work(request) as session:
            tenant_id = await session.scalar(select(Batch.tenant_id).where(Batch.id == batch_id))
            if tenant_id is None:
                raise GatewayError(f"No batch found with id '{batch_id}'.", status=404)
            _, started = await BatchService(session, request.app.state.settings, tenant_id).cancel(batch_id)
            if started:
                await AuditLogRepository(session).record(admin.actor, "batch.cancel", tenant_id=tenant_id,
                                                         details={"batch_id": batch_id})
    except GatewayError as exc:
        return await _page(request, admin, status=None, tenant_id=None, error=exc.message, code=exc.status)
    dispatch = getattr(request.app.state, "batch_dispatch", None)
    if started and dispatch is not None:
        try:
            await dispatch.finalize(batch_id)
        except Exception:  # committed: beat's sweep finalizes it
            logger.exception("could not send finalization for batch %s; the sweep will retry", batch_id)
    return redirect(request, "/admin/batches", done="cancelling")
