"""Thin routes for ``/v1/batches``, and the ``gateway.app`` extension that serves them.

Extension: ``router`` and ``lifespan`` (a ``BatchDispatcher`` on ``app.state.batch_dispatch``, sending
to the Celery broker). Each route runs one unit of work; Celery messages are sent only after its
commit, so a worker never looks for a batch that is not committed yet. If sending fails after the
commit, beat's sweep picks the batch up (it re-sends validation and kicks runs for open batches).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, FastAPI, Query, Request
from starlette.responses import Response

from gateway.batches.dispatch import BatchDispatcher
from gateway.batches.schemas import CreateBatchRequest, ListBatchesQuery
from gateway.batches.service import BatchService
from gateway.deps import CurrentPrincipal
from gateway.errors import parse_request_body

logger = logging.getLogger("tollgate.gateway.batches")

router = APIRouter(prefix="/v1", tags=["batches"])


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.batch_dispatch = BatchDispatcher(app.state.settings, app.state.redis)
    yield


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def _after_commit(what: str, batch_id: str, send: Any) -> None:
    try:
        await send(batch_id)
    except Exception:  # committed: beat's sweep will pick it up
        logger.exception("could not send %s for batch %s; the sweep will retry", what, batch_id)


@router.post("/batches", summary="Create a batch")
async def create_batch(request: Request, principal: CurrentPrincipal) -> Response:
    body = parse_request_body(CreateBatchRequest, await request.body())
    async with request.app.state.db.session() as session:
        batch = await BatchService(session, request.app.state.settings, principal.tenant_id,
                                   principal.api_key_id).create(body)
    await _after_commit("validation", batch["id"], request.app.state.batch_dispatch.validate)
    return _json(batch)


@router.get("/batches", summary="List batches")
async def list_batches(request: Request, principal: CurrentPrincipal,
                       query: Annotated[ListBatchesQuery, Query()]) -> Response:
    async with request.app.state.db.session() as session:
        body = await BatchService(session, request.app.state.settings, principal.tenant_id).list(
            after=query.after, limit=query.limit)
    return _json(body)


@router.get("/batches/{batch_id}", summary="Retrieve a batch")
async def retrieve_batch(batch_id: str, request: Request, principal: CurrentPrincipal) -> Response:
    async with request.app.state.db.session() as session:
        body = await BatchService(session, request.app.state.settings, principal.tenant_id).retrieve(batch_id)
    return _json(body)


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch")
async def cancel_batch(batch_id: str, request: Request, principal: CurrentPrincipal) -> Response:
    async with request.app.state.db.session() as session:
        body, started = await BatchService(session, request.app.state.settings,
                                           principal.tenant_id).cancel(batch_id)
    if started:
        await _after_commit("finalization", batch_id, request.app.state.batch_dispatch.finalize)
    return _json(body)
