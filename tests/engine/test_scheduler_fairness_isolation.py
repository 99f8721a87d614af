"""A step that admits a waiting sequence by fairness preemption carries only the under-share admissions
of that priority (and higher-priority work): the running sequences of that or a lower priority skip
that one step and run the next (pure Python, no torch)."""

import random
from collections import defaultdict

from engine.sequence import SequenceStatus
from tests.engine.scheduler_sim import (
    BS,
    check_block_invariants,
    make_scheduler,
    make_seq,
    run_to_completion,
    step,
)


def scheduled(batch):
    return {item.seq.seq_id: item.num_tokens for item in batch.seqs}


def saturate(sched, tenant="a", count=6, prompt_len=8, max_tokens=100, priority=0, steps=3):
    seqs = [
        make_seq(prompt_len, max_tokens=max_tokens, tenant=tenant, priority=priority) for _ in range(count)
    ]
    for seq in seqs:
        sched.add(seq)
    for _ in range(steps):
        step(sched)
    return seqs


def test_fairness_admission_step_carries_only_the_newcomer_and_the_next_step_everyone():
    sched = make_scheduler(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=64)
    a_seqs = saturate(sched)
    running_a = [s for s in a_seqs if s.status is SequenceStatus.RUNNING]
    assert len(running_a) == 4
    served_a = sched.fairness.served_tokens("a")
    computed = {s.seq_id: s.num_computed_tokens for s in running_a}
    b = make_seq(8, max_tokens=4, tenant="b")
    sched.add(b)

    batch = step(sched)
    assert scheduled(batch) == {b.seq_id: 8}
    assert batch.preempted == [a_seqs[3]] and sched.num_fairness_preemptions == 1
    kept = running_a[:3]
    assert all(s.status is SequenceStatus.RUNNING for s in kept)
    assert all(s.num_computed_tokens == computed[s.seq_id] for s in kept)  # skipped, not advanced
    assert sched.fairness.served_tokens("a") == served_a  # the dropped decodes were not charged
    check_block_invariants(sched)

    batch = step(sched)
    assert scheduled(batch) == {**{s.seq_id: 1 for s in kept}, b.seq_id: 1}
    assert batch.preempted == []
    check_block_invariants(sched)
    run_to_completion(sched)
    check_block_invariants(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_several_under_share_admissions_share_the_isolated_step():
    sched = make_scheduler(num_blocks=200, max_num_seqs=6, max_num_batched_tokens=128)
    saturate(sched, count=8)
    bs = [make_seq(8, max_tokens=4, tenant="b") for _ in range(4)]
    cs = [make_seq(8, max_tokens=4, tenant="c") for _ in range(1)]
    for seq in bs + cs:
        sched.add(seq)
    batch = step(sched)
    # share = ceil(6 / 3) = 2 each: b and c are admitted up to their share, each preempting one of a's.
    assert {item.seq.tenant for item in batch.seqs} <= {"b", "c"}
    assert scheduled(batch) == {bs[0].seq_id: 8, bs[1].seq_id: 8, cs[0].seq_id: 8}
    assert sched.num_fairness_preemptions == 3
    check_block_invariants(sched)
    running = {s.seq_id for s in sched.running}
    assert len(running) == 6
    batch = step(sched)
    assert set(scheduled(batch)) == running  # everyone runs the next step
    assert sorted(item.seq.tenant for item in batch.seqs) == ["a", "a", "a", "b", "b", "c"]


def test_higher_priority_work_stays_in_the_isolated_step():
    sched = make_scheduler(num_blocks=200, max_num_seqs=5, max_num_batched_tokens=64)
    high = make_seq(8, max_tokens=100, tenant="h", priority=0)
    sched.add(high)
    saturate(sched, count=6, priority=1)
    assert len(sched.running) == 5
    b = make_seq(8, max_tokens=4, tenant="b", priority=1)
    sched.add(b)
    batch = step(sched)
    assert scheduled(batch) == {high.seq_id: 1, b.seq_id: 8}
    assert sched.num_fairness_preemptions == 1
    batch = step(sched)
    assert len(batch.seqs) == 5 and {item.seq.tenant for item in batch.seqs} == {"h", "a", "b"}


def test_lower_priority_work_is_dropped_from_the_isolated_step_too():
    sched = make_scheduler(num_blocks=200, max_num_seqs=5, max_num_batched_tokens=64)
    low = make_seq(8, max_tokens=100, tenant="l", priority=2)
    sched.add(low)
    step(sched)
    # Tenant a fills the other slots at priority 1; 'low' keeps running (a preempts it only when short).
    saturate(sched, count=4, priority=1)
    assert {s.tenant for s in sched.running} == {"a", "l"} and len(sched.running) == 5
    b = make_seq(8, max_tokens=4, tenant="b", priority=1)
    sched.add(b)
    batch = step(sched)
    # b preempts the lower-priority 'low' first (not a fairness preemption): no isolation.
    assert sched.num_fairness_preemptions == 0 and batch.preempted == [low]
    assert b.seq_id in scheduled(batch) and len(batch.seqs) == 5
    # Now a holds 4 of 5 slots at priority 1 against b's 1 (share 3); a second b is a fairness admission.
    low2 = make_seq(8, max_tokens=100, tenant="l", priority=2)
    sched.add(low2)
    b2 = make_seq(8, max_tokens=4, tenant="b", priority=1)
    sched.add(b2)
    batch = step(sched)
    assert sched.num_fairness_preemptions == 1
    assert scheduled(batch) == {b2.seq_id: 8}  # neither a's decodes nor b's own running decode


def test_the_freed_budget_goes_to_the_newcomer_prompt():
    sched = make_scheduler(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=32)
    saturate(sched, count=5, steps=4)
    b = make_seq(32, max_tokens=4, tenant="b")
    sched.add(b)
    batch = step(sched)
    assert scheduled(batch) == {b.seq_id: 32}  # not 32 - 4 decodes: the whole prompt in one chunk


def test_no_isolation_without_a_fairness_preemption():
    # Unsaturated engine: b takes a free slot, a's decodes run in the same step.
    sched = make_scheduler(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64)
    a_seqs = saturate(sched, count=4)
    b = make_seq(8, max_tokens=4, tenant="b")
    sched.add(b)
    batch = step(sched)
    assert scheduled(batch) == {**{s.seq_id: 1 for s in a_seqs}, b.seq_id: 8}

    # Single tenant, saturated: its waiting sequence just waits, the running ones decode.
    sched = make_scheduler(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=64)
    a_seqs = saturate(sched, count=6)
    batch = step(sched)
    assert scheduled(batch) == {s.seq_id: 1 for s in a_seqs[:4]} and sched.num_preemptions == 0

    # Priority preemption: a higher-priority newcomer preempts, the other streams still decode.
    sched = make_scheduler(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=64)
    a_seqs = saturate(sched, count=4, priority=1)
    urgent = make_seq(8, max_tokens=4, tenant="b", priority=0)
    sched.add(urgent)
    batch = step(sched)
    assert batch.preempted == [a_seqs[3]] and sched.num_fairness_preemptions == 0
    assert scheduled(batch) == {urgent.seq_id: 8, **{s.seq_id: 1 for s in a_seqs[:3]}}


def test_a_block_reserved_for_a_dropped_decode_is_used_next_step():
    # Prompts of BS - 1 tokens: the third step's decode is the first token of each stream's second block.
    sched = make_scheduler(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=64)
    a_seqs = saturate(sched, count=5, prompt_len=BS - 1, steps=2)
    running_a = a_seqs[:4]
    assert all(s.num_computed_tokens == BS and len(s.block_table) == 1 for s in running_a)
    b = make_seq(8, max_tokens=4, tenant="b")
    sched.add(b)
    batch = step(sched)
    assert scheduled(batch) == {b.seq_id: 8}
    kept = running_a[:3]
    tables = {s.seq_id: list(s.block_table) for s in kept}
    for seq in kept:
        # The block reserved for position BS is kept (the decode it was for runs next step) ...
        assert seq.num_computed_tokens == BS and len(seq.block_table) == 2
    check_block_invariants(sched)
    batch = step(sched)
    assert scheduled(batch) == {**{s.seq_id: 1 for s in kept}, b.seq_id: 1}
    for seq in kept:
        # ... and is the one that decode writes to, no second reservation.
        assert seq.block_table == tables[seq.seq_id] and seq.num_computed_tokens == BS + 1
    check_block_invariants(sched)
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_random_two_tenant_load_keeps_blocks_consistent_and_isolates_fairness_steps():
    rng = random.Random(7)
    sched = make_scheduler(num_blocks=48, max_num_seqs=6, max_num_batched_tokens=48)
    served = defaultdict(int)
    isolated = 0

    def check(sched, batch):
        nonlocal isolated
        if sched.num_fairness_preemptions > check.fairness:
            isolated += 1
            # Only admissions (of the tenants under their share): nothing that was running before.
            assert batch.seqs and all(item.seq.seq_id in check.waiting for item in batch.seqs)
        check.fairness = sched.num_fairness_preemptions

    check.fairness = 0
    for _ in range(400):
        if rng.random() < 0.3:
            sched.add(make_seq(rng.randrange(4, 40), max_tokens=rng.randrange(1, 30), tenant="a"))
        if rng.random() < 0.08:
            sched.add(make_seq(rng.randrange(4, 20), max_tokens=rng.randrange(1, 8), tenant="b"))
        check.waiting = {s.seq_id for by_t in sched._waiting.values() for q in by_t.values() for s in q}
        step(sched, served, check)
        check_block_invariants(sched)
    run_to_completion(sched)
    check_block_invariants(sched)
    assert isolated > 0
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
