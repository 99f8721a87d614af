"""The adapter store: a directory of PEFT bundles, ``<root>/<adapter id>/``, that every gateway writes and
every engine replica of the adapters' base models reads as its ``--lora-dir``.

Invariants:
- A bundle appears whole or not at all: it is staged in a private directory under the root, then renamed
  into place (``stage``); an id's directory is never rewritten (a new registration has a new id).
- ``remove`` deletes an adapter's directory; a replica asked for it afterwards answers that it has no
  such bundle, so a deleted adapter cannot serve even from a gateway whose cache has not heard yet.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path

from gateway.adapters.bundle import remove
from tollgate.settings import Settings


def store_root(settings: Settings) -> Path:
    return settings.adapter_dir or (settings.data_dir / "adapters")


class AdapterStore:
    def __init__(self, root: Path) -> None:
        self.root = root.resolve()

    def path(self, adapter_id: str) -> Path:
        return self.root / adapter_id

    def stage(self, adapter_id: str, fill: Callable[[Path], None]) -> Path:
        """Put a bundle under ``adapter_id``: ``fill(directory)`` writes it into a private directory, which
        is then renamed into place. Blocking (call it in a thread); ``fill``'s error leaves nothing."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.root / f".staging-{uuid.uuid4().hex}"
        try:
            fill(staging)
            for name in os.listdir(staging):
                with open(staging / name, "rb") as f:
                    os.fsync(f.fileno())
            os.rename(staging, self.path(adapter_id))
        except BaseException:
            remove(staging)
            raise
        return self.path(adapter_id)

    def remove(self, adapter_id: str) -> None:
        remove(self.path(adapter_id))
