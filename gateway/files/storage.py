"""Where file bytes live: the ``FileStorage`` interface and its local-directory implementation.

Postgres holds the metadata (``files``); a backend holds the bytes under an opaque ``key``
(``<tenant id>/<file id>``). The gateway writes uploads, workers read batch inputs and write batch
outputs, so every gateway and worker must see the same storage: the local backend needs a shared
directory (one machine, or a shared volume); an S3-compatible backend implements the same four
methods over a bucket (range reads are not needed: files are read front to back).

Invariants (every backend):
- ``write`` is atomic: a reader sees either no object or the whole object, never a prefix, even if the
  writer dies mid-write (local: write to a temporary file in the same directory, fsync, rename).
- ``write`` refuses more than ``max_bytes`` with ``FileTooLarge`` and leaves nothing behind.
- ``delete`` of a missing key is not an error (retention and API deletes may race).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path
from typing import Protocol

import anyio

from tollgate.settings import Settings

READ_CHUNK_BYTES = 1024 * 1024


class FileTooLarge(ValueError):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(f"the file is larger than the limit of {max_bytes} bytes")
        self.max_bytes = max_bytes


class FileMissing(LookupError):
    """The object is not in storage (deleted by retention, or lost)."""


class FileStorage(Protocol):
    async def write(self, key: str, chunks: AsyncIterable[bytes], max_bytes: int) -> int:
        """Store the concatenated chunks under ``key`` (replacing any object); returns the byte count."""
        ...

    def read(self, key: str) -> AsyncIterator[bytes]:
        """The object's bytes in chunks; ``FileMissing`` if there is none."""
        ...

    async def delete(self, key: str) -> None: ...

    async def exists(self, key: str) -> bool: ...


class LocalFileStorage:
    """Objects as files under ``root`` (created on first write)."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def _path(self, key: str) -> Path:
        path = (self.root / key).resolve()
        if self.root not in path.parents:
            raise ValueError(f"storage key escapes the storage root: {key!r}")
        return path

    async def write(self, key: str, chunks: AsyncIterable[bytes], max_bytes: int) -> int:
        path = self._path(key)
        await anyio.to_thread.run_sync(lambda: path.parent.mkdir(parents=True, exist_ok=True))
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        size = 0
        try:
            async with await anyio.open_file(tmp, "wb") as out:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise FileTooLarge(max_bytes)
                    await out.write(chunk)
                await out.flush()
                await anyio.to_thread.run_sync(os.fsync, out.wrapped.fileno())
            await anyio.to_thread.run_sync(os.replace, tmp, path)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: tmp.unlink(missing_ok=True))
            raise
        return size

    async def read(self, key: str) -> AsyncIterator[bytes]:  # type: ignore[override]
        path = self._path(key)
        try:
            handle = await anyio.open_file(path, "rb")
        except FileNotFoundError:
            raise FileMissing(key) from None
        async with handle:
            while chunk := await handle.read(READ_CHUNK_BYTES):
                yield chunk

    async def delete(self, key: str) -> None:
        path = self._path(key)
        await anyio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))

    async def exists(self, key: str) -> bool:
        path = self._path(key)
        return await anyio.to_thread.run_sync(path.is_file)


def storage_root(settings: Settings) -> Path:
    return settings.file_storage_dir or (settings.data_dir / "files")


def create_storage(settings: Settings) -> FileStorage:
    """The configured backend (the local directory; an S3-compatible one plugs in here)."""
    return LocalFileStorage(storage_root(settings))


async def iter_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Split a byte stream into lines (without the ``\\n``; a last line without one is kept)."""
    rest = b""
    async for chunk in chunks:
        data = rest + chunk
        lines = data.split(b"\n")
        rest = lines.pop()
        for line in lines:
            yield line
    if rest:
        yield rest
