"""Thin route for ``POST /v1/responses`` (body validated from bytes, like chat)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.deps import CurrentPrincipal, RequestId, Runtime
from gateway.errors import parse_request_body
from gateway.openai.answers import respond
from gateway.openai.schemas import openapi_request_body
from gateway.responses.schemas import CreateResponseRequest
from gateway.responses.service import start_response

router = APIRouter()


@router.post("/responses", summary="Create a model response",
             openapi_extra=openapi_request_body(CreateResponseRequest))
async def create_response(request: Request, runtime: Runtime, principal: CurrentPrincipal,
                          request_id: RequestId) -> Any:
    body = parse_request_body(CreateResponseRequest, await request.body())
    answer = await start_response(runtime, principal, request_id, body)
    return await respond(answer, request, stream=bool(body.stream))
