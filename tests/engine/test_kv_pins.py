"""Cache lifetimes as pure logic (injected clock): pins bounded by a tenant quota and by half of the
tier, extended without more quota, expiring on time; the host tier passing over pinned blocks; retained
blocks written to disk from wherever they are and kept past the disk tier's LRU; ``in_memory`` blocks
never reaching the disk; explicit mode limiting what the block manager looks up and registers."""

from __future__ import annotations

import pytest

from engine.kv.block_manager import BlockManager
from engine.kv.pins import CachePolicy, Pins
from engine.kv.tiers import DiskIndex, HostTier
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def h(n: int) -> bytes:
    return n.to_bytes(32, "big")


def seq(tokens: list[int], policy: CachePolicy, salt: str | None = "tenant-a") -> Sequence:
    return Sequence(request_id=f"r{id(tokens)}", token_ids=list(tokens), params=SamplingParams(max_tokens=4),
                    cache_salt=salt, cache_policy=policy)


def prefill(bm: BlockManager, s: Sequence) -> None:
    assert bm.allocate_for_prefill(s)
    s.num_computed_tokens = len(s.token_ids)
    bm.commit_computed(s)


# -- Pins ------------------------------------------------------------------------------------------------

def test_pins_stop_at_the_tenant_quota_and_at_half_the_tier() -> None:
    clock = Clock()
    pins = Pins(capacity=10, quota=3, clock=clock)
    assert pins.pin([h(1), h(2), h(3), h(4)], "a", 60) == 3  # the leading blocks that fit the quota
    assert pins.count("a") == 3 and not pins.pinned(h(4))
    assert pins.pin([h(1), h(2)], "a", 120) == 2  # already pinned: extended, no more quota
    assert pins.expiry(h(1)) == clock.now + 120 and pins.count("a") == 3
    assert pins.pin([h(11), h(12), h(13)], "b", 60) == 2  # the tier's half (5) is reached first
    assert len(pins) == 5


def test_pins_expire_and_give_their_quota_back() -> None:
    clock = Clock()
    pins = Pins(capacity=100, quota=2, clock=clock)
    pins.pin([h(1), h(2)], "a", 60)
    pins.pin([h(1)], "a", 600)
    clock.now += 61
    assert not pins.pinned(h(2)) and pins.pinned(h(1)) and pins.count("a") == 1
    assert pins.pin([h(3)], "a", 60) == 1
    clock.now += 600
    assert len(pins) == 0 and pins.count("a") == 0


def test_a_zero_quota_pins_nothing() -> None:
    assert Pins(capacity=100, quota=0).pin([h(1)], "a", 60) == 0
    with pytest.raises(ValueError, match="quota"):
        Pins(capacity=100, quota=-1)
    with pytest.raises(ValueError, match="prefix_tokens"):
        CachePolicy(prefix_tokens=-1)


# -- Host and disk tiers ---------------------------------------------------------------------------------

def test_a_host_eviction_passes_over_pinned_blocks_until_they_expire() -> None:
    clock = Clock()
    host = HostTier(4, pin_quota=2, clock=clock)
    for n in range(1, 5):
        host.offload(h(n), n, "a")
    host.take_plan()
    assert host.pin_host([h(1), h(2)], "a", 1800) == 2
    host.offload(h(5), 5, "a")  # full: h(1) and h(2) are the oldest but pinned, h(3) goes
    host.take_plan()
    assert host.on_host(h(1)) and host.on_host(h(2)) and not host.on_host(h(3))
    clock.now += 1801
    host.offload(h(6), 6, "a")
    assert not host.on_host(h(1))


def test_retained_blocks_are_written_from_host_or_device_and_outlive_the_disk_lru() -> None:
    clock = Clock()
    disk = DiskIndex(capacity=4, retention_quota=2, clock=clock)
    host = HostTier(2, disk, clock=clock)
    host.offload(h(1), 1, "a")  # on host and, written through, on disk
    host.take_plan()
    # h(1) has its file already, h(2) sits on device block 7 only.
    assert host.retain([(h(1), None), (h(2), 7)], "a", 86_400) == 2
    plan = host.take_plan()
    assert plan.save == [(7, h(2), "a")] and not plan.persist
    assert plan.pin == [(h(1), "a", clock.now + 86_400), (h(2), "a", clock.now + 86_400)]
    for n in range(3, 9):  # six more files through a 4-file disk: the retained two stay
        host.offload(h(n), n, "a")
        host.take_plan()
    assert h(1) in disk and h(2) in disk and len(disk) == 4
    clock.now += 86_401
    host.offload(h(9), 9, "a")
    assert h(1) not in disk  # expired: back to plain LRU


