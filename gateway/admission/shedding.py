"""Overload shedding by tier: reject a request before any prefill is spent on it when the replica it
would run on cannot give it its first token within its tier's TTFT SLO.

Model (a pure function of one replica's ``GET /load`` report):

    predicted TTFT = (prefill tokens ahead + this prompt's uncached tokens) / tokens_per_s + step_time_s

"Ahead" is the pending prefill of requests the engine runs before or alongside this one: those at an
engine priority equal to or better (lower) than its tier's ``engine_priority``. The engine's scheduler
is strictly by priority, so backlog at a worse priority (a lower tier, the batch work soaking up idle
capacity at ``batch_engine_priority``) never delays it; equal-priority backlog counts in full (tenant
fairness may let the request cut in, so this errs towards shedding, never towards a missed SLO). The
comparison is on engine priorities, the scheduler's own order, so backlog at a priority no tier uses is
placed where the scheduler places it. When the report breaks its backlog down by priority
(``pending_prefill_tokens_by_priority``: engine priority → tokens; ``GET /load`` of a real or synthetic
replica) it is used; otherwise the whole ``pending_prefill_tokens`` counts as ahead for every tier
(conservative: then every tier sees the same wait, and the tightest SLO sheds everyone together).
``tokens_per_s`` is the engine's measured compute rate; with no measurement yet (idle replica) there is
nothing to predict from and nothing is shed.

Shedding protects SLOs from *queueing*: a request is shed when the wait before its own prefill can
start (``prefill tokens ahead / tokens_per_s + step_time_s``) already exceeds the SLO. Its own prefill
time is not held against it: on an idle replica a long document (whose prefill alone may take longer
than any TTFT objective) is served, since refusing it would protect nobody and no retry could succeed.
Nor are the replica's recent step times, when nothing is queued ahead: with no prefill backlog ahead of
a tier, nothing of that tier is shed, whatever ``step_time_s`` says (a long prefill, disk reads, tier
copies or a compile just ran; a new request joins the next step all the same).

Invariant (lowest tier first): a request of tier T is shed if the wait *any* tier ranked at or above T
sees exceeds that tier's SLO; the backlog ahead of T includes what is ahead of every better tier, so
whenever a tier is being shed every lower tier is too.
Shedding answers 503 with ``retry-after`` (the predicted excess, at least 1 s) and
``x-should-retry: false``: an immediate automatic retry would land in the same overload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.admission.headers import retry_headers
from gateway.errors import ServiceUnavailableError
from tollgate.settings import TierConfig


@dataclass(frozen=True, slots=True)
class ShedDecision:
    """Why a request is shed: the tier whose SLO would be missed and by how much."""

    tier: str
    limiting_tier: str
    predicted_ttft_ms: float
    slo_ms: int
    retry_after_ms: int

    def error(self) -> ServiceUnavailableError:
        return ServiceUnavailableError(
            f"The service is overloaded for the '{self.tier}' service tier: the predicted time to first "
            f"token ({self.predicted_ttft_ms:.0f} ms) exceeds the '{self.limiting_tier}' tier's objective "
            f"({self.slo_ms} ms). Please retry later or use a higher service tier.",
            code="overloaded",
            headers=retry_headers(self.retry_after_ms, should_retry=False),
        )


def _tier(tiers: Mapping[str, TierConfig], name: str) -> TierConfig:
    try:
        return tiers[name]
    except KeyError:
        raise ValueError(f"unknown tier {name!r}; configured: {sorted(tiers)}") from None


def prefill_tokens_ahead(load: Any, tier: str, tiers: Mapping[str, TierConfig]) -> int:
    """Pending prefill tokens on the replica that run before a new request of ``tier``."""
    by_priority: Mapping[int, int] | None = getattr(load, "pending_prefill_tokens_by_priority", None)
    if not by_priority:  # no breakdown (or an empty one): everything pending counts as ahead
        return max(0, int(load.pending_prefill_tokens))
    own = _tier(tiers, tier).engine_priority
    return sum(max(0, int(tokens)) for prio, tokens in by_priority.items() if int(prio) <= own)


def predict_ttft_ms(load: Any, prompt_tokens: int, tier: str, tiers: Mapping[str, TierConfig],
                    cached_tokens: int = 0) -> float:
    """Predicted time to first token (ms) of a new request of ``tier`` on the replica of ``load``
    (an ``engine.protocol.LoadReport``). ``cached_tokens``: prompt tokens the prefix cache is expected
    to serve (0 when unknown). Returns ``0.0`` when the replica has no throughput measurement."""
    if prompt_tokens < 0 or cached_tokens < 0:
        raise ValueError("prompt_tokens and cached_tokens must be >= 0")
    rate = float(load.tokens_per_s)
    if rate <= 0:
        return 0.0
    own = max(1, prompt_tokens - cached_tokens)  # at least the last prompt token is always computed
    return predict_wait_ms(load, tier, tiers) + 1000.0 * own / rate


def predict_wait_ms(load: Any, tier: str, tiers: Mapping[str, TierConfig]) -> float:
    """Predicted wait (ms) before a new request of ``tier`` starts its prefill on the replica of ``load``:
    the backlog ahead of it at the measured rate, plus one step. ``0.0`` when the rate is unmeasured."""
    rate = float(load.tokens_per_s)
    if rate <= 0:
        return 0.0
    return 1000.0 * (prefill_tokens_ahead(load, tier, tiers) / rate + max(0.0, float(load.step_time_s)))


def should_shed(load: Any, prompt_tokens: int, tier: str, tiers: Mapping[str, TierConfig],
                cached_tokens: int = 0) -> ShedDecision | None:
    """A ``ShedDecision`` if the request must be rejected now (raise ``decision.error()``), else None."""
    rank = _tier(tiers, tier).rank
    worst: ShedDecision | None = None
    worst_excess = 0.0
    for name, cfg in tiers.items():
        if cfg.rank < rank or prefill_tokens_ahead(load, name, tiers) == 0:
            continue  # a better tier, or nothing queued ahead of this one: no queueing to refuse
        excess = predict_wait_ms(load, name, tiers) - cfg.ttft_slo_ms
        if excess > worst_excess:
            worst_excess = excess
            worst = ShedDecision(tier=tier, limiting_tier=name,
                                 predicted_ttft_ms=predict_ttft_ms(load, prompt_tokens, name, tiers,
                                                                   cached_tokens),
                                 slo_ms=cfg.ttft_slo_ms, retry_after_ms=max(1000, int(excess) + 1))
    return worst
