"""Tenant and API key logic. Services flush through the repositories and never commit: the caller's
unit of work (``Database.session()`` / the request dependency) commits or rolls back.

Invariants: a tenant's tier is one of ``settings.tiers``; a suspended tenant always has a reason and an
active one never does; a key's secret leaves this module only in the return value of ``create_key``;
every change is recorded in ``audit_log`` with its actor, inside the same transaction.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.tenants.keys import generate_key, hash_key, parse_key, verify_key
from gateway.tenants.repository import ApiKeyRepository, AuditLogRepository, TenantRepository
from gateway.tenants.schemas import ApiKeyCreate, TenantCreate, TenantUpdate
from tollgate.models import BIGINT_MAX, SUSPENDED_REASONS, ApiKey, Tenant
from tollgate.settings import Settings


class TenantError(Exception):
    """Base of the domain errors below; ``status`` is the HTTP status an API should answer."""

    status = 400


class TenantNotFound(TenantError):
    status = 404


class TenantNameTaken(TenantError):
    status = 409


class InvalidTenantData(TenantError):
    status = 400


class TenantStateConflict(TenantError):
    """The change would undo a state another rule guards (a billing suspension hidden by an admin one)."""

    status = 409


class ApiKeyNotFound(TenantError):
    status = 404


class InvalidApiKey(TenantError):
    """The key is malformed, unknown, revoked, expired, or its tenant is suspended."""

    status = 401


class TenantService:
    def __init__(self, session: AsyncSession, settings: Settings) -> None:
        self.session = session
        self.settings = settings
        self.tenants = TenantRepository(session)
        self.audit = AuditLogRepository(session)

    def _check_tier(self, tier: str) -> None:
        if tier not in self.settings.tiers:
            known = ", ".join(self.settings.tiers)
            raise InvalidTenantData(f"unknown tier {tier!r}; configured tiers: {known}")

    async def create_tenant(self, data: TenantCreate, *, actor: str) -> Tenant:
        self._check_tier(data.tier)
        if await self.tenants.get_by_name(data.name) is not None:
            raise TenantNameTaken(f"a tenant named {data.name!r} already exists")
        try:
            async with self.session.begin_nested():
                tenant = await self.tenants.add(Tenant(**data.model_dump()))
        except IntegrityError as e:  # the name (a concurrent create won the race) or the Stripe customer
            constraint = getattr(getattr(e.orig, "diag", None), "constraint_name", None) or ""
            if "stripe_customer_id" in constraint:
                raise TenantStateConflict(f"the Stripe customer {data.stripe_customer_id!r} belongs to "
                                          "another tenant") from e
            raise TenantNameTaken(f"a tenant named {data.name!r} already exists") from e
        await self.audit.record(actor, "tenant.create", tenant_id=tenant.id, details=data.model_dump())
        return tenant

    async def get_tenant(self, ref: int | str) -> Tenant:
        """A tenant by id (int, or a string of digits) or by name."""
        tenant = None
        if (isinstance(ref, int) or ref.isdigit()) and 0 <= int(ref) <= BIGINT_MAX:  # beyond: no such id
            tenant = await self.tenants.get(int(ref))
        if tenant is None and isinstance(ref, str):
            tenant = await self.tenants.get_by_name(ref)
        if tenant is None:
            raise TenantNotFound(f"no tenant {ref!r}")
        return tenant

    async def list_tenants(self, *, limit: int = 100, offset: int = 0) -> Sequence[Tenant]:
        if not 1 <= limit <= 1000 or offset < 0:
            raise InvalidTenantData("limit must be in 1..1000 and offset >= 0")
        return await self.tenants.list(limit=limit, offset=offset)

    async def update_tenant(self, tenant_id: int, data: TenantUpdate, *, actor: str) -> Tenant:
        tenant = await self.get_tenant(tenant_id)
        changes = data.model_dump(include=data.model_fields_set)
        if "tier" in changes:
            if changes["tier"] is None:
                raise InvalidTenantData("tier cannot be cleared")
            self._check_tier(changes["tier"])
        for field, value in changes.items():
            setattr(tenant, field, value)
        await self.tenants.flush(tenant)
        await self.audit.record(actor, "tenant.update", tenant_id=tenant.id, details=changes)
        return tenant

    async def suspend(self, tenant_id: int, reason: str, *, actor: str) -> Tenant:
        if reason not in SUSPENDED_REASONS:
            raise InvalidTenantData(f"reason must be one of {SUSPENDED_REASONS}, got {reason!r}")
        tenant = await self.get_tenant(tenant_id)
        if tenant.status == "suspended" and tenant.suspended_reason == reason:
            return tenant  # already so: nothing changes, nothing is recorded
        if tenant.status == "suspended" and tenant.suspended_reason == "billing":
            # As the admin API (``gateway.admin.service.suspend_tenant``): replaced by an admin suspension,
            # a billing one could be lifted by a plain resume, without --force.
            raise TenantStateConflict(f"tenant {tenant.id} is suspended for billing; an admin suspension "
                                      "would hide it (resume --force lifts a billing suspension)")
        tenant.status, tenant.suspended_reason = "suspended", reason
        await self.tenants.flush(tenant)
        await self.audit.record(actor, "tenant.suspend", tenant_id=tenant.id, details={"reason": reason})
        return tenant


class ApiKeyService:
    def __init__(self, session: AsyncSession, settings: Settings) -> None:
        self.session = session
        self.settings = settings
        self.keys = ApiKeyRepository(session)
        self.tenants = TenantRepository(session)
        self.audit = AuditLogRepository(session)

    def _secret(self) -> str:
        return self.settings.key_hash_secret.get_secret_value()

    async def create_key(self, tenant_id: int, data: ApiKeyCreate, *, actor: str) -> tuple[ApiKey, str]:
        """A new key for the tenant: ``(row, full_key)``. The full key is not stored anywhere."""
        if await self.tenants.get(tenant_id) is None:
            raise TenantNotFound(f"no tenant {tenant_id!r}")
        if data.expires_at is not None and data.expires_at <= datetime.now(UTC):
            raise InvalidTenantData("expires_at must be in the future")
        key_id, _secret, full_key = generate_key()
        key = await self.keys.add(ApiKey(
            tenant_id=tenant_id, name=data.name, prefix=key_id, key_hash=hash_key(full_key, self._secret()),
            scopes=data.scopes, allowed_models=data.allowed_models, expires_at=data.expires_at,
        ))
        await self.audit.record(actor, "api_key.create", tenant_id=tenant_id,
                                details={"api_key_id": key.id, "prefix": key_id, "name": data.name})
        return key, full_key

    async def list_keys(self, tenant_id: int) -> Sequence[ApiKey]:
        return await self.keys.list_for_tenant(tenant_id)

    async def revoke_key(self, tenant_id: int, key_id: int, *, actor: str) -> ApiKey:
        key = await self.keys.revoke_for_tenant(tenant_id, key_id, datetime.now(UTC))
        if key is None:
            raise ApiKeyNotFound(f"tenant {tenant_id} has no API key {key_id}")
        await self.audit.record(actor, "api_key.revoke", tenant_id=tenant_id, details={"api_key_id": key_id})
        return key

    async def resolve(self, full_key: str, *, now: datetime | None = None) -> tuple[ApiKey, Tenant]:
        """The key row and tenant of a usable key, else ``InvalidApiKey`` (one message for every reason
        a caller could probe, except a suspended tenant, which the owner needs to know about)."""
        try:
            key_id, _ = parse_key(full_key)
        except ValueError as e:
            raise InvalidApiKey("Incorrect API key provided.") from e
        found = await self.keys.get_by_prefix(key_id)
        if found is None or not verify_key(full_key, found[0].key_hash, self._secret()):
            raise InvalidApiKey("Incorrect API key provided.")
        key, tenant = found
        now = now or datetime.now(UTC)
        if key.revoked_at is not None or (key.expires_at is not None and key.expires_at <= now):
            raise InvalidApiKey("Incorrect API key provided.")
        if tenant.status != "active":
            raise InvalidApiKey(f"Tenant {tenant.name!r} is suspended ({tenant.suspended_reason}).")
        return key, tenant
