"""Read-only record browser (sqladmin) under ``/admin/db``: the ledger, hourly rollups, the audit log,
batches, budget alerts and Stripe exports, with search, sorting, paging and CSV/JSON export.

Invariants:
- Read-only: every view has ``can_create = can_edit = can_delete = False``. Changes go through the
  dashboard's pages, which call the admin services (audit log, cache invalidation); nothing here
  writes to a table.
- Same login as the dashboard: ``DashboardGuard`` runs first inside sqladmin's app and answers a
  redirect to ``/admin/login`` unless the request carries a logged-in dashboard session (so sqladmin's
  own login page is never reachable). Secrets are never shown (no key or token hashes are listed).
- sqladmin is built at install time with an unbound async session factory; the extension's lifespan
  binds it to the app's database engine (``app.state.db``), which exists only then.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from sqladmin import Admin, ModelView
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from admin_ui.session import LoginRequired, current_admin
from admin_ui.web import SECURITY_HEADERS, redirect, safe_next
from engine.usage import COST_FIELDS, FIELDS
from tollgate.models import AuditLog, Batch, BudgetAlert, StripeExport, UsageEvent, UsageHourly

BASE_URL = "/admin/db"
# The dashboard's headers minus its CSP (sqladmin's templates use inline scripts).
RECORD_HEADERS = {name: value for name, value in SECURITY_HEADERS.items()
                  if name != "content-security-policy"}


class _ReadOnly(ModelView):
    can_create = False
    can_edit = False
    can_delete = False
    can_import = False
    page_size = 50
    page_size_options = [50, 100, 500]

    async def get_object_for_details(self, request: Request) -> Any:
        """None (sqladmin's 404) for an id that is no value of the key's type (``/details/abc`` for an
        integer key, or one past its range), where sqladmin's conversion raised a 500."""
        try:
            return await super().get_object_for_details(request)
        except (ValueError, DBAPIError):
            return None


class LedgerView(_ReadOnly, model=UsageEvent):
    name, name_plural, category = "Ledger row", "Ledger (usage_events)", "Usage"
    can_view_details = False  # composite key (id, created_at) of a partitioned table
    column_list = [UsageEvent.created_at, UsageEvent.request_id, UsageEvent.tenant_id, UsageEvent.api_key_id,
                   UsageEvent.model, UsageEvent.request_class, UsageEvent.tier, UsageEvent.status,
                   *(getattr(UsageEvent, name) for name in (*FIELDS, *COST_FIELDS)), UsageEvent.cost_pico_usd,
                   UsageEvent.ttft_ms, UsageEvent.tpot_ms]
    column_searchable_list = [UsageEvent.request_id, UsageEvent.model]
    column_sortable_list = [UsageEvent.created_at, UsageEvent.tenant_id, UsageEvent.cost_pico_usd,
                            UsageEvent.ttft_ms, UsageEvent.tpot_ms]
    column_default_sort = [(UsageEvent.created_at, True)]


class HourlyView(_ReadOnly, model=UsageHourly):
    name, name_plural, category = "Hourly rollup", "Hourly rollups", "Usage"
    can_view_details = False
    column_list = [UsageHourly.hour, UsageHourly.tenant_id, UsageHourly.model, UsageHourly.request_class,
                   UsageHourly.requests, *(getattr(UsageHourly, name) for name in (*FIELDS, *COST_FIELDS)),
                   UsageHourly.cost_pico_usd]
    column_sortable_list = [UsageHourly.hour, UsageHourly.tenant_id, UsageHourly.cost_pico_usd]
    column_default_sort = [(UsageHourly.hour, True)]


class AuditView(_ReadOnly, model=AuditLog):
    name, name_plural, category = "Audit entry", "Audit log", "Changes"
    column_list = [AuditLog.id, AuditLog.created_at, AuditLog.actor, AuditLog.action, AuditLog.tenant_id,
                   AuditLog.details]
    column_searchable_list = [AuditLog.actor, AuditLog.action]
    column_sortable_list = [AuditLog.id, AuditLog.created_at, AuditLog.tenant_id]
    column_default_sort = [(AuditLog.id, True)]


class BatchView(_ReadOnly, model=Batch):
    name, name_plural, category = "Batch", "Batches", "Batches"
    column_list = [Batch.id, Batch.tenant_id, Batch.status, Batch.model, Batch.request_total,
                   Batch.request_completed, Batch.request_failed, Batch.cost_pico_usd, Batch.created_at,
                   Batch.expires_at]
    column_searchable_list = [Batch.id, Batch.status]
    column_sortable_list = [Batch.created_at, Batch.tenant_id, Batch.status]
    column_default_sort = [(Batch.created_at, True)]


class BudgetAlertView(_ReadOnly, model=BudgetAlert):
    name, name_plural, category = "Budget alert", "Budget alerts", "Billing"
    column_exclude_list = [BudgetAlert.last_error]
    column_sortable_list = [BudgetAlert.created_at, BudgetAlert.tenant_id]
    column_default_sort = [(BudgetAlert.created_at, True)]


class StripeExportView(_ReadOnly, model=StripeExport):
    name, name_plural, category = "Stripe export", "Stripe exports", "Billing"
    column_list = [StripeExport.id, StripeExport.tenant_id, StripeExport.hour, StripeExport.revision,
                   StripeExport.kind, StripeExport.status, StripeExport.value_micro_usd,
                   StripeExport.attempts, StripeExport.sent_at]
    column_sortable_list = [StripeExport.id, StripeExport.hour, StripeExport.tenant_id]
    column_default_sort = [(StripeExport.id, True)]


VIEWS: tuple[type[ModelView], ...] = (LedgerView, HourlyView, AuditView, BatchView, BudgetAlertView,
                                      StripeExportView)


class DashboardGuard:
    """ASGI middleware inside sqladmin's app: only a logged-in dashboard admin gets through."""

    def __init__(self, app: ASGIApp, parent: FastAPI) -> None:
        self.app = app
        self.parent = parent

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request({**scope, "app": self.parent})
        try:
            await current_admin(request)
        except LoginRequired:
            response = redirect(request, "/admin/login", next=safe_next(request.url.path))
            await response(scope, receive, send)
            return
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in RECORD_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


def install_records(app: FastAPI) -> async_sessionmaker[AsyncSession]:
    """Mount the record browser; returns the session factory the lifespan must bind."""
    sessions: async_sessionmaker[AsyncSession] = async_sessionmaker(class_=AsyncSession,
                                                                    expire_on_commit=False)
    admin = Admin(app, session_maker=sessions, base_url=BASE_URL, title="Tollgate records",
                  middlewares=[Middleware(DashboardGuard, parent=app)])
    for view in VIEWS:
        admin.add_view(view)
    return sessions


def bind_records(sessions: async_sessionmaker[AsyncSession], app: Any) -> None:
    sessions.configure(bind=app.state.db.engine)
