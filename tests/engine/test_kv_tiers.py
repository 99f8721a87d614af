"""The prefix cache's lower tiers as pure logic: host slots in LRU order, demotion to a bounded disk
index, the copies of a step's plan, and the block manager turning evictions into offloads and a
prompt's chain past its device hits into host hits (counted as cached, per tier), never across salts."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import prefix_block_hashes
from engine.kv.block_manager import BlockManager
from engine.kv.tiers import NO_SALT, DiskIndex, HostTier, salt_key
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 4


def h(n: int) -> bytes:
    return n.to_bytes(32, "big")


def seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(request_id=f"r{id(tokens)}", token_ids=list(tokens), params=SamplingParams(max_tokens=4),
                    cache_salt=salt)


# -- HostTier and DiskIndex ----------------------------------------------------------------------------

def test_offloads_are_written_through_to_disk_and_evict_the_least_recently_used() -> None:
    host = HostTier(2, DiskIndex(capacity=8))
    assert host.offload(h(1), device_block=10, salt="a") and host.offload(h(2), device_block=11, salt="a")
    first = host.take_plan()
    assert first.offload == [(10, 0), (11, 1)] and first.persist == [(0, h(1), "a"), (1, h(2), "a")]
    host.offload(h(1), device_block=12, salt="a")  # already on the host: touched, no copy
    host.offload(h(3), device_block=13, salt="a")  # full: h(2) is now least recently used
    plan = host.take_plan()
    assert plan.offload == [(13, 1)] and plan.persist == [(1, h(3), "a")]
    assert not plan.demote  # h(2) has its file already: the eviction writes nothing
    assert not host.on_host(h(2)) and host.on_disk(h(2)) and host.on_host(h(1)) and host.on_host(h(3))
    assert host.counters.offloaded_blocks == 3 and host.counters.persisted_blocks == 3


def test_a_host_block_whose_file_was_dropped_is_demoted_and_the_oldest_files_go() -> None:
    host = HostTier(2, DiskIndex(capacity=1))
    host.offload(h(1), 1, "a")
    host.offload(h(2), 2, "a")  # the disk holds one file: h(1)'s is deleted
    assert host.take_plan().delete == [(h(1), "a")]
    host.offload(h(3), 3, "a")  # evicts h(1) from the host; without a file it is demoted first
    plan = host.take_plan()
    assert plan.demote == [(0, h(1), "a")] and plan.offload == [(3, 0)]
    assert host.counters.demoted_blocks == 1 and host.counters.disk_evicted_blocks == 3
    assert [host.on_disk(h(n)) for n in (1, 2, 3)] == [False, False, True]


def test_a_slot_the_plan_still_reads_is_never_reused_in_the_same_step() -> None:
    host = HostTier(2)
    host.offload(h(1), 1, "a")
    host.offload(h(2), 2, "a")
    # Both slots were written by this step's plan: a third block finds no slot and is not offloaded.
    assert not host.offload(h(3), 3, "a")
    host.take_plan()
    host.lock([h(1)])
    assert host.offload(h(3), 3, "a")  # takes h(2)'s slot, not the locked one
    assert host.on_host(h(1)) and not host.on_host(h(2))
    assert host.counters.host_evicted_blocks == 1  # no disk tier: dropped


def test_disk_runs_fill_and_count_as_disk_hits_once() -> None:
    disk = DiskIndex(capacity=8, entries=[(h(1), "a"), (h(2), "a"), (h(4), "a")])
    host = HostTier(4, disk)
    assert host.disk_run([h(1), h(2), h(3), h(4)]) == [(h(1), "a"), (h(2), "a")]  # stops at the gap
    assert host.reading(h(1)) and host.any_reading()
    assert host.disk_run([h(1), h(2)]) == []  # already being read
    assert host.fill(h(1), "a", b"k/v") and not host.fill(h(2), "a", None)  # h(2) unreadable
    assert not host.any_reading() and host.on_host(h(1)) and not host.on_disk(h(2))
    assert host.take_plan().fill == [(0, b"k/v")]
    assert host.load(h(1), device_block=7) == "disk"
    assert host.load(h(1), device_block=8) == "host"


def test_purge_drops_one_salt_from_host_and_disk() -> None:
    host = HostTier(2, DiskIndex(capacity=4))
    host.offload(h(1), 1, "tenant-a")
    host.offload(h(2), 2, "tenant-b")
    host.take_plan()
    host.offload(h(3), 3, "tenant-a")  # h(1) leaves the host, keeps its file
    host.take_plan()
    assert host.purge("tenant-a") == 3  # h(3) on the host, the files of h(1) and h(3)
    assert not host.on_host(h(3)) and not host.on_disk(h(1)) and host.on_disk(h(2)) and host.on_host(h(2))
    assert sorted(host.take_plan().delete) == sorted([(h(1), "tenant-a"), (h(3), "tenant-a")])


def test_salt_keys() -> None:
    assert salt_key(bytes(32)) == NO_SALT
    assert salt_key(bytes(range(32))) == "0001020304050607"


# -- BlockManager with a host tier ---------------------------------------------------------------------

def test_evicted_blocks_come_back_from_the_host_as_cached_tokens() -> None:
    host = HostTier(8)
    bm = BlockManager(num_blocks=4, block_size=BS, tiers=host)
    first = seq(list(range(9)))  # 2 full blocks + 1 token
    assert bm.allocate_for_prefill(first)
    first.num_computed_tokens = 9
    bm.commit_computed(first)
    bm.free(first)
    other = seq(list(range(100, 116)))  # needs all 4 blocks: evicts both cached blocks
    assert bm.allocate_for_prefill(other)
    plan = host.take_plan()
    assert sorted(block for block, _ in plan.offload) == [0, 1] and bm.num_cached_blocks == 0
    bm.free(other)
    again = seq(list(range(9)))
    assert bm.allocate_for_prefill(again)
    assert again.num_computed_tokens == again.num_cached_tokens == 8
    load = host.take_plan().load
    assert [block for _, block in load] == again.block_table[:2]
    assert bm.hit_tokens_by_tier == {"device": 0, "host": 8, "disk": 0}
    assert bm.prefix_hit_tokens == 8


def test_device_hits_then_host_hits_in_one_prompt() -> None:
    host = HostTier(8)
    bm = BlockManager(num_blocks=6, block_size=BS, tiers=host)
    prompt = list(range(13))  # 3 full blocks + 1
    first = seq(prompt)
    bm.allocate_for_prefill(first)
    first.num_computed_tokens = 13
    bm.commit_computed(first)
    bm.free(first)  # released tail first: block 3 (partial), 2, 1, 0 → LRU order 2, 1, 0
    filler = seq(list(range(200, 208)))  # takes the 2 free blocks
    assert bm.allocate_for_prefill(filler) and bm.num_cached_blocks == 3
    squeeze = seq(list(range(300, 308)))  # the partial block freed, then the chain's last block (2)
    assert bm.allocate_for_prefill(squeeze) and bm.num_cached_blocks == 2
    host.take_plan()
    bm.free(filler)
    again = seq(prompt)
    assert bm.allocate_for_prefill(again)
    assert again.num_cached_tokens == 12
    assert bm.hit_tokens_by_tier == {"device": 8, "host": 4, "disk": 0}


def test_another_salt_never_hits_any_tier() -> None:
    host = HostTier(8)
    bm = BlockManager(num_blocks=3, block_size=BS, tiers=host)
    mine = seq(list(range(9)), salt="tenant-a")
    bm.allocate_for_prefill(mine)
    mine.num_computed_tokens = 9
    bm.commit_computed(mine)
    bm.free(mine)
    bm.allocate_for_prefill(evict := seq(list(range(50, 62))))  # evicts to the host
    bm.free(evict)
    theirs = seq(list(range(9)), salt="tenant-b")
    assert bm.allocate_for_prefill(theirs) and theirs.num_cached_tokens == 0
    assert all(not host.on_host(d) for d in prefix_block_hashes(list(range(9)), BS, "tenant-b"))
    assert any(host.on_host(d) for d in prefix_block_hashes(list(range(9)), BS, "tenant-a"))


def test_a_prompt_on_disk_waits_for_its_reads() -> None:
    prompt = list(range(9))
    digests = prefix_block_hashes(prompt, BS)
    host = HostTier(4, DiskIndex(capacity=8, entries=[(d, NO_SALT) for d in digests]))
    bm = BlockManager(num_blocks=4, block_size=BS, tiers=host)
    waiting = seq(prompt)
    assert bm.disk_reads(waiting) == [(digests[0], NO_SALT), (digests[1], NO_SALT)]
    assert bm.waiting_for_disk(waiting)
    host.fill(digests[0], NO_SALT, b"0")
    assert bm.waiting_for_disk(waiting)
    host.fill(digests[1], NO_SALT, b"1")
    assert not bm.waiting_for_disk(waiting)
    host.take_plan()
    assert bm.allocate_for_prefill(waiting) and waiting.num_cached_tokens == 8
    assert bm.hit_tokens_by_tier["disk"] == 8


def test_without_prefix_caching_there_are_no_tiers() -> None:
    assert BlockManager(4, BS, enable_prefix_caching=False, tiers=HostTier(2)).tiers is None


def test_a_negative_disk_capacity_is_refused() -> None:
    with pytest.raises(ValueError):
        DiskIndex(-1)


def test_the_files_left_after_each_plan_are_the_disk_index() -> None:
    """A plan's writes (demote, persist) run before its deletes: a file dropped and written again in one
    step must not be deleted after its new copy, nor kept once the index dropped it."""
    host = HostTier(2, DiskIndex(capacity=2))
    files: set[bytes] = set()
    for step in ([1, 2], [3, 4], [1, 5], [2], [6, 3, 4]):
        for n in step:
            host.offload(h(n), n, "a")
        plan = host.take_plan()
        files |= {digest for _, digest, _ in plan.demote + plan.persist}
        files -= {digest for digest, _ in plan.delete}
        assert files == {h(n) for n in range(1, 7) if host.on_disk(h(n))}, step


def test_a_read_in_flight_when_its_tenant_is_purged_is_discarded() -> None:
    host = HostTier(4, DiskIndex(capacity=8, entries=[(h(1), "tenant-a")]))
    assert host.disk_run([h(1)]) == [(h(1), "tenant-a")]
    host.purge("tenant-a")
    host.take_plan()
    assert not host.any_reading()
    assert not host.fill(h(1), "tenant-a", b"k/v") and not host.on_host(h(1))
