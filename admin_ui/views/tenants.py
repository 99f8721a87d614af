"""Tenants and their API keys: list with search, create, edit tier/limits/budget, suspend/reactivate,
create (secret shown once) and revoke keys, purge the tenant's prompt cache on every engine replica, and
the tenant's audit log.

Every action calls ``gateway.admin.service`` inside the admin unit of work (audit row in the same
transaction, commit, then the ``tollgate:invalidate`` message gateways reload limits and keys on), as
the admin API does. An edit sends only the fields that changed, so the audit log shows the change.
A new key's secret is rendered in the response to the POST itself (never stored, never redirected
through a URL or the session) and the page is ``no-store``. So is a purge's outcome (blocks dropped,
and each replica that was not purged, with why): it is per call, and repeating a purge is harmless.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from admin_ui.session import CurrentAdmin, check_csrf
from admin_ui.web import redirect, render, unit_of_work
from gateway.adapters.service import list_adapters
from gateway.admin import service
from gateway.admin.auth import AdminPrincipal
from gateway.admin.schemas import (
    BIGINT_MAX,
    AdminTenant,
    KeyCreateRequest,
    TenantCreateRequest,
    TenantUpdateRequest,
)
from gateway.errors import GatewayError
from gateway.tenants.keys import display_prefix
from tollgate.models import ApiKey
from tollgate.settings import Settings

router = APIRouter(prefix="/admin/tenants")
TenantId = Annotated[int, Path(ge=1, le=BIGINT_MAX)]
PAGE_SIZE = 50
AUDIT_PAGE = 50
LIMIT_FIELDS = ("tpm_limit", "rpm_limit", "max_concurrency", "batch_tpd_limit")
NOTICES = {
    "created": "Tenant created.", "updated": "Limits saved; gateways apply them at once.",
    "unchanged": "Nothing changed.", "suspended": "Tenant suspended: its requests are refused (403).",
    "reactivated": "Tenant reactivated.", "revoked": "Key revoked; gateways refuse it from now on.",
    "adapter_deleted": "Adapter deleted: its model is gone for the tenant.",
}


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def form_errors(exc: ValidationError) -> list[str]:
    """Readable messages of a pydantic error, one per field."""
    out = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "form"
        out.append(f"{field.replace('_', ' ')}: {error['msg'].removeprefix('Value error, ')}")
    return out


def _blank_to_none(fields: dict[str, str], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: (fields.get(name, "").strip() or None) for name in names}


def key_status(key: ApiKey, now: datetime) -> str:
    if key.revoked_at is not None:
        return "revoked"
    if key.expires_at is not None and key.expires_at <= now:
        return "expired"
    return "active"


# ------------------------------------------------------------------------------------------ list


async def _list_page(request: Request, admin: AdminPrincipal, *, q: str | None, status: str | None,
                     page: int, form: dict[str, Any] | None = None, errors: list[str] | None = None,
                     code: int = 200) -> Response:
    async with request.app.state.db.session() as session:
        result = await service.list_tenants(session, search=q, status=status, limit=PAGE_SIZE,
                                            offset=(page - 1) * PAGE_SIZE)
    pages = max(1, -(-result.total // PAGE_SIZE))
    return render(request, "tenants.html", {
        "title": "Tenants", "tenants": [AdminTenant.of(t) for t in result.tenants], "total": result.total,
        "q": q or "", "status": status or "", "page": page, "pages": pages,
        "tiers": list(_settings(request).tiers), "form": form or {}, "errors": errors or [],
    }, admin=admin, status=code)


@router.get("", include_in_schema=False)
async def tenants(request: Request, admin: CurrentAdmin,
                  q: Annotated[str | None, Query(max_length=128)] = None,
                  status: Annotated[str | None, Query(pattern="^(active|suspended)?$")] = None,
                  page: Annotated[int, Query(ge=1, le=100_000)] = 1) -> Response:
    return await _list_page(request, admin, q=q, status=status or None, page=page)


@router.post("", include_in_schema=False)
async def create_tenant(request: Request, admin: CurrentAdmin) -> Response:
    fields = await check_csrf(request)
    raw = {"name": fields.get("name", ""), "tier": fields.get("tier") or "default",
           **_blank_to_none(fields, (*LIMIT_FIELDS, "monthly_budget_usd"))}
    try:
        body = TenantCreateRequest.model_validate(raw)
        async with unit_of_work(request) as session:
            tenant = await service.create_tenant(session, body, settings=_settings(request),
                                                 actor=admin.actor)
    except ValidationError as exc:
        return await _list_page(request, admin, q=None, status=None, page=1, form=fields,
                                errors=form_errors(exc), code=400)
    except GatewayError as exc:
        return await _list_page(request, admin, q=None, status=None, page=1, form=fields,
                                errors=[exc.message], code=exc.status)
    return redirect(request, f"/admin/tenants/{tenant.id}", done="created")


# ------------------------------------------------------------------------------------------ one tenant


async def tenant_page(request: Request, admin: AdminPrincipal, tenant_id: int, *, notice: str | None = None,
                       errors: list[str] | None = None, new_key: tuple[ApiKey, str] | None = None,
                       before_id: int | None = None, code: int = 200) -> Response:
    settings = _settings(request)
    now = datetime.now(UTC)
    month_start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    async with request.app.state.db.session() as session:
        tenant = AdminTenant.of(await service.get_tenant(session, tenant_id, settings=settings))
        keys = await service.list_keys(session, tenant_id, settings=settings)
        entries, more = await service.audit_log(session, tenant_id=tenant_id, before_id=before_id,
                                                limit=AUDIT_PAGE)
        month = await service.usage(session, start=month_start, end=now, tenant_id=tenant_id,
                                    settings=settings)
        adapters = await list_adapters(session, tenant_id)
    spent = int(month.totals.cost_pico_usd)
    budget = tenant.monthly_budget_pico_usd
    return render(request, "tenant.html", {
        "title": tenant.name, "tenant": tenant, "tiers": list(settings.tiers), "notice": notice,
        "errors": errors or [], "now": now,
        "keys": [{"row": k, "shown": display_prefix(k.prefix), "status": key_status(k, now)} for k in keys],
        "new_key": {"row": new_key[0], "secret": new_key[1]} if new_key else None,
        "audit": entries, "audit_more": more, "audit_next": entries[-1].id if entries else None,
        "month": month.totals, "spent_pico": spent,
        "budget_percent": None if not budget else min(100.0, 100.0 * spent / budget),
        "adapters": adapters, "served_models": [m.name for m in settings.models],
    }, admin=admin, status=code)


@router.get("/{tenant_id}", include_in_schema=False)
async def tenant(request: Request, admin: CurrentAdmin, tenant_id: TenantId,
                 done: Annotated[str | None, Query(max_length=32)] = None,
                 before_id: Annotated[int | None, Query(ge=1, le=BIGINT_MAX)] = None) -> Response:
    try:
        return await tenant_page(request, admin, tenant_id, notice=NOTICES.get(done or ""),
                                  before_id=before_id)
    except GatewayError as exc:
        return render(request, "error.html", {"title": "Not found", "message": exc.message},
                      status=exc.status, admin=admin)


async def _act(request: Request, admin: AdminPrincipal, tenant_id: int, action: Any,
               done: str) -> Response:
    """Run one service call in the admin unit of work; re-render the page with the error if it fails."""
    try:
        async with unit_of_work(request) as session:
            outcome = await action(session)
    except ValidationError as exc:
        return await tenant_page(request, admin, tenant_id, errors=form_errors(exc), code=400)
    except GatewayError as exc:
        if exc.status == 404:
            return render(request, "error.html", {"title": "Not found", "message": exc.message},
                          status=404, admin=admin)
        return await tenant_page(request, admin, tenant_id, errors=[exc.message], code=exc.status)
    if isinstance(outcome, Response):
        return outcome
    return redirect(request, f"/admin/tenants/{tenant_id}", done=done)


def _changed_fields(current: AdminTenant, fields: dict[str, str]) -> BaseModel:
    """A ``TenantUpdateRequest`` of the submitted fields whose value differs from the tenant's."""
    raw: dict[str, Any] = {"tier": fields.get("tier") or current.tier,
                           **_blank_to_none(fields, (*LIMIT_FIELDS, "monthly_budget_usd"))}
    parsed = TenantUpdateRequest.model_validate(raw)
    changed = [name for name in LIMIT_FIELDS + ("tier",) if getattr(parsed, name) != getattr(current, name)]
    if parsed.monthly_budget_usd != current.monthly_budget_pico_usd:
        changed.append("monthly_budget_usd")
    return TenantUpdateRequest.model_validate({name: raw[name] for name in changed})


