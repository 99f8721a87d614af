"""Thin route for ``POST /v1/completions`` (``gateway.openai.answers.add_generation_route``)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.completions.schemas import CompletionRequest
from gateway.completions.service import start_completion
from gateway.openai.answers import add_generation_route

router = APIRouter()
add_generation_route(router, "/completions", CompletionRequest, start_completion, name="completions",
                     summary="Create a completion (legacy)")
