"""Continuous-batching scheduler: priorities, chunked prefill, preemption by recompute, tenant fairness.

Pure Python (no torch), so it is unit-tested on any machine. One ``schedule()`` call builds one engine
step. Invariants and policies:

- **Budget.** A step computes at most ``max_num_batched_tokens`` tokens, decode tokens and prefill
  chunks together; at most ``max_num_seqs`` sequences are running. A prompt longer than what is left of
  the budget is computed in chunks over several steps (chunked prefill); only the chunk that reaches
  the last known token produces logits.
- **Priorities.** Lower value first. Priority levels are served in order; within a level, running
  sequences (decodes and unfinished prefill chunks) are scheduled before new admissions, so new
  prefills never stall the streams of the same or a lower priority. A waiting request of a strictly
  higher priority may preempt lower-priority running sequences when blocks or sequence slots are short.
- **Preemption by recompute.** When a running sequence needs a block and none is free, the
  lowest-priority, latest-arrived running sequence is preempted (possibly the requester itself): its
  blocks are freed, ``num_computed_tokens`` goes back to 0 and it re-enters the waiting queue at its
  original place in line (arrival order), keeping its generated tokens. The earliest-arrived sequence
  of the highest priority therefore always progresses, so no livelock, and a sequence that fits the
  cache alone (checked in ``add``) always finishes.
- **No starvation.** Priorities are strict, so batch work waits while interactive work is present and
  is served as soon as it stops. Admission is head-of-line: when the next request in order cannot be
  admitted, no later request is admitted ahead of it (a long prompt is not starved by short ones).
- **Tenant fairness.** Within a priority, tenants take turns by served tokens and hold a fair share of
  running slots, taken back by preemption when needed: see ``engine.fairness`` (``TenantFairness``)
  and, for the choice of victims, ``engine.preemption`` (``VictimPolicy``).
- **Pending tokens** (the overlapped loop): a sequence's tokens include those sampled by a launched step
  and not yet known on the host (``seq.num_tokens``); its next decode reads that token on the device. A
  sequence whose pending token is its ``max_tokens``-th is not scheduled again (it ends when the token
  is known), so a length stop costs no extra computed token.
- **n > 1.** Siblings (same ``request_id``) are admitted once the first stream has computed its prompt,
  so they reuse its full prompt blocks: through the prefix cache, or through ``BlockManager.fork`` when
  prefix caching is disabled.
- **Pulled prompts** (a decode replica, ``engine.kv.connector``): a request whose prompt blocks are still
  on their way from a prefill replica is passed over by admission (not head-of-line: a transfer must
  not hold up the others); once they arrived (or failed) it is admitted like any other.

The engine loop calls ``schedule()`` → runs the model → ``update_after_step(batch)`` (which returns the
sequences that yield a token, one per logits row) → samples, appends tokens and calls ``finish`` for
the sequences that stop.
"""

from __future__ import annotations

import bisect
import itertools

