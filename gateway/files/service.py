"""Files: upload (stream to storage, then record), list, retrieve, download, delete, retention.

Invariants:
- A ``files`` row exists only for bytes fully stored: the upload is written (atomically) first, the
  row added after; if the unit of work then fails, the orphaned object is deleted by the endpoint.
- Deleting removes the row in the unit of work and the bytes after the commit (``StoredFile``
  returned for the caller to delete), so a failed transaction never loses a file's bytes.
- Uploads: purpose ``batch``: a ``.jsonl`` name, at most ``files_max_bytes``, not empty, UTF-8; purpose
  ``fine-tune``: a LoRA adapter bundle as an archive (``.zip``, ``.tar``, ``.tar.gz``, ``.tgz``), at most
  ``adapter_max_bytes``, not empty; what it holds is checked when a model is created from it
  (``gateway.adapters``).
  Line-level validation (JSON, ``custom_id``, url, body) happens when a batch is created from the file,
  so a bad line is reported with its line number there, like OpenAI does.
- Every file expires ``files_retention_s`` after creation (or ``expires_after.seconds``, OpenAI's bounds);
  beat deletes expired files (``delete_expired``).
"""

from __future__ import annotations

import codecs
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.adapters.bundle import ARCHIVE_SUFFIXES, is_archive_name
from gateway.errors import InvalidRequestError, NotFoundError, RequestTooLargeError
from gateway.files.repository import FileRepository, delete_expired_files
from gateway.files.schemas import (
    MAX_EXPIRES_AFTER_S,
    MIN_EXPIRES_AFTER_S,
    UPLOAD_PURPOSES,
    FileDeleted,
    FileList,
    FileObject,
)
from gateway.files.storage import FileMissing, FileStorage, FileTooLarge
from tollgate.models import File
from tollgate.settings import Settings

DELETE_BATCH = 500


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex[:24]}"


def storage_key(tenant_id: int, file_id: str) -> str:
    return f"{tenant_id}/{file_id}"


@dataclass(frozen=True, slots=True)
class StoredFile:
    """A file's storage object (what is left to delete once its row is gone)."""

    id: str
    storage_key: str


class FileNotFound(NotFoundError):
    def __init__(self, file_id: str) -> None:
        super().__init__(f"No such File object: {file_id}", param="file_id")


def _check_purpose(purpose: str | None) -> str:
    if not purpose:
        raise InvalidRequestError("Missing required parameter: 'purpose'.", param="purpose",
                                  code="missing_required_parameter")
    if purpose not in UPLOAD_PURPOSES:
        raise InvalidRequestError(
            f"Invalid 'purpose': '{purpose}' is not supported by this platform; use 'batch' (a batch's "
            "input) or 'fine-tune' (a LoRA adapter bundle).",
            param="purpose", code="invalid_value")
    return purpose


def _check_expires_after(anchor: str | None, seconds: str | int | None) -> int | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequestError("Invalid 'expires_after[anchor]': only 'created_at' is supported.",
                                  param="expires_after[anchor]", code="invalid_value")
    try:
        value = int(seconds)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise InvalidRequestError("Invalid 'expires_after[seconds]': expected an integer.",
                                  param="expires_after[seconds]", code="invalid_type") from None
    if not MIN_EXPIRES_AFTER_S <= value <= MAX_EXPIRES_AFTER_S:
        raise InvalidRequestError(
            f"Invalid 'expires_after[seconds]': must be between {MIN_EXPIRES_AFTER_S} and "
            f"{MAX_EXPIRES_AFTER_S}.", param="expires_after[seconds]", code="invalid_value")
    return value


