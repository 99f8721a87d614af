"""Tenant self-service usage: ``GET /v1/organization/usage/completions`` and ``GET /v1/organization/costs``
with the tenant's own API key (OpenAI's Usage and Costs APIs; bodies validate against ``UsageResponse``).

A key restricted by scopes needs ``api.usage.read`` (OpenAI's permission name for these endpoints); an
unrestricted key may read its tenant's usage. Queries are scoped to the key's tenant by
``UsageRepository``; nothing of another tenant is reachable.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import Principal
from gateway.deps import CurrentPrincipal
from gateway.errors import PermissionDeniedError
from gateway.usage import service
from gateway.usage.repository import UsageRepository
from tollgate.db import Session

USAGE_SCOPE = "api.usage.read"

router = APIRouter(prefix="/v1/organization", tags=["usage"])

StringList = Annotated[list[str] | None, Query()]


def _repository(session: AsyncSession, principal: Principal) -> UsageRepository:
    if principal.scopes is not None and USAGE_SCOPE not in principal.scopes:
        raise PermissionDeniedError(f"This API key lacks the scope {USAGE_SCOPE!r} needed to read usage.",
                                    code="missing_scope")
    return UsageRepository(session, principal.tenant_id)


@router.get("/usage/completions")
async def usage_completions(
    principal: CurrentPrincipal, session: Session, start_time: int,
    end_time: int | None = None, bucket_width: str = "1d", models: StringList = None,
    batch: bool | None = None, group_by: StringList = None, limit: int | None = None,
    page: str | None = None, project_ids: StringList = None, user_ids: StringList = None,
    api_key_ids: StringList = None,
) -> dict[str, Any]:
    return await service.completions_usage(
        _repository(session, principal), start_time=start_time, end_time=end_time,
        bucket_width=bucket_width, models=models, batch=batch, group_by=group_by, limit=limit, page=page,
        project_ids=project_ids, user_ids=user_ids, api_key_ids=api_key_ids, now=int(time.time()))


@router.get("/costs")
async def costs(
    principal: CurrentPrincipal, session: Session, start_time: int,
    end_time: int | None = None, bucket_width: str = "1d", group_by: StringList = None,
    limit: int | None = None, page: str | None = None, project_ids: StringList = None,
    api_key_ids: StringList = None,
) -> dict[str, Any]:
    return await service.costs(
        _repository(session, principal), start_time=start_time, end_time=end_time,
        bucket_width=bucket_width, group_by=group_by, limit=limit, page=page, project_ids=project_ids,
        api_key_ids=api_key_ids, now=int(time.time()))
