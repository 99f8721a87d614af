"""Shedding counts as "ahead" the backlog at engine priorities the scheduler runs first or alongside
(``<=`` the tier's ``engine_priority``), read from a real ``LoadReport`` breakdown: a flex backlog sheds
flex while priority requests are still admitted; without a breakdown every tier sees everything."""

from __future__ import annotations

from engine.protocol import LoadReport
from gateway.admission.shedding import prefill_tokens_ahead, should_shed
from tollgate.settings import TierConfig, default_tiers

TIERS = default_tiers()  # priority 0 (500 ms), default 1 (700 ms), flex 2 (5000 ms)


def report(by_priority: dict[int, int], tokens_per_s: float = 1_000.0,
           step_time_s: float = 0.1) -> LoadReport:
    # As parsed from the JSON of GET /load: the priorities arrive as strings.
    return LoadReport.model_validate({
        "model": "m", "pool": "interactive", "waiting": 10, "running": 1,
        "pending_prefill_tokens": sum(by_priority.values()),
        "pending_prefill_tokens_by_priority": {str(k): v for k, v in by_priority.items()},
        "kv_usage": 0.1, "num_kv_blocks": 100, "free_kv_blocks": 90, "prefix_hit_rate": 0.0,
        "num_preemptions": 0, "tokens_per_s": tokens_per_s, "step_time_s": step_time_s, "ttft_s": 0.1})


def test_flex_backlog_sheds_flex_but_not_priority() -> None:
    load = report({2: 20_000})  # 20 s of flex prefill at 1,000 tok/s
    flex = should_shed(load, 50, "flex", TIERS)
    assert flex is not None and flex.limiting_tier == "flex" and flex.retry_after_ms > 10_000
    error = flex.error()
    assert error.status == 503 and error.code == "overloaded"
    assert error.headers["x-should-retry"] == "false"
    assert should_shed(load, 50, "priority", TIERS) is None
    assert should_shed(load, 50, "default", TIERS) is None


def test_without_the_breakdown_all_backlog_is_ahead_of_every_tier() -> None:
    load = report({2: 20_000})
    load.pending_prefill_tokens_by_priority = {}
    assert should_shed(load, 50, "priority", TIERS) is not None
    assert prefill_tokens_ahead(load, "priority", TIERS) == 20_000


def test_backlog_is_placed_by_engine_priority_not_by_tier() -> None:
    # Batch work soaking at a priority *better* than flex (a deployment's choice) is ahead of flex, and
    # the usual batch priority (one below the lowest tier) is ahead of nobody.
    load = report({0: 100, 1: 200, 2: 300, 3: 10_000})
    assert prefill_tokens_ahead(load, "priority", TIERS) == 100
    assert prefill_tokens_ahead(load, "default", TIERS) == 300
    assert prefill_tokens_ahead(load, "flex", TIERS) == 600
    tiers = TIERS | {"flex": TierConfig(engine_priority=5, ttft_slo_ms=5_000, tpot_slo_ms=200, rank=1)}
    assert prefill_tokens_ahead(load, "flex", tiers) == 10_600


def test_a_flex_backlog_below_the_flex_slo_sheds_nobody() -> None:
    load = report({2: 4_000})  # 4 s + one step < 5 s
    assert all(should_shed(load, 50, tier, TIERS) is None for tier in TIERS)
