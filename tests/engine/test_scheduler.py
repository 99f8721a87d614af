"""Scheduler behaviour, driven by a pure-Python stand-in for the engine loop (no model, no torch)."""

import random
from collections import defaultdict

import pytest

from engine.sequence import FinishReason, SequenceStatus
from tests.engine.scheduler_sim import (
    check_block_invariants,
    make_scheduler,
    make_seq,
    run_to_completion,
    step,
)


def test_budget_and_seq_limit_respected_and_blocks_returned():
    random.seed(0)
    sched = make_scheduler(num_blocks=40, max_num_seqs=5, max_num_batched_tokens=48)
    seqs = [make_seq(random.randint(1, 120), max_tokens=random.randint(1, 30)) for _ in range(40)]
    for seq in seqs:
        sched.add(seq)
    run_to_completion(sched)
    assert all(
        s.finish_reason is FinishReason.LENGTH and s.num_output_tokens == s.params.max_tokens for s in seqs
    )
    assert sched.block_manager.num_free_blocks == 40 and sched.block_manager.usage == 0.0
    assert sched.num_waiting == 0 and sched.num_running == 0


def test_long_prompt_is_chunked():
    sched = make_scheduler(max_num_batched_tokens=32)
    seq = make_seq(100, max_tokens=2)
    sched.add(seq)
    chunks = [step(sched).seqs[0].num_tokens for _ in range(4)]
    assert chunks == [32, 32, 32, 4]
    assert seq.num_output_tokens == 1
    assert sched.num_partial_prefill_chunks == 3 and sched.computed_prefill_tokens == 100


def test_decodes_go_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=20)
    a, b = make_seq(10, max_tokens=10), make_seq(10, max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)  # both prefills (20 tokens)
    late = make_seq(50, max_tokens=2)
    sched.add(late)
    batch = step(sched)
    sizes = {item.seq.request_id: item.num_tokens for item in batch.seqs}
    assert sizes == {a.request_id: 1, b.request_id: 1, late.request_id: 18}


def test_priorities_lower_value_first_and_fcfs_within():
    sched = make_scheduler(max_num_seqs=1)
    low = make_seq(8, priority=5)
    high1, high2 = make_seq(8, priority=0), make_seq(8, priority=0)
    for seq in (low, high1, high2):
        sched.add(seq)
    order = []
    while sched.has_unfinished():
        for item in step(sched).seqs:
            if item.seq.request_id not in order:
                order.append(item.seq.request_id)
    assert order == [high1.request_id, high2.request_id, low.request_id]


def test_preemption_by_recompute_and_preempted_seq_finishes():
    # 4 blocks: two sequences that each grow to 3 blocks cannot both run.
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    first, second = make_seq(20, max_tokens=20), make_seq(20, max_tokens=20)
    sched.add(first)
    sched.add(second)
    preempted = []
    while sched.has_unfinished():
        preempted += step(sched).preempted
    assert preempted and all(s is second for s in preempted)
    assert sched.num_preemptions == len(preempted) == second.num_preemptions
    assert first.num_preemptions == 0
    assert second.num_output_tokens == 20 and second.finish_reason is FinishReason.LENGTH
    assert second.num_cached_tokens == 0  # recompute is never reported as cached
    assert sched.block_manager.num_free_blocks == 4


def test_preempted_seq_keeps_its_place_in_line():
    sched = make_scheduler(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=64)
    first, second, third = (make_seq(20, max_tokens=20) for _ in range(3))
    for seq in (first, second, third):
        sched.add(seq)
    while second.num_preemptions == 0:
        step(sched)
    assert second.status is SequenceStatus.WAITING
    # second arrived before third, so it is readmitted first once first finishes.
    admitted = []
    while sched.has_unfinished():
        for item in step(sched).seqs:
            if item.seq is not first and item.seq.request_id not in admitted:
                admitted.append(item.seq.request_id)
    assert admitted == [second.request_id, third.request_id]


def test_high_priority_waiting_preempts_low_priority_running():
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=64)
    low = make_seq(40, max_tokens=8, priority=2)
    sched.add(low)
    step(sched)
    high = make_seq(40, max_tokens=4, priority=0)
    sched.add(high)
    batch = step(sched)
    assert batch.preempted == [low] and [i.seq for i in batch.seqs] == [high]
    run_to_completion(sched)
    assert high.num_output_tokens == 4 and low.num_output_tokens == 8


def test_seq_slots_preempted_for_higher_priority():
    sched = make_scheduler(max_num_seqs=1)
    low = make_seq(8, max_tokens=50, priority=1)
    sched.add(low)
    step(sched)
    high = make_seq(8, max_tokens=2, priority=0)
    sched.add(high)
    batch = step(sched)
    assert batch.preempted == [low] and [i.seq for i in batch.seqs] == [high]


