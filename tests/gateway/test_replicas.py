"""The replica set's pure logic: a pool's DNS name parsed and resolved (through a fake resolver), the
difference between what the router has and what the name says, and the router applying it: replicas
joining, leaving (retired, their index dropped and its follower stopped), a failed resolution keeping
them, draining ones out. With real engines under load: test_discovery.py."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from engine.protocol import LoadReport
from gateway.batches.runtime import BatchRouter
from gateway.engine_client import EngineClient
from gateway.metrics import gateway_metrics, observe_kv_index
from gateway.replicas import (
    PoolDiscovery,
    ResolutionFailed,
    current_replica_urls,
    diff,
    replica_url,
)
from gateway.routing import Router
from tollgate.settings import ModelConfig, PoolConfig, Settings


class FakeDNS:
    """A resolver whose answer the test sets; raises ``ResolutionFailed`` while ``failing``."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.failing = False
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.failing:
            raise ResolutionFailed(f"{host}: temporary failure")
        return list(self.addresses)


def load(draining: bool = False) -> LoadReport:
    return LoadReport(model="m", pool="interactive", waiting=0, running=0, pending_prefill_tokens=0,
                      kv_usage=0.0, num_kv_blocks=100, free_kv_blocks=100, prefix_hit_rate=0.0,
                      num_preemptions=0, tokens_per_s=0.0, step_time_s=0.0, ttft_s=0.0, draining=draining)


# ---- pure pieces -------------------------------------------------------------------------------
def test_diff_says_what_joined_and_what_left_in_order() -> None:
    change = diff(["http://a", "http://b", "http://c"], ["http://c", "http://d", "http://a", "http://d"])
    assert change.added == ["http://d"] and change.removed == ["http://b"]
    assert not diff(["http://a"], ["http://a"])
    assert diff([], ["http://a"]).added == ["http://a"]
    assert diff(["http://a"], []).removed == ["http://a"]


def test_replica_urls_from_addresses() -> None:
    assert replica_url("10.0.0.7", 8100) == "http://10.0.0.7:8100"
    assert replica_url("fd00::7", 8100) == "http://[fd00::7]:8100"
    with pytest.raises(ValueError):
        replica_url("not-an-address", 8100)


@pytest.mark.parametrize("spec", ["engines", "engines:", ":8100", "engines:http", "engines:0",
                                  "engines:70000", "http://engines:8100", "engines:8100/x"])
def test_a_malformed_dns_name_is_refused_with_what_to_write(spec: str) -> None:
    with pytest.raises(ValidationError, match="dns must be `name:port`"):
        PoolConfig(dns=spec)


def test_a_dns_name_parses() -> None:
    assert PoolConfig(dns="engine-interactive-headless.tollgate.svc.cluster.local:8100").dns_target == (
        "engine-interactive-headless.tollgate.svc.cluster.local", 8100)
    assert PoolConfig(dns="[fd00::1]:8100").dns_target == ("fd00::1", 8100)
    assert PoolConfig(replicas=["http://a:1"]).dns_target is None


async def test_discovery_adds_resolved_replicas_to_the_configured_ones_and_keeps_them_on_failure() -> None:
    dns = FakeDNS("10.0.0.2", "10.0.0.1", "10.0.0.2", "garbage")
    pools = {"interactive": PoolConfig(replicas=["http://static:8100/"], dns="engines.test:8100"),
             "batch": PoolConfig(replicas=["http://batch:8100"])}
    discovery = PoolDiscovery(pools, dns)
    assert list(discovery.pools) == ["interactive"]  # a pool without a name is never resolved
    answer = await discovery.resolve()
    assert answer == {"interactive": ["http://static:8100", "http://10.0.0.2:8100", "http://10.0.0.1:8100"]}
    assert dns.asked == [("engines.test", 8100)]
    dns.failing = True
    assert await discovery.resolve() == {}  # no answer: the caller keeps what it has
    dns.failing, dns.addresses = False, []
    assert await discovery.resolve() == {"interactive": ["http://static:8100"]}  # no address: all gone


async def test_a_resolver_that_hangs_is_a_failure_not_a_hang() -> None:
    async def hanging(host: str, port: int) -> list[str]:
        await asyncio.Event().wait()
        return []

    discovery = PoolDiscovery({"interactive": PoolConfig(dns="engines.test:8100")}, hanging, timeout_s=0.05)
    assert await discovery.resolve() == {}


async def test_current_urls_for_a_purge_report_names_that_do_not_resolve() -> None:
    dns = FakeDNS("10.0.0.9")
    pools = {"interactive": PoolConfig(dns="engines.test:8100"), "batch": PoolConfig(replicas=["http://b:1"])}
    assert await current_replica_urls(pools, dns) == (["http://b:1", "http://10.0.0.9:8100"], {})
    dns.failing = True
    urls, failed = await current_replica_urls(pools, dns)
    assert urls == ["http://b:1"] and "temporary failure" in failed["engines.test:8100"]


