"""Thin routes for ``GET /v1/models`` and ``GET /v1/models/{model}``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.deps import CurrentPrincipal, Runtime
from gateway.models import service

router = APIRouter()


@router.get("/models", summary="List models")
async def list_models(runtime: Runtime, principal: CurrentPrincipal) -> dict[str, Any]:
    return service.list_models(runtime, principal)


@router.get("/models/{model:path}", summary="Retrieve a model")
async def retrieve_model(model: str, runtime: Runtime, principal: CurrentPrincipal) -> dict[str, Any]:
    return service.get_model(runtime, principal, model)
