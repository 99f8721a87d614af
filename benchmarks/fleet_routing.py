"""Fleet routing measured at scale, by simulation: the real router and KV index against N simulated
replicas, for the ``round_robin``, ``affinity`` and ``index`` policies.

What is real and what is simulated:
- The gateway side is real: ``gateway.routing.Router`` (``pick`` / ``remember`` / ``inflight`` exactly
  as ``gateway.generation`` calls them), fed the replicas' block events through
  ``Router.apply_kv_page`` (the page ``GET /kv/events`` would answer, encoded and parsed as on the wire,
  after every engine step: the long poll delivers events within milliseconds) and their ``LoadReport``s
  every ``health_poll_interval_s`` (1 s), as the background probes do. Block hashes are
  ``engine.kv.block_hash.prefix_block_hashes`` salted with ``gateway.tenants.cache_salt.cache_salt``.
- Each replica runs the real engine bookkeeping: ``engine.scheduler.Scheduler`` (continuous batching,
  token budget, chunked prefill, preemption, tenant fairness) over ``engine.kv`` (``BlockManager`` with
  the prefix cache and its ``KVEventLog``; a ``HostTier`` with ``--host-blocks``). No weights run: a
  step's duration comes from a step-time model, on a virtual clock (a discrete-event simulation,
  deterministic for a seed; nothing sleeps).

Step-time model (seconds): ``a + b * prefill tokens in the step + c * decoding sequences``, for
Llama-3-8B in bf16 on one H100, from the measurements in benchmarks/RESULTS.md (GPU path):
- ``a`` = 5.0 ms: reading the weights once per step, 15.01 GB at the measured 3.0 TB/s copy bandwidth;
- ``c`` = 0.134 ms per decoding sequence: the measured decode step at batch 64 and 2k context
  (13.55 ms) less ``a``, over 64 (mostly its KV reads);
- ``b`` = 0.045 ms per prefill token: 16.1 GFLOP a token (2 x 8.03 B parameters) at half the measured
  bf16 matmul rate (713 TFLOP/s; extend attention ran at 31-44% of its floor): ~22k prefill tokens/s.
Host-tier hits are loaded for free (the copies overlap the step); the device pool holds
``--kv-blocks`` blocks of 16 tokens per replica (8,192 by default: 128k tokens, ~16 GiB of this model's
KV at 128 KiB a token), far less than the trace's transcripts together.

Trace (seeded): ``--tenants`` tenants, each with a system prompt of 1-4k tokens; ``--sessions`` agent
sessions spread over the tenants by a Zipf law (``--tenant-skew``), starting as a Poisson process. A
session runs 4-16 turns; turn 1 sends the tenant's system prompt and a task (100-1,000 tokens), every
later turn resends the whole transcript (every earlier prompt and answer) plus a tool result
(200-2,000 tokens); answers are 30-250 tokens; after an answer the agent thinks (exponential, mean
``--think-s``) before its next turn. Generated tokens are decided by the trace, so the next turn resends
exactly what the engine cached.

Offered load: ``--load`` is the share of the fleet's capacity the trace asks for if nothing were cached
(what a cache-blind operator provisions for): each request's cost in the step model, every prompt token
computed (the fixed ``a`` shared by a full token budget), every output token decoded in a batch as large
as the device pool fits (``a`` shared by that batch); the session arrival rate is set so that the
sessions' cost per second is ``load x replicas``. The utilisation column says how busy the replicas
really were (prefix hits make it lower).

Reported per policy: hit rate (prompt tokens served from the prefix cache when a request first starts:
the engine's ``num_cached_tokens``, what tenants are billed as cached) against the ideal of the trace (an
infinite cache per tenant with perfect routing: a request's leading full blocks that any earlier request
of the same tenant computed, prompt or answer, are hits, never the block of its last token; the only
miss besides new tokens is each tenant's first system prompt); the busiest replica's tokens computed
(prefill, recompute included, and decode) against the mean; queueing delay (arrival at the replica to
first scheduled) p50 / p95; time to first token p95; utilisation (share of the virtual time the
replicas were stepping); preemptions.

``python benchmarks/fleet_routing.py --out benchmarks/out/fleet_routing.json`` (16 replicas, 20 tenants,
400 sessions, load 0.7) prints a table and writes JSON; ``--quick`` runs a small configuration in
seconds.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, write_json  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv.block_hash import prefix_block_hashes  # noqa: E402
from engine.kv.block_manager import BlockManager  # noqa: E402
from engine.kv.cache import KVCache  # noqa: E402
from engine.kv.events import KVEventLog  # noqa: E402
from engine.kv.tiers import HostTier  # noqa: E402
from engine.protocol import LoadReport, encode_kv_events  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from engine.sequence import FinishReason, ScheduledBatch, Sequence  # noqa: E402
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.routing import IndexPolicy, Replica, Router, ScoreWeights  # noqa: E402
from gateway.tenants.cache_salt import cache_salt  # noqa: E402
from tollgate.settings import ModelConfig, PoolConfig, Settings  # noqa: E402

MODEL = "fleet-sim"
BLOCK_SIZE = 16
POLICIES = ("round_robin", "affinity", "index")
SALT_SECRET = "fleet-routing-simulation"
# The step-time model (see the module docstring), seconds.
STEP_FIXED_S = 5.0e-3
PREFILL_TOKEN_S = 0.045e-3
DECODE_SEQ_S = 0.134e-3


@dataclass(frozen=True)
class Shape:
    """The trace's and the replicas' dimensions (token ranges are inclusive)."""

    replicas: int = 16
    tenants: int = 20
    sessions: int = 400
    load: float = 0.7
    seed: int = 0
    tenant_skew: float = 0.8
    system_tokens: tuple[int, int] = (1000, 4000)
    task_tokens: tuple[int, int] = (100, 1000)
    tool_tokens: tuple[int, int] = (200, 2000)
    output_tokens: tuple[int, int] = (30, 250)
    turns: tuple[int, int] = (4, 16)
    think_s: float = 2.0
    kv_blocks: int = 8192
    host_blocks: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


QUICK = dict(replicas=4, tenants=4, sessions=32, system_tokens=(300, 800), task_tokens=(50, 300),
             tool_tokens=(50, 400), output_tokens=(20, 80), turns=(2, 6), kv_blocks=768)


# ---- the trace ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Turn:
    prompt_tokens: int  # the prompt is the session's transcript[:prompt_tokens]
    output_tokens: int  # the answer is the next output_tokens of the transcript
    think_s: float  # after the answer, before the next turn


@dataclass
class Session:
    index: int
    tenant: int
    salt: str
    start_s: float
    transcript: list[int]
    turns: list[Turn]
    hashes: list[bytes] = field(default_factory=list)  # the transcript's full blocks, as the gateway hashes


def build_trace(shape: Shape) -> list[Session]:
    rng = random.Random(shape.seed)
    tokens = lambda n: [rng.randrange(5, 32_000) for _ in range(n)]  # noqa: E731
    systems = [tokens(rng.randint(*shape.system_tokens)) for _ in range(shape.tenants)]
    weights = [1.0 / (rank + 1) ** shape.tenant_skew for rank in range(shape.tenants)]
    salts = [cache_salt(SALT_SECRET, tenant) for tenant in range(shape.tenants)]
    sessions = []
    for index in range(shape.sessions):
        tenant = rng.choices(range(shape.tenants), weights)[0]
        transcript = systems[tenant] + tokens(rng.randint(*shape.task_tokens))
        turns = []
        for number in range(rng.randint(*shape.turns)):
            if number:
                transcript += tokens(rng.randint(*shape.tool_tokens))
            prompt, output = len(transcript), rng.randint(*shape.output_tokens)
            transcript += tokens(output)
            turns.append(Turn(prompt, output, rng.expovariate(1.0 / shape.think_s)))
        session = Session(index, tenant, salts[tenant], 0.0, transcript, turns)
        session.hashes = prefix_block_hashes(transcript, BLOCK_SIZE, session.salt)
        sessions.append(session)
    # Poisson session starts at the rate that asks for ``load`` of the fleet's capacity.
    rate = shape.load * shape.replicas / (sum(session_cost(s, shape) for s in sessions) / len(sessions))
    clock = 0.0
    for session in sessions:
        clock += rng.expovariate(rate)
        session.start_s = clock
    return sessions


def session_cost(session: Session, shape: Shape) -> float:
    """Replica-seconds the session's turns cost with nothing cached (the load's yardstick)."""
    per_prompt_token = PREFILL_TOKEN_S + STEP_FIXED_S / shape.max_num_batched_tokens
    mean_context = sum(t.prompt_tokens + t.output_tokens for t in session.turns) / len(session.turns)
    batch = max(1, min(shape.max_num_seqs, shape.kv_blocks * BLOCK_SIZE // int(mean_context)))
    per_output_token = DECODE_SEQ_S + STEP_FIXED_S / batch
    return sum(t.prompt_tokens * per_prompt_token + t.output_tokens * per_output_token for t in session.turns)


def ideal_hit_tokens(sessions: list[Session]) -> int:
    """Hit tokens of an infinite cache per tenant with perfect routing (see the module docstring)."""
    seen: set[bytes] = set()
    hits = 0
    for session in sorted(sessions, key=lambda s: s.start_s):
        for turn in session.turns:
            for digest in session.hashes[:(turn.prompt_tokens - 1) // BLOCK_SIZE]:
                if digest not in seen:
                    break
                hits += BLOCK_SIZE
            # What the engine computes and caches: the prompt and the answer but its last token.
            seen.update(session.hashes[:(turn.prompt_tokens + turn.output_tokens - 1) // BLOCK_SIZE])
    return hits


# ---- the replicas ------------------------------------------------------------------------------------

@dataclass
class Request:
    session: Session
    turn: int
    arrival_s: float
    replica: SimReplica | None = None
    seq: Sequence | None = None
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None


class SimReplica:
    """One engine replica: the real scheduler and KV bookkeeping, stepping on the virtual clock."""

    def __init__(self, url: str, shape: Shape) -> None:
        self.url = url
        self.events = KVEventLog()
        tiers = HostTier(shape.host_blocks, None, self.events) if shape.host_blocks else None
        self.blocks = BlockManager(shape.kv_blocks, BLOCK_SIZE, True, tiers, self.events)
        config = EngineConfig(model=MODEL, max_num_seqs=shape.max_num_seqs,
                              max_num_batched_tokens=shape.max_num_batched_tokens)
        self.scheduler = Scheduler(config, KVCache(self.blocks))
        self.requests: dict[int, Request] = {}  # seq_id -> its unfinished request
        self.batch: ScheduledBatch | None = None
        self.busy_s = 0.0
        self.decode_tokens = 0
        self.steps = 0

    def step_time(self, batch: ScheduledBatch) -> float:
        prefill, decodes = 0, 0
        for item in batch.seqs:
            if item.num_tokens == 1 and item.start >= item.seq.num_prompt_tokens:
                decodes += 1
            else:
                prefill += item.num_tokens
        self.decode_tokens += decodes
        return STEP_FIXED_S + PREFILL_TOKEN_S * prefill + DECODE_SEQ_S * decodes

    def load_report(self) -> LoadReport:
        """What ``GET /load`` would answer now."""
        sched, bm = self.scheduler, self.blocks
        pending = sum(max(0, r.seq.num_prompt_tokens - r.seq.num_computed_tokens)
                      for r in self.requests.values() if r.seq is not None)
        return LoadReport(model=MODEL, pool="interactive", waiting=sched.num_waiting,
                          running=sched.num_running, pending_prefill_tokens=pending, kv_usage=bm.usage,
                          num_kv_blocks=bm.num_blocks, free_kv_blocks=bm.num_free_blocks,
                          prefix_hit_rate=bm.prefix_hit_rate, num_preemptions=sched.num_preemptions,
                          tokens_per_s=0.0, step_time_s=0.0, ttft_s=0.0)


# ---- the simulation ----------------------------------------------------------------------------------

class Simulation:
    def __init__(self, shape: Shape, sessions: list[Session], policy: str,
                 weights: ScoreWeights | None = None) -> None:
        self.shape, self.sessions, self.policy = shape, sessions, policy
        self.now = 0.0
        urls = [f"http://replica-{i:03d}:8100" for i in range(shape.replicas)]
        settings = Settings(environment="test", models=[ModelConfig(name=MODEL, path=None)],
                            pools={"interactive": PoolConfig(replicas=urls)}, routing_policy=policy)
        self.router = Router(settings, EngineClient(request_timeout_s=1.0), clock=lambda: self.now)
        if weights is not None and isinstance(self.router.policy, IndexPolicy):
            self.router.policy.weights = weights
        self.poll_s = settings.health_poll_interval_s
        self.replicas = {url: SimReplica(url, shape) for url in urls}
        self.routed: dict[str, Replica] = {r.url: r for r in self.router.replicas}
        for replica in self.router.replicas:
            replica.healthy = True
            replica.reported(self.replicas[replica.url].load_report())
        self.done: list[Request] = []
        self._heap: list[tuple[float, int, int, Any]] = []
        self._order = 0
        self._unfinished = 0

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (at, self._order, kind, payload))

    def run(self) -> None:
        for session in self.sessions:
            self._push(session.start_s, ARRIVE, Request(session, 0, session.start_s))
        self._unfinished = len(self.sessions)
        self._push(self.poll_s, POLL, None)
        while self._heap and self._unfinished:
            self.now, _, kind, payload = heapq.heappop(self._heap)
            if kind == ARRIVE:
                self._arrive(payload)
            elif kind == STEP_END:
                self._step_end(payload)
            else:
                for replica in self.router.replicas:
                    replica.reported(self.replicas[replica.url].load_report())
                self._push(self.now + self.poll_s, POLL, None)

    def _arrive(self, request: Request) -> None:
        """The gateway's dispatch (``Generation._open``): pick, count in flight, remember, send."""
        session, turn = request.session, request.session.turns[request.turn]
        hashes = session.hashes[:turn.prompt_tokens // BLOCK_SIZE]
        routed = self.router.pick(MODEL, hashes)
        routed.inflight += 1
        self.router.remember(routed, hashes)
        replica = self.replicas[routed.url]
        seq = Sequence(f"s{session.index}-t{request.turn}", session.transcript[:turn.prompt_tokens],
                       SamplingParams(max_tokens=turn.output_tokens, temperature=0.0, ignore_eos=True),
                       tenant=str(session.tenant), cache_salt=session.salt, arrival_time=self.now)
        request.replica, request.seq = replica, seq
        replica.requests[seq.seq_id] = request
        replica.scheduler.add(seq)
        if replica.batch is None:
            self._start_step(replica)
            self._publish(replica)

    def _start_step(self, replica: SimReplica) -> None:
        batch = replica.scheduler.schedule()
        if not batch:
            replica.batch = None
            return
        for item in batch.seqs:
            request = replica.requests[item.seq.seq_id]
            if request.first_scheduled_s is None:
                request.first_scheduled_s = self.now
        took = replica.step_time(batch)
        replica.busy_s += took
        replica.steps += 1
        replica.batch = batch
        self._push(self.now + took, STEP_END, replica)

    def _step_end(self, replica: SimReplica) -> None:
        sched, batch = replica.scheduler, replica.batch
        assert batch is not None
        for seq in sched.update_after_step(batch):
            request = replica.requests[seq.seq_id]
            turn = request.session.turns[request.turn]
            start = turn.prompt_tokens + seq.num_output_tokens
            sched.token_known(seq, request.session.transcript[start])
            if request.first_token_s is None:
                request.first_token_s = self.now
            if seq.num_output_tokens >= turn.output_tokens:
                sched.finish(seq, FinishReason.LENGTH)
                self._finish(request)
        self._start_step(replica)
        self._publish(replica)

    def _finish(self, request: Request) -> None:
        assert request.replica is not None and request.seq is not None
        request.finished_s = self.now
        del request.replica.requests[request.seq.seq_id]
        self.routed[request.replica.url].inflight -= 1
        self.done.append(request)
        session, turn = request.session, request.session.turns[request.turn]
        if request.turn + 1 < len(session.turns):
            at = self.now + turn.think_s
            self._push(at, ARRIVE, Request(session, request.turn + 1, at))
        else:
            self._unfinished -= 1

    def _publish(self, replica: SimReplica) -> None:
        """The replica's new block events into the router's index, through the wire format of
        ``GET /kv/events`` (only the index policy follows them, as in the gateway)."""
        if self.policy != "index":
            return
        routed = self.routed[replica.url]
        for _ in range(3):
            page = orjson.loads(encode_kv_events(replica.events.since(routed.kv.seq, routed.kv.epoch)))
            if self.router.apply_kv_page(routed, page):
                return


ARRIVE, STEP_END, POLL = 0, 1, 2


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def simulate(shape: Shape, policy: str, sessions: list[Session] | None = None,
             weights: ScoreWeights | None = None) -> dict[str, Any]:
    """One policy over the trace of ``shape``: the figures of the module docstring."""
    sessions = sessions if sessions is not None else build_trace(shape)
    started = time.perf_counter()
    sim = Simulation(shape, sessions, policy, weights)
    sim.run()
    done = sim.done
    prompt = sum(r.session.turns[r.turn].prompt_tokens for r in done)
    cached = sum(r.seq.num_cached_tokens or 0 for r in done if r.seq is not None)
    ideal = ideal_hit_tokens(sessions)
    computed = [rep.scheduler.computed_prefill_tokens + rep.decode_tokens for rep in sim.replicas.values()]
    busy = [rep.busy_s for rep in sim.replicas.values()]
    queueing = [r.first_scheduled_s - r.arrival_s for r in done if r.first_scheduled_s is not None]
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    expected = sum(len(s.turns) for s in sessions)
    return {
        "policy": policy, "requests": len(done), "requests_expected": expected,
        "prompt_tokens": prompt, "cached_tokens": cached, "hit_rate": cached / prompt if prompt else 0.0,
        "ideal_hit_rate": ideal / prompt if prompt else 0.0,
        "computed_tokens_by_replica": computed,
        "busiest_over_mean": max(computed) / (sum(computed) / len(computed)) if sum(computed) else 0.0,
        "busy_s_by_replica": busy, "virtual_s": sim.now,
        "utilisation": sum(busy) / (len(busy) * sim.now) if sim.now else 0.0,
        "queueing_p50_ms": 1000 * percentile(queueing, 0.5),
        "queueing_p95_ms": 1000 * percentile(queueing, 0.95),
        "ttft_p50_ms": 1000 * percentile(ttft, 0.5), "ttft_p95_ms": 1000 * percentile(ttft, 0.95),
        "preemptions": sum(rep.scheduler.num_preemptions for rep in sim.replicas.values()),
        "steps": sum(rep.steps for rep in sim.replicas.values()),
        "weights": vars_of(sim.router.policy.weights) if isinstance(sim.router.policy, IndexPolicy) else None,
        "wall_s": time.perf_counter() - started,
    }


def vars_of(weights: ScoreWeights) -> dict[str, float]:
    return {name: getattr(weights, name) for name in weights.__dataclass_fields__}


def table(results: list[dict[str, Any]]) -> str:
    base = next((r["hit_rate"] for r in results if r["policy"] == "round_robin"), None)
    rows = [[r["policy"], f"{r['hit_rate']:.1%}", f"{r['hit_rate'] / r['ideal_hit_rate']:.0%}",
             f"{r['hit_rate'] / base:.2f}x" if base else "-", f"{r['busiest_over_mean']:.2f}x",
             f"{r['queueing_p50_ms']:.0f} / {r['queueing_p95_ms']:.0f}", f"{r['ttft_p95_ms']:.0f}",
             f"{r['utilisation']:.0%}", r["preemptions"], f"{r['requests']}/{r['requests_expected']}"]
            for r in results]
    return format_table(["policy", "hit rate", "of ideal", "vs round robin", "busiest / mean tokens",
                         "queueing p50 / p95 ms", "TTFT p95 ms", "utilisation", "preemptions", "requests"],
                        rows)


def shape_from(args: argparse.Namespace) -> Shape:
    base = dict(QUICK) if args.quick else {}
    for name in ("replicas", "tenants", "sessions", "load", "seed", "tenant_skew", "think_s", "kv_blocks",
                 "host_blocks"):
        value = getattr(args, name)
        if value is not None:
            base[name] = value
    return Shape(**base)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, help="simulated engine replicas (16)")
    parser.add_argument("--tenants", type=int, help="tenants, each with its own system prompt (20)")
    parser.add_argument("--sessions", type=int, help="agent sessions in all (400)")
    parser.add_argument("--load", type=float, help="offered load as a share of the fleet's capacity (0.7)")
    parser.add_argument("--seed", type=int, help="the trace's seed (0)")
    parser.add_argument("--tenant-skew", type=float, help="Zipf exponent of sessions per tenant (0.8)")
    parser.add_argument("--think-s", type=float, help="mean pause of an agent between turns (2.0)")
    parser.add_argument("--kv-blocks", type=int, help="device KV blocks of 16 tokens per replica (8192)")
    parser.add_argument("--host-blocks", type=int, help="host tier blocks per replica (0: none)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--weights", default=None,
                        help="the index scorer's weights prefix,queue,kv (default: gateway.routing's)")
    parser.add_argument("--quick", action="store_true", help="a small configuration that runs in seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    shape = shape_from(args)
    weights = None
    if args.weights:
        prefix, queue, kv = (float(w) for w in args.weights.split(","))
        weights = ScoreWeights(prefix=prefix, queue=queue, kv=kv)
    sessions = build_trace(shape)
    results = [simulate(shape, policy, sessions, weights) for policy in args.policies.split(",")]
    print(table(results))
    prompt = results[0]["prompt_tokens"]
    print(f"{shape.replicas} replicas, {shape.tenants} tenants, {shape.sessions} sessions, "
          f"{results[0]['requests']} requests, {prompt:,} prompt tokens; ideal hit rate "
          f"{results[0]['ideal_hit_rate']:.1%}; load {shape.load:.0%} of capacity with nothing cached")
    if args.out:
        write_json(args.out, {"args": {k: v for k, v in vars(args).items() if k != "out"},
                              "shape": vars(shape), "results": results,
                              "machine": f"{os.cpu_count()}-core CPU",
                              "step_model_s": {"fixed": STEP_FIXED_S, "per_prefill_token": PREFILL_TOKEN_S,
                                               "per_decode_seq": DECODE_SEQ_S},
                              "date": datetime.now(UTC).isoformat(timespec="seconds")})
    return results


if __name__ == "__main__":
    main()
