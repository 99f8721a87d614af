"""Replica choice: healthy only, prefix affinity (learned and rendezvous), load watermark, failover."""

from __future__ import annotations

import pytest

from engine.block_hash import prefix_block_hashes
from engine.protocol import LoadReport
from gateway.engine_client import EngineClient
from gateway.errors import ServiceUnavailableError
from gateway.routing import WATERMARK_INFLIGHT_GAP, WATERMARK_WAITING, Router
from tollgate.settings import ModelConfig, PoolConfig, Settings

URLS = [f"http://replica-{i}:8100" for i in range(4)]


def load(waiting: int = 0, kv_usage: float = 0.1) -> LoadReport:
    return LoadReport(model="m", pool="interactive", waiting=waiting, running=1, pending_prefill_tokens=0,
                      kv_usage=kv_usage, num_kv_blocks=100, free_kv_blocks=90, prefix_hit_rate=0.0,
                      num_preemptions=0, tokens_per_s=100.0, step_time_s=0.01, ttft_s=0.1)


@pytest.fixture
async def router():
    settings = Settings(environment="test", models=[ModelConfig(name="m", path=None)],
                        pools={"interactive": PoolConfig(replicas=URLS)})
    client = EngineClient(request_timeout_s=5)
    r = Router(settings, client)
    for replica in r.replicas:
        replica.healthy = True
        replica.load = load()
    yield r
    await client.aclose()


def hashes(seed: int, blocks: int = 4) -> list[bytes]:
    return prefix_block_hashes(list(range(seed, seed + 16 * blocks)), 16, "salt")


def test_same_prefix_goes_to_the_same_replica(router: Router) -> None:
    picks = {router.pick("m", hashes(s)).url for s in range(40)}
    assert len(picks) > 1  # different prefixes spread over replicas
    for s in range(10):
        assert len({router.pick("m", hashes(s)).url for _ in range(5)}) == 1


def test_learned_affinity_follows_the_deepest_known_block(router: Router) -> None:
    h = hashes(1, blocks=6)
    chosen = router.replicas[3]
    router.remember(chosen, h[:5])
    assert router.pick("m", h) is chosen


def test_cached_prefix_estimate(router: Router) -> None:
    h = hashes(4, blocks=5)
    replica = router.replicas[1]
    assert router.cached_prefix_blocks(replica, h) == 0
    router.remember(replica, h[:3])
    assert router.cached_prefix_blocks(replica, h) == 3
    assert router.cached_prefix_blocks(router.replicas[2], h) == 0


def test_watermark_overrides_affinity(router: Router) -> None:
    h = hashes(2)
    preferred = router.pick("m", h)
    preferred.load = load(waiting=WATERMARK_WAITING)
    assert router.pick("m", h) is not preferred
    preferred.load = load()
    preferred.inflight = WATERMARK_INFLIGHT_GAP
    assert router.pick("m", h) is not preferred


def test_unhealthy_and_excluded_replicas_are_skipped(router: Router) -> None:
    h = hashes(3)
    first = router.pick("m", h)
    router.mark_failed(first, "connection refused")
    second = router.pick("m", h)
    assert second is not first
    third = router.pick("m", h, exclude=[second])
    assert third not in (first, second)
    for replica in router.replicas:
        router.mark_failed(replica, "down")
    with pytest.raises(ServiceUnavailableError):
        router.pick("m", h)


def test_short_prompt_goes_to_least_loaded(router: Router) -> None:
    for i, replica in enumerate(router.replicas):
        replica.inflight = 5 - i
    assert router.pick("m", []) is router.replicas[-1]


async def test_probe_marks_unreachable_replica_down(router: Router) -> None:
    await router.poll_once()  # none of these hosts exists
    assert not any(r.healthy for r in router.replicas)
    assert all(r.last_error for r in router.replicas)
