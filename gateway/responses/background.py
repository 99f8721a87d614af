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

A response whose worker died stays ``in_progress`` until beat's retention sweep marks it ``failed``
after ``request_timeout_s`` (a response never runs longer).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import select, type_coerce, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.auth import Principal
from gateway.deps import GatewayRuntime
from gateway.errors import GatewayError
from gateway.openai.streaming import collect_until
from gateway.responses.output import STATUS_CANCELLED, STATUS_FAILED, STATUS_IN_PROGRESS, STATUS_QUEUED
from gateway.responses.schemas import CreateResponseRequest
from gateway.responses.service import start_response
from tollgate.models import ApiKey, StoredResponse, Tenant

logger = logging.getLogger("tollgate.gateway.responses.background")


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
    async with runtime.sessions() as session, session.begin():
        claimed = await _claim(session, response_id)
        if claimed is None:
            return None
        row, principal = claimed
        request, created_at = dict(row.request or {}), int(row.body["created_at"])
    body = CreateResponseRequest.model_validate(request)
    request_id = f"req_{uuid.uuid4().hex}"
    try:
        answer = await start_response(runtime, principal, request_id, body, response_id=response_id,
                                      created_at=created_at)
    except GatewayError as exc:
        await _fail(runtime, response_id, exc)
        return STATUS_FAILED
    try:
        await collect_until(lambda: _cancelled(runtime, response_id), answer.generation, answer.body)
    except GatewayError:
        pass  # stored as failed by the response itself
    async with runtime.sessions() as session:
        return await session.scalar(select(StoredResponse.status).where(StoredResponse.id == response_id))


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

