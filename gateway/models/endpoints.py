"""Thin routes for ``/v1/models``: list, retrieve, and a tenant's adapter models' registration
(``POST``, a Tollgate extension) and deletion (``DELETE``, as OpenAI deletes fine-tuned models)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.deps import CurrentPrincipal, Runtime
from gateway.errors import InvalidRequestError
from gateway.models import service

router = APIRouter()


@router.get("/models", summary="List models")
async def list_models(request: Request, runtime: Runtime, principal: CurrentPrincipal) -> dict[str, Any]:
    async with request.app.state.db.session() as session:
        return await service.list_models(runtime, principal, session)


@router.post("/models", summary="Register a LoRA adapter as a model (Tollgate extension)")
async def create_model(request: Request, runtime: Runtime, principal: CurrentPrincipal) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise InvalidRequestError("The body is not valid JSON.", code="invalid_json") from None
    async with request.app.state.db.session() as session:
        return await service.create_adapter_model(runtime, principal, session, request.app.state.file_storage,
                                                  body)


@router.get("/models/{model:path}", summary="Retrieve a model")
async def retrieve_model(model: str, request: Request, runtime: Runtime,
                         principal: CurrentPrincipal) -> dict[str, Any]:
    async with request.app.state.db.session() as session:
        return await service.get_model(runtime, principal, session, model)


@router.delete("/models/{model:path}", summary="Delete a fine-tuned (adapter) model")
async def delete_model(model: str, request: Request, runtime: Runtime,
                       principal: CurrentPrincipal) -> dict[str, Any]:
    async with request.app.state.db.session() as session:
        return await service.delete_adapter_model(runtime, principal, session, model)
