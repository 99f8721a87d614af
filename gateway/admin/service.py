"""Admin operations: plain async functions taking a session (and, for writes, the acting admin), used by
the admin API, the dashboard and ``tollgate admins``. They never commit and never publish: run them
inside ``gateway.admin.uow.admin_unit_of_work`` (or the ``AdminSession`` dependency), which commits and
then announces the invalidations they queued.

Invariants:
- Every write records one ``audit_log`` row (actor, action, tenant_id, details) in the same
  transaction; tenant and key writes reuse ``gateway.tenants.service`` (which records them), prices reuse
  ``billing.service.set_price``.
- Changes gateways cache (tier, limits, status, a revoked key) queue a ``tollgate:invalidate`` message
  (``{"tenant_id": n}`` / ``{"key_id": "<prefix>"}``), published only after the commit.
- Status changes lock the tenant row first (``SELECT … FOR UPDATE``): the decision is made on the row
  as it is, not as it was before a concurrent billing suspension.
- Suspensions from the admin API have reason ``admin``. ``reactivate_tenant`` lifts an ``admin``
  suspension; a ``billing`` suspension (unpaid bill) is lifted only with ``force=True``, recorded as
  such, and never replaced by an ``admin`` one (that would let a plain reactivate lift it).
- Price rows start now or later: a row that starts in the past would rewrite which price was in effect
  for requests already billed.
- A prompt-cache purge (``purge_tenant_cache``) asks every replica of every configured pool
  (``settings.pools``: the batch pool too, which the public API's router does not route to; a pool's
  ``dns`` name resolved now, a name that cannot be resolved being a failed row of its own) to drop
  the tenant's salted blocks, concurrently, each bounded by ``PURGE_TIMEOUT_S``, once the tenant is
  known to exist (404 before any replica is asked). A replica that fails or does not answer is a row of
  the result (``error``), never an error of the call, so the others are purged and the admin sees which
  to retry; a purge is idempotent. Its audit row says what each replica answered, so the purge runs
  before the commit: should the commit fail, the admin gets an error and repeats it.
- Errors are ``AdminError`` (a ``GatewayError``: HTTP status + ``{"error": ...}`` body); the tenant
  service's domain errors are translated with the same status.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from argon2 import PasswordHasher
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from billing import repository as billing_repository
from billing.prices import OPTIONAL_PRICE_FIELDS, Price, new_price_start
from billing.service import PriceConflict, set_price
from engine.usage import total
from gateway.admin import repository
from gateway.admin.auth import generate_admin_token, hash_admin_token
from gateway.admin.schemas import (
    PRICE_FIELDS,
    PriceCreateRequest,
    PriceRowOut,
    TenantCreateRequest,
    TenantUpdateRequest,
    UsageRow,
    UsageTotals,
    usd_string,
)
from gateway.admin.uow import queue_invalidation
from gateway.engine_client import EngineClient, EngineUnavailable
from gateway.errors import GatewayError
from gateway.replicas import current_replica_urls
from gateway.tenants.cache_salt import cache_salt
from gateway.tenants.repository import AuditLogRepository
from gateway.tenants.schemas import ApiKeyCreate
from gateway.tenants.service import ApiKeyService, TenantError, TenantService
from tollgate.models import Admin, ApiKey, AuditLog, Tenant
from tollgate.settings import Settings

EMAIL_RE = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")
EMAIL_MAX_LENGTH = 254
MAX_PAGE = 1000
# How long one replica may take to purge a tenant's blocks (it deletes the disk tier's files first).
PURGE_TIMEOUT_S = 30.0
_TENANT_ERROR_CODES = {400: "invalid_value", 401: "invalid_api_key", 404: "not_found", 409: "conflict"}


class AdminError(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_value"


class AdminNotFound(AdminError):
    status = 404
    code = "not_found"


class AdminConflict(AdminError):
    status = 409
    code = "conflict"


@contextmanager
def _tenant_errors() -> Iterator[None]:
    try:
        yield
    except TenantError as e:
        raise AdminError(str(e), status=e.status, code=_TENANT_ERROR_CODES.get(e.status)) from e


# ------------------------------------------------------------------------------------------ admins


def normalize_email(email: str) -> str:
    email = email.strip().lower()
    if len(email) > EMAIL_MAX_LENGTH or not EMAIL_RE.fullmatch(email):
        raise AdminError(f"not an email address: {email[:EMAIL_MAX_LENGTH]!r}", param="email")
    return email


async def create_admin(session: AsyncSession, email: str, *, settings: Settings, actor: str,
                       password: str | None = None) -> tuple[Admin, str]:
    """A new admin and its API token (shown once). With ``password``, an argon2 hash of it is stored
    for the dashboard's password login."""
    email = normalize_email(email)
    admins = repository.AdminRepository(session)
    if await admins.get_by_email(email) is not None:
        raise AdminConflict(f"an admin {email!r} already exists (use `tollgate admins rotate-token`)")
    password_hash = _password_hash(password)
    token = generate_admin_token()
    try:
        async with session.begin_nested():
            admin = await admins.add(Admin(email=email, password_hash=password_hash,
                                           api_token_hash=hash_admin_token(token, settings)))
    except IntegrityError as e:  # a concurrent create won the race for the email
        raise AdminConflict(f"an admin {email!r} already exists") from e
    await AuditLogRepository(session).record(actor, "admin.create", details={
        "admin_id": admin.id, "email": email, "password_set": password_hash is not None})
    return admin, token


