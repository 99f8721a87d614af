"""Model → pool → replica routing with prefix affinity, fed by background health and load polling.

Configuration: ``settings.models`` names each served model and its pools; ``settings.pools[pool]``
lists the replicas' base URLs and/or a DNS name whose addresses are replicas (``gateway.replicas``,
re-resolved every ``replica_discovery_interval_s``). The public API serves the ``interactive`` pool (the
batch tier has its own: ``routed_pools``). Every ``health_poll_interval_s`` the router asks each replica
for ``/load`` (and ``/info`` once it first answers).

The replica set:
- A replica that appears in its pool's DNS answer joins at once: it is probed right away (so it takes
  requests as soon as it answers, not a poll interval later) and its KV index is followed from a snapshot.
- One that vanished leaves: removed from its route, marked ``retired`` (never healthy again), its index
  follower stopped and its index dropped. Requests already streaming from it hold their own connection
  and finish (or fail over) as they would have.
- A draining replica (SIGTERM: its ``/load`` says ``draining``, or it refused a request with
  ``engine_draining``: ``mark_draining``) is out of routing at once and stays out while it drains.

Invariants and policies:
- Only healthy replicas are picked. A replica that refuses connections (to a probe, or during a
  request: ``mark_failed``) is out at once; one whose probes fail otherwise (time out, answer garbage)
  is out after ``PROBE_FAILURES_TO_DOWN`` consecutive failures, so a replica that is merely busy
  answering a probe slowly keeps serving. A later successful probe brings a replica back.
- Where a prompt goes is its routing policy's choice (``settings.routing_policy``), by the prompt's
  leading full-block hashes (``engine.kv.block_hash``, salted per tenant, so no choice ever crosses
  tenants). The router builds one ``RoutingPolicy`` by name (``routing_policy``: an unknown name is a
  ``ValueError`` then, never at the first pick) and asks it only through that interface (``choose``,
  ``remember``, ``cached_prefix_blocks``, ``follows_kv_events``), so it never asks which one it has:
  - ``index`` (the default): by what each replica's prefix cache really holds (``gateway.kv_index``,
    followed from each replica's ``/kv/events`` by a long poll, so within milliseconds of each event,
    retried every ``kv_index_poll_interval_s`` while a replica is unreachable; plus what this process
    just sent, until the events say so: ``remember``), weighed against its load, as llm-d's endpoint
    picker does (``ScoreWeights``): among the replicas under their watermark, the highest of
    ``prefix x held share + queue x 1 / (1 + load_score / queue_scale) + kv x (1 - KV usage)``, where
    the held share is the prompt's leading blocks the replica holds (device 1, host 0.8, disk 0.5 a
    block) over its full blocks, and KV usage the blocks its running requests hold (last ``/load``).
    Ties (e.g. a prefix nobody holds on equally loaded replicas) go to the rendezvous order of the first
    block, the same in every process. The weights were tuned on ``benchmarks/fleet_routing.py`` (16
    simulated replicas, 20 tenants, 400 agent sessions at ~70% load; benchmarks/RESULTS.md). What they
    guarantee, whatever the trace: with equal loads the replica holding more of the prompt wins; a
    replica holding none of it wins only by being less busy or its cache less full; and since the KV
    term alone outweighs any prefix, a holder whose running requests fill its cache hands new work to an
    idle replica before it reaches its watermark. The KV term is what spreads a tenant's new sessions:
    its system prompt is a large share of their first prompt, so without it they would all follow the
    replicas already holding it, whose caches then thrash while others idle.
  - ``affinity``: a per-process guess, the replica this process last sent the deepest known block to
    (a bounded LRU map of block hash → replica, written by ``remember``).
  - ``round_robin``: the replicas in turn, whatever they hold or their load (a baseline for
    benchmarks); the turn moves on when a replica accepts a request (``remember``), so the shedding
    check's look and the dispatch get the same replica.
  Without a guess (affinity), rendezvous hashing on the first block hash picks a stable replica, so
  requests sharing a system prompt converge on one replica. A replica over its load watermark (queue
  or KV cache nearly full, or far more in flight from this gateway than the least loaded one) is never
  the choice of either; when every replica is, or for prompts shorter than a block, they make no choice
  (``choose`` returns None) and the least loaded healthy replica is used.
- Routing key (``prompt_cache_key``): a request that carries one is routed by rendezvous hashing on
  that key instead of its blocks, so one tenant's requests with one key go to one replica whatever
  their prompts. The caller derives the key per tenant (``gateway.generation``), so the same key string
  of two tenants is two unrelated routing identities. The keyed choice takes precedence over every
  policy's and obeys the same rules: healthy and not excluded (failover moves the key to the next
  replica in its rendezvous order), and the least loaded replica while it is over the watermark.
- ``pick`` never blocks and never does I/O; the hot path reads in-memory state only (the index is
  updated by a background task).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from engine.protocol import InfoResponse, LoadReport
from gateway.engine_client import EngineClient, EngineUnavailable
from gateway.errors import ServiceUnavailableError
from gateway.kv_index import GapError, ReplicaKVIndex
from gateway.metrics import forget_kv_index, observe_kv_index
from gateway.replicas import PoolDiscovery, Resolver, diff, static_urls
from tollgate.background import cancel_and_wait
from tollgate.settings import ModelConfig, Settings

logger = logging.getLogger("tollgate.gateway.routing")

INTERACTIVE_POOL = "interactive"
# Disaggregated serving (``gateway.generation.disaggregation``): a model's prefill replicas. They only
# prefill prompts for the interactive pool's decode replicas; ``pick`` never hands them anything else.
PREFILL_POOL = "prefill"
# Affinity bookkeeping: how many leading blocks of a prompt are remembered, and how many hashes in all.
AFFINITY_BLOCKS = 64
AFFINITY_CACHE_SIZE = 200_000
# Load watermark: a choice (the index's, affinity's, the routing key's) is overridden when the replica's
# queue is this long ...
WATERMARK_WAITING = 8
# ... or its KV cache is this full ...
WATERMARK_KV_USAGE = 0.95
# ... or this gateway has this many more requests in flight on it than on the least loaded replica.
WATERMARK_INFLIGHT_GAP = 16
PROBE_FAILURES_TO_DOWN = 3


@dataclass(frozen=True, slots=True)
class ScoreWeights:
    """The index policy's scorer: a weighted sum of three scores in [0, 1], the highest wins.

    - prefix: the share of the prompt's full blocks the replica holds (``ReplicaKVIndex.prefix_weight``:
      device 1, host 0.8, disk 0.5 a block) over the prompt's blocks;
    - queue: ``1 / (1 + load_score / queue_scale)`` (1 for an idle replica, 1/2 at ``queue_scale``);
    - kv: ``1 - kv_usage`` of the replica's last load report.
    """

    prefix: float = 3.0
    queue: float = 2.0
    kv: float = 4.0
    queue_scale: float = 1.0

    def score(self, prefix_share: float, load_score: float, kv_usage: float) -> float:
        return (self.prefix * prefix_share + self.queue / (1.0 + load_score / self.queue_scale)
                + self.kv * (1.0 - kv_usage))


# How long one long poll of a replica's /kv/events may wait for an event.
KV_EVENTS_WAIT_S = 1.0


@dataclass(eq=False)
class Replica:
    url: str
    pool: str
    healthy: bool = False
    info: InfoResponse | None = None
    load: LoadReport | None = None
    inflight: int = 0
    last_error: str | None = None
    checked_at: float = 0.0
    probe_failures: int = 0
    kv: ReplicaKVIndex = field(default_factory=ReplicaKVIndex)
    # Got SIGTERM: takes nothing new (out of routing until a probe finds a replica that is not draining).
    draining: bool = False
    # Left its pool (discovery): never routed to again, whatever a late probe says.
    retired: bool = False
    # LoRA adapters (store ids) it holds read: its last ``/load`` report, plus those sent to it since.
    adapters: set[str] = field(default_factory=set)
    # Prompt blocks this process sent it since its last ``/load`` report (``kv_usage_estimate``).
    sent_blocks: int = 0

    def reported(self, load: LoadReport) -> None:
        """A new ``/load`` report: its figures replace what this process counted since the last one."""
        self.load = load
        self.adapters = set(load.adapters)
        self.sent_blocks = 0

    @property
    def kv_usage_estimate(self) -> float:
        """Its KV cache's use: the last report's, plus the prompt blocks sent since, which it will hold.
        Without the second part every pick until the next report would see the same figure, and the
        replica whose cache was emptiest at the report would take all of them (prompts sharing no prefix
        herd onto one replica for a report interval)."""
        if self.load is None:
            return 0.0
        return min(1.0, self.load.kv_usage + self.sent_blocks / max(1, self.load.num_kv_blocks))

    @property
    def load_score(self) -> float:
        waiting = self.load.waiting + self.load.running if self.load else 0
        return self.inflight + waiting * 0.5

    def over_watermark(self, least_inflight: int) -> bool:
        if self.load is not None and (self.load.waiting >= WATERMARK_WAITING
                                      or self.kv_usage_estimate >= WATERMARK_KV_USAGE):
            return True
        return self.inflight - least_inflight >= WATERMARK_INFLIGHT_GAP


@dataclass(frozen=True, slots=True)
class ServedAdapter:
    """A tenant's LoRA adapter a request runs through: its id in the adapter store (what the engine is
    asked for) and the digest of its contents (what its prefix-cache keys are salted with)."""

    store_id: str
    digest: str


@dataclass(eq=False)
class ModelRoute:
    name: str
    path: str | None
    pools: list[str]
    replicas: list[Replica] = field(default_factory=list)
    created: int = 0
    routed: list[str] = field(default_factory=list)  # the pools whose replicas this router uses for it
    # A tenant's adapter model (``gateway.adapters``): ``name`` is its ``ft:`` id, ``base`` the served
    # model whose replicas, tokenizer and limits it shares; for a served model ``base`` is ``name``.
    base: str = ""
    adapter: ServedAdapter | None = None

    @property
    def served(self) -> str:
        """The served model whose replicas run this route's requests."""
        return self.base or self.name

    def info(self) -> InfoResponse | None:
        """Limits of the model (max length, block size, vocabulary) from any replica that reported them."""
        for replica in self.replicas:
            if replica.info is not None:
                return replica.info
        return None


