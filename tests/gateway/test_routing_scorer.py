"""The index policy's scorer (``gateway.routing.ScoreWeights``): prefix hits weighed against the
replica's queue and KV usage. Pure logic over the router's in-memory state: with equal loads the holder
wins, a busy holder whose cache is filling hands new work to an idle replica, one tenant's blocks never
attract another tenant's prompt, and the same state gives the same choice."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import prefix_block_hashes
from gateway.routing import Router, ScoreWeights
from tests.gateway.test_routing import load, make_router


@pytest.fixture
async def router():
    async for r in make_router("index"):
        yield r


def prompt(tenant: str, blocks: int = 8, seed: int = 0) -> list[bytes]:
    return prefix_block_hashes([(seed + 7 * i) % 500 + 5 for i in range(16 * blocks)], 16, tenant)


def hold(router: Router, replica: int, hashes: list[bytes]) -> None:
    router.replicas[replica].kv.held.update(dict.fromkeys(hashes, 1))


def test_each_score_moves_the_right_way() -> None:
    weights = ScoreWeights()
    assert weights.score(0.9, 1.0, 0.3) > weights.score(0.5, 1.0, 0.3)  # more of the prompt held
    assert weights.score(0.5, 1.0, 0.3) > weights.score(0.5, 4.0, 0.3)  # a longer queue
    assert weights.score(0.5, 1.0, 0.3) > weights.score(0.5, 1.0, 0.8)  # a fuller KV cache
    assert weights.score(0.0, 0.0, 0.0) > 0


def test_with_equal_loads_the_holder_of_more_of_the_prompt_wins(router: Router) -> None:
    p = prompt("tenant-1")
    hold(router, 1, p[:3])
    hold(router, 2, p[:6])
    assert router.pick("m", p) is router.replicas[2]
    hold(router, 3, p)
    assert router.pick("m", p) is router.replicas[3]


def test_a_holder_a_little_busier_keeps_the_prompt(router: Router) -> None:
    p = prompt("tenant-1")
    hold(router, 1, p)
    router.replicas[1].inflight = 3
    router.replicas[1].load = load(kv_usage=0.3)
    assert router.pick("m", p) is router.replicas[1]


def test_a_holder_with_a_long_queue_and_a_filling_cache_hands_over_to_an_idle_replica(router: Router) -> None:
    p = prompt("tenant-1")
    holder = router.replicas[1]
    hold(router, 1, p)
    holder.inflight = 8  # under the in-flight watermark (16 more than the least)
    holder.load = load(waiting=2, kv_usage=0.9)  # under the queue and KV watermarks
    assert not holder.over_watermark(0)
    chosen = router.pick("m", p)
    assert chosen is not holder and chosen.inflight == 0
    holder.load = load(waiting=2, kv_usage=0.3)  # its requests finish: it takes the prompt again
    holder.inflight = 1
    assert router.pick("m", p) is holder


def test_a_new_prefix_goes_to_the_least_busy_replica_and_then_stays(router: Router) -> None:
    p = prompt("tenant-1", seed=3)
    for i, replica in enumerate(router.replicas):
        replica.load = load(kv_usage=0.2 + 0.1 * i)
    first = router.pick("m", p)
    assert first is router.replicas[0]
    router.remember(first, p)  # sent: what it computes counts as held until its events say so
    router.replicas[0].load = load(kv_usage=0.4)
    assert router.pick("m", p) is first


def test_another_tenants_identical_prompt_is_never_drawn_to_the_holder(router: Router) -> None:
    mine, theirs = prompt("tenant-1"), prompt("tenant-2")  # the same tokens, salted per tenant
    hold(router, 1, mine)
    router.replicas[1].inflight = 1
    assert router.pick("m", mine) is router.replicas[1]
    assert router.cached_prefix_blocks(router.replicas[1], theirs) == 0
    assert router.pick("m", theirs) is not router.replicas[1]  # a little busier, and holds nothing of it


def test_the_same_state_gives_the_same_choice(router: Router) -> None:
    prompts = [prompt("tenant-1", seed=s) for s in range(30)]
    for i, p in enumerate(prompts[:10]):
        hold(router, i % 4, p[: 2 + i % 5])
    for i, replica in enumerate(router.replicas):
        replica.inflight = i % 3
        replica.load = load(waiting=i % 2, kv_usage=0.1 * (i + 1))
    first = [router.pick("m", p).url for p in prompts]
    assert [router.pick("m", p).url for p in prompts] == first
    assert len(set(first)) > 1