async def rotate_admin_token(session: AsyncSession, email: str, *, settings: Settings,
                             actor: str) -> tuple[Admin, str]:
    """Replace the admin's API token (the old one stops working at once); returns the new one."""
    admin = await _admin(session, email)
    token = generate_admin_token()
    admin.api_token_hash = hash_admin_token(token, settings)
    await repository.AdminRepository(session).flush()
    await AuditLogRepository(session).record(actor, "admin.rotate_token", details={"admin_id": admin.id})
    return admin, token


def _password_hash(password: str | None) -> str | None:
    """The argon2 hash of a dashboard password (None: no password login); an empty one is refused."""
    if password is not None and not password:
        raise AdminError("the admin password must not be empty")
    return PasswordHasher().hash(password) if password else None


async def _admin(session: AsyncSession, email: str) -> Admin:
    admin = await repository.AdminRepository(session).get_by_email(normalize_email(email))
    if admin is None:
        raise AdminNotFound(f"no admin {email!r}")
    return admin


async def set_admin_password(session: AsyncSession, email: str, password: str | None, *,
                             actor: str) -> Admin:
    """Set (or with None, remove) the admin's dashboard password; every dashboard session of that admin
    ends (``admin_ui.session``: a session carries a fingerprint of the password hash)."""
    password_hash = _password_hash(password)
    admin = await _admin(session, email)
    admin.password_hash = password_hash
    await repository.AdminRepository(session).flush()
    await AuditLogRepository(session).record(actor, "admin.set_password", details={
        "admin_id": admin.id, "password_set": password is not None})
    return admin


async def delete_admin(session: AsyncSession, email: str, *, actor: str) -> Admin:
    """Remove the admin: its API token and dashboard sessions stop working at once. The audit log keeps
    what it did (its rows name the actor, not the admin row)."""
    admin = await _admin(session, email)
    await repository.AdminRepository(session).delete(admin)
    await AuditLogRepository(session).record(actor, "admin.delete", details={
        "admin_id": admin.id, "email": admin.email})
    return admin


async def list_admins(session: AsyncSession) -> Sequence[Admin]:
    return await repository.AdminRepository(session).list()


# ------------------------------------------------------------------------------------------ tenants


@dataclass(frozen=True, slots=True)
class TenantPage:
    tenants: Sequence[Tenant]
    total: int


async def list_tenants(session: AsyncSession, *, search: str | None = None, status: str | None = None,
                       limit: int = 50, offset: int = 0) -> TenantPage:
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise AdminError(f"limit must be in 1..{MAX_PAGE} and offset >= 0")
    tenants, total = await repository.search_tenants(session, search=(search or "").strip() or None,
                                                     status=status, limit=limit, offset=offset)
    return TenantPage(tenants, total)


