"""Thin route for ``POST /v1/chat/completions``: parse and validate the body, hand it to the service.

The body is validated straight from bytes by pydantic (``model_validate_json``) instead of FastAPI's
body parameter: one pass, and every failure (bad JSON included) becomes OpenAI's 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.chat.schemas import ChatCompletionRequest
from gateway.chat.service import start_chat_completion
from gateway.deps import CurrentPrincipal, RequestId, Runtime
from gateway.errors import parse_request_body
from gateway.openai.answers import respond
from gateway.openai.schemas import openapi_request_body

router = APIRouter()


@router.post("/chat/completions", summary="Create a chat completion",
             openapi_extra=openapi_request_body(ChatCompletionRequest))
async def chat_completions(request: Request, runtime: Runtime, principal: CurrentPrincipal,
                           request_id: RequestId) -> Any:
    body = parse_request_body(ChatCompletionRequest, await request.body())
    answer = await start_chat_completion(runtime, principal, request_id, body)
    return await respond(answer, request, stream=bool(body.stream))
