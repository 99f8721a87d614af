"""Victim selection for preemption by recompute: which running sequence the scheduler preempts.

Pure Python (no torch). The ``Scheduler`` owns the running list and performs the preemption (frees the
blocks, requeues the sequence); ``VictimPolicy`` only picks, from the running sequences it is handed.
Invariants (the policies are stated in ``engine.scheduler`` and ``engine.fairness``):

- **Admission.** A waiting sequence at priority ``level`` may take lower-priority sequences first: the
  latest arrival of the lowest priority. Only then, and only when a fair ``share`` is given (its tenant
  is under its share at ``level``), a fairness victim: the latest arrival of the other tenant furthest
  over its share at ``level``. A fairness victim never crosses priorities, and a tenant at or below its
  share is never one.
- **Blocks for a running sequence.** The victim is of the lowest priority present (possibly the
  requester itself): within it, the latest arrival of the tenants over their share, else the latest
  arrival. The earliest-arrived sequence of the highest priority is therefore never a victim while
  another sequence runs, so it always progresses.
- **Never for nothing.** ``admission_candidates`` is exactly the set that repeated ``admission_victim``
  calls may take, so the scheduler preempts only when that set frees enough blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from engine.fairness import TenantFairness
from engine.sequence import Sequence


class VictimPolicy:
    """Picks preemption victims; ``arrival_rank`` (seq_id -> arrival order) is the scheduler's, read only."""

    def __init__(self, fairness: TenantFairness, arrival_rank: Mapping[int, int]) -> None:
        self._fairness = fairness
        self._rank = arrival_rank

    def admission_victim(
        self, running: list[Sequence], level: int, tenant: str, share: int | None
    ) -> tuple[Sequence | None, bool]:
        """The next victim for admitting a waiting sequence of ``tenant`` at ``level``, and whether it is
        a fairness victim (None, False: no victim left). ``share``: see the module docstring."""
        rank = self._rank
        lower = [s for s in running if s.priority > level]
        if lower:
            return max(lower, key=lambda s: (s.priority, rank[s.seq_id])), False
        if share is None:
            return None, False
        victim = self._fairness.fair_victim(_at(running, level), tenant, share)
        return victim, victim is not None

    def admission_candidates(
        self, running: list[Sequence], level: int, tenant: str, share: int | None
    ) -> list[Sequence]:
        """Every sequence that repeated ``admission_victim`` calls with these arguments may take."""
        victims = [s for s in running if s.priority > level]
        if share is not None:
            victims += self._fairness.over_share(_at(running, level), tenant, share)
        return victims

    def block_victim(self, running: list[Sequence], fair_share: Callable[[int], int]) -> Sequence | None:
        """The victim when a running sequence needs a block (None only if nothing runs);
        ``fair_share(level)`` gives the tenants' fair share at a priority."""
        if not running:
            return None
        lowest = max(s.priority for s in running)
        return self._fairness.block_victim(_at(running, lowest), fair_share(lowest))


def _at(running: Iterable[Sequence], level: int) -> list[Sequence]:
    return [s for s in running if s.priority == level]
