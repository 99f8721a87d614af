"""Replicas found by DNS, and drained, under load, end to end: real ``tollgate engine`` processes (the
tiny checkpoint, each on its own loopback address and one shared port, as pods behind a headless
Service), a real gateway whose pool names a DNS name resolved by a fake resolver the test changes while
clients stream through the gateway, real Postgres and Redis. Engines and gateway share an internal
token, so every call on the way is authenticated.

What a tenant and an operator must see: a replica that appears takes requests within a few discovery
rounds and is in the routing index (snapshot on first contact); one that vanishes gets nothing new while
the streams it held finish; a replica given SIGTERM mid-stream finishes that stream, says draining at
once (its /health, and its /load to a probe), and the gateway sends new requests to the other one
(learning it from the replica's refusal, which fails over); through all of it, every request completes:
none answered 5xx, none cut.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from gateway.engine_client import EngineClient
from gateway.routing import Router
from tests.factories import create_price
from tests.gateway.conftest import (
    MODEL,
    GatewayUnderTest,
    TenantKey,
    gateway_settings,
    make_tenant_key,
    run_engine,
    run_gateway,
)
from tests.polling import eventually, wait_until
from tollgate.db import Database
from tollgate.local_services import free_port
from tollgate.settings import PoolConfig

pytestmark = pytest.mark.slow

TOKEN = "discovery-test-internal-token-0123456789"
DNS_NAME = "engines.tollgate.test"
# A replica that appeared must take requests within this many discovery rounds (at 0.1 s each: the
# issue's 2 s).
ROUNDS_TO_TRAFFIC = 20


class FakeDNS:
    """The pool's DNS name, answered with the addresses the test sets; counts how often it was asked."""

    def __init__(self) -> None:
        self.addresses: list[str] = []
        self.rounds = 0

    async def __call__(self, host: str, port: int) -> list[str]:
        assert host == DNS_NAME
        self.rounds += 1
        return list(self.addresses)


@dataclass
class Engines:
    port: int
    urls: dict[str, str]  # address -> base URL
    procs: dict[str, object]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    """Two replicas, 127.0.0.2 and 127.0.0.3, on one port (what a headless Service's pods look like)."""
    port = free_port()
    root = tmp_path_factory.mktemp("discovery")
    with contextlib.ExitStack() as stack:
        urls, procs = {}, {}
        for address in ("127.0.0.2", "127.0.0.3"):
            url, proc = stack.enter_context(run_engine(tiny_model_dir, root / f"{address}.log", port=port,
                                                       host=address, env={"TOLLGATE_INTERNAL_TOKEN": TOKEN}))
            urls[address], procs[address] = url, proc
        yield Engines(port, urls, procs)


@contextlib.asynccontextmanager
async def dns_gateway(database_url: str, redis_url: str, model_dir: Path, port: int, dns: FakeDNS,
                      **settings: object) -> AsyncIterator[tuple[GatewayUnderTest, TenantKey]]:
    db = Database(database_url, pool_size=1)
    async with db.session() as session:
        await create_price(session, model=MODEL)
    await db.dispose()
    config = gateway_settings([], model_dir, database_url, redis_url).model_copy(update={
        "pools": {"interactive": PoolConfig(dns=f"{DNS_NAME}:{port}")},
        "replica_discovery_interval_s": 0.1, "internal_token": SecretStr(TOKEN), **settings})
    async with run_gateway(config, resolver=dns) as gateway:
        yield gateway, await make_tenant_key(gateway, tpm_limit=10**9, rpm_limit=10**6, max_concurrency=1000)