# -- routing policies (see the module docstring) --------------------------------------------------

class RoutingPolicy(Protocol):
    """Where a prompt goes among two or more candidates; the router's only view of its policy."""

    follows_kv_events: ClassVar[bool]

    def choose(self, candidates: Sequence[Replica], block_hashes: Sequence[bytes], least_inflight: int,
               now: float) -> Replica | None: ...

    def remember(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> None: ...

    def cached_prefix_blocks(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> int: ...


@dataclass(slots=True)
class IndexPolicy:
    """By the replicas' KV index, weighed against their load (``ScoreWeights``)."""

    weights: ScoreWeights = field(default_factory=ScoreWeights)
    follows_kv_events: ClassVar[bool] = True

    def choose(self, candidates: Sequence[Replica], block_hashes: Sequence[bytes], least_inflight: int,
               now: float) -> Replica | None:
        if not block_hashes:
            return None
        first, blocks = block_hashes[0], len(block_hashes)
        scored = [(self.weights.score(r.kv.prefix_weight(block_hashes, now) / blocks, r.load_score,
                                      r.kv_usage_estimate),
                   _rendezvous(first, r.url), r)
                  for r in candidates if not r.over_watermark(least_inflight)]
        best = max(scored, key=lambda s: s[:2], default=None)
        return best[2] if best is not None else None

    def remember(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> None:
        replica.kv.expect(block_hashes, now)

    def cached_prefix_blocks(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> int:
        return len(replica.kv.held_prefix(block_hashes, now))


class AffinityPolicy:
    """The replica this process last sent the prompt's deepest known block to, else rendezvous."""

    follows_kv_events: ClassVar[bool] = False

    def __init__(self) -> None:
        self._last_sent: OrderedDict[bytes, Replica] = OrderedDict()

    def choose(self, candidates: Sequence[Replica], block_hashes: Sequence[bytes], least_inflight: int,
               now: float) -> Replica | None:
        if not block_hashes:
            return None
        for h in reversed(block_hashes[:AFFINITY_BLOCKS]):
            replica = self._last_sent.get(h)
            if replica is not None:
                if replica in candidates and not replica.over_watermark(least_inflight):
                    return replica
                break
        preferred = max(candidates, key=lambda r: _rendezvous(block_hashes[0], r.url))
        return None if preferred.over_watermark(least_inflight) else preferred

    def remember(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> None:
        last_sent = self._last_sent
        for h in block_hashes[:AFFINITY_BLOCKS]:
            last_sent[h] = replica
            last_sent.move_to_end(h)
        while len(last_sent) > AFFINITY_CACHE_SIZE:
            last_sent.popitem(last=False)

    def cached_prefix_blocks(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> int:
        for depth in range(min(len(block_hashes), AFFINITY_BLOCKS), 0, -1):
            if self._last_sent.get(block_hashes[depth - 1]) is replica:
                return depth
        return 0


class RoundRobinPolicy:
    """The candidates in turn, a turn per pool (a disaggregated request picks a prefill and a decode
    replica: one shared turn would give each pool every other replica); the turn moves on when one
    accepts a request."""

    follows_kv_events: ClassVar[bool] = False

    def __init__(self) -> None:
        self._turns: dict[str, int] = {}

    def choose(self, candidates: Sequence[Replica], block_hashes: Sequence[bytes], least_inflight: int,
               now: float) -> Replica | None:
        return candidates[self._turns.get(candidates[0].pool, 0) % len(candidates)]

    def remember(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> None:
        self._turns[replica.pool] = self._turns.get(replica.pool, 0) + 1

    def cached_prefix_blocks(self, replica: Replica, block_hashes: Sequence[bytes], now: float) -> int:
        return 0  # it keeps no record of where prompts went


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "index": IndexPolicy, "affinity": AffinityPolicy, "round_robin": RoundRobinPolicy,
}


def routing_policy(name: str) -> RoutingPolicy:
    """A fresh policy called ``name`` (``settings.routing_policy``); ValueError naming the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        known = ", ".join(POLICIES)
        raise ValueError(f"Unknown routing policy {name!r}; expected one of: {known}.") from None


class Router:
    def __init__(self, settings: Settings, client: EngineClient, resolver: Resolver | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        # The time source of the index's expectations and the probes' marks (a simulation's virtual
        # clock drives the same code: benchmarks/fleet_routing.py).
        self.clock = clock
        self._interval = settings.health_poll_interval_s
        self.models: dict[str, ModelRoute] = {}
        for cfg in settings.models:
            route = ModelRoute(name=cfg.name, path=cfg.path, pools=list(cfg.pools),
                               created=_created(cfg.path), routed=self.routed_pools(cfg))
            for pool in route.routed:
                pool_cfg = settings.pools.get(pool)
                urls = static_urls(pool_cfg) if pool_cfg else []
                route.replicas += [Replica(url=url, pool=pool) for url in urls]
            self.models[cfg.name] = route
        self.policy: RoutingPolicy = routing_policy(settings.routing_policy)
        self._kv_interval = settings.kv_index_poll_interval_s
        self._tasks: list[asyncio.Task[None]] = []
        routed = {pool for route in self.models.values() for pool in route.routed}
        self._discovery = PoolDiscovery({p: c for p, c in settings.pools.items() if p in routed}, resolver,
                                        timeout_s=settings.health_check_timeout_s)
        self._discovery_interval = settings.replica_discovery_interval_s
        self._discovered_at = float("-inf")
        self._followers: dict[Replica, asyncio.Task[None]] = {}  # the index follower of each replica
        self._running = False

    def routed_pools(self, cfg: ModelConfig) -> list[str]:
        """The pools whose replicas serve ``cfg`` here: the interactive one (else the model's first), and
        its prefill pool when it has one."""
        first = INTERACTIVE_POOL if INTERACTIVE_POOL in cfg.pools else (cfg.pools or [INTERACTIVE_POOL])[0]
        return [first, *([PREFILL_POOL] if PREFILL_POOL in cfg.pools and first != PREFILL_POOL else [])]

    @property
    def replicas(self) -> list[Replica]:
        return [r for route in self.models.values() for r in route.replicas]

    async def start(self) -> None:
        """Resolve the pools' DNS names and probe every replica once (so the first requests find healthy
        ones), then discover, poll and follow the replicas' KV events in the background."""
        await self.discover_once()
        await self.poll_once()
        self._running = True
        self._tasks.append(asyncio.create_task(self._poll_forever(), name="tollgate-router-poll"))
        if self._discovery:
            self._tasks.append(asyncio.create_task(self._discover_forever(), name="tollgate-discovery"))
        if self.policy.follows_kv_events:
            await self.follow_kv_once()
            for replica in self.replicas:
                self._follow(replica)

    async def stop(self) -> None:
        self._running = False
        await cancel_and_wait([*self._tasks, *self._followers.values()], what="the router")
        self._tasks.clear()
        self._followers.clear()

    # -- the replica set ------------------------------------------------------------------------
    async def refresh(self) -> None:
        """Discovery (when an interval has passed since the last) and a probe of every replica, now: for
        a process whose event loop runs only while it works (a Celery worker between tasks)."""
        if self._discovery and time.monotonic() - self._discovered_at >= self._discovery_interval:
            await self.discover_once()
        await self.poll_once()

    async def discover_once(self) -> None:
        """Resolve the pools' DNS names and apply the differences (see the module docstring)."""
        if not self._discovery:
            return
        self._discovered_at = time.monotonic()
        added: list[Replica] = []
        for pool, urls in (await self._discovery.resolve()).items():
            added += self.apply_pool(pool, urls)
        if added and self._running:
            await asyncio.gather(*(self._probe(r) for r in added))
            if self.policy.follows_kv_events:
                for replica in added:
                    self._follow(replica)

    def apply_pool(self, pool: str, urls: Sequence[str]) -> list[Replica]:
        """Make ``pool``'s replicas in every route that uses it exactly ``urls``; the new replicas."""
        added: list[Replica] = []
        for route in self.models.values():
            if pool not in route.routed:
                continue
            change = diff((r.url for r in route.replicas if r.pool == pool), urls)
            if not change:
                continue
            gone = set(change.removed)
            for replica in [r for r in route.replicas if r.pool == pool and r.url in gone]:
                route.replicas.remove(replica)
                self._retire(replica)
            fresh = [Replica(url=url, pool=pool) for url in change.added]
            route.replicas += fresh
            added += fresh
            logger.info("model %s, pool %s: %d replica(s) joined %s, %d left %s", route.name, pool,
                        len(change.added), change.added, len(change.removed), change.removed)
        return added

    def _retire(self, replica: Replica) -> None:
        replica.retired, replica.healthy = True, False
        follower = self._followers.pop(replica, None)
        if follower is not None:
            follower.cancel()
        replica.kv.reset()
        if all(r.url != replica.url for r in self.replicas):
            forget_kv_index(replica.url)

    def mark_draining(self, replica: Replica) -> None:
        """The replica is shutting down (it said so): nothing new goes there."""
        if not replica.draining:
            logger.info("replica %s is draining: no new requests go there", replica.url)
        replica.draining, replica.healthy, replica.last_error = True, False, "draining"

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.poll_once()
            except Exception:  # a probe bug must not stop routing updates
                logger.exception("replica poll failed")

    async def _probe(self, replica: Replica) -> None:
        try:
            if replica.info is None:
                replica.info = await self._client.info(replica.url)
            load = await self._client.load(replica.url)
            replica.reported(load)
        except EngineUnavailable as exc:
            if replica.retired:
                return
            replica.probe_failures += 1
            replica.last_error = exc.message
            if exc.refused or replica.probe_failures >= PROBE_FAILURES_TO_DOWN:
                if replica.healthy:
                    logger.warning("replica %s is down: %s", replica.url, exc.message)
                replica.healthy = False
        else:
            replica.probe_failures = 0
            if replica.retired:
                return
            if load.draining:
                self.mark_draining(replica)
                return
            replica.draining = False
            if not replica.healthy:
                logger.info("replica %s is up (%s, pool %s)", replica.url, replica.info.model, replica.pool)
            replica.healthy = True
            replica.last_error = None
        replica.checked_at = self.clock()

    async def follow_kv_once(self) -> None:
        """Bring every healthy replica's index up to date with its block events."""
        await asyncio.gather(*(self._follow_kv(r) for r in self.replicas if r.healthy))

    def _follow(self, replica: Replica) -> None:
        if replica not in self._followers and not replica.retired:
            self._followers[replica] = asyncio.create_task(self._follow_replica(replica),
                                                           name=f"tollgate-kv-index {replica.url}")

    async def _discover_forever(self) -> None:
        while True:
            await asyncio.sleep(self._discovery_interval)
            try:
                await self.discover_once()
            except Exception:  # a resolver bug must not stop discovery for good
                logger.exception("replica discovery failed")

    async def _follow_replica(self, replica: Replica) -> None:
        """Long-poll one replica's block events until the router stops or the replica leaves its pool."""
        while not replica.retired:
            try:
                followed = replica.healthy and await self._follow_kv(replica, wait_s=KV_EVENTS_WAIT_S)
            except Exception:  # a bug here must not stop the index from following
                logger.exception("following the KV events of %s failed", replica.url)
                followed = False
            if not followed:
                await asyncio.sleep(self._kv_interval)

    async def _follow_kv(self, replica: Replica, wait_s: float = 0.0) -> bool:
        """Apply the replica's events until caught up (the first request may wait ``wait_s`` for one);
        False if the replica could not be reached."""
        index = replica.kv
        snapshots = index.snapshots
        try:
            return await self._follow_pages(replica, wait_s)
        finally:
            observe_kv_index(replica.url, index.blocks, index.snapshots - snapshots)

    async def _follow_pages(self, replica: Replica, wait_s: float) -> bool:
        index = replica.kv
        for _ in range(100):  # pages until caught up; the rest next round
            try:
                page = await self._client.kv_events(replica.url, index.epoch, index.seq, wait_s)
            except EngineUnavailable:
                return False  # the probes decide the replica's health; its index is rebuilt when it is back
            wait_s = 0.0
            if not self.apply_kv_page(replica, page):
                continue
            if page.get("snapshot") is None and not page["events"]:
                return True
        return True

    def apply_kv_page(self, replica: Replica, page: dict[str, Any]) -> bool:
        """Apply one ``/kv/events`` answer (parsed JSON) to the replica's index; False when it did not
        follow the cursor and the index was reset (ask again from 0: the next page is a snapshot)."""
        try:
            replica.kv.apply(page)
        except (GapError, KeyError, TypeError, ValueError) as exc:
            logger.warning("KV index of %s rebuilt: %s", replica.url, exc)
            replica.kv.reset()
            return False
        return True

    def mark_failed(self, replica: Replica, reason: str) -> None:
        """Take a replica out until a probe finds it answering again."""
        if replica.healthy:
            logger.warning("replica %s taken out: %s", replica.url, reason)
        replica.healthy = False
        replica.last_error = reason

    def pick(self, model: str, block_hashes: Sequence[bytes], exclude: Sequence[Replica] = (),
             routing_key: bytes | None = None, adapter: str | None = None, *,
             prefill: bool = False) -> Replica:
        """A replica for a request (``prefill``: a prefill replica for its prompt, chosen the same way)."""
        route = self.models[model]
        candidates = [r for r in route.replicas if r.healthy and r not in exclude
                      and (r.pool == PREFILL_POOL) == prefill]
        if not candidates:
            raise ServiceUnavailableError(
                f"No replica of the model `{model}` is available right now. Please retry shortly.",
                headers={"retry-after": "1"},
            )
        if len(candidates) == 1:
            return candidates[0]
        least_inflight = min(r.inflight for r in candidates)
        if adapter is not None:
            # A LoRA request prefers the replicas holding its adapter read, unless they are all over their
            # watermark: then another replica takes it (and reads it), so a busy adapter spreads.
            holding = [r for r in candidates
                       if adapter in r.adapters and not r.over_watermark(least_inflight)]
            if holding:
                candidates = holding
                if len(candidates) == 1:
                    return candidates[0]
        least = min(candidates, key=lambda r: r.load_score)
        if routing_key is not None:
            preferred = max(candidates, key=lambda r: _rendezvous(routing_key, r.url))
            return least if preferred.over_watermark(least_inflight) else preferred
        return self.policy.choose(candidates, block_hashes, least_inflight, self.clock()) or least

    def cached_prefix_blocks(self, replica: Replica, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks ``replica`` holds (index) or most likely still holds (it served them
        recently)."""
        return self.policy.cached_prefix_blocks(replica, block_hashes, self.clock())

    def remember(self, replica: Replica, block_hashes: Sequence[bytes]) -> None:
        """Record that ``replica`` now holds these leading blocks (called when it accepted the request;
        the index expects them there until the replica's events say so, the affinity policy guesses from
        it, round robin moves to the next turn)."""
        now = self.clock()
        # The blocks it will newly hold (those it already holds cost no more of its cache).
        held = self.policy.cached_prefix_blocks(replica, block_hashes, now)
        replica.sent_blocks += len(block_hashes) - held
        self.policy.remember(replica, block_hashes, now)

    @staticmethod
    def remember_adapter(replica: Replica, adapter: str) -> None:
        """``replica`` accepted a request for ``adapter``: it holds it read now (until its next report)."""
        replica.adapters.add(adapter)


def _rendezvous(key: bytes, url: str) -> bytes:
    return hashlib.blake2b(key + url.encode(), digest_size=8).digest()


def _created(path: str | None) -> int:
    """``created`` of the model object: when its checkpoint was written (0 when unknown)."""
    if not path:
        return 0
    for name in ("config.json", ""):
        with contextlib.suppress(OSError):
            return int(os.stat(Path(path) / name).st_mtime)
    return 0
