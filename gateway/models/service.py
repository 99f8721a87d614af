"""The models a key may use: every configured model, narrowed by the key's ``allowed_models``, and its
tenant's adapter models (``gateway.adapters``), which it registers and deletes here too.

A model the key may not use, or another tenant's adapter, is reported exactly like one that does not
exist (404 ``model_not_found``), so keys cannot probe what else the platform serves.

Registering an adapter (``POST /v1/models``, a Tollgate extension: OpenAI creates ``ft:`` models by
fine-tuning jobs) takes a file uploaded with purpose ``fine-tune`` (the bundle as an archive), a
``name`` and the served ``base_model``; the answer is the new ``Model``. A key restricted by scopes
needs ``api.model.write`` to register or delete.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import anyio
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.adapters.bundle import unpack
from gateway.adapters.service import (
    AdapterModels,
    delete_adapter,
    get_adapter,
    is_adapter_model,
    list_adapters,
    tenant_slug,
)
from gateway.auth import Principal
from gateway.deps import GatewayRuntime
from gateway.errors import InvalidRequestError, ModelNotFoundError, PermissionDeniedError
from gateway.files.service import FileService
from gateway.files.storage import FileStorage
from gateway.generation.requests import lookup_model
from gateway.routing import ModelRoute
from tollgate.models import Adapter, Tenant
from tollgate.redis import publish_invalidation

OWNED_BY = "tollgate"
WRITE_SCOPE = "api.model.write"


def model_object(route: ModelRoute) -> dict[str, Any]:
    """OpenAI's ``Model``, plus what this platform can do with it (an extension field OpenAI's SDKs
    keep): ``capabilities.embeddings`` and the vectors' length, as its replicas report them."""
    info = route.info()
    dimensions = info.embedding_dimensions if info is not None else None
    return {"id": route.name, "object": "model", "created": route.created, "owned_by": OWNED_BY,
            "capabilities": {"chat_completions": True, "completions": True, "responses": True,
                             "embeddings": dimensions is not None, "embedding_dimensions": dimensions}}


def adapter_object(row: Adapter, owner: str) -> dict[str, Any]:
    """An adapter model's ``Model``: owned by its tenant, with its base and what the adapter changes."""
    return {"id": row.model, "object": "model", "created": int(row.created_at.timestamp()), "owned_by": owner,
            "base_model": row.base_model,
            "adapter": {"rank": row.rank, "target_modules": list(row.target_modules), "bytes": row.bytes},
            "capabilities": {"chat_completions": True, "completions": True, "responses": True,
                             "embeddings": False, "embedding_dimensions": None}}


def _models(runtime: GatewayRuntime) -> AdapterModels:
    assert runtime.adapter_models is not None
    return runtime.adapter_models


async def list_models(runtime: GatewayRuntime, principal: Principal, session: AsyncSession) -> dict[str, Any]:
    data = [model_object(r) for name, r in runtime.router.models.items() if principal.may_use(name)]
    tenant = await session.get(Tenant, principal.tenant_id)
    owner = tenant_slug(tenant) if tenant is not None else OWNED_BY
    for row in await list_adapters(session, principal.tenant_id):
        served = row.base_model in runtime.router.models  # a base no longer served: not callable, not listed
        if served and (principal.may_use(row.model) or principal.may_use(row.base_model)):
            data.append(adapter_object(row, owner))
    return {"object": "list", "data": data}


async def get_model(runtime: GatewayRuntime, principal: Principal, session: AsyncSession,
                    model: str) -> dict[str, Any]:
    route = await lookup_model(runtime, principal, model)
    if route.adapter is None:
        return model_object(route)
    tenant = await session.get(Tenant, principal.tenant_id)
    row = await get_adapter(session, principal.tenant_id, model)
    return adapter_object(row, tenant_slug(tenant) if tenant is not None else OWNED_BY)


def _may_write(principal: Principal) -> None:
    if principal.scopes is not None and WRITE_SCOPE not in principal.scopes:
        raise PermissionDeniedError(f"You have insufficient permissions for this operation. Missing scopes: "
                                    f"{WRITE_SCOPE}.")


def _field(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise InvalidRequestError(f"Missing required parameter: '{name}'.", param=name,
                                  code="missing_required_parameter")
    if not isinstance(value, str):
        raise InvalidRequestError(f"Invalid type for '{name}': expected a string.", param=name,
                                  code="invalid_type")
    return value


async def create_adapter_model(runtime: GatewayRuntime, principal: Principal, session: AsyncSession,
                               storage: FileStorage, body: Any) -> dict[str, Any]:
    """Register the bundle of file ``file_id`` as adapter ``name`` on ``base_model`` (see the module
    docstring); commits."""
    _may_write(principal)
    if not isinstance(body, dict):
        raise InvalidRequestError("The body must be a JSON object.", code="invalid_type")
    file_id, name, base = _field(body, "file_id"), _field(body, "name"), _field(body, "base_model")
    if not principal.may_use(base) or base not in runtime.router.models:
        raise ModelNotFoundError(base)
    files = FileService(session, storage, runtime.settings, principal.tenant_id)
    row = await files.get_row(file_id)
    if row.purpose != "fine-tune":
        raise InvalidRequestError(f"Invalid 'file_id': {file_id} has purpose '{row.purpose}'; an adapter "
                                  "bundle is uploaded with purpose 'fine-tune'.", param="file_id",
                                  code="invalid_value")
    tenant = await session.get(Tenant, principal.tenant_id)
    assert tenant is not None  # the principal's tenant exists
    limit = runtime.settings.adapter_max_bytes
    with tempfile.TemporaryDirectory(prefix="tollgate-bundle-") as scratch:
        archive = Path(scratch) / "bundle"
        with open(archive, "wb") as out:
            async for chunk in await files.content(file_id):
                out.write(chunk)
        adapter = await _models(runtime).register(session, tenant, name, base,
                                                  lambda dest: unpack(archive, dest, limit), file_id=file_id)
    return adapter_object(adapter, tenant_slug(tenant))


async def delete_adapter_model(runtime: GatewayRuntime, principal: Principal, session: AsyncSession,
                               model: str) -> dict[str, Any]:
    """``DELETE /v1/models/{model}``: the tenant's adapter model goes (OpenAI's ``DeleteModelResponse``);
    served models cannot be deleted through the API (404, as OpenAI answers for models one does not own)."""
    _may_write(principal)
    if not is_adapter_model(model):
        raise ModelNotFoundError(model)
    row = await delete_adapter(session, principal.tenant_id, model)
    await session.commit()
    await forget_adapter(runtime, row)
    return {"id": model, "object": "model", "deleted": True}


async def forget_adapter(runtime: GatewayRuntime, row: Adapter) -> None:
    """After a deletion's commit: the bundle leaves the store, and every gateway forgets the model."""
    await anyio.to_thread.run_sync(_models(runtime).store.remove, row.id)
    if runtime.adapters is not None:
        runtime.adapters.forget(row.model)
    try:
        await publish_invalidation(runtime.redis, adapter_model=row.model)
    except Exception:  # the other gateways forget it within their cache's ttl; the bundle is gone already
        pass