from engine.config import EngineConfig
from engine.fairness import TenantFairness
from engine.kv.cache import KVCache
from engine.preemption import VictimPolicy
from engine.sequence import FinishReason, ScheduledBatch, ScheduledSeq, Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCache) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_loras = config.max_loras
        self.kv = kv
        self.block_manager = kv.blocks
        # priority -> tenant -> waiting sequences in arrival order.
        self._waiting: dict[int, dict[str, list[Sequence]]] = {}
        self._num_waiting = 0
        self.running: list[Sequence] = []
        self._arrival_rank: dict[int, int] = {}
        self._arrivals = itertools.count()
        self._by_request: dict[str, list[Sequence]] = {}
        self.fairness = TenantFairness(self.max_num_seqs, self._arrival_rank)
        self.victims = VictimPolicy(self.fairness, self._arrival_rank)
        self.num_preemptions = 0
        self.num_fairness_preemptions = 0
        self.num_partial_prefill_chunks = 0
        self.computed_prefill_tokens = 0

    # ---- queue management -----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ValueError if it could never fit the KV cache."""
        if seq.seq_id in self._arrival_rank:
            raise ValueError(f"sequence {seq.seq_id} of request {seq.request_id!r} was already added")
        if seq.status is not SequenceStatus.WAITING or seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"sequence {seq.seq_id} must be new (waiting, no blocks) to be added")
        if not seq.token_ids:
            raise ValueError(f"request {seq.request_id!r} has an empty prompt")
        if not isinstance(seq.priority, int) or isinstance(seq.priority, bool):
            raise ValueError(f"priority must be an int, got {seq.priority!r}")
        max_tokens = getattr(seq.params, "max_tokens", 1) or 1
        bm = self.block_manager
        needed = bm.blocks_needed(len(seq.token_ids) + max_tokens - 1)
        if needed > bm.num_blocks:
            raise ValueError(
                f"request {seq.request_id!r} needs up to {len(seq.token_ids) + max_tokens - 1} tokens "
                f"of KV cache ({needed} blocks of {bm.block_size}) but the cache holds only "
                f"{bm.num_blocks} blocks; shorten the prompt or max_tokens"
            )
        self._arrival_rank[seq.seq_id] = next(self._arrivals)
        self._by_request.setdefault(seq.request_id, []).append(seq)
        self.fairness.activate(seq.tenant)
        self._push_waiting(seq)
        self.kv.queue_disk_reads(seq)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[Sequence]:
        """Finish every unfinished sequence of the request with ``reason`` (ABORT) and free its blocks."""
        seqs = [s for s in self._by_request.get(request_id, []) if not s.is_finished]
        for seq in seqs:
            self.finish(seq, reason)
        return seqs

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Mark a sequence finished, remove it from the queues and free its blocks (idempotent)."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.seq_id in self._arrival_rank:
            self._remove_waiting(seq)
        self.kv.request_finished(seq, reason)  # a prefill replica leases its prompt's blocks first
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._arrival_rank.pop(seq.seq_id, None)
        siblings = self._by_request.get(seq.request_id)
        if siblings is not None:
            siblings.remove(seq)
            if not siblings:
                del self._by_request[seq.request_id]
        self.fairness.deactivate(seq.tenant)

    def has_unfinished(self) -> bool:
        return bool(self.running) or self._num_waiting > 0

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        """Pick the work of one step (see the module docstring for the policy), with the copies between
        KV tiers it needs first (``batch.transfers``)."""
        self.kv.begin_step()
        self.fairness.advance_vtime()
        step = _Step(self.max_num_batched_tokens, self.max_loras)
        block_size = self.block_manager.block_size
        running_by_level: dict[int, dict[str, list[Sequence]]] = {}
        for seq in self.running:
            running_by_level.setdefault(seq.priority, {}).setdefault(seq.tenant, []).append(seq)
        admitting = True
        for level in sorted(running_by_level.keys() | self._waiting.keys()):
            if step.fair_level is not None:
                break  # a fairness admission step carries no lower-priority work
            for seq in self.fairness.fair_order(running_by_level.get(level, {})):
                budget = step.budget
                if budget <= 0:
                    break
                if seq.status is not SequenceStatus.RUNNING or seq.seq_id in step.scheduled:
                    continue
                pending = seq.num_pending_tokens
                if pending and len(seq.token_ids) + pending - seq.num_prompt_tokens >= seq.params.max_tokens:
                    continue  # its pending token is its last (max_tokens): nothing more to compute
                num = min(len(seq.token_ids) + pending - seq.num_computed_tokens, budget)
                if num <= 0:
                    continue
                # After the checks above: a sequence with nothing to compute takes no adapter slot.
                if seq.lora is not None and not step.takes_adapter(seq.lora.digest):
                    continue  # the step's adapter slots are taken: it runs in a later step
                # Most decodes fit the blocks they hold; only a new block needs the block manager.
                fits = seq.num_computed_tokens + num <= len(seq.block_table) * block_size
                if fits or self._reserve_slots(seq, num, step):
                    self._grant(seq, num, step)
            if admitting and level in self._waiting:
                admitting = self._admit_level(level, step)
        if step.fair_level is not None:
            step.budget = self.fairness.isolate_admissions(
                step.scheduled, step.fair_admitted, step.fair_level, step.budget
            )
        elif step.budget > 0:
            self._add_drafts(step)
        return ScheduledBatch(list(step.scheduled.values()), step.preempted, self.kv.take_plan(),
                              kv_loads=self.kv.take_loads())

    def update_after_step(self, batch: ScheduledBatch) -> list[Sequence]:
        """The step is launched: advance ``num_computed_tokens`` by each chunk, give every sequence that
        samples a pending token (its id is known once the step ran: ``token_known``), and publish newly
        full blocks of known tokens to the prefix cache.

        Returns the sequences whose chunk reached their last token, in batch order: one per row of the
        runner's logits, i.e. the sequences to sample. Sequences finished since ``schedule()`` (aborted)
        are still returned, to keep rows aligned, but not advanced. The copies committing asked for (blocks
        retained on disk) are ``batch.transfers_after``.
        """
        sampled: list[Sequence] = []
        commit = self.block_manager.commit_computed
        block_size = self.block_manager.block_size
        running = SequenceStatus.RUNNING
        for item in batch.seqs:
            seq = item.seq
            samples = item.samples
            if samples:
                sampled.append(seq)
            if seq.status is not running:
                continue
            start = item.start
            end = start + item.num_tokens - item.num_draft  # drafts are computed once accepted
            if start != seq.num_computed_tokens or end > len(seq.token_ids) + seq.num_pending_tokens:
                raise RuntimeError(f"sequence {seq.seq_id} scheduled for tokens [{start}, {end}) but it has "
                                   f"{seq.num_computed_tokens} computed of {seq.num_tokens}")
            if start < seq.num_prompt_tokens:
                self.computed_prefill_tokens += min(end, seq.num_prompt_tokens) - start
            if not samples:
                self.num_partial_prefill_chunks += 1
            elif seq.pooling is None:
                seq.num_pending_tokens += 1
            seq.num_computed_tokens = end
            if end // block_size != start // block_size or not seq.cache_lifetimes_applied:
                commit(seq)  # (a chunk within one block fills none: every decode step but one in 16)
        batch.transfers_after = self.kv.take_plan()
        return sampled

    def token_known(self, seq: Sequence, token_id: int) -> None:
        """A pending token of ``seq`` came back from the device: append it."""
        if seq.num_pending_tokens < 1:
            raise RuntimeError(f"sequence {seq.seq_id} has no pending token")
        seq.num_pending_tokens -= 1
        seq.token_ids.append(token_id)

    def draft_accepted(self, seq: Sequence, token_id: int) -> None:
        """A draft token of ``seq`` matched the token drawn at its position: append it; its K/V, computed
        by the step that verified it, is valid."""
        seq.token_ids.append(token_id)
        seq.num_computed_tokens += 1

    def drafts_verified(self, seq: Sequence) -> None:
        """The step that verified ``seq``'s drafts was processed: give back the blocks taken for the
        rejected ones, and publish the blocks the accepted ones filled."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.trim(seq, len(seq.token_ids))
            self.block_manager.commit_computed(seq)

    def commit(self, seq: Sequence) -> None:
        """Publish the blocks of ``seq`` that known tokens filled and launched steps computed (a token
        learned after the step that computes it was launched: the overlapped loop)."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.commit_computed(seq)

    # ---- internals: scheduling ------------------------------------------------------------------
    def _admit_level(self, level: int, step: _Step) -> bool:
        """Admit waiting sequences of one priority; False when admission must stop for this step."""
        # n > 1: a sibling that arrives while another stream computes the shared prompt waits for it,
        # unless some stream already has the whole prompt computed (then its blocks can be shared).
        prefilling = {s.request_id for s in self.running if s.num_computed_tokens < s.num_prompt_tokens}
        prompt_ready = {s.request_id for s in self.running if s.num_computed_tokens >= s.num_prompt_tokens}
        share = self._fair_share(level)
        # Two passes in fair order: first the tenants under their share of running slots (they may
        # preempt tenants over theirs), each for at most the sequences that bring it to its share; then
        # everyone, with lower-priority victims only. A blocked head stops admission (head-of-line).
        under = self.fairness.under_share(self._waiting.get(level, {}), self._running_at(level), share)
        for fair_pass in (True, False):
            for seq in self.fairness.fair_order(under if fair_pass else self._waiting.get(level, {})):
                if step.budget <= 0:
                    return True
                if seq.status is not SequenceStatus.WAITING or seq in step.preempted:
                    continue
                if seq.lora is not None and (step.lora_blocked or not step.takes_adapter(seq.lora.digest)):
                    # No adapter slot left in this step: admitted in a later one. Nor is any LoRA request
                    # behind it (head-of-line among adapters), so the adapters holding the slots drain
                    # instead of taking new requests forever: every adapter gets its turn.
                    step.lora_blocked = True
                    continue
                if (
                    getattr(seq.params, "n", 1) > 1
                    and seq.request_id in prefilling
                    and seq.request_id not in prompt_ready
                ):
                    continue
                if self.block_manager.waiting_for_disk(seq):
                    return False  # its prefix is being read from disk: it waits at the head of the line
                if self.kv.pull_pending(seq):
                    continue  # its prompt's blocks are on their way from a prefill replica: others go on
                fair = fair_pass and self._num_running(level, seq.tenant) < share
                if not self._make_room(seq, level, share if fair else None, step):
                    return False
                self._remove_waiting(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                prefilling.add(seq.request_id)
                num = min(seq.num_uncomputed_tokens, step.budget)
                self._grant(seq, num, step)
                if fair:
                    step.fair_admitted.append(seq)
            if fair_pass and step.fair_level is not None:
                # A fairness preemption happened: this step carries only the under-share admissions
                # (``TenantFairness.isolate_admissions``): admit nobody else, nothing of lower priority.
                return False
        return True

    def _make_room(self, seq: Sequence, level: int, share: int | None, step: _Step) -> bool:
        """A sequence slot and blocks for ``seq``, preempting if that is enough; False if it is not.

        Victims: ``VictimPolicy.admission_victim`` (lower priorities first; then, only when ``share`` is
        given, i.e. ``seq``'s tenant is under its fair share at ``level``, tenants over their share).
        """

        def next_victim() -> tuple[Sequence | None, bool]:
            return self.victims.admission_victim(self.running, level, seq.tenant, share)

        if len(self.running) >= self.max_num_seqs and next_victim()[0] is None:
            return False
        if not self._allocate(seq):
            # Preempt only if that can make room: never for nothing (a block shared with a sequence
            # that stays is not reclaimable).
            bm = self.block_manager
            candidates = self.victims.admission_candidates(self.running, level, seq.tenant, share)
            if bm.blocks_needed(len(seq.token_ids)) > bm.reclaimable(candidates):
                return False
            while not self._allocate(seq):
                victim, fair = next_victim()
                if victim is None:
                    return False
                self._preempt(victim, step, fairness=fair)
        if len(self.running) >= self.max_num_seqs:
            # A victim exists (checked above; block preemptions only free slots).
            victim, fair = next_victim()
            if victim is not None:
                self._preempt(victim, step, fairness=fair)
        return True

    def _allocate(self, seq: Sequence) -> bool:
        bm = self.block_manager
        if not bm.enable_prefix_caching and getattr(seq.params, "n", 1) > 1:
            for sibling in self._by_request.get(seq.request_id, ()):
                if (
                    sibling is not seq
                    and sibling.status is SequenceStatus.RUNNING
                    and sibling.num_computed_tokens >= sibling.num_prompt_tokens
                ):
                    return bm.fork(sibling, seq)
        return bm.allocate_for_prefill(seq)

    def _add_drafts(self, step: _Step) -> None:
        """Once everything else of the step is scheduled, let the decodes that carry draft tokens take
        them along: within what is left of the budget, in blocks nobody holds or caches (a draft never
        preempts a sequence, delays an admission or evicts a cached block). Drafts are the platform's
        bet, not the tenant's work: no served tokens are charged for them."""
        bm = self.block_manager
        for item in step.scheduled.values():
            seq = item.seq
            if not seq.draft_token_ids or item.num_tokens != 1 or seq.num_pending_tokens:
                continue
            drafts = min(len(seq.draft_token_ids), step.budget)
            if drafts <= 0:
                break
            missing = bm.blocks_needed(seq.num_computed_tokens + 1 + drafts) - len(seq.block_table)
            if missing > bm.num_unused_blocks:  # as many as the unused blocks hold
                room = (len(seq.block_table) + bm.num_unused_blocks) * bm.block_size
                drafts = room - seq.num_computed_tokens - 1
                if drafts <= 0:
                    continue
            bm.ensure_slots(seq, 1 + drafts)
            item.add_drafts(drafts)
            step.budget -= drafts

    def _reserve_slots(self, seq: Sequence, num: int, step: _Step) -> bool:
        """Blocks for ``num`` more tokens of a running sequence, preempting if needed; False if it was."""
        while not self.block_manager.ensure_slots(seq, num):
            victim = self.victims.block_victim(self.running, self._fair_share)
            if victim is None:  # unreachable: seq itself is running
                return False
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, step: _Step, fairness: bool = False) -> None:
        self._ungrant(seq, step)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        if fairness:
            self.num_fairness_preemptions += 1
            step.fair_level = seq.priority  # a fairness preemption never crosses priorities
        step.preempted.append(seq)
        self._push_waiting(seq)

    def _ungrant(self, seq: Sequence, step: _Step) -> None:
        """Take ``seq``'s tokens out of this step, if it had any: budget and served tokens come back."""
        item = step.scheduled.pop(seq.seq_id, None)
        if item is not None:
            step.budget += item.num_tokens
            self.fairness.refund(seq.tenant, item.num_tokens)

    def _grant(self, seq: Sequence, num: int, step: _Step, drafts: int = 0) -> None:
        step.scheduled[seq.seq_id] = ScheduledSeq(seq, num, drafts)
        step.budget -= num
        self.fairness.charge(seq.tenant, num)

    # ---- internals: queues and tenants ----------------------------------------------------------
    def _fair_share(self, level: int) -> int:
        """Running sequences each tenant may hold at ``level`` (see ``TenantFairness.fair_share``)."""
        return self.fairness.fair_share(self._running_at(level), self._waiting.get(level, {}))

    def _running_at(self, level: int) -> list[Sequence]:
        return [s for s in self.running if s.priority == level]

    def _num_running(self, level: int, tenant: str) -> int:
        return sum(1 for s in self.running if s.priority == level and s.tenant == tenant)

    def _push_waiting(self, seq: Sequence) -> None:
        queue = self._waiting.setdefault(seq.priority, {}).setdefault(seq.tenant, [])
        rank = self._arrival_rank
        bisect.insort(queue, seq, key=lambda s: rank[s.seq_id])
        self._num_waiting += 1

    def _remove_waiting(self, seq: Sequence) -> None:
        tenants = self._waiting[seq.priority]
        queue = tenants[seq.tenant]
        queue.remove(seq)
        self._num_waiting -= 1
        if not queue:
            del tenants[seq.tenant]
            if not tenants:
                del self._waiting[seq.priority]


