"""The routing policy seam (``gateway.routing.RoutingPolicy``): every name the settings accept builds its
policy and an unknown one is refused when the router is built; each policy through ``RoutingPolicy``
alone (choose, remember, cached_prefix_blocks, follows_kv_events), on replicas in memory. How the router
uses them end to end: test_routing.py, test_kv_index.py, test_routing_scorer.py."""

from __future__ import annotations

from typing import get_args

import pytest

from engine.kv.block_hash import prefix_block_hashes
from gateway import routing
from gateway.engine_client import EngineClient
from gateway.routing import (
    POLICIES,
    WATERMARK_WAITING,
    AffinityPolicy,
    IndexPolicy,
    Replica,
    RoundRobinPolicy,
    Router,
    RoutingPolicy,
    _rendezvous,
    routing_policy,
)
from tests.gateway.test_routing import URLS, load
from tollgate.settings import ModelConfig, PoolConfig, Settings


def settings(policy: str = "index") -> Settings:
    return Settings(environment="test", models=[ModelConfig(name="m", path=None)],
                    pools={"interactive": PoolConfig(replicas=URLS)}, routing_policy=policy)


def create_replicas() -> list[Replica]:
    return [Replica(url=url, pool="interactive", healthy=True, load=load()) for url in URLS]


def prompt(seed: int, blocks: int = 4) -> list[bytes]:
    return prefix_block_hashes(list(range(seed, seed + 16 * blocks)), 16, "tenant-1")


def test_every_policy_the_settings_accept_is_built_by_the_router() -> None:
    names = get_args(Settings.model_fields["routing_policy"].annotation)
    assert set(names) == set(POLICIES)
    built = {name: type(Router(settings(name), EngineClient(request_timeout_s=1)).policy) for name in names}
    assert built == {"index": IndexPolicy, "affinity": AffinityPolicy, "round_robin": RoundRobinPolicy}
    assert [n for n in names if routing_policy(n).follows_kv_events] == ["index"]


def test_an_unknown_policy_is_refused_when_the_router_is_built() -> None:
    unchecked = settings().model_copy(update={"routing_policy": "fastest"})  # past the settings' own check
    with pytest.raises(ValueError, match=r"Unknown routing policy 'fastest'; expected one of: "
                                         r"index, affinity, round_robin\."):
        Router(unchecked, EngineClient(request_timeout_s=1))


def test_each_router_gets_a_policy_of_its_own() -> None:
    first, second = routing_policy("affinity"), routing_policy("affinity")
    replicas = create_replicas()
    first.remember(replicas[2], prompt(0), now=0.0)
    assert first.cached_prefix_blocks(replicas[2], prompt(0), now=0.0) == 4
    assert second.cached_prefix_blocks(replicas[2], prompt(0), now=0.0) == 0


def test_index_chooses_the_holder_and_counts_what_was_just_sent() -> None:
    policy: RoutingPolicy = IndexPolicy()
    replicas, p = create_replicas(), prompt(1)
    replicas[1].kv.held.update(dict.fromkeys(p[:2], 1))
    assert policy.choose(replicas, p, least_inflight=0, now=0.0) is replicas[1]
    assert policy.cached_prefix_blocks(replicas[1], p, now=0.0) == 2
    policy.remember(replicas[3], p, now=0.0)  # expected there until its events say otherwise
    assert policy.cached_prefix_blocks(replicas[3], p, now=0.0) == 4
    assert policy.choose(replicas, p, least_inflight=0, now=0.0) is replicas[3]


def test_index_makes_no_choice_without_a_block_or_a_replica_under_its_watermark() -> None:
    policy, replicas = IndexPolicy(), create_replicas()
    assert policy.choose(replicas, [], least_inflight=0, now=0.0) is None
    for replica in replicas:
        replica.load = load(waiting=WATERMARK_WAITING)
    assert policy.choose(replicas, prompt(2), least_inflight=0, now=0.0) is None


def test_affinity_follows_the_deepest_block_it_sent_else_rendezvous() -> None:
    policy: RoutingPolicy = AffinityPolicy()
    replicas, p = create_replicas(), prompt(3, blocks=6)
    by_rendezvous = max(replicas, key=lambda r: _rendezvous(p[0], r.url))
    assert policy.choose(replicas, p, least_inflight=0, now=0.0) is by_rendezvous
    chosen = next(r for r in replicas if r is not by_rendezvous)
    policy.remember(chosen, p[:5], now=0.0)
    assert policy.choose(replicas, p, least_inflight=0, now=0.0) is chosen
    assert policy.cached_prefix_blocks(chosen, p, now=0.0) == 5
    assert policy.cached_prefix_blocks(by_rendezvous, p, now=0.0) == 0
    chosen.load = load(waiting=WATERMARK_WAITING)  # over its watermark: back to the rendezvous choice
    assert policy.choose(replicas, p, least_inflight=0, now=0.0) is by_rendezvous
    by_rendezvous.load = load(waiting=WATERMARK_WAITING)
    assert policy.choose(replicas, p, least_inflight=0, now=0.0) is None
    assert policy.choose(replicas, [], least_inflight=0, now=0.0) is None


def test_affinity_forgets_the_oldest_blocks_past_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(routing, "AFFINITY_CACHE_SIZE", 4)
    policy, replicas = AffinityPolicy(), create_replicas()
    old, new = prompt(4), prompt(5)
    policy.remember(replicas[0], old, now=0.0)
    policy.remember(replicas[0], old[:1], now=0.0)  # its first block is now the most recently sent
    policy.remember(replicas[1], new[:3], now=0.0)
    assert policy.cached_prefix_blocks(replicas[0], old, now=0.0) == 1  # the three others forgotten
    assert policy.cached_prefix_blocks(replicas[1], new, now=0.0) == 3


def test_round_robin_turns_only_when_a_replica_accepts() -> None:
    policy: RoutingPolicy = RoundRobinPolicy()
    replicas, p = create_replicas(), prompt(6)
    replicas[0].load = load(waiting=WATERMARK_WAITING)  # blind to load and to what replicas hold
    seen = []
    for _ in range(len(replicas) + 1):
        replica = policy.choose(replicas, p, least_inflight=0, now=0.0)
        assert replica is not None and policy.choose(replicas, [], least_inflight=0, now=0.0) is replica
        policy.remember(replica, p, now=0.0)
        seen.append(replica)
    assert seen == [*replicas, replicas[0]]
    assert policy.cached_prefix_blocks(replicas[0], p, now=0.0) == 0