# ---- the router's replica set ------------------------------------------------------------------
def settings_with(pools: dict[str, PoolConfig], pools_of_model: list[str] | None = None) -> Settings:
    model = ModelConfig(name="m", pools=pools_of_model or ["interactive"])
    return Settings(environment="test", models=[model], pools=pools, health_check_timeout_s=0.5)


@pytest.fixture
async def client():
    c = EngineClient(request_timeout_s=5)
    yield c
    await c.aclose()


async def test_replicas_join_and_leave_with_the_dns_answer(client: EngineClient) -> None:
    dns = FakeDNS("10.0.0.1")
    router = Router(settings_with({"interactive": PoolConfig(replicas=["http://static:8100"],
                                                             dns="engines.test:8100")}), client, dns)
    assert [r.url for r in router.replicas] == ["http://static:8100"]
    await router.discover_once()
    first = router.replicas[1]
    assert [r.url for r in router.replicas] == ["http://static:8100", "http://10.0.0.1:8100"]

    dns.addresses = ["10.0.0.1", "10.0.0.2"]
    await router.discover_once()
    assert [r.url for r in router.replicas] == ["http://static:8100", "http://10.0.0.1:8100",
                                                 "http://10.0.0.2:8100"]
    assert router.replicas[1] is first  # a replica that stays keeps its state (index, load, in flight)

    first.healthy, first.inflight = True, 2
    first.kv.held[b"h" * 32] = 1
    observe_kv_index(first.url, {"device": 1, "host": 0, "disk": 0}, 1)
    blocks = ("tollgate_gateway_kv_index_blocks", {"replica": first.url, "tier": "device"})
    assert gateway_metrics().registry.get_sample_value(*blocks) == 1
    router._follow(first)
    follower = router._followers[first]
    dns.addresses = ["10.0.0.2"]
    await router.discover_once()
    assert [r.url for r in router.replicas] == ["http://static:8100", "http://10.0.0.2:8100"]
    assert first.retired and not first.healthy and first.kv.held == {}
    assert first.inflight == 2  # its streams still count where they are read
    assert gateway_metrics().registry.get_sample_value(*blocks) is None  # no series left behind
    await asyncio.gather(follower, return_exceptions=True)
    assert follower.cancelled() and first not in router._followers

    dns.failing = True  # a failed resolution keeps the replicas
    await router.discover_once()
    assert [r.url for r in router.replicas] == ["http://static:8100", "http://10.0.0.2:8100"]
    dns.failing, dns.addresses = False, []  # no address at all: only the configured one is left
    await router.discover_once()
    assert [r.url for r in router.replicas] == ["http://static:8100"]
    await router.stop()


async def test_a_retired_replica_stays_out_whatever_a_late_probe_says(client: EngineClient) -> None:
    dns = FakeDNS("127.0.0.1")
    router = Router(settings_with({"interactive": PoolConfig(dns="engines.test:1")}), client, dns)
    await router.discover_once()
    replica = router.replicas[0]
    dns.addresses = []
    await router.discover_once()
    await router._probe(replica)  # port 1: refused; a retired replica's probe changes nothing
    assert replica.retired and not replica.healthy and replica.probe_failures == 0


async def test_a_draining_replica_is_out_until_it_stops_draining(client: EngineClient) -> None:
    router = Router(settings_with({"interactive": PoolConfig(replicas=["http://a:1", "http://b:1"])}), client)
    a, b = router.replicas
    for replica in (a, b):
        replica.healthy, replica.load = True, load()
    router.mark_draining(a)
    assert a.draining and not a.healthy
    assert {router.pick("m", [bytes([i]) * 32]).url for i in range(32)} == {"http://b:1"}


async def test_the_batch_router_discovers_its_batch_pool_too(client: EngineClient) -> None:
    dns = FakeDNS("10.0.1.1", "10.0.1.2")
    settings = settings_with({"interactive": PoolConfig(replicas=["http://i:8100"]),
                              "batch": PoolConfig(dns="batch.test:8100")}, ["interactive", "batch"])
    batch = BatchRouter(settings, client, dns)
    await batch.discover_once()
    assert sorted((r.pool, r.url) for r in batch.replicas) == [
        ("batch", "http://10.0.1.1:8100"), ("batch", "http://10.0.1.2:8100"), ("interactive", "http://i:8100")]
    interactive = Router(settings, client, dns)
    await interactive.discover_once()
    assert [r.url for r in interactive.replicas] == ["http://i:8100"]  # the public API never uses batch
    assert dns.asked == [("batch.test", 8100)]  # and does not resolve a pool it does not route to