def test_low_priority_not_starved_after_high_priority_load_stops():
    random.seed(1)
    sched = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=32)
    batch_job = make_seq(30, max_tokens=10, priority=9)
    sched.add(batch_job)
    for _ in range(200):  # sustained interactive load
        if sched.num_waiting < 6:
            sched.add(make_seq(random.randint(5, 40), max_tokens=random.randint(2, 10), priority=0))
        step(sched)
    run_to_completion(sched)
    assert batch_job.finish_reason is FinishReason.LENGTH and batch_job.num_output_tokens == 10
    assert sched.block_manager.num_free_blocks == 12


def test_tenants_share_a_saturated_scheduler_fairly():
    random.seed(2)
    sched = make_scheduler(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64)
    # Tenant "big" submits 10x as many requests as "small", all at once, interleaved by arrival.
    for i in range(400):
        sched.add(make_seq(24, max_tokens=16, tenant="big"))
        if i % 10 == 0:
            sched.add(make_seq(24, max_tokens=16, tenant="small"))
    served = defaultdict(int)

    def has_waiting(tenant):
        return any(tenant in by_tenant for by_tenant in sched._waiting.values())

    steps = 0
    while has_waiting("small") and has_waiting("big"):
        step(sched, served)
        steps += 1
    assert steps > 50
    assert abs(served["big"] - served["small"]) <= 0.2 * max(served.values()), served


def test_new_tenant_cannot_bank_credit():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for _ in range(10):
        sched.add(make_seq(16, max_tokens=8, tenant="a"))
    for _ in range(30):
        step(sched)
    newcomer = make_seq(16, max_tokens=8, tenant="b")
    sched.add(newcomer)
    assert sched.fairness.served_tokens("b") == sched.fairness.served_tokens("a") > 0


def test_abort_frees_blocks_and_finishes_all_streams():
    sched = make_scheduler(num_blocks=32)
    keep = make_seq(30, max_tokens=50)
    sched.add(keep)
    free_at_start = sched.block_manager.num_free_blocks
    victims = [make_seq(40, max_tokens=50, rid="gone", n=2, index=i) for i in range(2)]
    waiting = make_seq(20, max_tokens=50, rid="gone-too")
    for seq in (*victims, waiting):
        sched.add(seq)
    for _ in range(5):
        step(sched)
    before = sched.block_manager.num_free_blocks
    aborted = sched.abort("gone") + sched.abort("gone-too")
    assert set(map(id, aborted)) == set(map(id, victims + [waiting]))
    assert all(s.finish_reason is FinishReason.ABORT and s.block_table == [] for s in aborted)
    assert sched.abort("gone") == [] and sched.abort("unknown") == []
    assert sched.block_manager.num_free_blocks > before
    sched.finish(keep, FinishReason.STOP)
    assert sched.block_manager.num_free_blocks == 32 >= free_at_start
    assert not sched.has_unfinished()


def test_prefix_cache_hits_through_the_scheduler():
    sched = make_scheduler()
    prompt = [random.randrange(1000) for _ in range(50)]
    first = make_seq(0, tokens=prompt, salt="tenant-a")
    sched.add(first)
    run_to_completion(sched)
    assert first.num_cached_tokens == 0
    second = make_seq(0, tokens=prompt, salt="tenant-a")
    other = make_seq(0, tokens=prompt, salt="tenant-b")
    sched.add(second)
    sched.add(other)
    batch = step(sched)
    assert second.num_cached_tokens == 48 and other.num_cached_tokens == 0
    sizes = {item.seq.request_id: item.num_tokens for item in batch.seqs}
    assert sizes[second.request_id] == 2 and sizes[other.request_id] == 50
    run_to_completion(sched)
    assert sched.computed_prefill_tokens == 50 + 2 + 50
    bm = sched.block_manager
    assert bm.prefix_hit_tokens == 48 and bm.prefix_queries_tokens == 150


