"""Replica choice: healthy only, prefix affinity (learned and rendezvous), load watermark, failover, and
the per-tenant ``prompt_cache_key`` routing key. Routing by the replicas' KV index: test_kv_index.py."""

from __future__ import annotations

import pytest

from engine.kv.block_hash import prefix_block_hashes
from engine.protocol import LoadReport
from gateway.engine_client import EngineClient
from gateway.errors import ServiceUnavailableError
from gateway.generation.service import tenant_routing_key
from gateway.routing import WATERMARK_INFLIGHT_GAP, WATERMARK_WAITING, Router
from gateway.tenants.cache_salt import cache_salt
from tollgate.settings import ModelConfig, PoolConfig, Settings

URLS = [f"http://replica-{i}:8100" for i in range(4)]


def load(waiting: int = 0, kv_usage: float = 0.1) -> LoadReport:
    return LoadReport(model="m", pool="interactive", waiting=waiting, running=1, pending_prefill_tokens=0,
                      kv_usage=kv_usage, num_kv_blocks=100, free_kv_blocks=90, prefix_hit_rate=0.0,
                      num_preemptions=0, tokens_per_s=100.0, step_time_s=0.01, ttft_s=0.1)


async def make_router(policy: str = "index"):  # type: ignore[no-untyped-def]
    settings = Settings(environment="test", models=[ModelConfig(name="m", path=None)],
                        pools={"interactive": PoolConfig(replicas=URLS)}, routing_policy=policy)
    client = EngineClient(request_timeout_s=5)
    r = Router(settings, client)
    for replica in r.replicas:
        replica.healthy = True
        replica.load = load()
    yield r
    await client.aclose()


@pytest.fixture
async def router():
    async for r in make_router():
        yield r


@pytest.fixture(params=["index", "affinity"])
async def any_router(request: pytest.FixtureRequest):
    async for r in make_router(request.param):
        yield r


@pytest.fixture
async def affinity_router():
    async for r in make_router("affinity"):
        yield r


def hashes(seed: int, blocks: int = 4) -> list[bytes]:
    return prefix_block_hashes(list(range(seed, seed + 16 * blocks)), 16, "salt")


def test_same_prefix_goes_to_the_same_replica(router: Router) -> None:
    picks = {router.pick("m", hashes(s)).url for s in range(40)}
    assert len(picks) > 1  # different prefixes spread over replicas
    for s in range(10):
        assert len({router.pick("m", hashes(s)).url for _ in range(5)}) == 1


def test_learned_affinity_follows_the_deepest_known_block(affinity_router: Router) -> None:
    router = affinity_router
    h = hashes(1, blocks=6)
    chosen = router.replicas[3]
    router.remember(chosen, h[:5])
    assert router.pick("m", h) is chosen


def test_cached_prefix_estimate(affinity_router: Router) -> None:
    router = affinity_router
    h = hashes(4, blocks=5)
    replica = router.replicas[1]
    assert router.cached_prefix_blocks(replica, h) == 0
    router.remember(replica, h[:3])
    assert router.cached_prefix_blocks(replica, h) == 3
    assert router.cached_prefix_blocks(router.replicas[2], h) == 0


def test_watermark_overrides_affinity(any_router: Router) -> None:
    router = any_router
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


def routing_key(tenant_id: int, key: str) -> bytes:
    routed = tenant_routing_key(cache_salt("test-secret", tenant_id), key)
    assert routed is not None
    return routed


def test_same_tenant_and_key_go_to_one_replica_whatever_the_prompt(router: Router) -> None:
    key = routing_key(1, "conversation-7")
    chosen = router.pick("m", hashes(0), routing_key=key)
    elsewhere = next(r for r in router.replicas if r is not chosen)
    router.remember(elsewhere, hashes(5))  # learned prefix affinity does not pull a keyed request away
    assert {router.pick("m", hashes(s), routing_key=key) for s in range(40)} == {chosen}
    assert router.pick("m", [], routing_key=key) is chosen  # even a prompt shorter than a block


def test_different_keys_spread_over_replicas(router: Router) -> None:
    h = hashes(0)
    assert len({router.pick("m", h, routing_key=routing_key(1, f"key-{i}")).url for i in range(40)}) > 1


def test_the_same_key_of_two_tenants_routes_independently(router: Router) -> None:
    keys = [f"user-{i}" for i in range(50)]
    assert all(routing_key(1, k) != routing_key(2, k) for k in keys)
    tenant_1 = [router.pick("m", hashes(0), routing_key=routing_key(1, k)).url for k in keys]
    tenant_2 = [router.pick("m", hashes(0), routing_key=routing_key(2, k)).url for k in keys]
    assert tenant_1 != tenant_2
    assert tenant_1 == [router.pick("m", hashes(9), routing_key=routing_key(1, k)).url for k in keys]


