"""Thin routes of the admin API under ``/admin/v1``; every one needs an admin token (``current_admin``
on the router), runs in one unit of work (``AdminSession``: commit, then publish invalidations, before
the response is sent) and calls ``gateway.admin.service``.

Tenants: ``GET/POST /tenants``, ``GET/PATCH /tenants/{id}``, ``POST /tenants/{id}/suspend``,
``POST /tenants/{id}/reactivate``, ``POST /tenants/{id}/purge-cache`` (drop the tenant's prompt cache on
every engine replica; 200 with each replica's outcome, also when some could not be purged). Keys:
``GET/POST /tenants/{id}/keys``, ``POST /tenants/{id}/keys/{key_id}/revoke``. Prices: ``GET/POST /prices``.
Usage: ``GET /usage``, ``GET /tenants/{id}/usage``. Audit: ``GET /audit``.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Query, Request

from gateway.admin import service
from gateway.admin.auth import CurrentAdmin, current_admin
from gateway.admin.schemas import (
    BIGINT_MAX,
    AdminApiKey,
    AdminApiKeyCreated,
    AdminTenant,
    ApiKeyList,
    AuditEntry,
    AuditList,
    CachePurgeReport,
    KeyCreateRequest,
    PriceCreateRequest,
    PriceList,
    PriceRowOut,
    PurgeCacheRequest,
    ReactivateRequest,
    SuspendRequest,
    TenantCreateRequest,
    TenantList,
    TenantUpdateRequest,
    UsageReport,
)
from gateway.admin.uow import AdminSession
from gateway.tenants.keys import display_prefix
from gateway.tenants.schemas import ApiKeyRead
from tollgate.models import ApiKey
from tollgate.settings import Settings

router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[Depends(current_admin)])

TenantId = Annotated[int, Path(ge=1, le=BIGINT_MAX)]
KeyId = Annotated[int, Path(ge=1, le=BIGINT_MAX)]
Limit = Annotated[int, Query(ge=1, le=service.MAX_PAGE)]


async def _settings(request: Request) -> Settings:  # async: no thread-pool hand-off
    return request.app.state.settings


AppSettings = Annotated[Settings, Depends(_settings)]


def _key(key: ApiKey) -> AdminApiKey:
    read = ApiKeyRead.model_validate(key)
    return AdminApiKey(**read.model_dump(), display_prefix=display_prefix(key.prefix))


# ------------------------------------------------------------------------------------------ tenants


@router.get("/tenants", summary="List tenants")
async def list_tenants(session: AdminSession, search: Annotated[str | None, Query(max_length=128)] = None,
                       status: Literal["active", "suspended"] | None = None, limit: Limit = 50,
                       offset: Annotated[int, Query(ge=0, le=BIGINT_MAX)] = 0) -> TenantList:
    page = await service.list_tenants(session, search=search, status=status, limit=limit, offset=offset)
    return TenantList(data=[AdminTenant.of(t) for t in page.tenants], total=page.total, limit=limit,
                      offset=offset, has_more=offset + len(page.tenants) < page.total)


@router.post("/tenants", status_code=201, summary="Create a tenant")
async def create_tenant(body: TenantCreateRequest, session: AdminSession, settings: AppSettings,
                        admin: CurrentAdmin) -> AdminTenant:
    return AdminTenant.of(await service.create_tenant(session, body, settings=settings, actor=admin.actor))


@router.get("/tenants/{tenant_id}", summary="Retrieve a tenant")
async def get_tenant(tenant_id: TenantId, session: AdminSession, settings: AppSettings) -> AdminTenant:
    return AdminTenant.of(await service.get_tenant(session, tenant_id, settings=settings))


@router.patch("/tenants/{tenant_id}", summary="Change a tenant's tier, limits or budget")
async def update_tenant(tenant_id: TenantId, body: TenantUpdateRequest, session: AdminSession,
                        settings: AppSettings, admin: CurrentAdmin) -> AdminTenant:
    tenant = await service.update_tenant(session, tenant_id, body, settings=settings, actor=admin.actor)
    return AdminTenant.of(tenant)


@router.post("/tenants/{tenant_id}/suspend", summary="Suspend a tenant (reason: admin)")
async def suspend_tenant(tenant_id: TenantId, session: AdminSession, admin: CurrentAdmin,
                         body: SuspendRequest | None = None) -> AdminTenant:
    note = body.note if body else None
    tenant = await service.suspend_tenant(session, tenant_id, actor=admin.actor, note=note)
    return AdminTenant.of(tenant)


@router.post("/tenants/{tenant_id}/reactivate", summary="Lift a suspension")
async def reactivate_tenant(tenant_id: TenantId, session: AdminSession, admin: CurrentAdmin,
                            body: ReactivateRequest | None = None) -> AdminTenant:
    body = body or ReactivateRequest()
    tenant = await service.reactivate_tenant(session, tenant_id, actor=admin.actor, force=body.force,
                                             note=body.note)
    return AdminTenant.of(tenant)


@router.post("/tenants/{tenant_id}/purge-cache", summary="Purge a tenant's prompt cache on every replica")
async def purge_cache(tenant_id: TenantId, request: Request, session: AdminSession, settings: AppSettings,
                      admin: CurrentAdmin, body: PurgeCacheRequest | None = None) -> CachePurgeReport:
    runtime = getattr(request.app.state, "gateway", None)  # absent when the public API is not installed
    purge = await service.purge_tenant_cache(session, tenant_id, settings=settings, actor=admin.actor,
                                             engine=runtime.engine if runtime else None,
                                             note=body.note if body else None)
    return CachePurgeReport.of(purge)


# ------------------------------------------------------------------------------------------ keys


@router.get("/tenants/{tenant_id}/keys", summary="List a tenant's API keys")
async def list_keys(tenant_id: TenantId, session: AdminSession, settings: AppSettings) -> ApiKeyList:
    return ApiKeyList(data=[_key(k) for k in await service.list_keys(session, tenant_id, settings=settings)])


@router.post("/tenants/{tenant_id}/keys", status_code=201, summary="Create an API key (secret shown once)")
async def create_key(tenant_id: TenantId, body: KeyCreateRequest, session: AdminSession,
                     settings: AppSettings, admin: CurrentAdmin) -> AdminApiKeyCreated:
    key, secret = await service.create_key(session, tenant_id, body, settings=settings, actor=admin.actor)
    return AdminApiKeyCreated(**_key(key).model_dump(), key=secret)


@router.post("/tenants/{tenant_id}/keys/{key_id}/revoke", summary="Revoke an API key")
async def revoke_key(tenant_id: TenantId, key_id: KeyId, session: AdminSession, settings: AppSettings,
                     admin: CurrentAdmin) -> AdminApiKey:
    return _key(await service.revoke_key(session, tenant_id, key_id, settings=settings, actor=admin.actor))


# ------------------------------------------------------------------------------------------ prices


@router.get("/prices", summary="The price book with effective dates")
async def list_prices(session: AdminSession,
                      model: Annotated[str | None, Query(min_length=1, max_length=128)] = None) -> PriceList:
    return PriceList(data=await service.list_prices(session, model))


@router.post("/prices", status_code=201, summary="Add a price row effective from a time")
async def add_price(body: PriceCreateRequest, session: AdminSession, admin: CurrentAdmin) -> PriceRowOut:
    return await service.add_price(session, body, actor=admin.actor)


# ------------------------------------------------------------------------------------------ usage

GroupBy = Annotated[list[str], Query(description="model, request_class, tenant_id and/or tier: repeated "
                                                 "or comma-separated")]
Granularity = Annotated[Literal["hour", "day"] | None, Query()]


def _utc(value: datetime | None, default: datetime) -> datetime:
    if value is None:
        return default
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _split(group_by: list[str]) -> list[str]:
    return [part.strip() for item in group_by for part in item.split(",") if part.strip()]


async def _usage(session: AdminSession, settings: Settings, tenant_id: int | None, start: datetime | None,
                 end: datetime | None, group_by: list[str], granularity: str | None) -> UsageReport:
    now = datetime.now(UTC)
    month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    start_at, end_at = _utc(start, month_start), _utc(end, now)
    result = await service.usage(session, start=start_at, end=end_at, tenant_id=tenant_id,
                                 group_by=_split(group_by), granularity=granularity, settings=settings)
    return UsageReport(tenant_id=tenant_id, start=start_at, end=end_at, group_by=result.group_by,
                       granularity=granularity, data=result.rows, totals=result.totals)  # type: ignore[arg-type]


@router.get("/usage", summary="Usage and cost over all tenants (or one, with tenant_id)")
async def usage(session: AdminSession, settings: AppSettings, start: datetime | None = None,
                end: datetime | None = None, group_by: GroupBy = [],  # noqa: B006 (FastAPI copies defaults)
                granularity: Granularity = None,
                tenant_id: Annotated[int | None, Query(ge=1, le=BIGINT_MAX)] = None) -> UsageReport:
    return await _usage(session, settings, tenant_id, start, end, group_by, granularity)


@router.get("/tenants/{tenant_id}/usage", summary="A tenant's usage and cost")
async def tenant_usage(tenant_id: TenantId, session: AdminSession, settings: AppSettings,
                       start: datetime | None = None, end: datetime | None = None,
                       group_by: GroupBy = [],  # noqa: B006
                       granularity: Granularity = None) -> UsageReport:
    return await _usage(session, settings, tenant_id, start, end, group_by, granularity)


# ------------------------------------------------------------------------------------------ audit


@router.get("/audit", summary="The audit log, newest first")
async def audit(session: AdminSession, tenant_id: Annotated[int | None, Query(ge=1, le=BIGINT_MAX)] = None,
                action: Annotated[str | None, Query(max_length=64)] = None,
                before_id: Annotated[int | None, Query(ge=1, le=BIGINT_MAX)] = None,
                limit: Limit = 100) -> AuditList:
    entries, has_more = await service.audit_log(session, tenant_id=tenant_id, action=action,
                                                before_id=before_id, limit=limit)
    return AuditList(data=[AuditEntry.model_validate(e) for e in entries], has_more=has_more)
