"""What each engine replica's prefix cache really holds, followed from its block events.

Every gateway process follows each replica's ``GET /kv/events`` (``engine.kv.events``) on its own:
events are applied in sequence order from a cursor; a snapshot (the engine restarted: a new ``epoch``;
or the cursor fell behind what the engine keeps) replaces the view wholesale. So every process converges
on the same index, and it reflects evictions, offloads to the host and disk tiers, and restarts, which
no guess from past routing decisions can.

``ReplicaKVIndex.held_prefix(hashes)`` answers the router on the hot path, in memory: the tier of each
leading block of a prompt that the replica holds, up to the first it does not. Hashes are salted per
tenant (``engine.kv.block_hash``), so the index never matches one tenant's prompt to another's blocks.

Between a routing decision and the events it causes there is a lag (the follow interval plus the
prefill). So that a session's next turn, or a burst sharing a new prefix, does not miss what is being
computed right now, the router also records what it just sent (``expect``): those blocks count as on the
device for ``EXPECT_TTL_S``, unless the replica's events say otherwise sooner (an event about a hash
replaces the expectation). Each process knows only its own decisions; the events are the shared truth.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from engine.kv.events import TIER_BITS

DEVICE, HOST, DISK = TIER_BITS["device"], TIER_BITS["host"], TIER_BITS["disk"]
# What a held block is worth to a new request, by the best tier it is in: a device hit is free, a host
# hit costs a copy over PCIe, a disk hit a read (still far cheaper than recomputing the block).
TIER_WEIGHT = {DEVICE: 1.0, HOST: 0.8, DISK: 0.5}
# How long blocks this process just sent to a replica count as held there without an event saying so,
# and how many such expectations a replica keeps.
EXPECT_TTL_S = 2.0
EXPECT_MAX = 100_000


def best_tier(bits: int) -> int:
    return DEVICE if bits & DEVICE else HOST if bits & HOST else DISK


class GapError(ValueError):
    """A page does not continue from the cursor: the follower asks for a snapshot."""


class ReplicaKVIndex:
    def __init__(self) -> None:
        self.epoch: str | None = None
        self.seq = 0
        self.held: dict[bytes, int] = {}
        self.snapshots = 0  # how often the view was rebuilt from a snapshot
        self.blocks = dict.fromkeys(TIER_BITS, 0)  # hashes held per tier (the index's size)
        self._expected: OrderedDict[bytes, float] = OrderedDict()  # hash -> until (monotonic)

    def expect(self, hashes: Sequence[bytes], now: float | None = None) -> None:
        """This process just sent a prompt with these blocks here: count them as held for a while."""
        until = (time.monotonic() if now is None else now) + EXPECT_TTL_S
        expected = self._expected
        for digest in hashes:
            expected[digest] = until
            expected.move_to_end(digest)
        while len(expected) > EXPECT_MAX:
            expected.popitem(last=False)

    def apply(self, page: dict[str, Any]) -> None:
        """Apply one ``/kv/events`` answer (parsed JSON). Raises ``GapError`` when its events do not
        follow the cursor (the caller resets and asks again from 0)."""
        snapshot = page.get("snapshot")
        if snapshot is not None:
            self.held = {bytes.fromhex(h): int(bits) for h, bits in snapshot.items()}
            self.epoch, self.seq = page["epoch"], int(page["seq"])
            self.snapshots += 1
            self.blocks = {tier: sum(1 for bits in self.held.values() if bits & bit)
                           for tier, bit in TIER_BITS.items()}
            return
        if page["epoch"] != self.epoch:
            raise GapError("events of another engine start")
        held, expected = self.held, self._expected
        for seq, kind, tier, digest_hex in page["events"]:
            if seq != self.seq + 1:
                raise GapError(f"event {seq} after {self.seq}")
            digest, bit = bytes.fromhex(digest_hex), TIER_BITS[tier]
            expected.pop(digest, None)
            before = held.get(digest, 0)
            after = before | bit if kind == "stored" else before & ~bit
            if after:
                held[digest] = after
            else:
                held.pop(digest, None)
            if after != before:
                self.blocks[tier] += 1 if kind == "stored" else -1
            self.seq = seq

    def reset(self) -> None:
        self.epoch, self.seq, self.held = None, 0, {}
        self.blocks = dict.fromkeys(TIER_BITS, 0)
        self._expected.clear()

    def held_prefix(self, hashes: Sequence[bytes], now: float | None = None) -> list[int]:
        """The best tier of each leading block held (or expected on the device), up to the first block
        that is neither."""
        held, expected, tiers = self.held, self._expected, []
        now = time.monotonic() if now is None else now
        for digest in hashes:
            bits = held.get(digest)
            if bits:
                tiers.append(best_tier(bits))
            elif expected.get(digest, 0.0) > now:
                tiers.append(DEVICE)
            else:
                break
        return tiers

    def prefix_weight(self, hashes: Sequence[bytes], now: float | None = None) -> float:
        return sum(TIER_WEIGHT[tier] for tier in self.held_prefix(hashes, now))