def test_no_or_empty_key_keeps_prefix_routing(router: Router) -> None:
    assert tenant_routing_key(cache_salt("test-secret", 1), None) is None
    assert tenant_routing_key(cache_salt("test-secret", 1), "") is None
    by_prefix = [router.pick("m", hashes(s)) for s in range(40)]
    assert [router.pick("m", hashes(s), routing_key=None) for s in range(40)] == by_prefix
    assert len(set(by_prefix)) > 1


def test_a_keyed_request_fails_over_to_one_next_replica(router: Router) -> None:
    key = routing_key(1, "conversation-8")
    preferred = router.pick("m", hashes(0), routing_key=key)
    second = router.pick("m", hashes(0), exclude=[preferred], routing_key=key)
    assert second is not preferred
    assert {router.pick("m", hashes(s), exclude=[preferred], routing_key=key) for s in range(20)} == {second}
    router.mark_failed(preferred, "connection refused")
    assert router.pick("m", hashes(1), routing_key=key) is second
    preferred.healthy = True  # a later probe brings it back: the key returns to it
    assert router.pick("m", hashes(1), routing_key=key) is preferred


def test_watermark_overrides_the_keyed_choice(router: Router) -> None:
    key = routing_key(1, "conversation-9")
    preferred = router.pick("m", hashes(0), routing_key=key)
    others = [r for r in router.replicas if r is not preferred]
    for i, replica in enumerate(others):
        replica.inflight = len(others) - i  # the last one is the least loaded
    preferred.load = load(waiting=WATERMARK_WAITING)
    assert router.pick("m", hashes(0), routing_key=key) is others[-1]
    preferred.load = load()
    preferred.inflight = others[-1].inflight + WATERMARK_INFLIGHT_GAP
    assert router.pick("m", hashes(0), routing_key=key) is others[-1]
    preferred.inflight = 0
    assert router.pick("m", hashes(0), routing_key=key) is preferred


def test_a_lora_request_prefers_the_replicas_holding_its_adapter(any_router: Router) -> None:
    """Replicas report the adapters they hold read (``/load``); a request for one goes to a holder (by
    its prefix among several), unless every holder is over its watermark: then to another replica, which
    reads it and holds it too (``remember_adapter``), so a busy adapter spreads like a hot prefix."""
    router = any_router
    holder, other = router.replicas[2], router.replicas[1]
    holder.adapters = {"a1"}
    for s in range(20):
        assert router.pick("m", hashes(s), adapter="a1") is holder
    assert {router.pick("m", hashes(s)).url for s in range(40)} != {holder.url}  # the base model spreads
    other.adapters.add("a1")
    assert {router.pick("m", hashes(s), adapter="a1").url for s in range(40)} == {holder.url, other.url}
    for replica in (holder, other):
        replica.load = load(waiting=WATERMARK_WAITING)
    spilled = router.pick("m", hashes(7), adapter="a1")
    assert spilled not in (holder, other)
    router.remember_adapter(spilled, "a1")
    assert router.pick("m", hashes(8), adapter="a1") is spilled


def test_prompts_sharing_no_prefix_spread_between_load_reports(router: Router) -> None:
    """Between two load reports, the prompt blocks sent to a replica count against its KV cache: distinct
    long prompts do not all go to the replica whose cache was emptiest at the last report."""
    for i, replica in enumerate(router.replicas):
        replica.load = load(kv_usage=0.1 + 0.05 * i)
    picks = []
    for s in range(12):
        h = hashes(1000 + 97 * s, blocks=8)  # distinct first blocks, 8 of the replicas' 100 each
        replica = router.pick("m", h)
        router.remember(replica, h)
        picks.append(replica.url)
    assert len(set(picks)) == len(router.replicas)
    assert router.replicas[0].sent_blocks == 8 * picks.count(router.replicas[0].url)
    router.remember(router.replicas[0], hashes(1000, blocks=8))  # the same prompt again: already held
    assert router.replicas[0].sent_blocks == 8 * picks.count(router.replicas[0].url)


async def test_round_robin_keeps_a_turn_per_pool() -> None:
    """A disaggregated request takes a prefill and a decode replica: each pool still goes round in turn."""
    from gateway.routing import PREFILL_POOL

    settings = Settings(environment="test", models=[ModelConfig(name="m", path=None, pools=["interactive",
                                                                                            PREFILL_POOL])],
                        pools={"interactive": PoolConfig(replicas=URLS[:2]),
                               PREFILL_POOL: PoolConfig(replicas=URLS[2:])}, routing_policy="round_robin")
    client = EngineClient(request_timeout_s=5)
    router = Router(settings, client)
    for replica in router.replicas:
        replica.healthy, replica.load = True, load()
    decodes, prefills = [], []
    for s in range(4):
        p = router.pick("m", hashes(s), prefill=True)
        router.remember(p, hashes(s))
        d = router.pick("m", hashes(s))
        router.remember(d, hashes(s))
        prefills.append(p.url)
        decodes.append(d.url)
    assert set(prefills) == set(URLS[2:]) and set(decodes) == set(URLS[:2])
    await client.aclose()
