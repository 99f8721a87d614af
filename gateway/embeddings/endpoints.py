"""Thin route for ``POST /v1/embeddings`` (body validated from bytes, like chat)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.deps import CurrentPrincipal, RequestId, Runtime
from gateway.embeddings.schemas import CreateEmbeddingRequest
from gateway.embeddings.service import start_embeddings
from gateway.errors import parse_request_body
from gateway.openai.answers import respond
from gateway.openai.schemas import openapi_request_body

router = APIRouter()


@router.post("/embeddings", summary="Create embeddings",
             openapi_extra=openapi_request_body(CreateEmbeddingRequest))
async def create_embeddings(request: Request, runtime: Runtime, principal: CurrentPrincipal,
                            request_id: RequestId) -> Any:
    body = parse_request_body(CreateEmbeddingRequest, await request.body())
    answer = await start_embeddings(runtime, principal, request_id, body)
    return await respond(answer, request, stream=False)