def test_cached_tokens_not_recounted_after_preemption():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    prompt = [random.randrange(1000) for _ in range(33)]
    warm = make_seq(0, tokens=prompt)
    sched.add(warm)
    run_to_completion(sched)
    a = make_seq(0, tokens=prompt, max_tokens=40)
    b = make_seq(40, max_tokens=40)
    sched.add(a)
    sched.add(b)
    run_to_completion(sched)
    assert a.num_cached_tokens == 32
    assert b.num_preemptions > 0 and b.num_cached_tokens == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_n_siblings_share_prompt_blocks(prefix_caching):
    sched = make_scheduler(prefix_caching=prefix_caching)
    prompt = [random.randrange(1000) for _ in range(40)]
    seqs = [make_seq(0, tokens=prompt, rid="multi", n=3, index=i, max_tokens=3) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    first = step(sched)
    assert [item.seq for item in first.seqs] == [seqs[0]]
    second = step(sched)
    assert {item.seq.index: item.num_tokens for item in second.seqs} == {0: 1, 1: 8, 2: 8}
    assert seqs[1].block_table[:2] == seqs[0].block_table[:2] == seqs[2].block_table[:2]
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_add_rejects_requests_that_can_never_fit():
    sched = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="KV cache"):
        sched.add(make_seq(60, max_tokens=10))
    seq = make_seq(10)
    sched.add(seq)
    with pytest.raises(ValueError, match="already added"):
        sched.add(seq)


def test_scheduler_and_block_manager_import_no_torch():
    import subprocess
    import sys

    code = "import sys, engine.scheduler, engine.kv.block_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_no_preemption_for_a_request_that_still_would_not_fit():
    sched = make_scheduler(num_blocks=6, max_num_batched_tokens=128)
    same = make_seq(40, max_tokens=30, priority=0)  # 3 blocks, grows to 5
    low = make_seq(10, max_tokens=20, priority=5)  # 1 block
    sched.add(same)
    sched.add(low)
    step(sched)
    big = make_seq(80, max_tokens=2, priority=0)  # 5 blocks: fits only once `same` finishes
    sched.add(big)
    batch = step(sched)
    assert batch.preempted == [] and low.status is SequenceStatus.RUNNING
    run_to_completion(sched)
    assert big.num_output_tokens == 2 and sched.block_manager.num_free_blocks == 6


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_keep_every_invariant(seed):
    rng = random.Random(seed)
    prefix_caching = seed % 3 != 0
    sched = make_scheduler(
        num_blocks=rng.randint(8, 40),
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(8, 96),
        prefix_caching=prefix_caching,
    )
    shared = [rng.randrange(1000) for _ in range(40)]
    added = []
    for t in range(300):
        if t < 200 and rng.random() < 0.3:
            n = rng.choice([1, 1, 1, 2, 3])
            prompt_len = rng.randint(1, 60)
            prompt = (shared + [rng.randrange(1000) for _ in range(60)])[:prompt_len]
            rid = f"w{seed}-{t}"
            group = []
            for i in range(n):
                s = make_seq(
                    0,
                    tokens=prompt,
                    max_tokens=rng.randint(1, 20),
                    priority=rng.choice([0, 1, 5]),
                    tenant=rng.choice("abc"),
                    salt=rng.choice([None, "x"]),
                    n=n,
                    index=i,
                    rid=rid,
                )
                group.append(s)
            try:
                for s in group:
                    sched.add(s)
                added += group
            except ValueError:
                sched.abort(rid)  # too big for this pool: drop any streams already queued
        if added and rng.random() < 0.05:
            sched.abort(rng.choice(added).request_id)
        step(sched)
        check_block_invariants(sched)
    run_to_completion(sched)
    check_block_invariants(sched)
    assert all(s.is_finished for s in added)
    assert all(
        s.num_output_tokens == s.params.max_tokens for s in added if s.finish_reason is FinishReason.LENGTH
    )
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_every_lora_adapter_gets_its_turn_at_the_slots():
    """With one adapter slot and a steady stream of requests for adapter a0, a request for a1 waiting
    behind them is admitted once the running a0s drain (no new a0 overtakes it), not after the stream
    stops; and a sequence with nothing left to compute claims no slot."""
    from types import SimpleNamespace

    from engine.config import EngineConfig
    from engine.kv.block_manager import BlockManager
    from engine.kv.cache import KVCache
    from engine.scheduler import Scheduler

    config = EngineConfig(model="unused", num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
                          max_loras=1)
    sched = Scheduler(config, KVCache(BlockManager(256, 16, True)))

    def lora_seq(adapter: str):
        seq = make_seq(8, max_tokens=6)
        seq.lora = SimpleNamespace(digest=adapter)
        return seq

    a1 = None
    for i in range(60):
        sched.add(lora_seq("a0"))  # a new a0 request every step
        if i == 3:
            a1 = lora_seq("a1")
            sched.add(a1)
        batch = step(sched)
        assert len({item.seq.lora.digest for item in batch.seqs if item.seq.lora is not None}) <= 1
        if a1 is not None and a1.is_finished:
            break
    assert a1 is not None and a1.is_finished, "a1 starved behind a steady stream of a0 requests"
    assert i < 30