def test_retaining_a_host_block_writes_its_slot_and_locks_it_for_the_plan() -> None:
    host = HostTier(2, DiskIndex(capacity=0), clock=Clock())
    host.offload(h(1), 1, "a")
    host.take_plan()
    assert host.retain([(h(1), 1)], "a", 60) == 0  # no disk capacity: nothing retained
    host = HostTier(1, DiskIndex(capacity=8), clock=Clock())
    host.offload(h(1), 1, "a", persist=False)
    host.take_plan()
    assert host.retain([(h(1), 1)], "a", 60) == 1
    assert host.take_plan().persist == [(0, h(1), "a")]


def test_in_memory_blocks_never_reach_the_disk() -> None:
    disk = DiskIndex(capacity=8)
    host = HostTier(1, disk)
    host.offload(h(1), 1, "a", persist=False)
    assert not host.take_plan().persist and h(1) not in disk
    host.offload(h(2), 2, "a")  # evicts h(1) from the only slot: dropped, not demoted
    plan = host.take_plan()
    assert not plan.demote and h(1) not in disk and host.counters.host_evicted_blocks == 1


def test_pins_found_on_disk_at_start_are_kept() -> None:
    clock = Clock()
    entries = [(h(n), "a") for n in range(1, 5)]
    disk = DiskIndex(capacity=2, entries=entries, pinned={h(1): clock.now + 60, h(2): clock.now - 1},
                     clock=clock)
    assert [d for d, _ in disk.trim()] == [h(2), h(3)]  # the expired pin is no pin
    assert h(1) in disk and disk.pins.count("a") == 1


# -- The block manager ----------------------------------------------------------------------------------

def test_lifetimes_apply_once_the_prompt_is_committed_and_report_what_was_held() -> None:
    clock = Clock()
    disk = DiskIndex(capacity=16, retention_quota=8, clock=clock)
    host = HostTier(8, disk, pin_quota=2, clock=clock)
    bm = BlockManager(num_blocks=8, block_size=BS, tiers=host)
    s = seq(list(range(13)), CachePolicy(ttl_s=1800, retention_s=86_400))  # 3 full blocks + 1 token
    assert bm.allocate_for_prefill(s)
    s.num_computed_tokens = 8
    bm.commit_computed(s)
    assert not s.cache_lifetimes_applied  # not all its prompt blocks yet
    s.num_computed_tokens = 13
    bm.commit_computed(s)
    assert s.num_cache_pinned_tokens == 2 * BS  # the tenant's quota: the two leading blocks
    assert s.num_cache_retained_tokens == 3 * BS
    assert [block for block, _, _ in host.take_plan().save] == s.block_table[:3]


def test_explicit_mode_caches_only_up_to_the_breakpoint() -> None:
    bm = BlockManager(num_blocks=16, block_size=BS)
    prompt = list(range(17))
    first = seq(prompt, CachePolicy(prefix_tokens=9))  # breakpoint inside block 2: blocks 0-1 cacheable
    prefill(bm, first)
    assert bm.num_cached_blocks == 2 and first.num_cache_write_tokens == 2 * BS
    bm.free(first)
    again = seq(prompt, CachePolicy())
    assert bm.allocate_for_prefill(again) and again.num_cached_tokens == 2 * BS
    none = seq(list(range(50, 67)), CachePolicy(prefix_tokens=0))  # explicit with no breakpoint
    prefill(bm, none)
    bm.free(none)
    repeat = seq(list(range(50, 67)), CachePolicy(prefix_tokens=0))
    assert bm.allocate_for_prefill(repeat) and repeat.num_cached_tokens == 0


def test_a_returning_prompt_served_from_the_cache_refreshes_its_pins() -> None:
    clock = Clock()
    host = HostTier(8, DiskIndex(capacity=16, clock=clock), clock=clock)
    bm = BlockManager(num_blocks=8, block_size=BS, tiers=host)
    policy = CachePolicy(ttl_s=1800, retention_s=86_400)
    first = seq(list(range(10)), policy)  # 2 full blocks + 2 tokens
    prefill(bm, first)
    bm.free(first)
    clock.now += 1000
    again = seq(list(range(10)), policy)
    prefill(bm, again)  # both blocks were prefix hits: nothing new to commit, the lifetimes still apply
    assert again.num_cached_tokens == 2 * BS
    assert (again.num_cache_pinned_tokens, again.num_cache_retained_tokens) == (2 * BS, 2 * BS)
    digest = bm._hashes_upto(again, 1)[0]
    assert host.pins.expiry(digest) == clock.now + 1800  # refreshed by the returning request
