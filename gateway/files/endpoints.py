"""Thin routes for ``/v1/files``, and the ``gateway.app`` extension that serves them.

Extension: ``router`` (the routes) and ``lifespan`` (puts the storage backend on
``app.state.file_storage``). Each route runs one unit of work (``app.state.db.session()``: commit on
success) and does its storage side effects after the commit: bytes of a deleted file are removed only
once the row is gone; an upload whose row could not be committed has its bytes removed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from starlette.datastructures import UploadFile
from starlette.responses import Response, StreamingResponse

from gateway.deps import CurrentPrincipal
from gateway.errors import InvalidRequestError
from gateway.files.schemas import ListFilesQuery
from gateway.files.service import FileService
from gateway.files.storage import FileStorage, create_storage

UPLOAD_CHUNK_BYTES = 1024 * 1024

router = APIRouter(prefix="/v1", tags=["files"])


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    app.state.file_storage = create_storage(app.state.settings)
    yield


async def get_storage(request: Request) -> FileStorage:  # async: no thread-pool hand-off
    return request.app.state.file_storage


Storage = Annotated[FileStorage, Depends(get_storage)]


def _json(model: Any) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


async def _chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(UPLOAD_CHUNK_BYTES):
        yield chunk


@router.post("/files", summary="Upload a file")
async def create_file(request: Request, principal: CurrentPrincipal, storage: Storage) -> Response:
    form = await request.form(max_files=1, max_fields=8)
    try:
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise InvalidRequestError("Missing required parameter: 'file'.", param="file",
                                      code="missing_required_parameter")
        purpose = form.get("purpose")
        anchor = form.get("expires_after[anchor]")
        seconds = form.get("expires_after[seconds]")
        db = request.app.state.db
        stored = None
        try:
            async with db.session() as session:
                service = FileService(session, storage, request.app.state.settings, principal.tenant_id)
                body, stored = await service.upload(
                    filename=upload.filename, content=_chunks(upload),
                    purpose=purpose if isinstance(purpose, str) else None,
                    expires_anchor=anchor if isinstance(anchor, str) else None,
                    expires_seconds=seconds if isinstance(seconds, str) else None)
        except BaseException:
            if stored is not None:
                await storage.delete(stored.storage_key)
            raise
        return _json(body)
    finally:
        await form.close()


@router.get("/files", summary="List files")
async def list_files(request: Request, principal: CurrentPrincipal, storage: Storage,
                     query: Annotated[ListFilesQuery, Query()]) -> Response:
    async with request.app.state.db.session() as session:
        service = FileService(session, storage, request.app.state.settings, principal.tenant_id)
        body = await service.list(purpose=query.purpose, after=query.after, limit=query.limit,
                                  order=query.order)
    return _json(body)


@router.get("/files/{file_id}", summary="Retrieve a file")
async def retrieve_file(file_id: str, request: Request, principal: CurrentPrincipal,
                        storage: Storage) -> Response:
    async with request.app.state.db.session() as session:
        body = await FileService(session, storage, request.app.state.settings,
                                 principal.tenant_id).retrieve(file_id)
    return _json(body)


@router.get("/files/{file_id}/content", summary="Download a file's content")
async def file_content(file_id: str, request: Request, principal: CurrentPrincipal,
                       storage: Storage) -> Response:
    async with request.app.state.db.session() as session:
        chunks = await FileService(session, storage, request.app.state.settings,
                                   principal.tenant_id).content(file_id)
    return StreamingResponse(chunks, media_type="application/octet-stream")


@router.delete("/files/{file_id}", summary="Delete a file")
async def delete_file(file_id: str, request: Request, principal: CurrentPrincipal,
                      storage: Storage) -> Response:
    async with request.app.state.db.session() as session:
        body, stored = await FileService(session, storage, request.app.state.settings,
                                         principal.tenant_id).delete(file_id)
    await storage.delete(stored.storage_key)
    return _json(body)