async def _checked_utf8(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    decoder = codecs.getincrementaldecoder("utf-8")()
    try:
        async for chunk in chunks:
            decoder.decode(chunk)
            yield chunk
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise InvalidRequestError("Invalid file: a JSONL file must be UTF-8 text.", param="file",
                                  code="invalid_file") from None


class FileService:
    def __init__(self, session: AsyncSession, storage: FileStorage, settings: Settings,
                 tenant_id: int) -> None:
        self.repo = FileRepository(session, tenant_id)
        self.storage = storage
        self.settings = settings
        self.tenant_id = tenant_id

    async def upload(self, *, filename: str | None, content: AsyncIterable[bytes], purpose: str | None,
                     expires_anchor: str | None = None, expires_seconds: str | int | None = None,
                     ) -> tuple[FileObject, StoredFile]:
        """Store and record an upload; returns the object and its storage (delete it if the unit of
        work fails)."""
        purpose = _check_purpose(purpose)
        lifetime = _check_expires_after(expires_anchor, expires_seconds)
        name = (filename or "").rsplit("/", 1)[-1]
        if purpose == "fine-tune":
            if not is_archive_name(name):
                raise InvalidRequestError(
                    "Invalid file format for an adapter bundle: upload PEFT's adapter_config.json and "
                    f"adapter_model.safetensors as one archive ({', '.join(ARCHIVE_SUFFIXES)})",
                    param="file", code="invalid_file_format")
            checked, limit = content, self.settings.adapter_max_bytes
        else:
            if not name.endswith(".jsonl"):
                raise InvalidRequestError("Invalid file format for Batch API. Must be .jsonl", param="file",
                                          code="invalid_file_format")
            checked, limit = _checked_utf8(content), self.settings.files_max_bytes
        file_id = new_file_id()
        key = storage_key(self.tenant_id, file_id)
        try:
            size = await self.storage.write(key, checked, limit)
        except FileTooLarge as exc:
            raise RequestTooLargeError(f"File too large: the limit is {exc.max_bytes} bytes.",
                                       param="file") from None
        if size == 0:
            await self.storage.delete(key)
            raise InvalidRequestError("Invalid file: the file is empty.", param="file", code="invalid_file")
        now = datetime.now(UTC)
        row = await self.repo.add(File(
            id=file_id, tenant_id=self.tenant_id, purpose=purpose, filename=name[:512], bytes=size,
            storage_key=key, created_at=now, expires_at=now + timedelta(
                seconds=lifetime if lifetime is not None else self.settings.files_retention_s)))
        return FileObject.of(row), StoredFile(file_id, key)

    async def record_output(self, *, file_id: str, filename: str, size: int, key: str,
                            lifetime_s: float) -> File:
        """Record a batch output already written to ``key`` (the batch runner)."""
        now = datetime.now(UTC)
        return await self.repo.add(File(id=file_id, tenant_id=self.tenant_id, purpose="batch_output",
                                        filename=filename, bytes=size, storage_key=key, created_at=now,
                                        expires_at=now + timedelta(seconds=lifetime_s)))

    async def get_row(self, file_id: str) -> File:
        row = await self.repo.get(file_id)
        if row is None:
            raise FileNotFound(file_id)
        return row

    async def retrieve(self, file_id: str) -> FileObject:
        return FileObject.of(await self.get_row(file_id))

    async def list(self, *, purpose: str | None, after: str | None, limit: int, order: str) -> FileList:
        rows, more = await self.repo.page(purpose=purpose, after=after, limit=limit,
                                          descending=order == "desc")
        data = [FileObject.of(r) for r in rows]
        return FileList(data=data, first_id=data[0].id if data else None,
                        last_id=data[-1].id if data else None, has_more=more)

    async def content(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes; the first chunk is read here, so a missing object is a 404 before any
        response starts."""
        row = await self.get_row(file_id)
        chunks = self.storage.read(row.storage_key)
        try:
            first = await anext(chunks, b"")
        except FileMissing:
            raise FileNotFound(file_id) from None

        async def all_chunks() -> AsyncIterator[bytes]:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk

        return all_chunks()

    async def delete(self, file_id: str) -> tuple[FileDeleted, StoredFile]:
        row = await self.repo.delete(file_id)
        if row is None:
            raise FileNotFound(file_id)
        return FileDeleted(id=row.id), StoredFile(row.id, row.storage_key)


async def delete_expired(session: AsyncSession, now: datetime, limit: int = DELETE_BATCH) -> list[StoredFile]:
    """Retention (beat): delete expired rows; returns their storage to delete after the commit."""
    return [StoredFile(r.id, r.storage_key) for r in await delete_expired_files(session, now, limit)]
