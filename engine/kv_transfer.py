"""The copies of the prefix cache's tiers: device KV pool ↔ host buffer ↔ block files on disk.

``engine.kv_tiers`` decides which block goes where; ``KVTransfer.execute(plan)`` makes one step's copies
before the step's forward pass, in the plan's order (demote, offload, persist, save, fill, load, pin,
delete). The host
buffer has the device pool's layout per layer (``[2, slots, block_size, kv_heads, head_dim]``, pinned
memory on a GPU). Disk I/O runs on one background thread in submission order, so a read queued after
the write of the same file sees it; reads report back through ``finished_reads`` (the engine thread
feeds them to the host tier) and never block a step.

A block file is ``{disk_dir}/{fingerprint}/{salt key}/{chain hash}.kv``: a magic header and the block's
K/V for every layer (``[layers, 2, block_size, kv_heads, head_dim]``, raw). The fingerprint covers the
checkpoint's config, dtype and block shape, so a replica restarted with another model never reads
them; a file of the wrong size is a miss (and is deleted). Files are written to a temporary name and
renamed, so a crash never leaves half a block under a hash. A retained (pinned) file's modification time
is its pin's expiry, in the future: ``scan`` reports those pins at start, and a read leaves them alone
(any other read marks the file recently used).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import threading
import time
from pathlib import Path

import torch

from engine.kv_tiers import TransferPlan

logger = logging.getLogger(__name__)

_MAGIC = b"TGKV1\n"
_SUFFIX = ".kv"


def cache_fingerprint(model_dir: Path, dtype: torch.dtype, block_shape: tuple[int, ...]) -> str:
    """16 hex digits naming the KV layout of a checkpoint (its config.json, the dtype, the block shape)."""
    config = (model_dir / "config.json").read_bytes() if (model_dir / "config.json").is_file() else b""
    digest = hashlib.sha256(config + f"|{dtype}|{block_shape}".encode()).hexdigest()
    return digest[:16]


class KVTransfer:
    def __init__(self, kv_caches: list[torch.Tensor], num_host_slots: int, disk_dir: Path | None,
                 fingerprint: str) -> None:
        self.kv_caches = kv_caches
        layout = kv_caches[0].shape  # [2, blocks, block_size, kv_heads, head_dim]
        self.dtype = kv_caches[0].dtype
        self.device = kv_caches[0].device
        pin = self.device.type == "cuda"
        self.host = [torch.zeros((2, num_host_slots, *layout[2:]), dtype=self.dtype, pin_memory=pin)
                     for _ in kv_caches]
        self.block_shape = (len(kv_caches), 2, *layout[2:])
        self.block_bytes = self.dtype.itemsize * int(torch.Size(self.block_shape).numel())
        self.root = disk_dir / fingerprint if disk_dir is not None else None
        self._jobs: queue.Queue[tuple[str, Path, object] | None] = queue.Queue()
        self._reads: queue.Queue[tuple[bytes, str, bytes | None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._io_loop, name="tollgate-kv-disk", daemon=True)
            self._thread.start()

    # ---- one step's copies ------------------------------------------------------------------------
    def execute(self, plan: TransferPlan) -> None:
        for slot, digest, salt in plan.demote:
            self._jobs.put(("write", self.path(digest, salt), self._slot_bytes(slot)))
        if plan.offload:
            blocks = torch.tensor([b for b, _ in plan.offload], device=self.device)
            slots = torch.tensor([s for _, s in plan.offload])
            for kv, host in zip(self.kv_caches, self.host, strict=True):
                host[:, slots] = kv[:, blocks].to("cpu")
        for slot, digest, salt in plan.persist:
            self._jobs.put(("write", self.path(digest, salt), self._slot_bytes(slot)))
        if plan.save:
            blocks = torch.tensor([b for b, _, _ in plan.save], device=self.device)
            saved = torch.stack([kv[:, blocks].to("cpu") for kv in self.kv_caches])  # [layers, 2, n, ...]
            for i, (_, digest, salt) in enumerate(plan.save):
                data = saved[:, :, i].contiguous().view(torch.uint8).numpy().tobytes()
                self._jobs.put(("write", self.path(digest, salt), data))
        for slot, data in plan.fill:
            self._set_slot(slot, data)  # type: ignore[arg-type]
        if plan.load:
            slots = torch.tensor([s for s, _ in plan.load])
            blocks = torch.tensor([b for _, b in plan.load], device=self.device)
            for kv, host in zip(self.kv_caches, self.host, strict=True):
                kv[:, blocks] = host[:, slots].to(self.device, non_blocking=True)
        for digest, salt, until in plan.pin:
            self._jobs.put(("pin", self.path(digest, salt), until))
        for digest, salt in plan.delete:
            self._jobs.put(("delete", self.path(digest, salt), None))

    def _slot_bytes(self, slot: int) -> bytes:
        block = torch.stack([host[:, slot] for host in self.host])  # [layers, 2, bs, heads, dim]
        return block.contiguous().view(torch.uint8).numpy().tobytes()

    def _set_slot(self, slot: int, data: bytes) -> None:
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(self.block_shape)
        for layer, host in enumerate(self.host):
            host[:, slot] = block[layer]

    # ---- disk -------------------------------------------------------------------------------------
    def path(self, digest: bytes, salt: str) -> Path:
        assert self.root is not None
        return self.root / salt / f"{digest.hex()}{_SUFFIX}"

    def read(self, files: list[tuple[bytes, str]]) -> None:
        """Queue reads of block files; each result comes back through ``finished_reads``."""
        for digest, salt in files:
            self._jobs.put(("read", self.path(digest, salt), (digest, salt)))

    def wait_for_read(self, timeout_s: float) -> None:
        """Block until a read finishes (it stays queued for ``finished_reads``) or ``timeout_s`` passes."""
        try:
            self._reads.put(self._reads.get(timeout=timeout_s))
        except queue.Empty:
            pass

    def finished_reads(self) -> list[tuple[bytes, str, bytes | None]]:
        """Reads done since the last call: (hash, salt key, the block's bytes or None if unreadable)."""
        done = []
        while True:
            try:
                done.append(self._reads.get_nowait())
            except queue.Empty:
                return done

    def scan(self, now: float) -> tuple[list[tuple[bytes, str]], dict[bytes, float]]:
        """The block files on disk for this fingerprint, least recently used first (a restart's index),
        and the pins among them (hash -> expiry: a modification time after ``now``)."""
        if self.root is None:
            return [], {}
        found = []
        for path in self.root.glob(f"*/*{_SUFFIX}"):
            try:
                digest = bytes.fromhex(path.stem)
                found.append((path.stat().st_mtime, digest, path.parent.name))
            except (ValueError, OSError):
                continue
        found.sort()
        files = [(digest, salt) for _, digest, salt in found if len(digest) == 32]
        pins = {digest: mtime for mtime, digest, _ in found if len(digest) == 32 and mtime > now}
        return files, pins

    def delete_salt(self, salt: str) -> None:
        """Remove a salt's directory (after its files left the index): the purge of a tenant."""
        if self.root is not None:
            self._jobs.put(("rmdir", self.root / salt, None))

    def flush(self) -> None:
        """Wait until every queued disk job is done (tests, shutdown)."""
        if self._thread is not None:
            done = threading.Event()
            self._jobs.put(("barrier", Path(), done))
            done.wait()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def _io_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            kind, path, payload = job
            try:
                if kind == "write":
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(".tmp")
                    with open(tmp, "wb") as out:
                        out.write(_MAGIC)
                        out.write(payload)  # type: ignore[arg-type]
                    os.replace(tmp, path)
                elif kind == "read":
                    digest, salt = payload  # type: ignore[misc]
                    self._reads.put((digest, salt, self._read_file(path)))
                elif kind == "pin":
                    os.utime(path, (payload, payload))  # type: ignore[arg-type]
                elif kind == "delete":
                    path.unlink(missing_ok=True)
                elif kind == "rmdir":
                    for child in path.glob("*"):
                        child.unlink(missing_ok=True)
                    path.rmdir()
                elif kind == "barrier":
                    payload.set()  # type: ignore[union-attr]
            except Exception as exc:  # the thread must outlive any one job: readers wait on its answers
                logger.warning("KV disk tier: %s %s failed: %r", kind, path, exc)
                if kind == "read":
                    self._reads.put((*payload, None))  # type: ignore[misc]

    def _read_file(self, path: Path) -> bytes | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        if not data.startswith(_MAGIC) or len(data) != len(_MAGIC) + self.block_bytes:
            logger.warning("KV disk tier: %s is not a block of this model; deleted", path)
            path.unlink(missing_ok=True)
            return None
        if path.stat().st_mtime <= time.time():  # recently used (a pinned file keeps its expiry)
            os.utime(path)
        return data[len(_MAGIC):]