class _Step:
    """What one ``schedule()`` call has granted so far."""

    __slots__ = ("budget", "scheduled", "preempted", "fair_level", "fair_admitted", "adapters", "max_loras",
                 "lora_blocked")

    def __init__(self, budget: int, max_loras: int = 0) -> None:
        self.budget = budget
        # The LoRA adapters (by digest) of the sequences granted so far: at most ``max_loras`` per step,
        # one device slot each (``engine.lora.layers``).
        self.adapters: set[str] = set()
        self.max_loras = max_loras
        # A waiting LoRA sequence found no slot: no later waiting LoRA sequence is admitted this step.
        self.lora_blocked = False
        self.scheduled: dict[int, ScheduledSeq] = {}
        self.preempted: list[Sequence] = []
        # The priority at which a fairness preemption happened this step (None: none happened), and
        # the sequences admitted there for tenants under their share: the only work of that priority
        # or lower that the step keeps.
        self.fair_level: int | None = None
        self.fair_admitted: list[Sequence] = []

    def takes_adapter(self, digest: str) -> bool:
        """Whether a sequence of adapter ``digest`` fits this step's slots (taking one if needed)."""
        if digest in self.adapters:
            return True
        if len(self.adapters) >= self.max_loras:
            return False
        self.adapters.add(digest)
        return True
