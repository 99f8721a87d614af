"""What the prefix cache holds, published in order: one event per block hash stored in or removed from a
tier (device, host, disk), each with a sequence number, for the gateways' routing index.

The block manager and the tiers emit events from the engine thread; the HTTP server reads them from
another (``GET /kv/events``, a long poll: ``wait`` returns as soon as there is something new), so
``KVEventLog`` is guarded by a lock. It keeps the last ``capacity``
events and a mirror of the holdings they add up to, so a reader that is too far behind, or that has
never read (a new gateway process, a restarted replica: ``epoch`` changes with every engine start),
gets a snapshot (every held hash with its tiers, as of a sequence number) and continues from there.

Invariants:
- Sequence numbers start at 1 and have no gaps; an event is ``(seq, kind, tier, hash)`` with ``kind``
  ``stored`` or ``removed``. A hash may be held in several tiers at once (device and its disk copy).
- Replaying ``since(0)``'s snapshot and then every later event reproduces ``holdings()`` exactly.
- Hashes are the salted chain hashes of ``engine.kv.block_hash``: the gateway computes the same ones from a
  tenant's prompt, and one tenant's hashes never equal another's.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass

TIER_BITS = {"device": 1, "host": 2, "disk": 4}
STORED, REMOVED = "stored", "removed"
DEFAULT_CAPACITY = 65_536


@dataclass(frozen=True, slots=True)
class EventPage:
    """``since``'s answer: events after the cursor, or (``snapshot`` not None) the whole holdings as of
    ``seq`` followed by nothing (the reader continues from ``seq``)."""

    epoch: str
    seq: int
    events: list[tuple[int, str, str, bytes]]
    snapshot: dict[bytes, int] | None = None


class KVEventLog:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.epoch = os.urandom(8).hex()
        self._lock = threading.Condition()
        self._events: deque[tuple[int, str, str, bytes]] = deque(maxlen=capacity)
        self._seq = 0
        self._held: dict[bytes, int] = {}  # hash -> bit set of TIER_BITS

    def stored(self, digest: bytes, tier: str) -> None:
        bit = TIER_BITS[tier]
        with self._lock:
            held = self._held.get(digest, 0)
            if held & bit:
                return
            self._held[digest] = held | bit
            self._append(STORED, tier, digest)

    def removed(self, digest: bytes, tier: str) -> None:
        bit = TIER_BITS[tier]
        with self._lock:
            held = self._held.get(digest, 0)
            if not held & bit:
                return
            if held == bit:
                del self._held[digest]
            else:
                self._held[digest] = held & ~bit
            self._append(REMOVED, tier, digest)

    def _append(self, kind: str, tier: str, digest: bytes) -> None:
        self._seq += 1
        self._events.append((self._seq, kind, tier, digest))
        self._lock.notify_all()

    def wait(self, after: int, epoch: str | None, timeout_s: float) -> None:
        """Block (a server thread, never the engine's) until there is something after ``after`` for a
        reader of ``epoch``, or ``timeout_s`` passed: the long poll of ``GET /kv/events``."""
        with self._lock:
            self._lock.wait_for(lambda: epoch != self.epoch or self._seq > after, timeout=timeout_s)

    def since(self, after: int, epoch: str | None = None, limit: int = 10_000) -> EventPage:
        """Events with ``seq > after`` (at most ``limit``), or a snapshot when the reader's cursor is of
        another epoch, ahead of us, or older than the oldest event kept."""
        with self._lock:
            oldest = self._events[0][0] if self._events else self._seq + 1
            if epoch != self.epoch or after > self._seq or after < oldest - 1:
                return EventPage(self.epoch, self._seq, [], dict(self._held))
            skip = after - oldest + 1
            events = [self._events[i] for i in range(skip, min(len(self._events), skip + limit))]
            return EventPage(self.epoch, events[-1][0] if events else after, events)

    def holdings(self) -> dict[bytes, int]:
        with self._lock:
            return dict(self._held)

    @property
    def seq(self) -> int:
        return self._seq
