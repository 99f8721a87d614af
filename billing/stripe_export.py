"""Usage → Stripe meter events, exactly once per (tenant, hour, revision), never drifting from the ledger.

Two phases, each its own transaction (the ``stripe_exports`` table is the outbox):

1. **Plan** (``plan_exports``): per attached tenant (``stripe_export_state`` row locked ``FOR UPDATE``, so
   planners of one tenant run one at a time), the ledger's cost per UTC hour in
   ``[since_hour, until)`` is compared with what earlier revisions covered for that hour. Each hour
   whose cost changed gets a row with the next revision: ``amount_pico_usd`` = the change,
   ``covered_pico_usd`` = the hour's cost now. The value to report carries the sub-micro-USD remainder
   across hours: with ``covered`` the tenant's total covered cost (pico-USD) and ``sent`` the net
   micro-USD reported, the row reports ``floor(covered / 1e6) - sent``. So after every plan
   ``0 <= covered - sent * 1e6 < 1e6``: the total sent never drifts from the ledger by a micro-USD.
   A negative change (the ledger of an hour shrank, e.g. an operator's correction) is never a second
   meter event: it becomes a customer balance credit in whole cents, and the part below a cent stays
   owed back until later usage absorbs it (the next reports are smaller by it; until then the
   bound above holds with ``-1e4 * 1e6 < covered - sent * 1e6``).
   The running hour can be planned (``until`` = now); usage arriving for an hour after it was
   exported makes a new revision with the delta. Meter events of revision 1 carry the hour as their
   timestamp; later revisions carry the planning time, so late usage lands on an open invoice.
2. **Send** (``send_pending``): pending rows in id order, each under a row lock (``SKIP LOCKED``: two
   runs never send one row at once). The Stripe call carries the row's ``identifier``
   (``<tenant>:<hour>:<revision>``) and an ``Idempotency-Key`` derived from it; only after Stripe
   accepted it is the row marked ``sent``. A crash or timeout between Stripe's answer and that commit
   leaves the row pending; the retry sends the same key (Stripe replays its first answer) or, once the
   key aged out, the same identifier (Stripe rejects it as a duplicate, which proves it was accepted):
   either way exactly one event per identifier. A 5xx or network error leaves the row pending.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import stripe
from sqlalchemy import Numeric, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.ledger import SessionFactory
from billing.rollups import hour_of
from tollgate.models import StripeExport, StripeExportState, StripeProvisioning, Tenant, UsageEvent

logger = logging.getLogger("tollgate.billing.stripe")

PICO_PER_MICRO = 1_000_000
MICRO_PER_CENT = 10_000
# Stripe accepts meter event timestamps within the past 35 days; stay a day inside that.
MAX_EVENT_AGE = timedelta(days=34)


def identifier_for(tenant_id: int, hour: datetime, revision: int) -> str:
    return f"{tenant_id}:{hour.astimezone(UTC).strftime('%Y-%m-%dT%H')}:{revision}"


def idempotency_key_for(identifier: str) -> str:
    return f"tollgate-export-{identifier}"


@dataclass
class PlanResult:
    tenants: int = 0
    rows: list[int] = field(default_factory=list)


async def _hourly_ledger(session: AsyncSession, tenant_id: int, start: datetime,
                         end: datetime) -> dict[datetime, int]:
    hour = func.date_trunc("hour", UsageEvent.created_at, "UTC")
    stmt = (select(hour, func.sum(cast(UsageEvent.cost_pico_usd, Numeric)))
            .where(UsageEvent.tenant_id == tenant_id, UsageEvent.created_at >= start,
                   UsageEvent.created_at < end)
            .group_by(hour))
    return {hour_of(h): int(total) for h, total in (await session.execute(stmt)).all()}


async def _covered(session: AsyncSession, tenant_id: int) -> dict[datetime, tuple[int, int]]:
    """Per hour: (cost covered by all revisions, last revision)."""
    stmt = (select(StripeExport.hour, func.sum(cast(StripeExport.amount_pico_usd, Numeric)),
                   func.max(StripeExport.revision))
            .where(StripeExport.tenant_id == tenant_id).group_by(StripeExport.hour))
    return {hour_of(h): (int(total), int(rev)) for h, total, rev in (await session.execute(stmt)).all()}


async def plan_tenant(session: AsyncSession, tenant: Tenant, until: datetime, now: datetime) -> list[int]:
    state = await session.scalar(select(StripeExportState)
                                 .where(StripeExportState.tenant_id == tenant.id).with_for_update())
    if state is None or tenant.stripe_customer_id is None:
        return []
    ledger = await _hourly_ledger(session, tenant.id, state.since_hour, until)
    covered = await _covered(session, tenant.id)
    total = int(state.covered_pico_usd)
    sent = int(state.sent_micro_usd)
    planned: list[StripeExport] = []
    for hour in sorted(ledger.keys() | {h for h in covered if state.since_hour <= h < until}):
        already, last_revision = covered.get(hour, (0, 0))
        delta = ledger.get(hour, 0) - already
        if delta == 0:
            continue
        total += delta
        target = total // PICO_PER_MICRO
        revision = last_revision + 1
        if delta > 0:  # more usage: report what the carry makes whole micro-USD (maybe 0)
            kind, value = "meter_event", max(0, target - sent)
        else:
            kind, value = "credit", -(max(0, sent - target) // MICRO_PER_CENT) * MICRO_PER_CENT
        sent += value
        identifier = identifier_for(tenant.id, hour, revision)
        row = StripeExport(
            tenant_id=tenant.id, hour=hour, revision=revision, kind=kind, identifier=identifier,
            stripe_customer_id=tenant.stripe_customer_id, amount_pico_usd=delta,
            covered_pico_usd=already + delta, value_micro_usd=value,
            # A credit smaller than a cent has nothing to send: only the carry changes.
            status="sent" if kind == "credit" and value == 0 else "pending",
            sent_at=now if kind == "credit" and value == 0 else None,
        )
        session.add(row)
        planned.append(row)
    if planned:
        state.covered_pico_usd = Decimal(total)
        state.sent_micro_usd = Decimal(sent)
        state.updated_at = now
        await session.flush()
    return [row.id for row in planned]


async def plan_exports(session: AsyncSession, *, until: datetime, now: datetime | None = None,
                       tenant_ids: list[int] | None = None) -> PlanResult:
    """Plan the rows for every attached tenant's usage before ``until``; the caller commits."""
    now = now or datetime.now(UTC)
    stmt = (select(Tenant).join(StripeExportState, StripeExportState.tenant_id == Tenant.id)
            .where(Tenant.stripe_customer_id.is_not(None)).order_by(Tenant.id))
    if tenant_ids is not None:
        stmt = stmt.where(Tenant.id.in_(tenant_ids))
    result = PlanResult()
    for tenant in (await session.scalars(stmt)).all():
        result.tenants += 1
        result.rows += await plan_tenant(session, tenant, until, now)
    return result


