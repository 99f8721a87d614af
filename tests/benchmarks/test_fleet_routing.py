"""``benchmarks/fleet_routing.py`` in its quick configuration (4 simulated replicas, 4 tenants, 32 agent
sessions): every request completes under every policy, no policy beats the trace's ideal hit rate, a seed
gives the same figures every time, and routing by the index beats round robin's hit rate."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.fleet_routing import QUICK, Shape, build_trace, ideal_hit_tokens, main, simulate


@pytest.fixture(scope="module")
def quick() -> dict[str, dict[str, Any]]:
    return {r["policy"]: r for r in main(["--quick"])}


def test_every_request_completes_under_every_policy(quick: dict[str, dict[str, Any]]) -> None:
    assert set(quick) == {"round_robin", "affinity", "index"}
    for result in quick.values():
        assert result["requests"] == result["requests_expected"] > 0
        assert result["queueing_p95_ms"] <= result["ttft_p95_ms"]


def test_no_policy_beats_the_ideal(quick: dict[str, dict[str, Any]]) -> None:
    for result in quick.values():
        assert 0.0 < result["hit_rate"] <= result["ideal_hit_rate"] < 1.0


def test_the_index_beats_round_robin(quick: dict[str, dict[str, Any]]) -> None:
    assert quick["index"]["hit_rate"] > 1.2 * quick["round_robin"]["hit_rate"]


def test_a_seed_gives_the_same_figures() -> None:
    shape = Shape(**QUICK, seed=3)
    first, second = (simulate(shape, "index") for _ in range(2))
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second
    other = simulate(Shape(**QUICK, seed=4), "index")
    assert other["prompt_tokens"] != first["prompt_tokens"]


def test_the_ideal_counts_a_tenants_system_prompt_once_and_each_session_its_transcript() -> None:
    shape = Shape(**{**QUICK, "tenants": 1, "sessions": 2, "turns": (2, 2)})
    first, second = sorted(build_trace(shape), key=lambda s: s.start_s)
    shared = 0  # the system prompt's full blocks, common to both sessions' chains
    while first.hashes[shared] == second.hashes[shared]:
        shared += 1
    returning = sum((s.turns[1].prompt_tokens - 1) // 16 for s in (first, second))
    # Turn 2 resends turn 1 and its answer: everything but the answer's last token was computed.
    reused = sum(min((s.turns[1].prompt_tokens - 1) // 16,
                     (s.turns[0].prompt_tokens + s.turns[0].output_tokens - 1) // 16)
                 for s in (first, second))
    assert reused <= returning
    assert ideal_hit_tokens([first, second]) == 16 * (shared + reused)
