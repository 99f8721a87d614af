"""Thin route for ``POST /v1/embeddings`` (``gateway.openai.answers.add_generation_route``; never
streamed)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.embeddings.schemas import CreateEmbeddingRequest
from gateway.embeddings.service import start_embeddings
from gateway.openai.answers import add_generation_route

router = APIRouter()
add_generation_route(router, "/embeddings", CreateEmbeddingRequest, start_embeddings,
                     name="create_embeddings", summary="Create embeddings")