@dataclass
class SendResult:
    sent: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


def _is_duplicate_identifier(exc: stripe.StripeError) -> bool:
    error = getattr(exc, "error", None)
    code = getattr(error, "code", None) or getattr(exc, "code", None)
    message = str(getattr(error, "message", None) or exc.user_message or "")
    return code == "resource_already_exists" or ("identifier" in message and "already exists" in message)


async def _send_one(client: stripe.StripeClient, row: StripeExport, event_name: str) -> str | None:
    options: stripe.RequestOptions = {"idempotency_key": idempotency_key_for(row.identifier)}
    if row.kind == "credit":
        cents = -row.value_micro_usd // MICRO_PER_CENT
        txn = await client.v1.customers.balance_transactions.create_async(
            row.stripe_customer_id,
            {"amount": -cents, "currency": "usd",
             "description": f"Tollgate usage correction {row.identifier}",
             "metadata": {"tollgate_identifier": row.identifier}}, options)
        return txn.id
    # Derived from the row alone, so every retry sends the same parameters under its Idempotency-Key.
    stamp = max(row.hour if row.revision == 1 else row.created_at, row.created_at - MAX_EVENT_AGE)
    await client.v1.billing.meter_events.create_async(
        {"event_name": event_name, "identifier": row.identifier, "timestamp": int(stamp.timestamp()),
         "payload": {"stripe_customer_id": row.stripe_customer_id, "value": str(row.value_micro_usd)}},
        options)
    return row.identifier


async def send_pending(sessions: SessionFactory, client: stripe.StripeClient, *,
                       limit: int = 1000) -> SendResult:
    """Send pending rows, the least tried first, then the oldest; each row's outcome is committed on its
    own. Least tried first: rows Stripe keeps refusing (a customer deleted there) stay pending with their
    error, and must not hold back every other tenant's usage once there are ``limit`` of them."""
    result = SendResult()
    async with sessions() as session:
        provisioning = await session.get(StripeProvisioning, 1)
        ids = list((await session.scalars(select(StripeExport.id).where(StripeExport.status == "pending")
                                          .order_by(StripeExport.attempts, StripeExport.id)
                                          .limit(limit))).all())
    if not ids:
        return result
    if provisioning is None:
        raise RuntimeError("stripe_exports has pending rows but Stripe is not provisioned")
    for row_id in ids:
        async with sessions() as session:
            row = await session.scalar(select(StripeExport).where(StripeExport.id == row_id,
                                                                  StripeExport.status == "pending")
                                       .with_for_update(skip_locked=True))
            if row is None:
                continue  # sent meanwhile, or another run is sending it right now
            row.attempts += 1
            try:
                object_id = await _send_one(client, row, provisioning.meter_event_name)
            except stripe.InvalidRequestError as exc:
                if row.kind == "meter_event" and _is_duplicate_identifier(exc):
                    object_id = row.identifier  # Stripe already holds this very event
                else:
                    _failed(result, row, exc)
                    continue
            except stripe.StripeError as exc:  # 5xx, rate limit, network: retried next run
                _failed(result, row, exc)
                continue
            row.status, row.sent_at, row.stripe_object_id, row.last_error = (
                "sent", datetime.now(UTC), object_id, None)
            result.sent += 1
    return result


def _failed(result: SendResult, row: StripeExport, exc: Exception) -> None:
    row.last_error = f"{type(exc).__name__}: {exc}"[:2000]
    result.failed += 1
    result.errors.append(f"{row.identifier}: {row.last_error}")
    logger.warning("stripe export %s not sent (attempt %d): %s", row.identifier, row.attempts, exc)


@dataclass
class ExportResult:
    planned: int
    sent: int
    failed: int
    errors: list[str]


async def export_to_stripe(sessions: SessionFactory, client: stripe.StripeClient, *, until: datetime,
                           now: datetime | None = None) -> ExportResult:
    """Plan (committed) then send: the beat task and ``tollgate billing export-stripe``."""
    async with sessions() as session:
        plan = await plan_exports(session, until=until, now=now)
    sent = await send_pending(sessions, client)
    return ExportResult(planned=len(plan.rows), sent=sent.sent, failed=sent.failed, errors=sent.errors)
