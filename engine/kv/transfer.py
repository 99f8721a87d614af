"""The copies of the prefix cache's tiers: device KV pool ↔ host buffer ↔ block files on disk.

``engine.kv.tiers`` decides which block goes where; ``KVTransfer.execute(plan)`` issues one step's copies
before the step's forward pass (on a GPU, device ↔ host copies run on side streams and overlap the
forward pass; see ``execute``), in the plan's order (demote, offload, persist, save, fill, load, pin,
delete, drop a purged salt's directory, read). The model runner owns it and calls it in device order
(on the CPU with a device thread, on that thread); ``finished_reads`` and ``wait_for_read`` are the
only calls from elsewhere (the scheduler's ``KVCache``), and are thread-safe. The host buffer has the
device pool's layout per layer (``[2, slots, block_size, kv_heads, head_dim]``, pinned memory on a GPU).
Disk I/O runs on one background thread in submission order, so a read queued after the write of the
same file sees it; reads report back through ``finished_reads`` (``KVCache.begin_step`` feeds them to
the host tier) and never block a step.

A block file is ``{disk_dir}/{fingerprint}/{salt key}/{chain hash}.kv``: a magic header and the block's
K/V for every layer (``[layers, 2, block_size, kv_heads, head_dim]``, raw). The fingerprint covers the
checkpoint's config, dtype and block shape, so a replica restarted with another model never reads
them; a file of the wrong size is a miss (and is deleted). Files are written to a temporary name and
renamed, so a crash never leaves half a block under a hash.
Tensor parallelism: every rank keeps its own shard of each block in its own host buffer and its own
files (the fingerprint covers the rank), and runs rank 0's plans on them. Rank 0's reads take the same
file from every rank's directory (``peer_roots``, one host) and succeed only if all are readable: a
filled slot's data is then one payload per rank, and rank 0 sends each rank its own.
A retained (pinned) file's modification time
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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import cast

import torch

from engine.device import upload
from engine.kv.tiers import TransferPlan

logger = logging.getLogger(__name__)

_MAGIC = b"TGKV1\n"
_SUFFIX = ".kv"


def cache_fingerprint(model_dir: Path, dtype: torch.dtype | str, block_shape: tuple[int, ...], rank: int = 0,
                      tp_size: int = 1) -> str:  # fmt: skip
    """16 hex digits naming the KV layout of a checkpoint (its config.json, the dtype (with an FP8 cache's
    scales), the block shape; under tensor parallelism, which rank's shard of how many)."""
    config = (model_dir / "config.json").read_bytes() if (model_dir / "config.json").is_file() else b""
    shard = f"|tp{rank}/{tp_size}" if tp_size > 1 else ""
    digest = hashlib.sha256(config + f"|{dtype}|{block_shape}{shard}".encode()).hexdigest()
    return digest[:16]


# A block read from disk: its payload, or one per rank (tensor parallelism, read by rank 0).
BlockData = bytes | tuple[bytes, ...]

# Copies issued together: an event on each side stream after them (none on the CPU: done), the tensors
# they read and write (kept alive until then), and what to do on the host once they have landed, in order.
_InFlight = tuple[list["torch.cuda.Event"], list[torch.Tensor], list[Callable[[], None]]]


class KVTransfer:
    def __init__(self, kv_caches: list[torch.Tensor], num_host_slots: int, disk_dir: Path | None,
                 fingerprint: str, peer_fingerprints: list[str] | None = None) -> None:
        self.kv_caches = kv_caches
        layout = kv_caches[0].shape  # [2, blocks, block_size, kv_heads, head_dim]
        self.dtype = kv_caches[0].dtype
        self.device = kv_caches[0].device
        pin = self.device.type == "cuda"
        self.num_slots = num_host_slots
        self.host = [torch.zeros((2, num_host_slots, *layout[2:]), dtype=self.dtype, pin_memory=pin)
                     for _ in kv_caches]
        self.block_shape = (len(kv_caches), 2, *layout[2:])
        self.block_bytes = self.dtype.itemsize * int(torch.Size(self.block_shape).numel())
        self.root = disk_dir / fingerprint if disk_dir is not None else None
        # Rank 0 of a tensor-parallel replica: the other ranks' directories, which its reads also read.
        self.peer_roots = [disk_dir / f for f in peer_fingerprints or []] if disk_dir is not None else []
        self._jobs: queue.Queue[tuple[str, Path, object] | None] = queue.Queue()
        self._reads: queue.Queue[tuple[bytes, str, BlockData | None]] = queue.Queue()
        self._thread: threading.Thread | None = None
        # A GPU's copies to the host and from it run on two side streams (two copy engines); the copies
        # issued and not yet landed.
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.load_stream = torch.cuda.Stream(self.device) if cuda else None
        self._in_flight: list[_InFlight] = []
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._io_loop, name="tollgate-kv-disk", daemon=True)
            self._thread.start()

    # ---- one step's copies ------------------------------------------------------------------------
    def execute(self, plan: TransferPlan) -> None:
        """Issue one step's copies. Device blocks leave for the host without the step waiting for them:
        offloaded and saved blocks are gathered on the current stream (ordered before the forward pass
        that may overwrite them) and copied to pinned host memory on the side stream (a GPU), while the
        forward pass runs; their host slots, disk writes, pins and deletes *land* later (``poll`` after
        the step, or at the next ``execute``), always in the order they were issued. Loads are copied on
        the side stream too, and the current stream waits for them before the forward pass.

        A plan that reads or writes host slots now (demotes to disk, fills from disk, loads to the
        device) first waits for everything issued earlier to land, since an earlier offload may still be
        on its way into one of those slots. Any other plan only lands what has finished: waiting there
        would make the host wait for the previous forward pass, which the last step's saves follow on
        the side stream, and undo the overlapped loop."""
        if plan.demote or plan.fill or plan.load:
            self.complete()
        else:
            self.poll()
        for slot, digest, salt in plan.demote:  # these slots are reused by this plan: read them now
            self._write_slot(slot, self.path(digest, salt))
        landing: list[Callable[[], None]] = []
        keep: list[torch.Tensor] = []
        if plan.offload:
            blocks = upload([b for b, _ in plan.offload], self.device)
            slots = torch.tensor([s for _, s in plan.offload])
            staged = self._to_host([kv[:, blocks] for kv in self.kv_caches], keep)
            landing.append(lambda: self._scatter(slots, staged))
        for slot, digest, salt in plan.persist:
            landing.append(partial(self._write_slot, slot, self.path(digest, salt)))
        if plan.save:
            blocks = upload([b for b, _, _ in plan.save], self.device)
            saved = self._to_host([kv[:, blocks] for kv in self.kv_caches], keep)  # per layer [2, n, ...]
            landing.append(lambda: self._write_saved(saved, plan.save))
        for digest, salt, until in plan.pin:
            landing.append(partial(self._jobs.put, ("pin", self.path(digest, salt), until)))
        for digest, salt in plan.delete:
            landing.append(partial(self._jobs.put, ("delete", self.path(digest, salt), None)))
        for salt in plan.drop_salts:
            landing.append(partial(self._drop_salt, salt))
        if plan.read:  # after the writes queued above: a read sees the block just written
            landing.append(partial(self._queue_reads, plan.read))
        for slot, data in plan.fill:
            self._set_slot(slot, data)  # type: ignore[arg-type]
        if plan.load:
            offloaded = {slot for _, slot in plan.offload}
            if any(slot in offloaded for slot, _ in plan.load):  # evicted and loaded back in one step
                self._land((self._record(keep), keep, landing))
                landing, keep = [], []
            self._load(plan.load, keep)
        self._in_flight.append((self._record(keep), keep, landing))

    def poll(self) -> None:
        """Land the copies that have finished (after a step: the forward pass hid them)."""
        while self._in_flight and all(event.query() for event in self._in_flight[0][0]):
            self._land(self._in_flight.pop(0))

    def complete(self) -> None:
        """Wait for and land every copy issued so far."""
        while self._in_flight:
            self._land(self._in_flight.pop(0))

    def _land(self, entry: _InFlight) -> None:
        events, _keep, landing = entry  # _keep: what the side streams read and wrote, alive until now
        for event in events:
            event.synchronize()
        for step in landing:
            step()

    def _record(self, keep: list[torch.Tensor]) -> list[torch.cuda.Event]:
        """An event after each side stream's copies so far (none on the CPU or with none issued)."""
        if self.stream is None or self.load_stream is None or not keep:
            return []
        events = [torch.cuda.Event(), torch.cuda.Event()]
        events[0].record(self.stream)
        events[1].record(self.load_stream)
        return events

    def _to_host(self, gathered: list[torch.Tensor], keep: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per layer, the gathered blocks copied into pinned host memory (asynchronously on a GPU; the
        side stream waits for the gathers, and ``keep`` holds what it reads and writes until it has)."""
        if self.stream is None:
            return [g.to("cpu") for g in gathered]
        staged = [torch.empty(g.shape, dtype=g.dtype, pin_memory=True) for g in gathered]
        keep.extend(gathered + staged)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for dst, src in zip(staged, gathered, strict=True):
                dst.copy_(src, non_blocking=True)
        return staged

    def _scatter(self, slots: torch.Tensor, staged: list[torch.Tensor]) -> None:
        for host, layer in zip(self.host, staged, strict=True):
            host[:, slots] = layer

    def _write_saved(self, saved: list[torch.Tensor], save: list[tuple[int, bytes, str]]) -> None:
        blocks = torch.stack(saved)  # [layers, 2, n, bs, heads, dim]
        for i, (_, digest, salt) in enumerate(save):
            self._jobs.put(("write", self.path(digest, salt), _file_bytes(blocks[:, :, i])))

    def _load(self, load: list[tuple[int, int]], keep: list[torch.Tensor]) -> None:
        """Host slots into device blocks: on a GPU, staged in pinned memory and copied on the load stream
        after what the current stream has queued (offload gathers of the same blocks), and the current
        stream waits for them (the forward pass reads them), not for the offloads' copies to the host."""
        slots = torch.tensor([s for s, _ in load])
        blocks = upload([b for _, b in load], self.device)
        if self.stream is None:
            for kv, host in zip(self.kv_caches, self.host, strict=True):
                kv[:, blocks] = host[:, slots].to(self.device)
            return
        assert self.load_stream is not None
        staged = [torch.index_select(host, 1, slots).pin_memory() for host in self.host]
        keep.extend(staged)
        current = torch.cuda.current_stream(self.device)
        self.load_stream.wait_stream(current)
        with torch.cuda.stream(self.load_stream):
            for kv, layer in zip(self.kv_caches, staged, strict=True):
                kv[:, blocks] = layer.to(self.device, non_blocking=True)
        current.wait_stream(self.load_stream)

    def _write_slot(self, slot: int, path: Path) -> None:
        self._jobs.put(("write", path, self._slot_bytes(slot)))

    def _slot_bytes(self, slot: int) -> bytes:
        return _file_bytes(torch.stack([host[:, slot] for host in self.host]))

    def _set_slot(self, slot: int, data: BlockData) -> None:
        if isinstance(data, tuple):  # one payload per rank (tensor parallelism): rank 0's is the first
            data = data[0]
        block = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.dtype).view(self.block_shape)
        for layer, host in enumerate(self.host):
            host[:, slot] = block[layer]

    # ---- disk -------------------------------------------------------------------------------------
    def path(self, digest: bytes, salt: str) -> Path:
        assert self.root is not None
        return self.root / salt / f"{digest.hex()}{_SUFFIX}"

    def _queue_reads(self, files: list[tuple[bytes, str]]) -> None:
        """Queue reads of block files; each result comes back through ``finished_reads``."""
        for digest, salt in files:
            self._jobs.put(("read", self.path(digest, salt), (digest, salt)))

    def wait_for_read(self, timeout_s: float) -> None:
        """Block until a read finishes (it stays queued for ``finished_reads``) or ``timeout_s`` passes."""
        try:
            self._reads.put(self._reads.get(timeout=timeout_s))
        except queue.Empty:
            pass

    def finished_reads(self) -> list[tuple[bytes, str, BlockData | None]]:
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

    def _drop_salt(self, salt: str) -> None:
        """Remove a salt's directory (queued after its files' deletes): the purge of a tenant."""
        if self.root is not None:
            self._jobs.put(("rmdir", self.root / salt, None))

    def flush(self) -> None:
        """Land every copy and wait until every queued disk job is done (tests, shutdown)."""
        self.complete()
        if self._thread is not None:
            done = threading.Event()
            self._jobs.put(("barrier", Path(), done))
            done.wait()

    def close(self) -> None:
        self.complete()
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
                    digest, salt = cast(tuple[bytes, str], payload)
                    self._reads.put((digest, salt, self._read_shards(path)))
                elif kind == "pin":
                    os.utime(path, (payload, payload))  # type: ignore[arg-type]
                elif kind == "delete":
                    path.unlink(missing_ok=True)
                elif kind == "rmdir":
                    for child in path.glob("*"):
                        child.unlink(missing_ok=True)
                    path.rmdir()
                elif kind == "barrier":
                    cast(threading.Event, payload).set()
            except Exception as exc:  # the thread must outlive any one job: readers wait on its answers
                logger.warning("KV disk tier: %s %s failed: %r", kind, path, exc)
                if kind == "read":
                    digest, salt = cast(tuple[bytes, str], payload)
                    self._reads.put((digest, salt, None))

    def _read_shards(self, path: Path) -> BlockData | None:
        """A block file's payload; with peers, the tuple of every rank's payloads (None if one is not
        readable: the block is a miss on every rank)."""
        data = self._read_file(path)
        if not self.peer_roots or data is None:
            return data
        assert self.root is not None
        relative = path.relative_to(self.root)
        shards = [data]
        for root in self.peer_roots:
            peer = self._read_file(root / relative)
            if peer is None:
                return None
            shards.append(peer)
        return tuple(shards)

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


def _file_bytes(block: torch.Tensor) -> bytes:
    """A block file's payload: one block's K/V, ``[layers, 2, block_size, kv_heads, head_dim]``, raw."""
    return block.contiguous().view(torch.uint8).numpy().tobytes()
