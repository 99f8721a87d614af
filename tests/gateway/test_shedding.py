"""Overload shedding: TTFT prediction from a replica's load report, shedding on the queue ahead of a
request (never on its own prefill), lowest tier shed first."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.protocol import LoadReport
from gateway.admission.shedding import predict_ttft_ms, prefill_tokens_ahead, should_shed
from tollgate.settings import default_tiers

TIERS = default_tiers()  # priority (500 ms), default (700 ms), flex (5000 ms)


def report(pending: int, tokens_per_s: float = 10_000.0, step_time_s: float = 0.02) -> LoadReport:
    return LoadReport(model="m", pool="interactive", waiting=3, running=4, pending_prefill_tokens=pending,
                      kv_usage=0.5, num_kv_blocks=100, free_kv_blocks=50, prefix_hit_rate=0.0,
                      num_preemptions=0, tokens_per_s=tokens_per_s, step_time_s=step_time_s, ttft_s=0.1)


class ByPriority:
    """A load report that also breaks its prefill backlog down by engine priority."""

    def __init__(self, by_priority: dict[int, int], tokens_per_s: float = 10_000.0) -> None:
        self.pending_prefill_tokens_by_priority = by_priority
        self.pending_prefill_tokens = sum(by_priority.values())
        self.tokens_per_s = tokens_per_s
        self.step_time_s = 0.0


def test_prediction_is_backlog_plus_own_prefill_over_measured_rate() -> None:
    # (4,000 ahead + 1,000 own) / 10,000 tok/s = 500 ms, + one 20 ms step.
    assert predict_ttft_ms(report(4_000), 1_000, "default", TIERS) == pytest.approx(520.0)
    # Expected cache hits are not prefilled; the last prompt token always is.
    assert predict_ttft_ms(report(0), 1_000, "default", TIERS, cached_tokens=1_000) == pytest.approx(20.1)


def test_an_unmeasured_replica_predicts_nothing_and_sheds_nothing() -> None:
    assert predict_ttft_ms(report(10**9, tokens_per_s=0.0), 100, "flex", TIERS) == 0.0
    assert should_shed(report(10**9, tokens_per_s=0.0), 100, "flex", TIERS) is None


def test_only_backlog_at_equal_or_better_tiers_is_ahead() -> None:
    prio = {name: cfg.engine_priority for name, cfg in TIERS.items()}
    load = ByPriority({prio["priority"]: 1_000, prio["default"]: 2_000, prio["flex"]: 30_000, 99: 50_000})
    assert prefill_tokens_ahead(load, "priority", TIERS) == 1_000
    assert prefill_tokens_ahead(load, "default", TIERS) == 3_000
    assert prefill_tokens_ahead(load, "flex", TIERS) == 33_000  # batch priority 99 is never ahead
    assert predict_ttft_ms(load, 0, "priority", TIERS) == pytest.approx(100.1)


def test_light_load_sheds_nobody() -> None:
    for tier in TIERS:
        assert should_shed(report(1_000), 500, tier, TIERS) is None


def test_a_long_prompt_is_shed_only_for_the_queue_ahead_of_it() -> None:
    # 20,000 own tokens at 10k tok/s: 2 s of prefill, over the priority and default SLOs on its own.
    long_document = 20_000
    assert predict_ttft_ms(report(0), long_document, "priority", TIERS) > TIERS["default"].ttft_slo_ms
    for tier in TIERS:
        assert should_shed(report(0), long_document, tier, TIERS) is None  # idle: nothing to protect
        assert should_shed(report(1_000), long_document, tier, TIERS) is None  # a short queue fits
    # A queue that alone breaks the SLO still sheds it, like any other request.
    assert should_shed(report(8_000), long_document, "default", TIERS) is not None


def test_lowest_tier_is_shed_first_as_load_grows() -> None:
    prio = {name: cfg.engine_priority for name, cfg in TIERS.items()}
    # Flex backlog alone: only flex requests wait behind it.
    flex_flood = ByPriority({prio["flex"]: 60_000})
    assert should_shed(flex_flood, 500, "flex", TIERS) is not None
    assert should_shed(flex_flood, 500, "default", TIERS) is None
    assert should_shed(flex_flood, 500, "priority", TIERS) is None
    # Default-tier backlog that breaks the default SLO also sheds flex, not priority.
    default_flood = ByPriority({prio["default"]: 8_000})
    assert should_shed(default_flood, 500, "priority", TIERS) is None
    assert should_shed(default_flood, 500, "default", TIERS) is not None
    decision = should_shed(default_flood, 500, "flex", TIERS)
    assert decision is not None and decision.limiting_tier == "default"


def test_without_a_breakdown_shedding_is_still_monotonic_in_tier() -> None:
    shed = {tier: should_shed(report(5_500), 0, tier, TIERS) is not None for tier in TIERS}
    # 5,500 tokens at 10k tok/s ≈ 570 ms: over priority's 500 ms SLO, so every tier at or below it sheds.
    assert shed == {"priority": True, "default": True, "flex": True}
    shed = {tier: should_shed(report(3_000), 0, tier, TIERS) is not None for tier in TIERS}
    assert shed == {"priority": False, "default": False, "flex": False}


def test_shed_error_is_503_with_retry_after_and_no_automatic_retry() -> None:
    decision = should_shed(report(100_000), 500, "default", TIERS)
    assert decision is not None
    error = decision.error()
    assert error.status == 503
    assert error.headers["x-should-retry"] == "false"
    # ~10 s of backlog over a 0.5-0.7 s SLO: retry in about the excess, in whole seconds.
    assert 9 <= int(error.headers["retry-after"]) <= 11
    assert error.body()["error"]["code"] == "overloaded"


def test_unknown_tier_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown tier"):
        should_shed(report(0), 1, "gold", TIERS)


@given(step_time_s=st.floats(0.0, 600.0), tokens_per_s=st.floats(0.0, 1e7), prompt=st.integers(0, 10**6),
       cached=st.integers(0, 10**6), tier=st.sampled_from(sorted(TIERS)),
       batch_backlog=st.integers(0, 10**9))
@settings(max_examples=300, deadline=None)
def test_nothing_queued_ahead_is_never_shed(step_time_s: float, tokens_per_s: float, prompt: int, cached: int,
                                          tier: str, batch_backlog: int) -> None:
    """Whatever the replica's recent step times (a long prefill, disk reads, tier copies, a compile), a
    replica with no prefill queued ahead of a request's tier never sheds it: shedding refuses queueing."""
    idle = report(0, tokens_per_s=tokens_per_s, step_time_s=step_time_s)
    assert should_shed(idle, prompt, tier, TIERS, min(cached, prompt)) is None
    # Backlog below every tier (the batch tier's work soaking up idle capacity) is not ahead either.
    below = ByPriority({99: batch_backlog}, tokens_per_s=tokens_per_s)
    below.step_time_s = step_time_s
    assert should_shed(below, prompt, tier, TIERS, min(cached, prompt)) is None
