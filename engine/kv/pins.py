"""Cache lifetimes: a request's prompt-cache policy, and the pins that hold its blocks in a tier.

OpenAI's API sells cache lifetime as a product; the gateway turns it into a ``CachePolicy`` per request:

- ``prompt_cache_options.ttl`` (``30m``) is a *minimum* lifetime: ``ttl_s``. The request's cacheable
  prompt blocks are pinned in the host tier for that long: the host tier's LRU passes over them, and a
  pinned block evicted from the device is offloaded to the host like any other.
- ``prompt_cache_retention`` ``24h`` is ``retention_s``: the blocks are written to the disk tier now (not
  only when evicted) and pinned there; the pin is the block file's modification time, so it outlives a
  restart. ``in_memory`` is ``persist=False``: the blocks this request writes to the cache never reach
  the disk (a host eviction drops them); a later request of the same tenant that asks for a retention
  of the same prefix still retains them (its own choice for its own tokens).
- ``prompt_cache_options.mode`` ``explicit`` limits the cache to the prompt's first ``prefix_tokens``
  (its last explicit breakpoint, rounded down to whole blocks): nothing past it is looked up or written,
  and with no breakpoint (``0``) the request does not use the cache at all. ``None`` is ``implicit``:
  the whole prompt.

Pins are bounded twice (``Pins``): a tenant (a salt key) pins at most ``quota`` blocks of a tier, and all
tenants together at most ``MAX_PINNED_SHARE`` of its capacity, so the LRU always has unpinned blocks to
drop. Beyond a bound the request is still served; the leading blocks that fit are pinned (a prefix
without its head is useless) and the request reports how many tokens it pinned. Pinning a block already
pinned by the same tenant only extends its expiry and uses no more quota.

Times are wall-clock seconds (``time.time``, injectable): a retention pin means the same after a restart.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_PINNED_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class CachePolicy:
    prefix_tokens: int | None = None  # explicit mode: the cacheable prompt prefix; None: implicit
    ttl_s: float = 0.0  # minimum host-tier lifetime of the cacheable prompt blocks
    retention_s: float = 0.0  # keep them on the disk tier this long
    persist: bool = True  # False (``in_memory``): blocks written by this request never go to disk

    def __post_init__(self) -> None:
        if self.prefix_tokens is not None and self.prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be >= 0, got {self.prefix_tokens}")
        if self.ttl_s < 0 or self.retention_s < 0:
            raise ValueError("ttl_s and retention_s must be >= 0")
        if self.retention_s and not self.persist:
            raise ValueError("a retention on disk contradicts persist=False (in_memory)")

    def cacheable_tokens(self, num_tokens: int) -> int:
        """Of a sequence's first ``num_tokens``, how many the cache may hold."""
        return num_tokens if self.prefix_tokens is None else min(num_tokens, self.prefix_tokens)


DEFAULT_POLICY = CachePolicy()


class Pins:
    """Pinned hashes of one tier: hash -> (expiry, salt key), with per-salt counts under ``quota``."""

    def __init__(self, capacity: int, quota: int, clock: Callable[[], float] = time.time) -> None:
        if quota < 0:
            raise ValueError(f"a pin quota must be >= 0 blocks, got {quota}")
        self.limit = int(capacity * MAX_PINNED_SHARE)
        self.quota = quota
        self.clock = clock
        self._until: dict[bytes, tuple[float, str]] = {}
        self._per_salt: dict[str, int] = {}
        self._expiries: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        self.sweep()
        return len(self._until)

    def count(self, salt: str) -> int:
        self.sweep()
        return self._per_salt.get(salt, 0)

    def pinned(self, digest: bytes) -> bool:
        entry = self._until.get(digest)
        return entry is not None and entry[0] > self.clock()

    def expiry(self, digest: bytes) -> float | None:
        entry = self._until.get(digest)
        return entry[0] if entry is not None and entry[0] > self.clock() else None

    def pin(self, digests: list[bytes], salt: str, seconds: float) -> int:
        """Pin the leading ``digests`` until now + ``seconds``, as far as the quota and the tier's share
        allow; returns how many leading hashes are pinned (already pinned ones count, and are extended)."""
        self.sweep()
        until = self.clock() + seconds
        done = 0
        for digest in digests:
            entry = self._until.get(digest)
            if entry is None:
                if self._per_salt.get(salt, 0) >= self.quota or len(self._until) >= self.limit:
                    break
            elif entry[1] != salt:
                break  # cannot happen with salted hashes; never let one tenant extend another's pin
            self.restore(digest, salt, max(until, entry[0]) if entry else until)
            done += 1
        return done

    def restore(self, digest: bytes, salt: str, until: float) -> None:
        """Record a pin until ``until`` (also a block file's expiry read back at start: no bound is
        checked, the tenant's count grows)."""
        if digest not in self._until:
            self._per_salt[salt] = self._per_salt.get(salt, 0) + 1
        self._until[digest] = (until, salt)
        heapq.heappush(self._expiries, (until, digest))

    def discard(self, digest: bytes) -> None:
        entry = self._until.pop(digest, None)
        if entry is not None:
            self._decrement(entry[1])

    def purge(self, salt: str) -> None:
        for digest in [d for d, (_, s) in self._until.items() if s == salt]:
            self.discard(digest)

    def sweep(self) -> None:
        """Forget expired pins (stale heap entries of extended pins are skipped)."""
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            until, digest = heapq.heappop(self._expiries)
            entry = self._until.get(digest)
            if entry is not None and entry[0] <= now:
                self.discard(digest)

    def _decrement(self, salt: str) -> None:
        left = self._per_salt[salt] - 1
        if left:
            self._per_salt[salt] = left
        else:
            del self._per_salt[salt]
