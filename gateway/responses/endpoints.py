"""Thin routes of the Responses API: ``POST /v1/responses`` (body validated from bytes, like chat), and
``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` and
``POST /v1/responses/{id}/cancel`` on stored responses. ``background: true`` is queued, not run here."""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from gateway.deps import CurrentPrincipal, RequestId, Runtime
from gateway.errors import parse_request_body
from gateway.openai.answers import respond
from gateway.openai.schemas import openapi_request_body
from gateway.responses.schemas import CreateResponseRequest, ListInputItemsQuery
from gateway.responses.service import (
    cancel_response,
    delete_response,
    get_response,
    list_input_items,
    queue_response,
    start_response,
)

router = APIRouter()


@router.post("/responses", summary="Create a model response",
             openapi_extra=openapi_request_body(CreateResponseRequest))
async def create_response(request: Request, runtime: Runtime, principal: CurrentPrincipal,
                          request_id: RequestId) -> Any:
    body = parse_request_body(CreateResponseRequest, await request.body())
    if body.background:
        return _json(await queue_response(runtime, principal, body))
    answer = await start_response(runtime, principal, request_id, body)
    return await respond(answer, request, stream=bool(body.stream))


@router.get("/responses/{response_id}", summary="Retrieve a model response")
async def retrieve_response(response_id: str, runtime: Runtime, principal: CurrentPrincipal) -> Response:
    return _json(await get_response(runtime, principal.tenant_id, response_id))


@router.post("/responses/{response_id}/cancel", summary="Cancel a background response")
async def cancel(response_id: str, runtime: Runtime, principal: CurrentPrincipal) -> Response:
    return _json(await cancel_response(runtime, principal.tenant_id, response_id))


@router.delete("/responses/{response_id}", summary="Delete a model response")
async def remove_response(response_id: str, runtime: Runtime, principal: CurrentPrincipal) -> Response:
    return _json(await delete_response(runtime, principal.tenant_id, response_id))


@router.get("/responses/{response_id}/input_items", summary="List a response's input items")
async def input_items(response_id: str, runtime: Runtime, principal: CurrentPrincipal,
                      query: Annotated[ListInputItemsQuery, Query()]) -> Response:
    return _json(await list_input_items(runtime, principal.tenant_id, response_id, limit=query.limit,
                                        order=query.order, after=query.after))


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")
