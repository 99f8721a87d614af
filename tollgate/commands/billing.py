"""``tollgate billing setup-stripe|attach|export-stripe``: Stripe provisioning and usage export.

- ``setup-stripe`` creates, once, the billing meter (``tollgate_usage``, sum of micro-USD), a product and
  a metered monthly price on that meter; a rerun prints what exists.
- ``attach TENANT`` creates the tenant's Stripe customer and subscription (once) and starts exporting
  its usage from the current hour. Tenants never attached are never exported.
- ``alert-webhook TENANT URL|--clear`` sets where budget alerts are POSTed and prints the signing secret.
- ``export-stripe [--until now|ISO]`` plans and sends what the ledger holds before ``--until`` (by default
  what the beat would: whole hours that ended ``stripe_export_lag_s`` ago; ``now`` includes the running
  hour). Running it twice, or next to the beat, sends nothing twice.
Needs ``TOLLGATE_STRIPE_API_KEY`` (and ``TOLLGATE_STRIPE_API_BASE`` for a Stripe-compatible endpoint).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TypeVar

import click

if TYPE_CHECKING:
    import stripe
    from sqlalchemy.ext.asyncio import AsyncSession

    from billing.stripe_billing import Attachment, Provisioning
    from billing.stripe_export import ExportResult
    from tollgate.db import Database
    from tollgate.settings import Settings

T = TypeVar("T")
Work = Callable[["Database", "Settings", "stripe.StripeClient"], Awaitable[T]]


def _until(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    if value == "now":
        return datetime.now(UTC)
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise click.BadParameter(f"'now' or an ISO 8601 date/time, got {value!r}", ctx=ctx,
                                 param=param) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _run(work: Work[T]) -> T:
    """Run ``work(db, settings, client)`` and turn configuration and Stripe errors into CLI errors."""
    import stripe

    from billing.stripe_billing import StripeNotConfigured, TenantNotFound, open_stripe
    from tollgate.db import Database
    from tollgate.settings import get_settings

    settings = get_settings()

    async def main() -> T:
        async with open_stripe(settings) as client:
            db = Database.from_settings(settings)
            try:
                return await work(db, settings, client)
            finally:
                await db.dispose()

    try:
        return asyncio.run(main())
    except (StripeNotConfigured, TenantNotFound, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from exc
    except stripe.StripeError as exc:
        raise click.ClickException(f"Stripe: {exc.user_message or exc}") from exc


@click.group()
def billing() -> None:
    """Stripe provisioning and usage export."""


@billing.command("setup-stripe")
def setup_stripe() -> None:
    """Create the Stripe meter, product and metered price (once)."""
    from billing.stripe_billing import setup_stripe as setup

    async def work(db: Database, settings: Settings, client: stripe.StripeClient) -> Provisioning:
        async with db.session() as session:
            return await setup(session, client, settings)

    done = _run(work)
    state = "created" if done.created else "already provisioned"
    click.echo(f"{state}: meter {done.meter_id} (event {done.meter_event_name}), product {done.product_id}, "
               f"price {done.price_id}")


@billing.command("attach")
@click.argument("tenant")
def attach(tenant: str) -> None:
    """Create TENANT's (name or id) Stripe customer and subscription and start exporting its usage."""
    from billing.stripe_billing import attach_tenant

    async def work(db: Database, settings: Settings, client: stripe.StripeClient) -> Attachment:
        async with db.session() as session:
            return await attach_tenant(session, client, tenant)

    done = _run(work)
    state = "attached" if done.created else "already attached"
    click.echo(f"tenant {done.tenant_id} {state}: customer {done.customer_id}, "
               f"subscription {done.subscription_id}")


@billing.command("alert-webhook")
@click.argument("tenant")
@click.argument("url", required=False)
@click.option("--clear", is_flag=True, help="Stop sending budget alerts to a URL (the dashboard flag stays).")
def alert_webhook(tenant: str, url: str | None, clear: bool) -> None:
    """Send TENANT's budget alerts (80 % and 100 % of its monthly budget) to URL, signed; prints the
    signing secret for the tenant's receiver (header Tollgate-Signature: t=...,v1=HMAC-SHA256)."""
    from billing.alerts import set_alert_webhook
    from billing.statements import StatementTenantNotFound, find_tenant_id
    from tollgate.commands._async import run_in_session
    from tollgate.settings import get_settings

    if clear == (url is not None):
        raise click.UsageError("give either URL or --clear")

    async def work(session: AsyncSession) -> str | None:
        try:
            return await set_alert_webhook(session, await find_tenant_id(session, tenant), url)
        except (StatementTenantNotFound, ValueError) as exc:
            raise click.ClickException(str(exc)) from exc

    secret = run_in_session(get_settings(), work)
    click.echo(f"alerts go to {url}; signing secret: {secret}" if url else "alert webhook cleared")


@billing.command("export-stripe")
@click.option("--until", callback=_until, help="'now' (includes the running hour) or an ISO 8601 time "
                                               "[whole hours that ended stripe_export_lag_s ago].")
def export_stripe(until: datetime | None) -> None:
    """Send usage to Stripe as meter events, exactly once per tenant, hour and revision."""
    from billing.jobs import export_horizon
    from billing.stripe_export import export_to_stripe

    async def work(db: Database, settings: Settings, client: stripe.StripeClient) -> ExportResult:
        return await export_to_stripe(db.session, client, until=until or export_horizon(settings))

    result = _run(work)
    click.echo(f"planned {result.planned}, sent {result.sent}, pending after errors {result.failed}")
    for error in result.errors:
        click.echo(f"  {error}", err=True)
    if result.failed:
        raise SystemExit(1)
