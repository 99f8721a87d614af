"""Thin route for ``POST /v1/completions`` (body validated from bytes, like chat)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from gateway.completions.service import create_completion
from gateway.deps import CurrentPrincipal, RequestId, Runtime
from gateway.errors import from_pydantic
from gateway.openai.completion_schemas import CompletionRequest
from gateway.openai.schemas import openapi_request_body

router = APIRouter()


@router.post("/completions", summary="Create a completion (legacy)",
             openapi_extra=openapi_request_body(CompletionRequest))
async def completions(request: Request, runtime: Runtime, principal: CurrentPrincipal,
                      request_id: RequestId) -> Any:
    try:
        body = CompletionRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise from_pydantic(exc) from None
    return await create_completion(runtime, principal, request_id, body, request)
