"""The prefix cache's lower tiers, host memory and disk: which block hash lives where, in LRU order, and
the copies a step must make. Pure Python (no torch); ``engine.kv.transfer`` makes the copies.

Blocks move down when they are evicted and up when a prompt needs them:

- **Device → host.** When the block manager evicts a cached device block (its pool is short), the block
  is *offloaded*: it takes a host slot (``HostTier``) and the step's ``TransferPlan`` copies it there
  before the step's forward pass can overwrite the device block. A hash already on the host is only
  touched (its copy is the same K/V: equal chain hashes mean equal prefixes).
- **Host → disk.** With a disk tier, every offloaded block is also written to a file (``persist``,
  write-through: the disk holds everything the host does, so a restarted replica finds it, and a host
  eviction costs no write). A host slot taken from a full host tier evicts the least recently used host
  block; one whose file was dropped meanwhile is *demoted*: the plan writes its slot to a file before the
  slot is overwritten. The disk tier (``DiskIndex``) keeps at most its capacity of files, dropping the
  least recently used; its files outlive the engine (the index is rebuilt from the directory at start).
  Blocks still only on the device when the engine stops are lost.
- **Host → device.** A prompt whose chain continues on the host after its device hits gets fresh
  device blocks for those hashes, and the plan copies the host slots into them before the forward pass:
  a host hit is prefilled like a device hit, never recomputed.
- **Disk → host.** A prompt whose chain continues on disk has those files read in the background
  (``disk_run``: the engine's reader thread) as soon as it is queued; each finished read takes a host
  slot (``fill``). Until its reads are done the request waits at the head of its queue like one
  waiting for blocks to free, so the running step never waits for the disk.
- **Lifetimes** (``engine.kv.pins``). ``pin_host`` pins blocks in the host tier for a request's ``ttl``:
  a host eviction passes over them. ``retain`` writes blocks to disk now (from their host slot, or
  ``save`` from their device block) and pins their files for the retention; the disk tier's LRU passes
  over them, and the pin is each file's modification time. A block of an ``in_memory`` request
  (``persist=False``) is neither written through nor demoted: it leaves the host without a file.

Invariants:
- A hash is in at most one host slot and at most one disk file; a slot carries at most one hash.
- A slot read or written by the current plan is *locked* until the plan is taken, so a later eviction
  in the same step never overwrites what the plan still reads.
- Every hash carries its salt key (the tenant's ``cache_salt`` digest, shortened): tiers never mix
  tenants beyond what the salted chain hash already guarantees, and ``purge`` drops one salt's blocks.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv.events import KVEventLog
from engine.kv.pins import Pins

NO_SALT = "none"


def salt_key(salt_digest: bytes) -> str:
    """The directory and index key of a salt (16 hex digits of its digest; ``none`` for no salt)."""
    return NO_SALT if not any(salt_digest) else salt_digest[:8].hex()


@dataclass
class TransferPlan:
    """The copies one step needs, in this order: host slots written to disk (``demote``: before those
    slots are reused), device blocks copied to host slots (``offload``), offloaded slots written to disk
    (``persist``), device blocks written to disk (``save``: retained blocks), disk data put in host slots
    (``fill``), host slots copied to device blocks (``load``); then the files whose pins are set (their
    expiry as modification time), the files to delete, the directories of purged salts to remove
    (``drop_salts``) and, last, the files to read into the host tier (``read``: after every write
    before them, so a read sees the block just written)."""

    demote: list[tuple[int, bytes, str]] = field(default_factory=list)  # (slot, hash, salt key)
    offload: list[tuple[int, int]] = field(default_factory=list)  # (device block, host slot)
    persist: list[tuple[int, bytes, str]] = field(default_factory=list)  # (slot, hash, salt key)
    save: list[tuple[int, bytes, str]] = field(default_factory=list)  # (device block, hash, salt key)
    fill: list[tuple[int, object]] = field(default_factory=list)  # (host slot, data read from disk)
    load: list[tuple[int, int]] = field(default_factory=list)  # (host slot, device block)
    pin: list[tuple[bytes, str, float]] = field(default_factory=list)  # (hash, salt key, expiry)
    delete: list[tuple[bytes, str]] = field(default_factory=list)  # (hash, salt key) of disk files
    drop_salts: list[str] = field(default_factory=list)  # salt keys whose directory goes (a purge)
    read: list[tuple[bytes, str]] = field(default_factory=list)  # (hash, salt key) of files to read

    def __bool__(self) -> bool:
        return bool(self.demote or self.offload or self.persist or self.save or self.fill or self.load
                    or self.pin or self.delete or self.drop_salts or self.read)


class DiskIndex:
    """The disk tier's files, least recently used first, at most ``capacity`` of them; pinned files
    (``pins``: retained, at most ``retention_quota`` per tenant) are dropped only once their pin expired.
    ``pinned`` restores the pins found at start (hash -> expiry)."""

    def __init__(self, capacity: int, entries: list[tuple[bytes, str]] | None = None,
                 events: KVEventLog | None = None, *, retention_quota: int | None = None,
                 pinned: dict[bytes, float] | None = None, clock: Callable[[], float] = time.time) -> None:
        if capacity < 0:
            raise ValueError(f"disk capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self.events = events
        self._files: OrderedDict[bytes, str] = OrderedDict(entries or [])
        self.pins = Pins(capacity, capacity // 4 if retention_quota is None else retention_quota, clock)
        now = clock()
        for digest, until in (pinned or {}).items():
            if until > now and digest in self._files:
                self.pins.restore(digest, self._files[digest], until)
        if events is not None:
            for digest in self._files:
                events.stored(digest, "disk")

    def _removed(self, digest: bytes) -> None:
        if self.events is not None:
            self.events.removed(digest, "disk")

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._files

    def __len__(self) -> int:
        return len(self._files)

    def salt_of(self, digest: bytes) -> str | None:
        return self._files.get(digest)

    def touch(self, digest: bytes) -> None:
        self._files.move_to_end(digest)

    def add(self, digest: bytes, salt: str) -> list[tuple[bytes, str]]:
        """Record a file; returns the files to delete to stay within capacity (oldest first)."""
        self._files[digest] = salt
        self._files.move_to_end(digest)
        if self.events is not None:
            self.events.stored(digest, "disk")
        return self.trim()

    def discard(self, digest: bytes) -> None:
        if self._files.pop(digest, None) is not None:
            self.pins.discard(digest)
            self._removed(digest)

    def purge(self, salt: str) -> list[bytes]:
        gone = [digest for digest, s in self._files.items() if s == salt]
        for digest in gone:
            del self._files[digest]
            self._removed(digest)
        self.pins.purge(salt)
        return gone

    def trim(self) -> list[tuple[bytes, str]]:
        """The oldest unpinned files beyond capacity (then, if pins alone exceed it after a restart with
        less disk, the oldest pinned ones), dropped from the index (to delete)."""
        excess = len(self._files) - self.capacity
        if excess <= 0:
            return []
        doomed = [d for d in self._files if not self.pins.pinned(d)][:excess]
        if len(doomed) < excess:
            doomed += [d for d in self._files if self.pins.pinned(d)][: excess - len(doomed)]
        dropped = []
        for digest in doomed:
            dropped.append((digest, self._files.pop(digest)))
            self.pins.discard(digest)
            self._removed(digest)
        return dropped


@dataclass
class TierCounters:
    offloaded_blocks: int = 0  # device → host
    persisted_blocks: int = 0  # offloaded blocks written through to disk
    demoted_blocks: int = 0  # host → disk on a host eviction (a block whose file had been dropped)
    loaded_blocks: int = 0  # host → device
    disk_read_blocks: int = 0  # disk → host
    host_evicted_blocks: int = 0  # dropped from the host without a disk copy
    disk_evicted_blocks: int = 0
    saved_blocks: int = 0  # device → disk (retained blocks not yet on the host or disk)


class HostTier:
    """Host slots holding evicted device blocks, with the disk tier below them (optional). ``pin_quota``
    bounds a tenant's host pins (default: a quarter of the slots)."""

    def __init__(self, num_slots: int, disk: DiskIndex | None = None,
                 events: KVEventLog | None = None, *, pin_quota: int | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs >= 1 slot, got {num_slots}")
        self.num_slots = num_slots
        self.disk = disk
        self.events = events
        self.pins = Pins(num_slots, num_slots // 4 if pin_quota is None else pin_quota, clock)
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._salt_of: list[str] = [NO_SALT] * num_slots
        self._persist: list[bool] = [True] * num_slots  # False: an ``in_memory`` block, never on disk
        self._free = list(range(num_slots - 1, -1, -1))
        self._locked: set[int] = set()
        self._reading: dict[bytes, str] = {}  # hash -> salt key, files being read
        self._purged_reads: set[bytes] = set()  # reads of a purged salt still in flight: discarded
        self._from_disk: set[bytes] = set()
        self.plan = TransferPlan()
        self.counters = TierCounters()

    # ---- queries ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot_of)

    def on_host(self, digest: bytes) -> bool:
        return digest in self._slot_of

    def on_disk(self, digest: bytes) -> bool:
        return self.disk is not None and digest in self.disk

    def persists(self, digest: bytes) -> bool:
        """Whether the host copy of ``digest`` may go to disk (False for an ``in_memory`` block)."""
        return self._persist[self._slot_of[digest]]

    def reading(self, digest: bytes) -> bool:
        return digest in self._reading

    def any_reading(self) -> bool:
        return bool(self._reading)

    # ---- moves ------------------------------------------------------------------------------------
    def offload(self, digest: bytes, device_block: int, salt: str, persist: bool = True) -> bool:
        """A cached device block is evicted: keep its K/V on the host (and, if it may ``persist``, on
        disk). False if no slot can be had."""
        if digest in self._slot_of:
            self._slot_of.move_to_end(digest)
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self._put(digest, slot, salt, persist)
        self.plan.offload.append((device_block, slot))
        self.counters.offloaded_blocks += 1
        if persist and self.disk is not None and self.disk.capacity > 0:
            if digest in self.disk:
                self.disk.touch(digest)
            else:
                self._write_slot(slot, digest, salt)
        return True

    def lock(self, digests: list[bytes]) -> None:
        """Keep the slots of ``digests`` (host hits about to be loaded) from reuse until the plan is taken."""
        for digest in digests:
            self._locked.add(self._slot_of[digest])
            self._slot_of.move_to_end(digest)

    def load(self, digest: bytes, device_block: int) -> str:
        """Copy the host copy of ``digest`` into ``device_block`` this step (a prefix hit on the host);
        returns the tier the hit counts for: ``disk`` the first time a block read from disk is used."""
        slot = self._slot_of[digest]
        self._slot_of.move_to_end(digest)
        self._locked.add(slot)
        self.plan.load.append((slot, device_block))
        self.counters.loaded_blocks += 1
        if digest in self._from_disk:
            self._from_disk.discard(digest)
            return "disk"
        return "host"

    def disk_run(self, digests: list[bytes]) -> list[tuple[bytes, str]]:
        """The files to read for a prompt whose chain continues on disk: from the first hash that is on
        neither the host nor being read, as long as the chain stays on disk, at most what the host tier
        holds (more would evict the run's own first blocks). Marks them being read."""
        if self.disk is None:
            return []
        reads: list[tuple[bytes, str]] = []
        for digest in digests:
            if len(reads) == self.num_slots:
                break
            if digest in self._slot_of or digest in self._reading:
                continue
            salt = self.disk.salt_of(digest)
            if salt is None:
                break
            self._reading[digest] = salt
            reads.append((digest, salt))
        return reads

    def fill(self, digest: bytes, salt: str, data: object | None) -> bool:
        """A disk read finished (``data`` None: the file was unreadable, which drops it). False if no
        host slot could take it (it stays on disk; the prompt recomputes those tokens)."""
        self._reading.pop(digest, None)
        if digest in self._purged_reads:  # its tenant was purged while the file was being read
            self._purged_reads.discard(digest)
            return False
        if data is None:
            if self.disk is not None:
                self.disk.discard(digest)
            return False
        if digest in self._slot_of:
            return True
        slot = self._take_slot()
        if slot is None:
            return False
        self._put(digest, slot, salt)
        self._from_disk.add(digest)
        self.plan.fill.append((slot, data))
        if self.disk is not None and digest in self.disk:
            self.disk.touch(digest)
        self.counters.disk_read_blocks += 1
        return True

    def pin_host(self, digests: list[bytes], salt: str, seconds: float) -> int:
        """Pin the leading ``digests`` (a request's cacheable prompt blocks) in the host tier for
        ``seconds``, within the tenant's quota; returns how many are pinned. A pinned block still on the
        device is offloaded here when the device evicts it, and no host eviction takes it."""
        return self.pins.pin(digests, salt, seconds)

    def retain(self, blocks: list[tuple[bytes, int | None]], salt: str, seconds: float) -> int:
        """Keep the leading ``blocks`` (hash, device block or None) on disk for ``seconds``, within the
        tenant's quota: each is written now unless its file exists, from its host slot or else its device
        block, and its file's pin is set. Returns how many are retained (0 without a disk tier)."""
        disk = self.disk
        if disk is None or disk.capacity == 0:
            return 0
        placeable = []
        for digest, device_block in blocks:
            if digest not in disk and digest not in self._slot_of and device_block is None:
                break
            placeable.append((digest, device_block))
        count = disk.pins.pin([digest for digest, _ in placeable], salt, seconds)
        for digest, device_block in placeable[:count]:
            if digest in disk:
                disk.touch(digest)
            elif digest in self._slot_of:
                self._write_slot(self._slot_of[digest], digest, salt)
            else:
                self.plan.save.append((device_block, digest, salt))  # type: ignore[arg-type]
                self.counters.saved_blocks += 1
                self._add_file(digest, salt)
            self.plan.pin.append((digest, salt, disk.pins.expiry(digest) or 0.0))
        return count

    def take_plan(self) -> TransferPlan:
        """The step's copies (the caller executes them before the forward pass); unlocks every slot."""
        plan, self.plan = self.plan, TransferPlan()
        self._locked.clear()
        return plan

    def purge(self, salt: str) -> int:
        """Drop every block of ``salt`` from the host and disk tiers (their files are deleted by the
        next plan); returns the blocks dropped."""
        gone = [digest for digest, slot in self._slot_of.items() if self._salt_of[slot] == salt]
        for digest in gone:
            slot = self._slot_of.pop(digest)
            self._from_disk.discard(digest)
            self._free.append(slot)
            self._host_removed(digest)
        self.pins.purge(salt)
        dropped = len(gone)
        reads = [digest for digest, s in self._reading.items() if s == salt]
        for digest in reads:
            del self._reading[digest]
            self._purged_reads.add(digest)
        if self.disk is not None:
            files = self.disk.purge(salt)
            self.plan.delete.extend((digest, salt) for digest in files)
            dropped += len(files)
        return dropped

    # ---- internals --------------------------------------------------------------------------------
    def _put(self, digest: bytes, slot: int, salt: str, persist: bool = True) -> None:
        self._slot_of[digest] = slot
        self._salt_of[slot] = salt
        self._persist[slot] = persist
        self._locked.add(slot)
        if self.events is not None:
            self.events.stored(digest, "host")

    def _host_removed(self, digest: bytes) -> None:
        if self.events is not None:
            self.events.removed(digest, "host")

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for digest, slot in self._slot_of.items():  # LRU first, past what this step's plan uses and pins
            if slot in self._locked or self.pins.pinned(digest):
                continue
            del self._slot_of[digest]
            self._from_disk.discard(digest)
            self._host_removed(digest)
            self._demote(digest, slot)
            return slot
        return None

    def _demote(self, digest: bytes, slot: int) -> None:
        salt = self._salt_of[slot]
        self.pins.discard(digest)  # an expired pin
        if self.disk is not None and digest in self.disk:
            self.disk.touch(digest)
            return
        if self.disk is None or self.disk.capacity == 0 or not self._persist[slot]:
            self.counters.host_evicted_blocks += 1
            return
        self.plan.demote.append((slot, digest, salt))
        self.counters.demoted_blocks += 1
        self._add_file(digest, salt)

    def _write_slot(self, slot: int, digest: bytes, salt: str) -> None:
        """Write host ``slot`` to the file of ``digest`` when the plan runs (the slot is kept from reuse
        until then)."""
        self._locked.add(slot)
        self.plan.persist.append((slot, digest, salt))
        self.counters.persisted_blocks += 1
        self._add_file(digest, salt)

    def _add_file(self, digest: bytes, salt: str) -> None:
        assert self.disk is not None
        if any(d == digest for d, _ in self.plan.delete):  # its file was dropped earlier in this step
            self.plan.delete = [(d, s) for d, s in self.plan.delete if d != digest]
        for old, old_salt in self.disk.add(digest, salt):
            self.plan.delete.append((old, old_salt))
            self.counters.disk_evicted_blocks += 1
