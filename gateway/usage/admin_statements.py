"""Admin statements: ``GET /admin/v1/statements/{tenant}?month=YYYY-MM`` (JSON) and
``GET /admin/v1/statements/{tenant}.csv?month=YYYY-MM`` (CSV export), ``tenant`` an id or a name.

Authenticated by the admin API's dependency (``gateway.admin.auth.CurrentAdmin``: admin token only,
tenant keys get 403). Read-only; the numbers come from ``billing.statements`` (exact pico-USD lines,
cents with the rounding carried to the total).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import Response
from sqlalchemy.ext.asyncio import AsyncSession

from billing.statements import Statement, StatementTenantNotFound, build_statement, find_tenant_id
from gateway.admin.auth import CurrentAdmin
from gateway.errors import InvalidRequestError, NotFoundError
from tollgate.db import Session

router = APIRouter(prefix="/admin/v1/statements", tags=["admin"])

Month = Annotated[str, Query(pattern=r"^\d{4}-(0[1-9]|1[0-2])$", description="UTC month, YYYY-MM")]


async def _statement(session: AsyncSession, tenant: str, month: str) -> Statement:
    try:
        return await build_statement(session, await find_tenant_id(session, tenant), month)
    except StatementTenantNotFound as exc:
        raise NotFoundError(str(exc), code="tenant_not_found") from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="month", code="invalid_value") from exc


@router.get("/{tenant}.csv")
async def statement_csv(tenant: str, month: Month, admin: CurrentAdmin, session: Session) -> Response:
    statement = await _statement(session, tenant, month)
    filename = f"statement-{statement.tenant_name}-{statement.month}.csv".replace('"', "")
    return Response(statement.to_csv(), media_type="text/csv",
                    headers={"content-disposition": f'attachment; filename="{filename}"'})


@router.get("/{tenant}")
async def statement_json(tenant: str, month: Month, admin: CurrentAdmin, session: Session) -> dict[str, Any]:
    return (await _statement(session, tenant, month)).as_dict()
