"""``KVCache``: the engine's KV-cache bookkeeping behind one object, owned by the scheduler.

It holds the ``BlockManager`` (device blocks and the prefix cache), the lower tiers (``HostTier`` with
its ``DiskIndex``) and the ``KVEventLog``, and is what the scheduler asks and tells about blocks. It
never copies a byte: each step's moves between tiers come out as a ``TransferPlan`` (``take_plan``),
which the scheduler attaches to the batch and the model runner executes in device order (before the
forward pass that could overwrite an evicted block; a plan made while committing a step, after it).

The disk reads a queued prompt needs are part of the plan too (``TransferPlan.read``); their results
come back through ``io`` (the runner's ``KVTransfer``: ``finished_reads`` and ``wait_for_read`` are
thread-safe) and ``begin_step`` puts them in host slots before anything is scheduled.

Pure Python (no torch): unit-tested with the scheduler on any machine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceLike
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol

from engine.config import EngineConfig
from engine.kv.block_manager import BlockManager
from engine.kv.events import KVEventLog
from engine.kv.tiers import DiskIndex, HostTier, TransferPlan
from engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from engine.kv.connector import KVConnector

logger = logging.getLogger(__name__)

class TierIO(Protocol):
    """The side of ``engine.kv.transfer.KVTransfer`` the bookkeeping sees: the size of a block, what a
    restarted replica finds on its disk tier, and the disk reads that finished (thread-safe)."""

    block_bytes: int
    num_slots: int  # host tier slots

    def scan(self, now: float) -> tuple[list[tuple[bytes, str]], dict[bytes, float]]: ...

    def finished_reads(self) -> SequenceLike[tuple[bytes, str, object]]: ...

    def wait_for_read(self, timeout_s: float) -> None: ...


class KVCache:
    def __init__(self, blocks: BlockManager, io: TierIO | None = None) -> None:
        self.blocks = blocks
        self.tiers = blocks.tiers
        self.events = blocks.events
        self.io = io
        self._plan = TransferPlan()  # what the tiers do not plan themselves (a restart's trim)
        # Disaggregated serving (``engine.kv.connector``): leases (prefill) or pulls (decode); None: both.
        self.connector: KVConnector | None = None

    def attach(self, connector: KVConnector) -> None:
        """Serve a prefill or decode role with ``connector`` (its pulled blocks continue prompt chains)."""
        self.connector = connector
        if connector.role == "decode":
            self.blocks.remote = connector

    @classmethod
    def create(cls, config: EngineConfig, num_blocks: int, io: TierIO | None,
               events: KVEventLog | None = None) -> KVCache:
        """The device pool of ``num_blocks`` and, when ``io`` is given (``config.host_tier``), the host
        tier of its ``num_slots`` and, with ``config.disk_tier``, the disk tier found on disk (trimmed to
        its capacity)."""
        events = events if events is not None else KVEventLog()
        tiers = None
        trim: list[tuple[bytes, str]] = []
        if io is not None and config.enable_prefix_caching:
            disk = None
            if config.disk_tier:
                capacity = config.num_disk_kv_blocks
                if capacity is None:
                    capacity = int(config.disk_kv_gb * 2**30) // io.block_bytes
                files, pins = io.scan(time.time())
                disk = DiskIndex(capacity, files, events,
                                 retention_quota=config.kv_retention_quota_blocks, pinned=pins)
                trim = disk.trim()
                logger.info("KV disk tier: %d blocks of %d found", len(disk), disk.capacity)
            tiers = HostTier(io.num_slots, disk, events, pin_quota=config.kv_pin_quota_blocks)
            logger.info("KV host tier: %d blocks (%.2f GiB)", io.num_slots,
                        io.num_slots * io.block_bytes / 2**30)
        manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching, tiers, events)
        cache = cls(manager, io if tiers is not None else None)
        cache._plan.delete.extend(trim)
        return cache

    # ---- the step ---------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Put the disk reads that finished since the last step into host slots (their copies are in the
        next plan), so this step's admissions can hit them."""
        if self.connector is not None:
            self.connector.begin_step()
        if self.tiers is None or self.io is None:
            return
        for digest, salt, data in self.io.finished_reads():
            self.tiers.fill(digest, salt, data)

    def take_plan(self) -> TransferPlan | None:
        """The copies asked for since the last call (None: nothing to do); unlocks the host slots."""
        if self.tiers is None:
            return None
        plan = self.tiers.take_plan()
        if self._plan:
            own, self._plan = self._plan, TransferPlan()
            plan.delete[:0] = own.delete
        return plan if plan else None

    def take_loads(self) -> list[tuple[int, bytes]]:
        """The pulled blocks admissions placed since the last call: (device block, payload)."""
        return self.connector.take_loads() if self.connector is not None else []

    def pull_pending(self, seq: Sequence) -> bool:
        """Whether ``seq``'s request still waits for its blocks from a prefill replica."""
        return self.connector is not None and self.connector.get_num_new_matched_tokens(seq, 0)[1]

    def request_finished(self, seq: Sequence, reason: FinishReason) -> None:
        """``seq`` finished, its blocks not freed yet: a prefill replica leases its prompt's."""
        if self.connector is not None:
            self.connector.request_finished(seq, reason)

    def queue_disk_reads(self, seq: Sequence) -> None:
        """A new prompt whose chain continues on disk: its files are read (by the next plan) while it
        waits."""
        if self.tiers is not None and self.tiers.disk is not None:
            self.tiers.plan.read.extend(self.blocks.disk_reads(seq))

    def reading(self) -> bool:
        """Whether a disk read is in flight (a prompt may be waiting for it)."""
        return self.tiers is not None and self.tiers.any_reading()

    def wait_for_read(self, timeout_s: float) -> None:
        """Block until a disk read finishes or ``timeout_s`` passes (every waiting prompt waits for one)."""
        if self.io is not None:
            self.io.wait_for_read(timeout_s)

    def purge(self, cache_salt: str | None) -> int:
        """Drop every cached block of ``cache_salt`` in every tier; the next plan deletes its files and
        directory. Returns how many blocks went."""
        dropped = self.blocks.purge(cache_salt)
        if self.tiers is not None and self.tiers.disk is not None:
            self.tiers.plan.drop_salts.append(self.blocks.salt_key(cache_salt))
        return dropped

    # ---- gauges -----------------------------------------------------------------------------------
    def tier_stats(self) -> dict[str, Any]:
        """The lower tiers' fill, capacity, moves and pins (``EngineStats`` fields; empty without tiers)."""
        tiers = self.tiers
        if tiers is None or self.io is None:
            return {}
        disk = tiers.disk
        return {"kv_tier_blocks": {"host": len(tiers), "disk": len(disk) if disk else 0},
                "kv_tier_capacity": {"host": tiers.num_slots, "disk": disk.capacity if disk else 0},
                "kv_tier_moves": asdict(tiers.counters), "kv_block_bytes": self.io.block_bytes,
                "kv_pinned_blocks": {"host": len(tiers.pins), "disk": len(disk.pins) if disk else 0}}
