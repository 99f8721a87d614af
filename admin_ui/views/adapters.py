"""A tenant's LoRA adapters on its page: register a PEFT bundle (its ``adapter_config.json`` and
``adapter_model.safetensors``, uploaded in one form) on a served model, and delete one.

Both go through ``gateway.adapters`` as the API and ``tollgate adapters`` do: the bundle is checked by a
replica of the base before it is recorded (a refusal is re-rendered with the replica's reason), and each
change is an audit row with the admin as actor. A deleted adapter's bundle leaves the store after the
commit, and every gateway is told.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import APIRouter, Request
from fastapi import Path as PathParam
from sqlalchemy import select
from starlette.datastructures import UploadFile
from starlette.responses import Response

from admin_ui.session import CurrentAdmin, check_csrf
from admin_ui.views.tenants import TenantId, tenant_page
from admin_ui.web import redirect, render, unit_of_work
from gateway.adapters.bundle import BUNDLE_FILES, BundleError, copy_dir
from gateway.adapters.service import delete_adapter
from gateway.adapters.store import AdapterStore, store_root
from gateway.errors import GatewayError
from gateway.models.service import forget_adapter
from tollgate.models import Adapter, Tenant

router = APIRouter(prefix="/admin/tenants")
CHUNK = 1024 * 1024


async def _save(upload: UploadFile, path: Path, budget: list[int]) -> None:
    with open(path, "wb") as out:
        while chunk := await upload.read(CHUNK):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise BundleError("the adapter bundle is larger than the platform's limit")
            out.write(chunk)


@router.post("/{tenant_id}/adapters", include_in_schema=False)
async def register_adapter(request: Request, admin: CurrentAdmin, tenant_id: TenantId) -> Response:
    fields = await check_csrf(request)
    form = await request.form()
    runtime = getattr(request.app.state, "gateway", None)  # absent when the public API is not installed
    if runtime is None or runtime.adapter_models is None:
        return await tenant_page(request, admin, tenant_id, code=503,
                                 errors=["This gateway serves no models."])
    uploads = {name: form.get(name) for name in BUNDLE_FILES}
    missing = [name for name, upload in uploads.items()
               if not isinstance(upload, UploadFile) or not upload.filename]
    if missing:
        return await tenant_page(request, admin, tenant_id, code=400,
                                 errors=[f"Choose the bundle's {' and '.join(missing)}."])
    limit = runtime.settings.adapter_max_bytes
    try:
        with tempfile.TemporaryDirectory(prefix="tollgate-bundle-") as scratch:
            budget = [limit]
            for name, upload in uploads.items():
                assert isinstance(upload, UploadFile)
                await _save(upload, Path(scratch) / name, budget)
            async with unit_of_work(request) as session:
                tenant = await session.get(Tenant, tenant_id)
                if tenant is None:
                    return render(request, "error.html", {"title": "Not found",
                                                          "message": f"no tenant {tenant_id}"},
                                  status=404, admin=admin)
                row = await runtime.adapter_models.register(
                    session, tenant, fields.get("name", "").strip(), fields.get("base_model", ""),
                    lambda dest: copy_dir(Path(scratch), dest, limit), actor=admin.actor)
    except BundleError as exc:
        return await tenant_page(request, admin, tenant_id, code=400,
                                 errors=[f"Invalid adapter bundle: {exc}"])
    except GatewayError as exc:
        return await tenant_page(request, admin, tenant_id, errors=[exc.message], code=exc.status)
    return await tenant_page(request, admin, tenant_id,
                             notice=f"Adapter registered: the tenant calls it as model {row.model}.")


@router.post("/{tenant_id}/adapters/{adapter_id}/delete", include_in_schema=False)
async def remove_adapter(request: Request, admin: CurrentAdmin, tenant_id: TenantId,
                         adapter_id: Annotated[str, PathParam(max_length=32)]) -> Response:
    await check_csrf(request)
    runtime = getattr(request.app.state, "gateway", None)
    try:
        async with unit_of_work(request) as session:
            model = (await session.execute(select(Adapter.model).where(
                Adapter.id == adapter_id, Adapter.tenant_id == tenant_id))).scalar()
            row = await delete_adapter(session, tenant_id, model or adapter_id, actor=admin.actor)
    except GatewayError as exc:
        return render(request, "error.html", {"title": "Not found", "message": exc.message},
                      status=exc.status, admin=admin)
    if runtime is not None and runtime.adapter_models is not None:
        await forget_adapter(runtime, row)
    else:  # no public API here: only the bundle to remove
        await anyio.to_thread.run_sync(AdapterStore(store_root(request.app.state.settings)).remove, row.id)
    return redirect(request, f"/admin/tenants/{tenant_id}", done="adapter_deleted")
