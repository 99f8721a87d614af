"""Background responses, run by a worker (``responses.background``, ``gateway.responses.tasks``).

``POST /v1/responses`` with ``background: true`` stores the response ``queued`` with its request
(``service.queue_response``) and sends the task. ``run_background`` then:

- claims it: ``queued`` → ``in_progress`` under the row lock, so a redelivered task or a second worker
  runs it at most once, and one cancelled while queued never starts;
- runs it as the key that created it, at the ``flex`` tier, through the same generation service as
  every request (admitted, billed and metered alike), and stores it as it ends
  (``service.start_response`` with the queued id);
- stops it when ``POST /v1/responses/{id}/cancel`` marks it ``cancelled``: the row's status is polled
  every ``responses_cancel_poll_s``, and the generation is interrupted like a client hang-up (billed for
  what it generated; the stored object keeps that output, status ``cancelled``);
- an error before any engine work (rate limit, overload, no replica) ends it ``failed`` with the reason.

A running response holds a lease in Redis (``lease_key``, ``background_lease_ttl_s``, renewed at a third of
it), set before its claim commits, so a response seen ``in_progress`` without its lease has lost its
worker (SIGKILLed, its host gone). Beat's ``responses.requeue`` sweep (every ``batch_sweep_interval_s``)
puts such a response back to ``queued`` and sends its task again, up to ``MAX_ATTEMPTS`` runs in all, then
marks it ``failed``: a worker's death costs the tenant a wait, not the response. The same sweep sends the
task of a response still ``queued`` after a lease period again (a dead worker may hold it unacknowledged
until the broker's visibility timeout, an hour). Every run of a response
has the same request id (``request_id_of``), the ledger's idempotency key, so a response run twice (its
first worker died after billing, before storing) is billed once. As a last resort the retention sweep
still fails a response ``in_progress`` after ``request_timeout_s`` (a response never runs longer).

The final state is stored before the run is metered (a tenant must find its answer once billed), so a
worker killed in between would leave a response its tenant reads, with its usage, and no ledger row. The
final update therefore also stores the usage record about to be metered (``usage_pending``), which the
worker clears once metered; the same sweep meters a record left on a response whose lease expired
(``meter_pending``). A cancelled response, whose engine count comes after its final update, is not
covered: its worker meters it as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import orjson
from redis.asyncio import Redis
from sqlalchemy import select, type_coerce, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncSession

from billing.outbox import UsageRecord, append_usage
from gateway.auth import Principal
from gateway.deps import GatewayRuntime
from gateway.errors import GatewayError
from gateway.openai.streaming import collect_until
from gateway.responses.output import STATUS_CANCELLED, STATUS_FAILED, STATUS_IN_PROGRESS, STATUS_QUEUED
from gateway.responses.schemas import CreateResponseRequest
from gateway.responses.service import start_response
from gateway.responses.store import SessionFactory
from tollgate.models import ApiKey, StoredResponse, Tenant

logger = logging.getLogger("tollgate.gateway.responses.background")

MAX_ATTEMPTS = 3


def lease_key(response_id: str) -> str:
    return f"tollgate:responses:running:{response_id}"


def attempts_key(response_id: str) -> str:
    return f"tollgate:responses:attempts:{response_id}"


def resent_key(response_id: str) -> str:
    return f"tollgate:responses:resent:{response_id}"


def request_id_of(response_id: str) -> str:
    """The request id of every run of a background response (the ledger's idempotency key)."""
    return f"req_{response_id}"


@dataclass(eq=False)
class BackgroundRuntime(GatewayRuntime):
    """The interactive pipeline in a worker process: no API keys to authenticate (the stored response
    names its tenant and key)."""

    authenticates: bool = False


async def _claim(session: AsyncSession, response_id: str) -> tuple[StoredResponse, Principal] | None:
    row = await session.scalar(select(StoredResponse).where(StoredResponse.id == response_id)
                               .with_for_update())
    if row is None or row.status != STATUS_QUEUED or row.request is None:
        return None
    tenant = await session.get_one(Tenant, row.tenant_id)
    key = await session.get(ApiKey, row.api_key_id) if row.api_key_id is not None else None
    row.status = STATUS_IN_PROGRESS
    row.body = {**row.body, "status": STATUS_IN_PROGRESS}
    return row, Principal.of_owner(tenant, key)


async def run_background(runtime: GatewayRuntime, response_id: str) -> str | None:
    """Run a queued background response to its end; returns its final status (None: not run here)."""
    ttl_ms = max(1, round(runtime.settings.background_lease_ttl_s * 1000))
    holder = uuid.uuid4().hex
    async with runtime.sessions() as session, session.begin():
        claimed = await _claim(session, response_id)
        if claimed is None:
            return None
        # The lease exists before anyone can see the claim: in_progress without a lease means a dead worker.
        await runtime.redis.set(lease_key(response_id), holder, px=ttl_ms)
        row, principal = claimed
        request, created_at = dict(row.request or {}), int(row.body["created_at"])
    renewal = asyncio.create_task(_renew(runtime, response_id, holder, ttl_ms))
    try:
        return await _run(runtime, response_id, principal, request, created_at)
    finally:
        renewal.cancel()
        with contextlib.suppress(Exception):
            await runtime.redis.delete(lease_key(response_id))


async def _run(runtime: GatewayRuntime, response_id: str, principal: Principal, request: dict,
               created_at: int) -> str | None:
    body = CreateResponseRequest.model_validate(request)
    try:
        answer = await start_response(runtime, principal, request_id_of(response_id), body,
                                      response_id=response_id, created_at=created_at)
    except GatewayError as exc:
        await _fail(runtime, response_id, exc)
        return STATUS_FAILED
    try:
        await collect_until(lambda: _cancelled(runtime, response_id), answer.generation, answer.body)
    except GatewayError:
        pass  # stored as failed by the response itself
    async with runtime.sessions() as session:
        # Metered (or kept in the usage spool) by now: the copy stored with the final state is done with.
        await session.execute(update(StoredResponse).where(StoredResponse.id == response_id,
                                                           StoredResponse.usage_pending.is_not(None))
                              .values(usage_pending=None))
        await session.commit()
        return await session.scalar(select(StoredResponse.status).where(StoredResponse.id == response_id))


async def _renew(runtime: GatewayRuntime, response_id: str, holder: str, ttl_ms: int) -> None:
    """Keep the lease alive while the run goes on (Redis down for a moment: the next renewal retries)."""
    while True:
        await asyncio.sleep(ttl_ms / 3000)
        with contextlib.suppress(Exception):
            await runtime.redis.set(lease_key(response_id), holder, px=ttl_ms)


async def requeue_orphans(sessions: SessionFactory, redis: Redis, send: Callable[[str], Awaitable[None]],
                          resend_after_ms: int = 30_000) -> dict[str, int]:
    """Background responses ``in_progress`` without a lease (their worker died): back to ``queued`` and
    sent again, or ``failed`` after ``MAX_ATTEMPTS`` runs; those ``queued`` for longer than
    ``resend_after_ms``: their task sent again. Returns the counts."""
    async with sessions() as session:
        running = (await session.scalars(select(StoredResponse.id).where(
            StoredResponse.status == STATUS_IN_PROGRESS, StoredResponse.request.is_not(None)))).all()
        waiting = (await session.scalars(select(StoredResponse.id).where(
            StoredResponse.status == STATUS_QUEUED, StoredResponse.request.is_not(None),
            StoredResponse.created_at < datetime.now(UTC) - timedelta(milliseconds=resend_after_ms)))).all()
    counts = {"requeued": 0, "failed": 0, "resent": 0, "metered": await meter_pending(sessions, redis)}
    for response_id in waiting:
        # Its task may be held, unacknowledged, by a worker that died (the broker gives it back only after
        # its visibility timeout, an hour): send it again, at most once per lease period. A duplicate task
        # is harmless (only a queued response is claimed).
        if await redis.set(resent_key(response_id), 1, px=max(1000, resend_after_ms), nx=True):
            try:
                await send(response_id)
            except Exception:
                logger.exception("could not send background response %s again", response_id)
                await redis.delete(resent_key(response_id))
                continue
            counts["resent"] += 1
    for response_id in running:
        if await redis.exists(lease_key(response_id)):
            continue
        status = await _set_orphan_status(sessions, redis, response_id)
        if status == STATUS_QUEUED:
            try:
                await send(response_id)
            except Exception:  # the broker is down: in_progress again, for the next sweep to retry
                logger.exception("could not send background response %s again", response_id)
                await _set_status(sessions, response_id, STATUS_QUEUED, STATUS_IN_PROGRESS)
                await redis.decr(attempts_key(response_id))
                continue
            counts["requeued"] += 1
        elif status == STATUS_FAILED:
            counts["failed"] += 1
    if any(counts.values()):
        logger.warning("background responses of dead workers: %(requeued)d queued again, %(failed)d failed, "
                       "%(resent)d tasks sent again, %(metered)d metered", counts)
    return counts


async def meter_pending(sessions: SessionFactory, redis: Redis) -> int:
    """Meter the usage records that workers stored with a background response's final state and died
    before metering (the row ended, its lease gone): each is appended to the usage outbox, then cleared.
    One its worker did append (it died before clearing) is appended again: the ledger keeps a request id
    once. Returns how many were appended."""
    async with sessions() as session:
        pending = (await session.execute(select(StoredResponse.id, StoredResponse.usage_pending).where(
            StoredResponse.usage_pending.is_not(None),
            StoredResponse.status.not_in((STATUS_QUEUED, STATUS_IN_PROGRESS))))).all()
    metered = 0
    for response_id, raw in pending:
        if await redis.exists(lease_key(response_id)):
            continue  # its worker is still at it
        record = UsageRecord.from_json(orjson.dumps(raw))
        await append_usage(redis, record)  # Redis down: raises; the next sweep tries again
        async with sessions() as session:
            await session.execute(update(StoredResponse).where(StoredResponse.id == response_id)
                                  .values(usage_pending=None))
            await session.commit()
        logger.warning("metered background response %s (request %s) for its worker, which died first",
                       response_id, record.request_id)
        metered += 1
    return metered


async def _set_orphan_status(sessions: SessionFactory, redis: Redis,
                             response_id: str) -> str | None:
    async with sessions() as session:  # a unit of work: commits on exit
        row = await session.scalar(select(StoredResponse).where(StoredResponse.id == response_id)
                                   .with_for_update())
        if row is None or row.status != STATUS_IN_PROGRESS or await redis.exists(lease_key(response_id)):
            return None
        attempts = await redis.incr(attempts_key(response_id))
        await redis.expire(attempts_key(response_id), 24 * 3600)
        if attempts >= MAX_ATTEMPTS:
            row.status = STATUS_FAILED
            message = f"The worker running this response stopped {attempts} times."
            row.body = {**row.body, "status": STATUS_FAILED,
                        "error": {"code": "server_error", "message": message}}
        else:
            row.status = STATUS_QUEUED
            row.body = {**row.body, "status": STATUS_QUEUED}
        return row.status


async def _set_status(sessions: SessionFactory, response_id: str, old: str, new: str) -> None:
    async with sessions() as session:  # a unit of work: commits on exit
        row = await session.scalar(select(StoredResponse).where(StoredResponse.id == response_id)
                                   .with_for_update())
        if row is not None and row.status == old:
            row.status = new
            row.body = {**row.body, "status": new}


async def _cancelled(runtime: GatewayRuntime, response_id: str) -> None:
    """Returns once the response has been cancelled (``POST .../cancel``)."""
    while True:
        await asyncio.sleep(runtime.settings.responses_cancel_poll_s)
        async with runtime.sessions() as session:
            status = await session.scalar(select(StoredResponse.status)
                                          .where(StoredResponse.id == response_id))
        if status in (None, STATUS_CANCELLED):
            return


async def _fail(runtime: GatewayRuntime, response_id: str, exc: GatewayError) -> None:
    code = "rate_limit_exceeded" if exc.status == 429 else "server_error"
    async with runtime.sessions() as session, session.begin():
        row = await session.scalar(select(StoredResponse).where(StoredResponse.id == response_id)
                                   .with_for_update())
        if row is not None and row.status == STATUS_IN_PROGRESS:
            row.status = STATUS_FAILED
            row.body = {**row.body, "status": STATUS_FAILED, "error": {"code": code, "message": exc.message}}


async def fail_abandoned(session: AsyncSession, now: datetime, max_run_s: float) -> int:
    """Background responses still ``in_progress`` after ``max_run_s`` (their worker died) → ``failed``."""
    result = await session.execute(
        update(StoredResponse)
        .where(StoredResponse.status == STATUS_IN_PROGRESS, StoredResponse.request.is_not(None),
               StoredResponse.created_at < now - timedelta(seconds=max_run_s))
        .values(status=STATUS_FAILED, body=StoredResponse.body.op("||")(type_coerce(
            {"status": STATUS_FAILED, "error": {"code": "server_error",
                                                "message": "The worker running this response stopped."}},
            JSONB))))
    return int(result.rowcount)  # type: ignore[attr-defined]

