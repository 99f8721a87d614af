"""What a replica's LoRA adapters cost it, counted since start (torch-free: ``EngineStats`` carries a
``LoRAStats`` snapshot to ``engine.metrics``).

Two tiers: ``host`` (a bundle read from disk and checked into host memory: ``engine.lora.registry``'s LRU)
and ``device`` (an adapter copied into a device slot: ``engine.lora.layers``). Invariants:
- ``loads[tier]`` counts what was brought into the tier, ``evictions[tier]`` what was dropped from it to
  make room (a device slot given to another adapter, the host LRU's oldest), ``resident[tier]`` what it
  holds now; ``load_seconds[tier]`` is a histogram of the loads' durations (``LOAD_BUCKETS``).
- ``requests[name]`` counts the requests accepted for each adapter (by the name the request gave it).
- Counters only grow; a snapshot is a new object, safe to hand to another thread.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TIERS = ("host", "device")
# Seconds: a device copy of a small adapter takes ~1 ms, reading a bundle of a large one seconds.
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class LoadTimes:
    """A histogram of load durations: a count per bucket of ``LOAD_BUCKETS`` (and one past the last)."""

    def __init__(self) -> None:
        self._counts = [0] * (len(LOAD_BUCKETS) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect.bisect_left(LOAD_BUCKETS, seconds)] += 1  # a bucket's bound is inclusive
        self._sum += seconds

    def snapshot(self) -> Histogram:
        counts = list(self._counts)
        cumulative, total = [], 0
        for bound, count in zip((*LOAD_BUCKETS, float("inf")), counts, strict=True):
            total += count
            cumulative.append((bound, total))
        return Histogram(cumulative, self._sum)


@dataclass(frozen=True)
class Histogram:
    """``buckets``: (upper bound, observations <= it), cumulative, the last bound infinite."""

    buckets: list[tuple[float, int]]
    sum: float

    @property
    def count(self) -> int:
        return self.buckets[-1][1]


@dataclass(frozen=True)
class LoRAStats:
    loads: dict[str, int] = field(default_factory=dict)
    evictions: dict[str, int] = field(default_factory=dict)
    resident: dict[str, int] = field(default_factory=dict)
    load_seconds: dict[str, Histogram] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