async def get_tenant(session: AsyncSession, tenant_id: int, *, settings: Settings) -> Tenant:
    with _tenant_errors():
        return await TenantService(session, settings).get_tenant(tenant_id)


async def _locked_tenant(session: AsyncSession, tenant_id: int) -> Tenant:
    tenant = await repository.lock_tenant(session, tenant_id)
    if tenant is None:
        raise AdminNotFound(f"no tenant {tenant_id!r}")
    return tenant


async def create_tenant(session: AsyncSession, data: TenantCreateRequest, *, settings: Settings,
                        actor: str) -> Tenant:
    with _tenant_errors():
        return await TenantService(session, settings).create_tenant(data.to_tenant_create(), actor=actor)


async def update_tenant(session: AsyncSession, tenant_id: int, data: TenantUpdateRequest, *,
                        settings: Settings, actor: str) -> Tenant:
    """Change tier, limits, budget or Stripe customer; gateways reload the tenant's limits at once."""
    service = TenantService(session, settings)
    await _locked_tenant(session, tenant_id)
    if not data.model_fields_set:
        return await get_tenant(session, tenant_id, settings=settings)
    with _tenant_errors():
        try:
            async with session.begin_nested():
                tenant = await service.update_tenant(tenant_id, data.to_tenant_update(), actor=actor)
        except IntegrityError as e:  # the only unique column a PATCH can set
            raise AdminConflict("that stripe_customer_id belongs to another tenant",
                                param="stripe_customer_id") from e
    queue_invalidation(session, tenant_id=tenant.id)
    return tenant


async def suspend_tenant(session: AsyncSession, tenant_id: int, *, actor: str,
                         note: str | None = None) -> Tenant:
    """Suspend with reason ``admin`` (idempotent). A tenant suspended for billing stays so."""
    tenant = await _locked_tenant(session, tenant_id)
    if tenant.status == "suspended":
        if tenant.suspended_reason == "admin":
            return tenant
        raise AdminConflict(f"tenant {tenant.id} is already suspended ({tenant.suspended_reason}); "
                            "an admin suspension would hide the billing one")
    tenant.status, tenant.suspended_reason = "suspended", "admin"
    await session.flush()
    await AuditLogRepository(session).record(actor, "tenant.suspend", tenant_id=tenant.id,
                                             details={"reason": "admin", "note": note})
    queue_invalidation(session, tenant_id=tenant.id)
    return tenant


async def reactivate_tenant(session: AsyncSession, tenant_id: int, *, actor: str, force: bool = False,
                            note: str | None = None) -> Tenant:
    """Lift an ``admin`` suspension (idempotent on an active tenant); a ``billing`` one needs ``force``."""
    tenant = await _locked_tenant(session, tenant_id)
    if tenant.status == "active":
        return tenant
    reason = tenant.suspended_reason
    if reason != "admin" and not force:
        raise AdminConflict(f"tenant {tenant.id} is suspended for {reason}; reactivating it needs "
                            '"force": true', code="suspended_for_billing")
    tenant.status, tenant.suspended_reason = "active", None
    await session.flush()
    await AuditLogRepository(session).record(actor, "tenant.reactivate", tenant_id=tenant.id,
                                             details={"lifted_reason": reason, "forced": reason != "admin",
                                                      "note": note})
    queue_invalidation(session, tenant_id=tenant.id)
    return tenant


# ------------------------------------------------------------------------------------------ prompt cache


@dataclass(frozen=True, slots=True)
class ReplicaPurge:
    """One replica's answer to a purge: the blocks it dropped, or why it was not purged."""

    url: str
    purged_blocks: int | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class CachePurge:
    tenant_id: int
    replicas: list[ReplicaPurge]

    @property
    def purged_blocks(self) -> int:
        return sum(r.purged_blocks or 0 for r in self.replicas)

    @property
    def failed(self) -> list[ReplicaPurge]:
        """The replicas that still may hold the tenant's blocks (purge again to retry them)."""
        return [r for r in self.replicas if r.error is not None]


@asynccontextmanager
async def _engine_client(engine: EngineClient | None, settings: Settings) -> AsyncIterator[EngineClient]:
    """``engine`` (a gateway runtime's pool of connections), else a client of this call's own."""
    if engine is not None:
        yield engine
        return
    own = EngineClient.for_settings(settings)
    try:
        yield own
    finally:
        await own.aclose()


