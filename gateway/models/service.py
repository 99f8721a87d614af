"""The models a key may use: every configured model, narrowed by the key's ``allowed_models``.

A model the key may not use is reported exactly like one that does not exist (404
``model_not_found``), so keys cannot probe what else the platform serves.
"""

from __future__ import annotations

from typing import Any

from gateway.auth import Principal
from gateway.deps import GatewayRuntime
from gateway.errors import ModelNotFoundError
from gateway.routing import ModelRoute

OWNED_BY = "tollgate"


def model_object(route: ModelRoute) -> dict[str, Any]:
    """OpenAI's ``Model``, plus what this platform can do with it (an extension field OpenAI's SDKs
    keep): ``capabilities.embeddings`` and the vectors' length, as its replicas report them."""
    info = route.info()
    dimensions = info.embedding_dimensions if info is not None else None
    return {"id": route.name, "object": "model", "created": route.created, "owned_by": OWNED_BY,
            "capabilities": {"chat_completions": True, "completions": True, "responses": True,
                             "embeddings": dimensions is not None, "embedding_dimensions": dimensions}}


def list_models(runtime: GatewayRuntime, principal: Principal) -> dict[str, Any]:
    data = [model_object(r) for name, r in runtime.router.models.items() if principal.may_use(name)]
    return {"object": "list", "data": data}


def get_model(runtime: GatewayRuntime, principal: Principal, model: str) -> dict[str, Any]:
    route = runtime.router.models.get(model)
    if route is None or not principal.may_use(model):
        raise ModelNotFoundError(model)
    return model_object(route)
