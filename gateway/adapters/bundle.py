"""A PEFT adapter bundle taken out of what a tenant uploaded, before any replica reads it.

A bundle is PEFT's ``save_pretrained`` output: ``adapter_config.json`` and ``adapter_model.safetensors``.
It arrives as an archive (a file uploaded with purpose ``fine-tune``: ``.zip``, ``.tar``, ``.tar.gz`` or
``.tgz``) or as a directory (the CLI, the dashboard's two uploads).

Invariants:
- ``unpack`` writes exactly the two files into ``dest`` or raises ``BundleError``; the archive's members
  are never extracted by path (no traversal, links or devices reach the disk): the two regular files are
  found by their base name, at the archive's top or in one directory (``save_pretrained`` output
  zipped with its folder), and copied out by content. Other members (PEFT's ``README.md``) are ignored.
- At most ``max_bytes`` are written in all, counted while copying (an archive's declared sizes are not
  trusted); an empty member is refused.
- Whether the bundle fits its base (rank, targets, shapes, dtype) is the engine's check
  (``POST /lora/check``), never decided here.
"""

from __future__ import annotations

import shutil
import tarfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
BUNDLE_FILES = (CONFIG_FILE, WEIGHTS_FILE)
ARCHIVE_SUFFIXES = (".zip", ".tar", ".tar.gz", ".tgz")
_CHUNK = 1024 * 1024


class BundleError(ValueError):
    """An upload that is not an adapter bundle (a 400 naming the file)."""


def is_archive_name(filename: str) -> bool:
    return filename.lower().endswith(ARCHIVE_SUFFIXES)


def _place(name: str) -> str | None:
    """The bundle file a member of this name is (at the top or in one directory), else None."""
    parts = [p for p in name.replace("\\", "/").split("/") if p not in ("", ".")]
    if not parts or len(parts) > 2 or ".." in parts or parts[-1] not in BUNDLE_FILES:
        return None
    return parts[-1]


def _copy(source: IO[bytes], target: Path, budget: list[int]) -> None:
    written = 0
    with open(target, "wb") as out:
        while chunk := source.read(_CHUNK):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise BundleError("the adapter bundle is larger than the limit of "
                                  f"{budget[1]} bytes")
            out.write(chunk)
            written += len(chunk)
    if written == 0:
        raise BundleError(f"{target.name} is empty")


@contextmanager
def _members(archive: Path) -> Iterator[list[tuple[str, IO[bytes]]]]:
    """``(bundle file, reader)`` of the archive's regular members that are bundle files."""
    if zipfile.is_zipfile(archive):
        with zipfile.ZipFile(archive) as zf:
            infos = [(place, info) for info in zf.infolist()
                     if not info.is_dir() and (place := _place(info.filename)) is not None
                     and (info.external_attr >> 16) & 0o170000 in (0, 0o100000)]  # regular files only
            readers = [(place, zf.open(info)) for place, info in infos]
            try:
                yield readers
            finally:
                for _, reader in readers:
                    reader.close()
        return
    try:
        tf = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError):
        raise BundleError("the file is not a zip or tar archive") from None
    with tf:
        found: list[tuple[str, IO[bytes]]] = []
        try:
            for info in tf:
                place = _place(info.name)
                if place is None or not info.isreg():
                    continue
                member = tf.extractfile(info)
                if member is not None:
                    found.append((place, member))
        except (tarfile.TarError, OSError, EOFError) as exc:
            raise BundleError(f"the archive cannot be read: {exc}") from None
        yield found


def unpack(archive: Path, dest: Path, max_bytes: int) -> None:
    """Write the bundle of ``archive`` into ``dest`` (created); ``BundleError`` if it is not one."""
    dest.mkdir(parents=True, exist_ok=True)
    budget = [max_bytes, max_bytes]
    try:
        with _members(archive) as members:
            names = [place for place, _ in members]
            for name in BUNDLE_FILES:
                if names.count(name) != 1:
                    raise BundleError(f"the archive must hold exactly one {name} (PEFT's save_pretrained "
                                      f"output), found {names.count(name)}")
            for place, reader in members:
                _copy(reader, dest / place, budget)
    except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as exc:
        raise BundleError(f"the archive cannot be read: {exc}") from None


def copy_dir(source: Path, dest: Path, max_bytes: int) -> None:
    """Copy the bundle in directory ``source`` into ``dest`` (created); ``BundleError`` if it lacks one."""
    dest.mkdir(parents=True, exist_ok=True)
    budget = [max_bytes, max_bytes]
    for name in BUNDLE_FILES:
        path = source / name
        if not path.is_file():
            raise BundleError(f"{source} has no {name} (PEFT's save_pretrained output)")
        with open(path, "rb") as reader:
            _copy(reader, dest / name, budget)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
