"""``tollgate tenants ...`` and ``tollgate keys ...``: admin operations from the command line.

They call ``gateway.tenants.service`` in one unit of work each (commit on success) and record the
change in ``audit_log`` with the actor ``cli:<user>``. ``keys create`` prints the new secret key as the
LAST line of its output (scripts take ``| tail -n 1``); it is shown only once. Revocations and tenant
changes are announced on Redis (``tollgate:invalidate``) after the commit when Redis is configured, so
running gateways drop cached keys at once.

``tenants purge-cache`` drops the tenant's prompt cache on every replica of the configured pools
(``settings.pools``: the CLI reaches them itself, it runs in no gateway), one line per replica, then the
total; it exits 1 when a replica was not purged (run it again to retry those).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

import click

from tollgate.commands._async import cli_actor, run_in_session
from tollgate.settings import Settings, get_settings

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from tollgate.models import ApiKey, Tenant


def _announce(settings: Settings, **what: int | str) -> None:
    if not settings.redis_url:
        return
    from tollgate.redis import create_redis, publish_invalidation

    async def main() -> None:
        redis = create_redis(settings)
        try:
            await publish_invalidation(redis, **what)
        finally:
            await redis.aclose()

    try:
        asyncio.run(main())
    except Exception as e:  # the change is committed; caches still expire after key_cache_ttl_s
        click.echo(f"warning: could not notify gateways through Redis ({e})", err=True)


def _limit(value: int | None) -> str:
    return "unlimited" if value is None else str(value)


def _blocks(count: int) -> str:
    return f"{count} block{'' if count == 1 else 's'}"


def _echo_tenant(tenant: object) -> None:
    from gateway.tenants.schemas import PICO_PER_USD, TenantRead

    t = TenantRead.model_validate(tenant)
    budget = ("unlimited" if t.monthly_budget_pico_usd is None
              else f"${t.monthly_budget_pico_usd / PICO_PER_USD:,.2f}")
    status = t.status + (f" ({t.suspended_reason})" if t.suspended_reason else "")
    click.echo(f"tenant {t.id} {t.name!r}: tier={t.tier} status={status} tpm={_limit(t.tpm_limit)} "
               f"rpm={_limit(t.rpm_limit)} max_concurrency={_limit(t.max_concurrency)} "
               f"batch_tpd={_limit(t.batch_tpd_limit)} monthly_budget={budget}")


@click.group()
def tenants() -> None:
    """Create and manage tenants."""


@tenants.command("create")
@click.argument("name")
@click.option("--tier", default="default", show_default=True, help="priority, default or flex.")
@click.option("--tpm", type=click.IntRange(min=0), default=None, help="Tokens per minute (default: none).")
@click.option("--rpm", type=click.IntRange(min=0), default=None, help="Requests per minute.")
@click.option("--max-concurrency", type=click.IntRange(min=0), default=None, help="Concurrent streams.")
@click.option("--batch-tpd", type=click.IntRange(min=0), default=None, help="Batch tokens per day.")
@click.option("--monthly-budget-usd", default=None, help="Monthly spend cap in USD, e.g. 250 or 99.50.")
@click.option("--stripe-customer-id", default=None)
def create_tenant(name: str, tier: str, tpm: int | None, rpm: int | None, max_concurrency: int | None,
                  batch_tpd: int | None, monthly_budget_usd: str | None,
                  stripe_customer_id: str | None) -> None:
    """Create tenant NAME."""
    from pydantic import ValidationError

    from gateway.tenants.schemas import TenantCreate, pico_usd_from_usd
    from gateway.tenants.service import TenantService

    try:
        budget = None if monthly_budget_usd is None else pico_usd_from_usd(monthly_budget_usd)
        data = TenantCreate(name=name, tier=tier, tpm_limit=tpm, rpm_limit=rpm,
                            max_concurrency=max_concurrency, batch_tpd_limit=batch_tpd,
                            monthly_budget_pico_usd=budget,
                            stripe_customer_id=stripe_customer_id)
    except (ValidationError, ValueError) as e:
        raise click.BadParameter(str(e)) from e
    settings = get_settings()
    actor = cli_actor()
    tenant = run_in_session(settings, lambda s: TenantService(s, settings).create_tenant(data, actor=actor))
    _echo_tenant(tenant)


@tenants.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=100, show_default=True)
@click.option("--offset", type=click.IntRange(min=0), default=0, show_default=True)
def list_tenants(limit: int, offset: int) -> None:
    """List tenants by id."""
    from gateway.tenants.service import TenantService

    settings = get_settings()
    for tenant in run_in_session(settings, lambda s: TenantService(s, settings).list_tenants(limit=limit,
                                                                                            offset=offset)):
        _echo_tenant(tenant)


@tenants.command("suspend")
@click.argument("tenant")
@click.option("--reason", type=click.Choice(["admin", "billing"]), default="admin", show_default=True)
def suspend_tenant(tenant: str, reason: str) -> None:
    """Suspend TENANT (name or id): its keys stop working."""
    from gateway.tenants.service import TenantService

    settings = get_settings()

    async def work(session: AsyncSession) -> Tenant:
        service = TenantService(session, settings)
        return await service.suspend((await service.get_tenant(tenant)).id, reason, actor=cli_actor())

    row = run_in_session(settings, work)
    _announce(settings, tenant_id=row.id)
    _echo_tenant(row)


@tenants.command("resume")
@click.argument("tenant")
@click.option("--force", is_flag=True, help="Also lift a billing suspension (recorded in the audit log).")
def resume_tenant(tenant: str, force: bool) -> None:
    """Lift the admin suspension of TENANT (name or id); a billing suspension needs --force."""
    from gateway.admin.service import reactivate_tenant
    from gateway.tenants.service import TenantService

    settings = get_settings()

    async def work(session: AsyncSession) -> Tenant:
        tenant_id = (await TenantService(session, settings).get_tenant(tenant)).id
        return await reactivate_tenant(session, tenant_id, actor=cli_actor(), force=force)

    row = run_in_session(settings, work)
    _announce(settings, tenant_id=row.id)
    _echo_tenant(row)


@tenants.command("purge-cache")
@click.argument("tenant")
@click.option("--note", default=None, help="Why (kept in the audit log), e.g. a deletion request's id.")
def purge_cache(tenant: str, note: str | None) -> None:
    """Drop TENANT's (name or id) cached prompt blocks on every engine replica, in every tier."""
    from gateway.admin.service import CachePurge, purge_tenant_cache
    from gateway.tenants.service import TenantService

    settings = get_settings()

    async def work(session: AsyncSession) -> CachePurge:
        tenant_id = (await TenantService(session, settings).get_tenant(tenant)).id
        return await purge_tenant_cache(session, tenant_id, settings=settings, actor=cli_actor(), note=note)

    purge = run_in_session(settings, work)
    for replica in purge.replicas:
        outcome = (f"{_blocks(replica.purged_blocks or 0)} purged" if replica.error is None
                   else f"NOT purged: {replica.error}")
        click.echo(f"{replica.url}\t{outcome}")
    click.echo(f"tenant {purge.tenant_id}: {_blocks(purge.purged_blocks)} purged on "
               f"{len(purge.replicas) - len(purge.failed)} of {len(purge.replicas)} replicas")
    if purge.failed:
        raise click.ClickException(f"{len(purge.failed)} replica(s) not purged; run the command again "
                                   "to retry them")


