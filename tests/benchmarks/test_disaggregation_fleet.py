"""``benchmarks/disaggregation_fleet.py`` in its quick configuration (4 replicas; colocated, 1:1 and 1:3):
the gateway's threshold sends every long prompt and no short one to a prefill replica, decode replicas keep
long prompts out of the running streams' steps (lower p99 TPOT and ITL than colocated at full load), a
short-prompt trace gains nothing from the split, and a seed gives the same figures every time."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.disaggregation_fleet import (
    QUICK,
    TRACES,
    Links,
    Pull,
    Shape,
    build_trace,
    run_grid,
    simulate,
    step_time,
)

Grid = dict[tuple[str, float, str], dict[str, Any]]  # (trace, load, topology) -> its figures


@pytest.fixture(scope="module")
def quick() -> Grid:
    return {(r["trace"], r["load"], r["topology"]): r for r in run_grid(Shape(**QUICK), ["long", "short"])}


def test_every_request_completes(quick: Grid) -> None:
    assert len(quick) == 2 * len(QUICK["loads"]) * 3
    for result in quick.values():
        assert result["requests"] == result["requests_expected"] > 0
        assert 0.0 <= result["goodput"] <= min(result["within_ttft"], result["within_tpot"]) <= 1.0
        assert result["goodput_tight_tpot"] <= result["goodput"]


def test_the_threshold_sends_long_prompts_to_prefill_replicas_and_short_ones_nowhere(
        quick: Grid) -> None:
    for (trace, _, topology), result in quick.items():
        remote = trace == "long" and topology != "colocated"  # long: 4-8k tokens, short: 200-500
        assert result["remote_share"] == (1.0 if remote else 0.0), (trace, topology)


def test_a_threshold_in_the_middle_splits_the_trace_by_prompt_length() -> None:
    shape = Shape(**{**QUICK, "min_prompt_tokens": 6000})
    result = simulate(shape, TRACES["long"], 1.0, "1:1")
    prompts = [r.prompt for r in build_trace(TRACES["long"], shape.requests["long"], 1.0, shape)]
    assert result["remote_by_request"] == [p >= 6000 for p in prompts]
    assert 0.0 < result["remote_share"] < 1.0


def test_decode_replicas_keep_long_prompts_out_of_the_streams(
        quick: Grid) -> None:
    colocated = quick["long", 1.0, "colocated"]
    # A colocated stream waits out steps that carry a full prefill chunk (the budget less the streams).
    shape = Shape()
    chunk_step = step_time(shape.max_num_batched_tokens - shape.max_num_seqs, 0.0, 0)
    assert colocated["itl_p99_s"] > chunk_step
    for split in ("1:1", "1:3"):
        disaggregated = quick["long", 1.0, split]
        assert disaggregated["itl_p99_s"] < chunk_step
        assert disaggregated["tpot_p99_s"] < colocated["tpot_p99_s"]


def test_short_prompts_gain_nothing_from_the_split(quick: Grid) -> None:
    for load in QUICK["loads"]:
        colocated = quick["short", load, "colocated"]
        for split in ("1:1", "1:3"):
            disaggregated = quick["short", load, split]
            assert disaggregated["goodput"] <= colocated["goodput"]
            assert disaggregated["ttft_p99_s"] >= colocated["ttft_p99_s"]
            assert disaggregated["output_tokens_per_s"] <= colocated["output_tokens_per_s"]


def test_a_seed_gives_the_same_figures() -> None:
    small = {**QUICK, "requests": {"long": 40, "short": 40}}
    first, second = (simulate(Shape(**small), TRACES["long"], 1.0, "1:3") for _ in range(2))
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second
    other = simulate(Shape(**small, seed=1), TRACES["long"], 1.0, "1:3")
    assert other["ttft_p50_s"] != first["ttft_p50_s"]


def test_the_step_model_is_anchored_on_the_measured_decode_step() -> None:
    assert step_time(0, 0.0, 64 * 2048) == pytest.approx(13.55e-3, abs=0.05e-3)  # RESULTS.md, H100


def test_pulls_share_the_nics_max_min_fairly() -> None:
    a, b, c, x, y = (object() for _ in range(5))
    request = build_trace(TRACES["long"], 1, 1.0, Shape())[0]
    pull = lambda source, target: Pull(request, source, target, 0, 1e9)  # type: ignore[arg-type]  # noqa: E731
    links = Links(10e9)
    links.pulls = [pull(a, x), pull(a, y), pull(b, y)]
    assert links.next_completion() == pytest.approx(0.2)
    assert [p.rate for p in links.pulls] == [5e9, 5e9, 5e9]
    links = Links(10e9)
    links.pulls = [pull(a, x), pull(b, x), pull(c, x), pull(a, y)]
    assert links.next_completion() == pytest.approx(0.15)  # x in: a third each; a out gives a->y the rest
    assert [p.rate for p in links.pulls] == pytest.approx([10e9 / 3] * 3 + [20e9 / 3])
    a_to_y = links.pulls[-1]
    assert links.advance(0.15) == [a_to_y]
    assert links.next_completion() == pytest.approx(0.3)  # x's three pulls still share x
