"""Routing by what replicas hold: the engines' block event log (cursor pages, snapshots for new readers,
for readers too far behind and after a restart), the gateway's per-replica index following it, the
router's choice by held prefix (device above host above disk, weighed against load, load watermark,
rendezvous when nobody holds it, round robin as a baseline) and, with two real engine replicas, an index
that agrees with the engines after evictions and a restart and sends a returning session to the replica
holding its prefix."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from engine.kv.block_hash import prefix_block_hashes
from engine.kv.events import KVEventLog
from engine.protocol import KVEventsResponse, encode_kv_events
from gateway.engine_client import EngineClient
from gateway.kv_index import EXPECT_TTL_S, GapError, ReplicaKVIndex
from gateway.routing import WATERMARK_WAITING, Router, _rendezvous
from tests.gateway.conftest import run_engine
from tests.gateway.test_routing import load, make_router
from tollgate.local_services import free_port
from tollgate.settings import ModelConfig, PoolConfig, Settings


def h(n: int) -> bytes:
    return n.to_bytes(32, "big")


def page(log: KVEventLog, index: ReplicaKVIndex) -> dict:
    """What the engine answers the index's cursor, through the wire format."""
    body = encode_kv_events(log.since(index.seq, index.epoch))
    return KVEventsResponse.model_validate_json(body).model_dump()


def follow(log: KVEventLog, index: ReplicaKVIndex) -> None:
    try:
        index.apply(page(log, index))
    except GapError:
        index.reset()
        index.apply(page(log, index))
    # The per-tier sizes it keeps as it goes equal a count over what it holds.
    assert index.blocks == {tier: sum(1 for bits in index.held.values() if bits & bit)
                            for tier, bit in {"device": 1, "host": 2, "disk": 4}.items()}


# -- the event log and the index ------------------------------------------------------------------------

def test_the_index_follows_events_and_snapshots_to_the_engines_holdings() -> None:
    log, index = KVEventLog(capacity=4), ReplicaKVIndex()
    log.stored(h(1), "device")
    log.stored(h(2), "device")
    follow(log, index)  # a new reader: a snapshot
    assert index.snapshots == 1 and index.held == log.holdings()
    log.stored(h(1), "disk")
    log.removed(h(1), "device")
    log.stored(h(3), "host")
    follow(log, index)  # three events after the cursor
    assert index.snapshots == 1 and index.held == log.holdings() == {h(1): 4, h(2): 1, h(3): 2}
    for n in range(10, 16):  # more than the log keeps: the reader is too far behind
        log.stored(h(n), "device")
    follow(log, index)
    assert index.snapshots == 2 and index.held == log.holdings()
    restarted = KVEventLog()  # another engine start: another epoch
    restarted.stored(h(1), "disk")
    follow(restarted, index)
    assert index.held == {h(1): 4} and index.epoch == restarted.epoch


def test_events_that_do_not_follow_the_cursor_are_a_gap() -> None:
    log, index = KVEventLog(), ReplicaKVIndex()
    follow(log, index)
    log.stored(h(1), "device")
    log.stored(h(2), "device")
    skipped = encode_kv_events(log.since(1, log.epoch))
    with pytest.raises(GapError):
        index.apply(KVEventsResponse.model_validate_json(skipped).model_dump())


def test_repeated_and_unknown_changes_publish_nothing() -> None:
    log = KVEventLog()
    log.stored(h(1), "device")
    log.stored(h(1), "device")
    log.removed(h(2), "host")
    assert log.seq == 1


# -- the router's choice ---------------------------------------------------------------------------------

@pytest.fixture
async def router():
    async for r in make_router("index"):
        yield r


def hold(router: Router, replica: int, hashes: list[bytes], tier: str = "device") -> None:
    bits = {"device": 1, "host": 2, "disk": 4}[tier]
    for digest in hashes:
        router.replicas[replica].kv.held[digest] = router.replicas[replica].kv.held.get(digest, 0) | bits


def prompt_hashes(seed: int, blocks: int = 6) -> list[bytes]:
    return prefix_block_hashes(list(range(seed, seed + 16 * blocks)), 16, "salt")


def test_the_replica_holding_the_longest_prefix_wins(router: Router) -> None:
    p = prompt_hashes(1)
    hold(router, 1, p[:2])
    hold(router, 2, p[:5])
    assert router.pick("m", p) is router.replicas[2]
    assert router.cached_prefix_blocks(router.replicas[2], p) == 5
    assert router.cached_prefix_blocks(router.replicas[0], p) == 0


def test_device_outweighs_host_outweighs_disk(router: Router) -> None:
    p = prompt_hashes(2)
    hold(router, 0, p[:4], "disk")
    hold(router, 1, p[:4], "host")
    assert router.pick("m", p) is router.replicas[1]
    hold(router, 3, p[:4], "device")
    assert router.pick("m", p) is router.replicas[3]
    hold(router, 0, p[:4], "device")  # device and disk copies: counted at its best tier
    tied = {router.replicas[0].url, router.replicas[3].url}
    assert router.pick("m", p).url == max(tied, key=lambda url: _rendezvous(p[0], url))  # same everywhere


def test_a_holder_over_its_watermark_is_passed_over(router: Router) -> None:
    p = prompt_hashes(3)
    hold(router, 1, p[:6])
    hold(router, 2, p[:3])
    router.replicas[1].load = load(waiting=WATERMARK_WAITING)
    assert router.pick("m", p) is router.replicas[2]


