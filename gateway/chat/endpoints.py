"""Thin route for ``POST /v1/chat/completions`` (``gateway.openai.answers.add_generation_route``)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.chat.schemas import ChatCompletionRequest
from gateway.chat.service import start_chat_completion
from gateway.openai.answers import add_generation_route

router = APIRouter()
add_generation_route(router, "/chat/completions", ChatCompletionRequest, start_chat_completion,
                     name="chat_completions", summary="Create a chat completion")
