"""Thin route for ``POST /v1/completions`` (body validated from bytes, like chat)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.completions.schemas import CompletionRequest
from gateway.completions.service import start_completion
from gateway.deps import CurrentPrincipal, RequestId, Runtime
from gateway.errors import parse_request_body
from gateway.openai.answers import respond
from gateway.openai.schemas import openapi_request_body

router = APIRouter()


@router.post("/completions", summary="Create a completion (legacy)",
             openapi_extra=openapi_request_body(CompletionRequest))
async def completions(request: Request, runtime: Runtime, principal: CurrentPrincipal,
                      request_id: RequestId) -> Any:
    body = parse_request_body(CompletionRequest, await request.body())
    answer = await start_completion(runtime, principal, request_id, body)
    return await respond(answer, request, stream=bool(body.stream))