def test_what_this_process_just_sent_counts_until_the_events_say_otherwise(router: Router) -> None:
    p = prompt_hashes(6)
    hold(router, 0, p[:2])
    router.remember(router.replicas[2], p)  # sent there a moment ago; no event yet
    assert router.pick("m", p) is router.replicas[2]
    index = router.replicas[2].kv
    log = KVEventLog()
    follow(log, index)  # its snapshot: the replica holds nothing of it (yet)
    assert router.pick("m", p) is router.replicas[2]  # the expectation outlives a snapshot ...
    other = ReplicaKVIndex()
    other.expect(p, now=1000.0)
    assert len(other.held_prefix(p, now=1000.0 + EXPECT_TTL_S - 0.5)) == len(p)
    assert other.held_prefix(p, now=1000.0 + EXPECT_TTL_S) == []  # ... but not its time
    log.stored(p[0], "device")
    log.removed(p[0], "device")
    follow(log, index)  # an event about a hash replaces its expectation
    assert index.held_prefix(p) == []


def test_a_somewhat_busier_holder_keeps_its_prompt(router: Router) -> None:
    """Prefix hits weigh against load (``ScoreWeights``; more in test_routing_scorer.py): a holder of the
    whole prompt with a few more requests in flight is still the best place for it."""
    p = prompt_hashes(7)
    hold(router, 1, p)
    router.replicas[1].inflight = 3
    assert router.pick("m", p) is router.replicas[1]
    router.replicas[1].load = load(waiting=2, kv_usage=0.9)  # and its running requests fill its cache
    assert router.pick("m", p) is not router.replicas[1]


def test_nobody_holding_it_converges_by_rendezvous(router: Router) -> None:
    p = prompt_hashes(4)
    first = router.pick("m", p)
    assert all(router.pick("m", p) is first for _ in range(5))
    assert router.cached_prefix_blocks(first, p) == 0


async def test_round_robin_turns_once_per_accepted_request() -> None:
    async for router in make_router("round_robin"):
        p = prompt_hashes(5)
        seen = []
        for _ in range(8):
            replica = router.pick("m", p)
            assert router.pick("m", p) is replica  # the shedding look and the dispatch agree
            router.remember(replica, p)
            seen.append(replica.url)
        assert len(set(seen)) == 4 and seen[:4] == seen[4:]


# -- two real engine replicas ------------------------------------------------------------------------------

def generate(url: str, prompt: list[int], salt: str) -> None:
    body = {"request_id": uuid.uuid4().hex, "prompt_token_ids": prompt, "max_tokens": 2, "temperature": 0.0,
            "cache_salt": salt, "tenant": salt}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert b'"type":"final"' in response.read()


def holdings(url: str) -> dict[bytes, int]:
    snapshot = httpx.get(f"{url}/kv/events", params={"after": 0}, timeout=10).json()["snapshot"]
    return {bytes.fromhex(digest): bits for digest, bits in snapshot.items()}


@pytest.mark.slow
async def test_with_two_replicas_the_index_agrees_and_routes_a_returning_session(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    options = ("--num-kv-blocks", "12", "--host-kv-gb", "0.0001", "--disk-kv-gb", "0.01",
               "--kv-disk-dir", str(tmp_path / "kv"))
    port_b = free_port()
    sessions = {n: [(97 * n + 13 * j) % 200 + 5 for j in range(72)] for n in range(6)}
    with (run_engine(tiny_model_dir, tmp_path / "a.log", options=options) as (url_a, _),
          run_engine(tiny_model_dir, tmp_path / "b.log", port=port_b, options=options) as (url_b, _)):
        settings = Settings(environment="test", models=[ModelConfig(name="tiny", path=None)],
                            pools={"interactive": PoolConfig(replicas=[url_a, url_b])})
        client = EngineClient(request_timeout_s=60)
        router = Router(settings, client)
        try:
            await router.poll_once()
            a, b = router.replicas
            # Sessions 0-2 on A, 3-5 on B: 5 blocks each in a 12-block pool, so older ones are evicted
            # to the host tier (a few blocks) and written through to disk.
            for n, prompt in sessions.items():
                generate(url_a if n < 3 else url_b, prompt, "tenant-1")
            await router.follow_kv_once()
            assert a.kv.held == holdings(url_a) and b.kv.held == holdings(url_b)
            assert any(bits & 4 for bits in a.kv.held.values())  # evictions reached the disk tier
            for n, prompt in sessions.items():
                chosen = router.pick("tiny", prefix_block_hashes(prompt, 16, "tenant-1"))
                assert chosen is (a if n < 3 else b), n
            # Another tenant's identical prompt matches nothing anywhere.
            assert router.cached_prefix_blocks(a, prefix_block_hashes(sessions[0], 16, "tenant-2")) == 0
        finally:
            await router.stop()
        # B restarts on the same port: a new epoch, holding only what its disk tier kept.
    with run_engine(tiny_model_dir, tmp_path / "b.log", port=port_b, options=options) as (url_b, _):
        try:
            await router.poll_once()
            await router.follow_kv_once()
            restarted = holdings(url_b)
            assert b.kv.held == restarted and restarted and all(bits == 4 for bits in restarted.values())
            assert b.kv.snapshots >= 2
        finally:
            await client.aclose()