@click.group()
def keys() -> None:
    """Create, list and revoke API keys."""


@keys.command("create")
@click.argument("tenant")
@click.option("--name", default="", help="A label for the key.")
@click.option("--expires-at", type=click.DateTime(["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%d %H:%M:%S%z"]),
              default=None, help="Expiry with a timezone, e.g. 2030-01-01T00:00:00+0000.")
@click.option("--allowed-model", "allowed_models", multiple=True, help="Restrict to this model (repeatable).")
def create_key(tenant: str, name: str, expires_at: datetime | None, allowed_models: tuple[str, ...]) -> None:
    """Create an API key for TENANT (name or id); the secret key is the last line printed."""
    from pydantic import ValidationError

    from gateway.tenants.schemas import ApiKeyCreate
    from gateway.tenants.service import ApiKeyService, TenantService

    try:
        data = ApiKeyCreate(name=name, expires_at=expires_at, allowed_models=list(allowed_models) or None)
    except ValidationError as e:
        raise click.BadParameter(str(e)) from e
    settings = get_settings()

    async def work(session: AsyncSession) -> tuple[str, int, str, str]:
        owner = await TenantService(session, settings).get_tenant(tenant)
        key, full_key = await ApiKeyService(session, settings).create_key(owner.id, data, actor=cli_actor())
        return owner.name, key.id, key.prefix, full_key

    tenant_name, key_id, prefix, full_key = run_in_session(settings, work)
    click.echo(f"created API key {key_id} (id {prefix}) for tenant {tenant_name!r}; it is shown only once:")
    click.echo(full_key)


@keys.command("list")
@click.argument("tenant")
def list_keys(tenant: str) -> None:
    """List TENANT's keys (never their secrets)."""
    from gateway.tenants.keys import display_prefix
    from gateway.tenants.service import ApiKeyService, TenantService

    settings = get_settings()

    async def work(session: AsyncSession) -> Sequence[ApiKey]:
        owner = await TenantService(session, settings).get_tenant(tenant)
        return await ApiKeyService(session, settings).list_keys(owner.id)

    for key in run_in_session(settings, work):
        state = "revoked" if key.revoked_at else "active"
        expiry = f" expires {key.expires_at.isoformat()}" if key.expires_at else ""
        click.echo(f"{key.id}\t{display_prefix(key.prefix)}\t{state}{expiry}\t{key.name}")


@keys.command("revoke")
@click.argument("tenant")
@click.argument("key_id", type=int)
def revoke_key(tenant: str, key_id: int) -> None:
    """Revoke TENANT's key KEY_ID (the numeric id from `keys list`)."""
    from gateway.tenants.service import ApiKeyService, TenantService

    settings = get_settings()

    async def work(session: AsyncSession) -> ApiKey:
        owner = await TenantService(session, settings).get_tenant(tenant)
        return await ApiKeyService(session, settings).revoke_key(owner.id, key_id, actor=cli_actor())

    key = run_in_session(settings, work)
    _announce(settings, key_id=key.prefix)
    click.echo(f"revoked API key {key.id}")