@router.post("/{tenant_id}/limits", include_in_schema=False)
async def update_limits(request: Request, admin: CurrentAdmin, tenant_id: TenantId) -> Response:
    fields = await check_csrf(request)
    settings = _settings(request)

    async def action(session: Any) -> Response | None:
        current = AdminTenant.of(await service.get_tenant(session, tenant_id, settings=settings))
        update = _changed_fields(current, fields)
        if not update.model_fields_set:
            return redirect(request, f"/admin/tenants/{tenant_id}", done="unchanged")
        await service.update_tenant(session, tenant_id, update, settings=settings,  # type: ignore[arg-type]
                                    actor=admin.actor)
        return None

    return await _act(request, admin, tenant_id, action, "updated")


@router.post("/{tenant_id}/suspend", include_in_schema=False)
async def suspend(request: Request, admin: CurrentAdmin, tenant_id: TenantId) -> Response:
    fields = await check_csrf(request)
    note = fields.get("note", "").strip()[:1000] or None
    return await _act(request, admin, tenant_id, lambda s: service.suspend_tenant(
        s, tenant_id, actor=admin.actor, note=note), "suspended")


@router.post("/{tenant_id}/reactivate", include_in_schema=False)
async def reactivate(request: Request, admin: CurrentAdmin, tenant_id: TenantId) -> Response:
    fields = await check_csrf(request)
    note = fields.get("note", "").strip()[:1000] or None
    force = fields.get("force") == "on"
    return await _act(request, admin, tenant_id, lambda s: service.reactivate_tenant(
        s, tenant_id, actor=admin.actor, force=force, note=note), "reactivated")