async def _purge_replica(engine: EngineClient, url: str, salt: str, timeout_s: float) -> ReplicaPurge:
    try:
        async with asyncio.timeout(timeout_s):
            return ReplicaPurge(url, await engine.purge(url, salt))
    except EngineUnavailable as exc:
        return ReplicaPurge(url, None, exc.message.removeprefix(f"{url}/kv/purge: "))
    except TimeoutError:
        return ReplicaPurge(url, None, f"no answer within {timeout_s:g} s")


async def purge_tenant_cache(session: AsyncSession, tenant_id: int, *, settings: Settings, actor: str,
                             engine: EngineClient | None = None, note: str | None = None,
                             timeout_s: float = PURGE_TIMEOUT_S) -> CachePurge:
    """Drop the tenant's prompt cache (device, host and disk tiers) on every configured replica; per
    replica the blocks dropped or the error. Recorded as ``tenant.purge_cache`` with each outcome."""
    tenant = await get_tenant(session, tenant_id, settings=settings)
    salt = cache_salt(settings.key_hash_secret.get_secret_value(), tenant.id)
    urls, unresolved = await current_replica_urls(settings.pools, timeout_s=settings.health_check_timeout_s)
    async with _engine_client(engine, settings) as client:
        replicas = await asyncio.gather(*(_purge_replica(client, url, salt, timeout_s) for url in urls))
    # A pool name that does not resolve now may still have replicas holding the tenant's blocks.
    missed = [ReplicaPurge(name, None, f"cannot resolve: {why}") for name, why in unresolved.items()]
    purge = CachePurge(tenant.id, [*replicas, *missed])
    await AuditLogRepository(session).record(actor, "tenant.purge_cache", tenant_id=tenant.id, details={
        "purged_blocks": purge.purged_blocks,
        "replicas": {r.url: r.purged_blocks for r in purge.replicas if r.error is None},
        "failed": {r.url: r.error for r in purge.failed} or None, "note": note})
    return purge


# ------------------------------------------------------------------------------------------ keys


async def create_key(session: AsyncSession, tenant_id: int, data: ApiKeyCreate, *, settings: Settings,
                     actor: str) -> tuple[ApiKey, str]:
    """A new key for the tenant: ``(row, full secret key)``; the secret is not stored anywhere."""
    with _tenant_errors():
        return await ApiKeyService(session, settings).create_key(tenant_id, data, actor=actor)


async def list_keys(session: AsyncSession, tenant_id: int, *, settings: Settings) -> Sequence[ApiKey]:
    await get_tenant(session, tenant_id, settings=settings)
    return await ApiKeyService(session, settings).list_keys(tenant_id)


async def revoke_key(session: AsyncSession, tenant_id: int, key_id: int, *, settings: Settings,
                     actor: str) -> ApiKey:
    """Revoke (idempotent); every gateway drops the key from its cache once the change commits."""
    with _tenant_errors():
        key = await ApiKeyService(session, settings).revoke_key(tenant_id, key_id, actor=actor)
    queue_invalidation(session, key_id=key.prefix)
    return key


# ------------------------------------------------------------------------------------------ prices


async def list_prices(session: AsyncSession, model: str | None = None, *,
                      now: datetime | None = None) -> list[PriceRowOut]:
    """The price book, oldest first per model, each row with the time the next one replaces it."""
    now = now or datetime.now(UTC)
    if model is not None:
        rows = [(model, start, price) for start, price in await billing_repository.price_rows(session, model)]
    else:
        rows = await billing_repository.all_prices(session)
    out = []
    for i, (name, start, price) in enumerate(rows):
        following = rows[i + 1] if i + 1 < len(rows) else None
        until = following[1] if following is not None and following[0] == name else None
        out.append(PriceRowOut.of(name, start, until, start <= now and (until is None or now < until), price))
    return out


