"""Tenant fairness for the scheduler: virtual token counters, fair order, fair share, fair victims.

Pure Python (no torch). The ``Scheduler`` owns the queues and the running list and asks
``TenantFairness`` the fairness questions about the sequences it hands over; this module owns only
the per-tenant counters. Policies:

- **Tenant fairness.** Within one priority, work is picked tenant by tenant: the tenant with the least
  *served tokens* (a virtual token counter, charged with every token computed for it) goes first,
  FCFS within a tenant and between equal tenants. A tenant that becomes active starts at the current
  minimum of the active tenants (the virtual time), so idle time never banks credit.
- **Fair share of running slots (and the KV blocks they hold).** Ordering the waiting queue is not
  enough: once one tenant holds every running slot, another tenant's request would wait for one of its
  streams to end. Within priority ``p``, a tenant's fair share is ``ceil(max_num_seqs / T)`` running
  sequences, ``T`` the number of distinct tenants with running or waiting sequences at ``p``. When a
  waiting sequence of tenant ``t`` cannot be admitted (sequence slots or blocks short), ``t`` holds fewer
  than its share at ``p`` and another tenant ``u`` holds more than its share at ``p``, the latest-arrived
  running sequence of the tenant furthest over its share is preempted by recompute (the usual path: it
  re-enters waiting at its place in line, nothing is re-billed as cached) and ``t``'s sequence is
  admitted. Lower-priority work is preempted first, as before, and a fairness preemption never crosses
  priorities. No thrash: a tenant at or below its share is never a victim, and a tenant already at its
  share never triggers one, so a preemption can never be undone by the reverse one. Admission scans the
  tenants under their share first (up to their share), then everyone, each pass in fair order and
  head-of-line (a blocked head stops admission, for lower priorities too). When a running
  sequence needs a block and none is free, the victim is still of the lowest priority present, but
  within it a sequence of a tenant over its share goes before the latest arrival. The victim returns
  when a slot frees up and no tenant under its share is waiting, at the latest when the other tenants'
  work ends. Counted in ``num_fairness_preemptions`` (also in ``num_preemptions``).
- **A fairness admission gets its own step.** When admitting a waiting sequence at priority ``p``
  required a fairness preemption, that step carries only the admissions of the tenants under their
  share at ``p`` (the first admission pass; each chunk then grows into the budget freed below, its
  blocks being allocated already) and the work of strictly higher priorities: the decodes and chunks of
  the running sequences at ``p`` or lower are dropped from this step only (their served tokens are
  refunded, ``num_computed_tokens`` does not move) and nothing else is admitted; they all run the next
  step. The newcomer's prefill is thus not slowed by the saturating tenant's decodes (the cost: one
  step of theirs per fairness preemption, which only happens when a tenant under its share arrives).
  A block that ``ensure_slots`` reserved for a dropped token stays in the sequence's table: it covers
  the position computed next step, where ``ensure_slots`` finds it. Steps without a fairness preemption
  (unsaturated engine, single tenant, priority or block-pressure preemptions) are unchanged.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Mapping

from engine.sequence import ScheduledSeq, Sequence


class TenantFairness:
    """Served-token counters per tenant and the fairness decisions that read them.

    A tenant is *active* from the ``activate`` of its first unfinished sequence to the ``deactivate``
    of its last. The virtual time never decreases; when advanced it becomes the least counter of the
    active tenants, and a tenant activated later starts no lower than it. Counters of inactive tenants
    at or below the virtual time are forgotten (they would restart there anyway).

    ``arrival_rank`` (seq_id -> arrival order) belongs to the scheduler and is only read here: it
    breaks ties FCFS and picks the latest arrival as a victim.
    """

    def __init__(self, max_num_seqs: int, arrival_rank: Mapping[int, int]) -> None:
        self.max_num_seqs = max_num_seqs
        self._rank = arrival_rank
        self._served: dict[str, int] = {}
        self._active: dict[str, int] = {}  # tenant -> unfinished sequences
        self._vtime = 0

    # ---- virtual token counters -----------------------------------------------------------------
    def served_tokens(self, tenant: str) -> int:
        """The tenant's virtual token counter (tokens served, shifted by the virtual time on activation)."""
        return self._served.get(tenant, self._vtime)

    def activate(self, tenant: str) -> None:
        """One more unfinished sequence of ``tenant``; the first starts it at the virtual time."""
        count = self._active.get(tenant, 0)
        if count == 0:
            self.advance_vtime()
            self._served[tenant] = max(self._served.get(tenant, self._vtime), self._vtime)
        self._active[tenant] = count + 1

    def deactivate(self, tenant: str) -> None:
        """One unfinished sequence of ``tenant`` fewer."""
        count = self._active[tenant] - 1
        if count:
            self._active[tenant] = count
            return
        del self._active[tenant]
        self.advance_vtime()
        if self._served.get(tenant, 0) <= self._vtime:
            self._served.pop(tenant, None)

    def advance_vtime(self) -> None:
        if self._active:
            self._vtime = max(self._vtime, min(self._served.get(t, self._vtime) for t in self._active))

    def charge(self, tenant: str, num_tokens: int) -> None:
        self._served[tenant] = self._served.get(tenant, self._vtime) + num_tokens

    def refund(self, tenant: str, num_tokens: int) -> None:
        """Take back tokens charged this step (the tenant was charged, so its counter exists)."""
        self._served[tenant] -= num_tokens

    # ---- decisions ------------------------------------------------------------------------------
    def fair_order(self, by_tenant: Mapping[str, list[Sequence]]) -> Iterator[Sequence]:
        """Yield sequences tenant by tenant, least-served tenant first, re-reading counters as they grow.

        Within a tenant, in the given order; ties go to the earliest-arrived head, then the tenant name.
        Iterates over snapshots, so callers may admit or preempt while iterating.
        """
        queues = {tenant: list(seqs) for tenant, seqs in by_tenant.items() if seqs}
        if len(queues) == 1:  # one tenant: its own order, no heap
            yield from next(iter(queues.values()))
            return
        rank = self._rank
        heap = [(self.served_tokens(t), rank[q[0].seq_id], t) for t, q in queues.items()]
        heapq.heapify(heap)
        position = dict.fromkeys(queues, 0)
        while heap:
            _, _, tenant = heapq.heappop(heap)
            queue = queues[tenant]
            i = position[tenant]
            yield queue[i]
            position[tenant] = i + 1
            if i + 1 < len(queue):
                heapq.heappush(heap, (self.served_tokens(tenant), rank[queue[i + 1].seq_id], tenant))

    def fair_share(self, running: Iterable[Sequence], waiting_tenants: Iterable[str]) -> int:
        """Running sequences each tenant may hold at one priority: ceil(max_num_seqs / T), ``T`` the
        tenants with a sequence in ``running`` or a name in ``waiting_tenants`` (both of that priority)."""
        tenants = {s.tenant for s in running}
        tenants.update(waiting_tenants)
        return -(-self.max_num_seqs // max(1, len(tenants)))

    def under_share(
        self, waiting: Mapping[str, list[Sequence]], running: Iterable[Sequence], share: int
    ) -> dict[str, list[Sequence]]:
        """The waiting queues of the tenants running fewer than ``share`` sequences, each cut to the
        sequences that bring it to its share (``waiting`` and ``running`` of one priority)."""
        counts = _count_by_tenant(running)
        return {t: q[: share - counts.get(t, 0)] for t, q in waiting.items() if counts.get(t, 0) < share}

    def fair_victim(self, running: list[Sequence], tenant: str, share: int) -> Sequence | None:
        """The latest-arrived sequence of ``running`` (one priority) of the tenant furthest over its fair
        share, if ``tenant`` is under its share and another tenant is over it."""
        counts = _count_by_tenant(running)
        if counts.get(tenant, 0) >= share:
            return None
        candidates = [s for s in running if s.tenant != tenant and counts[s.tenant] > share]
        if not candidates:
            return None
        rank = self._rank
        return max(candidates, key=lambda s: (counts[s.tenant], rank[s.seq_id]))

    def over_share(self, running: Iterable[Sequence], tenant: str, share: int) -> list[Sequence]:
        """Every sequence that repeated ``fair_victim`` calls for ``tenant`` may take from ``running``
        (one priority): the latest arrivals of each other tenant beyond its share."""
        rank = self._rank
        victims: list[Sequence] = []
        for seqs in _group_by_tenant(s for s in running if s.tenant != tenant).values():
            if len(seqs) > share:
                seqs.sort(key=lambda s: rank[s.seq_id])
                victims += seqs[share:]
        return victims

    def block_victim(self, running: list[Sequence], share: int) -> Sequence:
        """The sequence of ``running`` (the lowest priority present, not empty) to preempt for a running
        sequence's block: the latest arrival of the tenants over ``share``, else the latest arrival."""
        counts = _count_by_tenant(running)
        rank = self._rank
        return max(running, key=lambda s: (counts[s.tenant] > share, rank[s.seq_id]))

    def isolate_admissions(
        self, scheduled: dict[int, ScheduledSeq], admitted: list[Sequence], level: int, budget: int
    ) -> int:
        """Make a step that admitted by fairness preemption at ``level`` its own (see the module
        docstring); returns the budget left.

        Drops from ``scheduled`` (in place) everything of priority ``level`` or lower but the
        under-share ``admitted``, refunding their served tokens, then grows the admitted chunks into
        the freed budget. The dropped running sequences keep their state and their blocks (a block
        reserved this step for a token not computed covers a position the sequence computes next
        step) and are scheduled normally next step.
        """
        keep = {seq.seq_id for seq in admitted}
        for seq_id, item in list(scheduled.items()):
            if item.seq.priority >= level and seq_id not in keep:
                del scheduled[seq_id]
                budget += item.num_tokens
                self.refund(item.seq.tenant, item.num_tokens)
        for seq in admitted:
            chunk = scheduled.get(seq.seq_id)
            if chunk is None or budget <= 0:
                continue
            # allocate_for_prefill / fork gave blocks for every token, so a longer chunk needs none.
            extra = min(seq.num_uncomputed_tokens - chunk.num_tokens, budget)
            if extra > 0:
                chunk.extend(extra)
                budget -= extra
                self.charge(seq.tenant, extra)
        return budget


def _group_by_tenant(seqs: Iterable[Sequence]) -> dict[str, list[Sequence]]:
    groups: dict[str, list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(seq.tenant, []).append(seq)
    return groups


def _count_by_tenant(seqs: Iterable[Sequence]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for seq in seqs:
        counts[seq.tenant] = counts.get(seq.tenant, 0) + 1
    return counts