def purge_messages(purge: service.CachePurge) -> tuple[str, list[str]]:
    """The notice and the errors (one per replica not purged) that report a purge."""
    done, blocks = len(purge.replicas) - len(purge.failed), purge.purged_blocks
    notice = (f"Prompt cache purged: {blocks:,} block{'' if blocks == 1 else 's'} dropped on {done} of "
              f"{len(purge.replicas)} replica{'' if len(purge.replicas) == 1 else 's'}.")
    return notice, [f"Not purged: {r.url} ({r.error}). Purge again to retry." for r in purge.failed]


@router.post("/{tenant_id}/purge-cache", include_in_schema=False)
async def purge_cache(request: Request, admin: CurrentAdmin, tenant_id: TenantId) -> Response:
    fields = await check_csrf(request)
    note = fields.get("note", "").strip()[:1000] or None
    runtime = getattr(request.app.state, "gateway", None)  # absent when the public API is not installed
    try:
        async with unit_of_work(request) as session:
            purge = await service.purge_tenant_cache(session, tenant_id, settings=_settings(request),
                                                     actor=admin.actor, note=note,
                                                     engine=runtime.engine if runtime else None)
    except GatewayError as exc:
        if exc.status == 404:
            return render(request, "error.html", {"title": "Not found", "message": exc.message},
                          status=404, admin=admin)
        return await tenant_page(request, admin, tenant_id, errors=[exc.message], code=exc.status)
    notice, errors = purge_messages(purge)
    return await tenant_page(request, admin, tenant_id, notice=notice, errors=errors)


@router.post("/{tenant_id}/keys", include_in_schema=False)
async def create_key(request: Request, admin: CurrentAdmin, tenant_id: TenantId) -> Response:
    fields = await check_csrf(request)
    expires = fields.get("expires_at", "").strip()
    try:
        expires_at = datetime.fromisoformat(expires).replace(tzinfo=UTC) if expires else None
        models = [m.strip() for m in fields.get("allowed_models", "").split(",") if m.strip()]
        body = KeyCreateRequest.model_validate({"name": fields.get("name", ""), "expires_at": expires_at,
                                                "allowed_models": models or None})
        async with unit_of_work(request) as session:
            created = await service.create_key(session, tenant_id, body, settings=_settings(request),
                                               actor=admin.actor)
    except ValueError as exc:  # a malformed date or a ValidationError
        errors = form_errors(exc) if isinstance(exc, ValidationError) else [f"expires at: {exc}"]
        return await tenant_page(request, admin, tenant_id, errors=errors, code=400)
    except GatewayError as exc:
        return await tenant_page(request, admin, tenant_id, errors=[exc.message], code=exc.status)
    return await tenant_page(request, admin, tenant_id, new_key=created,
                              notice="Key created. Copy the secret now: it is not shown again.")


@router.post("/{tenant_id}/keys/{key_id}/revoke", include_in_schema=False)
async def revoke_key(request: Request, admin: CurrentAdmin, tenant_id: TenantId,
                     key_id: Annotated[int, Path(ge=1, le=BIGINT_MAX)]) -> Response:
    await check_csrf(request)
    return await _act(request, admin, tenant_id, lambda s: service.revoke_key(
        s, tenant_id, key_id, settings=_settings(request), actor=admin.actor), "revoked")