async def add_price(session: AsyncSession, data: PriceCreateRequest, *, actor: str,
                    now: datetime | None = None) -> PriceRowOut:
    """Add a price row from ``data.effective_from`` (now when omitted). Gateways pick it up with their
    periodic price-book refresh (``billing.price_cache.PriceBookCache``)."""
    now = now or datetime.now(UTC)
    try:
        start = new_price_start(data.effective_from, now)
    except ValueError as e:  # PastEffectiveFrom, or a date without a timezone
        raise AdminError(str(e), param="effective_from") from e
    try:
        price = Price.of(input=data.input_usd_per_mtok, output=data.output_usd_per_mtok,
                         **{name: getattr(data, f"{name}_usd_per_mtok") for name in OPTIONAL_PRICE_FIELDS})
        start = await set_price(session, data.model, price, start, now=now)
    except PriceConflict as e:
        raise AdminConflict(str(e), param="effective_from") from e
    except ValueError as e:
        raise AdminError(str(e)) from e
    await record_price_set(session, actor, data.model, start, price)
    return next(row for row in await list_prices(session, data.model, now=now)
                if row.effective_from == start)


async def record_price_set(session: AsyncSession, actor: str, model: str, start: datetime,
                           price: Price) -> None:
    """The audit row of a price set (the admin API and ``tollgate prices set`` alike)."""
    details: dict[str, Any] = {"model": model, "effective_from": start.isoformat(),
                               "pico_usd_per_token": {name: getattr(price, name) for name in PRICE_FIELDS}}
    await AuditLogRepository(session).record(actor, "price.set", details=details)


# ------------------------------------------------------------------------------------------ usage


@dataclass(frozen=True, slots=True)
class UsageResult:
    group_by: list[str]
    rows: list[UsageRow]
    totals: UsageTotals


def _totals(sums: Sequence[repository.UsageSum]) -> dict[str, Any]:
    cost = sum(s.cost_pico_usd for s in sums)
    return {"requests": sum(s.requests for s in sums), **total(s.usage for s in sums).fields(),
            "cost_pico_usd": str(cost), "cost_usd": usd_string(cost)}


async def usage(session: AsyncSession, *, start: datetime, end: datetime, tenant_id: int | None = None,
                group_by: Sequence[str] = (), granularity: str | None = None,
                settings: Settings) -> UsageResult:
    """Sums of the ledger (``usage_events``) over ``[start, end)``, per tenant or overall, grouped by
    any of model / request_class / tenant_id / tier and by UTC hour or day."""
    if start.tzinfo is None or end.tzinfo is None:
        raise AdminError("start and end must be timezone-aware")
    if start >= end:
        raise AdminError("start must be before end", param="start")
    unknown = [name for name in group_by if name not in repository.USAGE_DIMENSIONS]
    if unknown:
        raise AdminError(f"cannot group usage by {unknown[0]!r}; use {', '.join(repository.USAGE_DIMENSIONS)}"
                         " (and granularity=hour|day for time buckets)", param="group_by")
    if granularity is not None and granularity not in repository.USAGE_GRANULARITIES:
        raise AdminError("granularity must be hour or day", param="granularity")
    group_by = list(dict.fromkeys(group_by))
    if tenant_id is not None:
        await get_tenant(session, tenant_id, settings=settings)
    sums = await repository.usage_sums(session, start=start, end=end, tenant_id=tenant_id,
                                       group_by=group_by, granularity=granularity)
    rows = [UsageRow(bucket_start=s.bucket_start, **s.group, **_totals([s]))  # type: ignore[arg-type]
            for s in sums]
    totals = UsageTotals(**_totals(sums))
    return UsageResult(group_by, rows, totals)


# ------------------------------------------------------------------------------------------ audit


async def audit_log(session: AsyncSession, *, tenant_id: int | None = None, action: str | None = None,
                    before_id: int | None = None, limit: int = 100) -> tuple[Sequence[AuditLog], bool]:
    """Audit entries, newest first, and whether older ones exist (page on with ``before_id``)."""
    if not 1 <= limit <= MAX_PAGE:
        raise AdminError(f"limit must be in 1..{MAX_PAGE}", param="limit")
    entries = await repository.audit_entries(session, tenant_id=tenant_id, action=action,
                                             before_id=before_id, limit=limit + 1)
    return entries[:limit], len(entries) > limit