async def prompt_tokens_served(url: str) -> float:
    """What the replica has been sent so far (its ``tollgate_engine_prompt_tokens_total``)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tollgate_engine_prompt_tokens_total"))


async def idle(url: str) -> bool:
    async with httpx.AsyncClient(timeout=10, headers={"Authorization": f"Bearer {TOKEN}"}) as client:
        load = (await client.get(f"{url}/load")).json()
    return load["running"] == 0 and load["waiting"] == 0


@dataclass
class Load:
    """Clients streaming chat completions through the gateway until stopped; every outcome kept."""

    gateway: GatewayUnderTest
    key: TenantKey
    max_tokens: int = 24
    requests_per_client: int | None = None  # None: until stopped
    completed: int = 0
    failures: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self, clients: int) -> None:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(clients)]

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self, index: int) -> None:
        async with httpx.AsyncClient(base_url=f"{self.gateway.url}/v1", headers=self.key.headers,
                                     timeout=120) as http:
            turn = 0
            while not self._stop.is_set() and turn != self.requests_per_client:
                turn += 1
                # Distinct prompts, so that routing spreads them over every replica it has.
                body = {"model": MODEL, "max_tokens": self.max_tokens, "stream": True,
                        "messages": [{"role": "user", "content": f"{turn}.{index} count with me " * 4}]}
                await self._one(http, body)

    async def _one(self, http: httpx.AsyncClient, body: dict) -> None:
        try:
            async with http.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    self.failures.append(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
                    return
                done = False
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: {") and "error" in json.loads(line[6:]):
                        self.failures.append(f"stream error: {line[:300]}")
                if not done:
                    self.failures.append("stream ended without [DONE]")
                else:
                    self.completed += 1
        except httpx.HTTPError as exc:
            self.failures.append(f"{type(exc).__name__}: {exc}")


async def test_replicas_appear_and_vanish_under_load_with_nothing_lost(
        engines: Engines, tiny_model_dir: Path, new_database: str, redis_url: str) -> None:
    a, b = engines.urls["127.0.0.2"], engines.urls["127.0.0.3"]
    dns = FakeDNS()
    dns.addresses = ["127.0.0.2"]
    async with dns_gateway(new_database, redis_url, tiny_model_dir, engines.port, dns) as (gateway, key):
        router = gateway.runtime.router
        assert [r.url for r in router.replicas] == [a]  # resolved before the first request
        load = Load(gateway, key)
        load.start(clients=6)
        await eventually(lambda: load.completed >= 6, "requests served by the first replica")

        # A replica appears: within a few discovery rounds it is probed, indexed and sent requests.
        before = await prompt_tokens_served(b)
        dns.addresses = ["127.0.0.2", "127.0.0.3"]
        await eventually(lambda: any(r.url == b for r in router.replicas), "the new replica to join")
        joined_at = dns.rounds
        await eventually(lambda: _served_more(b, before), "the new replica to receive requests")
        assert dns.rounds - joined_at <= ROUNDS_TO_TRAFFIC, (dns.rounds, joined_at)
        new = next(r for r in router.replicas if r.url == b)
        assert new.healthy and new.info is not None
        await eventually(lambda: new.kv.epoch is not None, "the new replica's index (snapshot)")
        assert new.kv.snapshots >= 1

        # A replica vanishes while it streams: its streams finish, it gets nothing new, its index goes.
        await eventually(lambda: _busy(a), "streams on the first replica")
        old = next(r for r in router.replicas if r.url == a)
        dns.addresses = ["127.0.0.3"]
        await eventually(lambda: old.retired, "the vanished replica to leave")
        assert [r.url for r in router.replicas] == [b] and old.kv.held == {} and not old.healthy
        await eventually(lambda: idle(a), "the vanished replica's streams to finish")
        served_by_a = await prompt_tokens_served(a)
        done = load.completed
        await eventually(lambda: load.completed >= done + 12, "more requests, all on the remaining replica")
        assert await prompt_tokens_served(a) == served_by_a

        # It comes back (a new pod on the same address): a new replica, indexed from a new snapshot.
        dns.addresses = ["127.0.0.3", "127.0.0.2"]
        await eventually(lambda: any(r.url == a and not r.retired for r in router.replicas), "the return")
        await eventually(lambda: _served_more(a, served_by_a), "the returned replica to receive requests")
        await load.stop()
    assert load.failures == [] and load.completed > 30


async def _served_more(url: str, before: float) -> bool:
    return await prompt_tokens_served(url) > before


async def _busy(url: str) -> bool:
    return not await idle(url)


async def test_sigterm_mid_stream_drains_while_the_gateway_fails_over(
        engines: Engines, tiny_model_dir: Path, new_database: str, redis_url: str, tmp_path: Path) -> None:
    """The gateway's health poll is slow here (30 s), so it learns that the replica drains only from the
    replica's refusal of a request, which fails over to the other replica; nothing reaches the tenant."""
    b = engines.urls["127.0.0.3"]
    dns = FakeDNS()
    dns.addresses = ["127.0.0.4"]
    with run_engine(tiny_model_dir, tmp_path / "drained.log", port=engines.port, host="127.0.0.4",
                    env={"TOLLGATE_INTERNAL_TOKEN": TOKEN}) as (c, proc):
        async with dns_gateway(new_database, redis_url, tiny_model_dir, engines.port, dns,
                               health_poll_interval_s=30.0) as (gateway, key):
            router = gateway.runtime.router
            long = Load(gateway, key, max_tokens=1500, requests_per_client=1)  # on the only replica there is
            long.start(clients=1)
            await eventually(lambda: _busy(c), "the long stream to run on the replica")
            dns.addresses = ["127.0.0.4", "127.0.0.3"]
            await eventually(lambda: any(r.url == b and r.healthy for r in router.replicas), "the second")

            proc.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient(timeout=10) as http:
                health = await eventually(lambda: _draining_health(http, c), "/health to say draining",
                                          timeout_s=10)
            assert health["status"] == "draining"
            # A probe sees the drain too (another router, so that this gateway's learns it from a refusal).
            client = EngineClient.for_settings(gateway.settings)
            try:
                prober = Router(gateway.settings, client, dns)
                await prober.discover_once()
                await prober.poll_once()
                assert {r.url: (r.healthy, r.draining) for r in prober.replicas} == {c: (False, True),
                                                                                    b: (True, False)}
            finally:
                await client.aclose()
            drained = next(r for r in router.replicas if r.url == c)
            assert drained.healthy  # the gateway has not probed it since
            served_by_b = await prompt_tokens_served(b)
            short = Load(gateway, key)
            short.start(clients=4)
            await eventually(lambda: drained.draining and not drained.healthy, "the gateway to see the drain")
            done = short.completed
            await eventually(lambda: short.completed >= done + 8, "requests after the drain was seen")
            await short.stop()
            assert await prompt_tokens_served(b) > served_by_b
            # The long stream goes on to its end, then the replica exits.
            await long.stop()
            await asyncio.to_thread(wait_until, lambda: proc.poll() is not None, "the drained one's exit")
            assert proc.returncode == 0
    assert long.failures == [] and long.completed == 1
    assert short.failures == [] and short.completed >= 8


async def _draining_health(http: httpx.AsyncClient, url: str) -> dict | None:
    response = await http.get(f"{url}/health")
    return response.json() if response.status_code == 503 else None
