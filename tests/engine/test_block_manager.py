import pytest

from engine.kv.block_manager import BlockManager
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

BS = 16


def make_seq(tokens, salt=None, request_id="r", index=0, n=1):
    return Sequence(request_id, list(tokens), SamplingParams(n=n), cache_salt=salt, index=index)


def run_prefill(bm, seq):
    """Pretend the runner computed every known token."""
    assert bm.allocate_for_prefill(seq)
    seq.num_computed_tokens = len(seq.token_ids)
    bm.commit_computed(seq)


def test_allocate_free_returns_all_blocks():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    seq = make_seq(range(40))
    assert bm.allocate_for_prefill(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert seq.num_computed_tokens == 0 and seq.num_cached_tokens == 0
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == [] and bm.usage == 0.0


def test_allocation_fails_without_side_effects():
    bm = BlockManager(2, BS)
    seq = make_seq(range(40))
    assert not bm.allocate_for_prefill(seq)
    assert seq.block_table == [] and seq.num_cached_tokens is None and bm.num_free_blocks == 2


def test_prefix_hit_reuses_all_but_last_token_block():
    bm = BlockManager(16, BS)
    prompt = list(range(48))  # exactly 3 full blocks
    first = make_seq(prompt)
    run_prefill(bm, first)
    second = make_seq(prompt)
    assert bm.allocate_for_prefill(second)
    assert second.num_cached_tokens == 32 and second.num_computed_tokens == 32
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert bm.prefix_queries_tokens == 96 and bm.prefix_hit_tokens == 32

    longer = make_seq(prompt + [1, 2, 3])
    assert bm.allocate_for_prefill(longer)
    assert longer.num_cached_tokens == 48


def test_other_salt_misses():
    bm = BlockManager(16, BS)
    run_prefill(bm, make_seq(range(48), salt="a"))
    other = make_seq(range(48), salt="b")
    assert bm.allocate_for_prefill(other)
    assert other.num_cached_tokens == 0


def test_evictable_blocks_hit_after_free_and_evicted_lru_when_needed():
    bm = BlockManager(6, BS)
    a = make_seq(range(33))
    run_prefill(bm, a)  # 3 blocks, 2 full ones cached
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 2 and bm.num_evictable_blocks == 2
    again = make_seq(range(33))
    assert bm.allocate_for_prefill(again)
    assert again.num_cached_tokens == 32
    bm.free(again)
    # A 6-block request needs every block: the cached ones are evicted (their hashes dropped).
    big = make_seq(range(1000, 1000 + 90))
    assert bm.allocate_for_prefill(big)
    assert bm.num_cached_blocks == 0
    bm.free(big)
    third = make_seq(range(33))
    assert bm.allocate_for_prefill(third) and third.num_cached_tokens == 0


def test_eviction_prefers_least_recently_released():
    bm = BlockManager(5, BS)
    old, new = make_seq(range(17)), make_seq(range(500, 517))
    run_prefill(bm, old)
    run_prefill(bm, new)
    bm.free(old)
    bm.free(new)
    # 3 free blocks (never cached) + 2 evictable: a 4-block request evicts exactly the older one.
    big = make_seq(range(2000, 2064))
    assert bm.allocate_for_prefill(big)
    bm.free(big)
    probe_new, probe_old = make_seq(range(500, 517)), make_seq(range(17))
    assert bm.allocate_for_prefill(probe_new) and probe_new.num_cached_tokens == 16
    assert bm.allocate_for_prefill(probe_old) and probe_old.num_cached_tokens == 0


def test_hits_do_not_count_as_free_capacity():
    bm = BlockManager(3, BS)
    a = make_seq(range(33))
    run_prefill(bm, a)
    bm.free(a)
    # Needs 3 blocks, 2 of which are evictable hits: exactly fits.
    b = make_seq(list(range(32)) + [5, 6, 7, 8])
    assert bm.allocate_for_prefill(b) and b.num_cached_tokens == 32


def test_num_cached_tokens_set_once():
    bm = BlockManager(16, BS)
    run_prefill(bm, make_seq(range(40)))
    seq = make_seq(list(range(16)) + [99] * 10)
    assert bm.allocate_for_prefill(seq) and seq.num_cached_tokens == 16
    bm.free(seq)
    seq.num_computed_tokens = 0
    run_prefill(bm, make_seq(list(range(16)) + [99] * 16 + [1]))  # now 2 blocks would hit
    seq.token_ids = list(range(16)) + [99] * 16 + [3]
    assert bm.allocate_for_prefill(seq)
    assert seq.num_computed_tokens == 32 and seq.num_cached_tokens == 16


def test_ensure_slots_grows_and_refuses_when_full():
    bm = BlockManager(2, BS, enable_prefix_caching=False)
    seq = make_seq(range(16))
    assert bm.allocate_for_prefill(seq) and len(seq.block_table) == 1
    seq.num_computed_tokens = 16
    assert bm.ensure_slots(seq, 1) and len(seq.block_table) == 2
    seq.num_computed_tokens = 32
    assert not bm.ensure_slots(seq, 1) and len(seq.block_table) == 2
    with pytest.raises(ValueError, match="num_new_tokens"):
        bm.ensure_slots(seq, -1)


def test_fork_shares_full_prompt_blocks_without_prefix_cache():
    bm = BlockManager(10, BS, enable_prefix_caching=False)
    prompt = list(range(40))
    parent = make_seq(prompt, n=2)
    run_prefill(bm, parent)
    parent.append_token(7)
    child = make_seq(prompt, index=1, n=2)
    assert bm.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] not in parent.block_table
    assert child.num_computed_tokens == 32
    free_before = bm.num_free_blocks
    bm.free(parent)
    assert bm.num_free_blocks == free_before + 1  # shared blocks stay referenced by the child
    bm.free(child)
    assert bm.num_free_blocks == 10


def test_double_allocation_rejected():
    bm = BlockManager(4, BS)
    seq = make_seq(range(5))
    assert bm.allocate_for_prefill(seq)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate_for_prefill(seq)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, BS)
