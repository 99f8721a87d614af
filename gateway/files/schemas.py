"""OpenAI's file objects (``OpenAIFile``, ``ListFilesResponse``, ``DeleteFileResponse``) and upload fields.

Timestamps are UNIX seconds. ``status`` is always ``processed`` (a file row exists only once its bytes
are stored). Purposes: uploads are ``batch`` (the only input this platform consumes); batch results are
``batch_output``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from tollgate.models import File

# ``fine-tune``: a LoRA adapter bundle, as an archive (``gateway.adapters.bundle``), to register as a model.
UPLOAD_PURPOSES = ("batch", "fine-tune")
# OpenAI's bounds for ``expires_after.seconds``.
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 2_592_000


def unix(at: datetime | None) -> int | None:
    return int(at.timestamp()) if at is not None else None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None

    @classmethod
    def of(cls, row: File) -> FileObject:
        return cls(id=row.id, bytes=row.bytes, created_at=unix(row.created_at) or 0,
                   expires_at=unix(row.expires_at), filename=row.filename, purpose=row.purpose)


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class ListFilesQuery(BaseModel):
    purpose: str | None = None
    limit: int = Field(default=10_000, ge=1, le=10_000)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None
