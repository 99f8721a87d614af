"""A pure-Python stand-in for the engine loop, shared by the scheduler tests: build a scheduler and
sequences, run steps that append a dummy token to every sampled sequence, check block accounting."""

import random

from engine.config import EngineConfig
from engine.kv.block_manager import BlockManager
from engine.kv.cache import KVCache
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, Sequence

BS = 16


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, prefix_caching=True):
    config = EngineConfig(
        model="unused",
        num_kv_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=prefix_caching,
    )
    return Scheduler(config, KVCache(BlockManager(num_blocks, BS, prefix_caching)))


_ids = iter(range(10**9))


def make_seq(
    prompt_len, max_tokens=4, priority=0, tenant="t", salt=None, tokens=None, n=1, index=0, rid=None
):
    tokens = list(tokens) if tokens is not None else [random.randrange(1000) for _ in range(prompt_len)]
    return Sequence(
        rid or f"req-{next(_ids)}",
        tokens,
        SamplingParams(max_tokens=max_tokens, n=n),
        priority=priority,
        tenant=tenant,
        cache_salt=salt,
        index=index,
    )


def step(sched, served=None, check=None):
    """One engine step: schedule, 'run', append a dummy token to every sampled seq, finish at max_tokens.

    ``check(sched, batch)`` runs right after ``schedule()``, before anything finishes.
    """
    batch = sched.schedule()
    if check is not None:
        check(sched, batch)
    assert batch.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    for item in batch.seqs:
        assert item.num_tokens >= 1
        assert len(item.seq.block_table) * BS >= item.start + item.num_tokens
        if served is not None:
            served[item.seq.tenant] += item.num_tokens
    for seq in sched.update_after_step(batch):
        if seq.is_finished:
            continue
        sched.token_known(seq, 1)
        if seq.num_output_tokens >= seq.params.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
    return batch


def run_to_completion(sched, max_steps=10_000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("scheduler did not finish its work")


def check_block_invariants(sched):
    bm = sched.block_manager
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        assert len(seq.block_table) * BS >= seq.num_computed_tokens
        for block in seq.block_table:
            refs[block] += 1
    for by_tenant in sched._waiting.values():
        for queue in by_tenant.values():
            for seq in queue:
                assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert refs == bm._ref_counts
    in_use = sum(1 for r in refs if r)
    assert in_use + bm.num_free_blocks == bm.num_blocks
    assert all(bm._hash_to_block[bm._block_hash[b]] == b for b in bm._evictable)
