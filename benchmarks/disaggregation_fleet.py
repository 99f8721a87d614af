"""Disaggregated serving (#40), part (b): a fleet simulation of colocated against prefill:decode pools.

For a long-prompt and a short-prompt trace at rising load, the same number of replicas is run three
ways: all colocated (``both``), 1:1 and 1:3 prefill:decode. Reported per (trace, load, topology): the
share of prompts prefilled remotely, time to first token (TTFT) and time per output token (TPOT: a
request's decode time over its tokens after the first) at p50 and p99, the p99 of the gaps between
tokens (ITL, every stream's every gap), the shares within the trace's TTFT target, its TPOT target and
both (goodput), the share within both with a tighter, interactive TPOT target, and the output tokens per
second. Other splits: ``--topologies colocated,3:1``.

What is real and what is simulated:
- The gateway side is real: ``gateway.routing.Router`` picks the decode (or colocated) replica and the
  prefill replica as ``gateway.generation`` does (``inflight`` counted as there: the decode replica's
  from its pick, before the prefill), its load reports refreshed every
  ``health_poll_interval_s``; ``gateway.generation.disaggregation.remote_prefill_wanted`` decides per
  request (a prompt is prefilled remotely when at least ``disagg_min_prompt_tokens``, 1,024 by default,
  of it is not cached on the decode replica). Prompts are unique (no prefix is shared), so nothing is
  ever cached: the block hashes the router sees are unique stand-ins.
- The replicas are a model of the engine's scheduler (``engine.scheduler``), not the scheduler itself:
  continuous batching of at most ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens a
  step (the engine's defaults, 64 and 2,048); running sequences first, in admission order (a decode
  takes one token, an unfinished prompt a chunk of what is left of the budget), then first-come
  first-served, head-of-line admission while slots, budget and KV blocks last. A request reserves the
  blocks of its prompt and answer when admitted, so nothing is preempted. A colocated replica mixes
  prefill chunks into its decode steps: a long prompt makes the steps of every running stream slower.
  A prefill replica computes prompts only (its one sampled token is dropped) and holds their blocks
  until pulled; a decode replica admits a pulled request with every full block of its prompt but the
  one holding its last token in place (``(P - 1) // 16`` blocks), computes that last block and samples
  every token, as the engine does.
- The KV transfer: the prompt's full blocks (128 KiB a token) over ``--link-gb-s`` (25 GB/s by default:
  a 200 Gb/s RDMA NIC per GPU at line rate; 50 GB/s for 400 Gb/s) plus ``LINK_SETUP_S`` a pull (its
  request, checks and ack). Pulls in flight share the NICs (the prefill replica's out, the decode
  replica's in) max-min fairly, as flows on a fabric do. Part (a)'s ~330 MB/s is Python
  framing over a CPU's loopback, not a fabric's rate.

Step-time model (seconds), Llama-3-8B in bf16 on one H100, from the GPU figures in
benchmarks/RESULTS.md ("GPU path"): ``a + b x prefill tokens + e x (query, key) pairs of the prefill
chunks + c x context tokens of the decoding sequences``:
- ``a`` = 5.0 ms: the weights read once a step, 15.01 GB at the measured 3.0 TB/s copy bandwidth;
- ``b`` = 0.045 ms a prefill token: 16.1 GFLOP a token (2 x 8.03 B parameters) at half the measured
  bf16 matmul rate (713 TFLOP/s);
- ``e`` = 1.96 ns a (query, key) pair: 4 x 32 layers x 4,096 FLOP of causal attention at 37.5% of the
  matmul rate (extend attention ran at 31-44% of its floor);
- ``c`` = 65.2 ns a context token: the measured decode step at batch 64 and context 2,048 (13.55 ms)
  less ``a``, over its 131,072 context tokens (its KV, 17.18 GB, is most of what it reads).
KV pool: ``--kv-gib`` (48 GiB: 0.9 of 80 GB less the 15 GB of weights and room for activations) at
128 KiB a token. ``a``, ``b`` and ``c`` are ``benchmarks/fleet_routing.py``'s, ``c`` per context token.

Offered load: as in ``benchmarks/fleet_routing.py``, the share of a colocated fleet's capacity the
trace asks for: a request's cost in the step model (its prompt computed in full chunks sharing ``a``,
its answer decoded in a batch as large as slots and KV allow), Poisson arrivals at the rate that asks
``load x replicas`` replica-seconds a second. Above 1.0 queues grow for as long as the trace lasts, so
the figures there depend on its length.

``python benchmarks/disaggregation_fleet.py --out benchmarks/out/disaggregation_fleet.json`` (8
replicas, loads 0.25-1.0, 1,000 long and 3,000 short requests a point) prints the table and writes
JSON; ``--quick`` runs a small configuration in seconds. Deterministic for a seed.
"""

from __future__ import annotations

import argparse
import heapq
import os
import random
import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, write_json  # noqa: E402
from benchmarks.fleet_routing import DECODE_SEQ_S, PREFILL_TOKEN_S, STEP_FIXED_S  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.protocol import GenerateRequest, InfoResponse, LoadReport  # noqa: E402
from gateway.engine_client import EngineClient  # noqa: E402
from gateway.generation.disaggregation import remote_prefill_wanted  # noqa: E402
from gateway.routing import INTERACTIVE_POOL, PREFILL_POOL, Replica, Router  # noqa: E402
from tollgate.settings import ModelConfig, PoolConfig, Settings  # noqa: E402

MODEL = "disagg-sim"
BLOCK_SIZE = 16
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16: 128 KiB
DECODE_CONTEXT = 2048  # the measured decode step's context (RESULTS.md; its batch, 64, is in DECODE_SEQ_S)
CONTEXT_TOKEN_S = DECODE_SEQ_S / DECODE_CONTEXT  # 65.2 ns; the measured step is a + 64 x 2,048 x this
ATTENTION_PAIR_S = 4 * 32 * 4096 / (0.375 * 713e12)  # 1.96 ns a (query, key) pair of a prefill chunk
LINK_SETUP_S = 1e-3  # a pull's request, checks and ack (an assumption: the RDMA read itself is the rest)
ENGINE = EngineConfig(model=MODEL)
TOPOLOGIES = ("colocated", "1:1", "1:3")


def prefill_replicas(topology: str, replicas: int) -> int:
    """How many of ``replicas`` prefill in ``topology`` (``colocated``: none; ``P:D``: that ratio)."""
    if topology == "colocated":
        return 0
    try:
        prefill, decode = (int(part) for part in topology.split(":"))
    except ValueError:
        raise ValueError(f"a topology is colocated or P:D (e.g. 1:3), got {topology!r}") from None
    if prefill < 1 or decode < 1 or replicas % (prefill + decode):
        raise ValueError(f"{replicas} replicas do not split {topology}")
    return replicas * prefill // (prefill + decode)


@dataclass(frozen=True)
class Trace:
    """A request mix (token ranges inclusive, uniform) and its targets."""

    name: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    ttft_s: float
    tpot_s: float
    tight_tpot_s: float  # a second, interactive TPOT target


TRACES = {"long": Trace("long", (4000, 8000), (200, 500), ttft_s=2.0, tpot_s=0.050, tight_tpot_s=0.025),
          "short": Trace("short", (200, 500), (200, 500), ttft_s=0.5, tpot_s=0.050, tight_tpot_s=0.025)}


@dataclass(frozen=True)
class Shape:
    replicas: int = 8
    topologies: tuple[str, ...] = TOPOLOGIES
    loads: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    requests: dict[str, int] = field(default_factory=lambda: {"long": 1000, "short": 3000})
    seed: int = 0
    link_gb_s: float = 25.0
    kv_gib: float = 48.0
    min_prompt_tokens: int = Settings.model_fields["disagg_min_prompt_tokens"].default
    max_num_seqs: int = ENGINE.max_num_seqs
    max_num_batched_tokens: int = ENGINE.max_num_batched_tokens
    routing_policy: str = "index"  # the gateway's default; round_robin spreads blindly (``--routing``)

    def __post_init__(self) -> None:
        for topology in self.topologies:
            prefill_replicas(topology, self.replicas)  # raises when the replicas do not split so

    @property
    def kv_blocks(self) -> int:
        return int(self.kv_gib * 2**30) // (KV_BYTES_PER_TOKEN * BLOCK_SIZE)


QUICK: dict[str, Any] = dict(replicas=4, loads=(0.5, 1.0), requests={"long": 120, "short": 300})


def step_time(prefill_tokens: int, attention_pairs: float, decode_context_tokens: int) -> float:
    return (STEP_FIXED_S + PREFILL_TOKEN_S * prefill_tokens + ATTENTION_PAIR_S * attention_pairs
            + CONTEXT_TOKEN_S * decode_context_tokens)


def chunk_pairs(start: int, tokens: int) -> float:
    """(query, key) pairs of causal attention for prompt positions [start, start + tokens)."""
    return tokens * (2 * start + tokens + 1) / 2


# ---- the trace ---------------------------------------------------------------------------------------

@dataclass(eq=False, slots=True)
class Request:
    index: int
    prompt: int
    output: int
    arrival_s: float
    hashes: tuple[bytes, ...]
    remote: bool = False
    decode: Replica | None = None  # the router's choice for the decode (or colocated) side
    prefill: Replica | None = None
    computed: int = 0
    generated: int = 0
    blocks: int = 0
    first_token_s: float | None = None
    last_token_s: float = 0.0
    finished_s: float | None = None


def request_cost(prompt: int, output: int, shape: Shape) -> float:
    """Replica-seconds one request costs a colocated replica (the offered load's yardstick)."""
    budget = shape.max_num_batched_tokens
    prefill = prompt * (PREFILL_TOKEN_S + STEP_FIXED_S / budget) + ATTENTION_PAIR_S * chunk_pairs(0, prompt)
    batch = max(1, min(shape.max_num_seqs, shape.kv_blocks * BLOCK_SIZE // (prompt + output)))
    return prefill + output * (STEP_FIXED_S / batch + CONTEXT_TOKEN_S * (prompt + output / 2))


def build_trace(trace: Trace, count: int, load: float, shape: Shape) -> list[Request]:
    """``count`` requests with Poisson arrivals at ``load``; the lengths and the arrivals' pattern depend
    on the seed only (every load and topology sees the same requests, spaced in proportion)."""
    rng = random.Random(f"{shape.seed}-{trace.name}")
    lengths = [(rng.randint(*trace.prompt_tokens), rng.randint(*trace.output_tokens)) for _ in range(count)]
    gaps = [rng.expovariate(1.0) for _ in range(count)]
    rate = load * shape.replicas / (sum(request_cost(p, o, shape) for p, o in lengths) / count)
    requests, clock = [], 0.0
    for index, ((prompt, output), gap) in enumerate(zip(lengths, gaps, strict=True)):
        clock += gap / rate
        hashes = tuple(f"{index}:{block}".encode() for block in range(prompt // BLOCK_SIZE))
        requests.append(Request(index, prompt, output, clock, hashes))
    return requests


# ---- the replicas ------------------------------------------------------------------------------------

class SimReplica:
    """One replica of the step-time model (see the module docstring), stepping on the virtual clock."""

    def __init__(self, routed: Replica, role: str, shape: Shape) -> None:
        self.routed, self.role, self.shape = routed, role, shape
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_blocks = shape.kv_blocks
        self.batch: list[tuple[Request, int]] | None = None
        self.busy_s = 0.0

    def blocks_for(self, request: Request) -> int:
        tokens = request.prompt if self.role == "prefill" else request.prompt + request.output
        return -(-tokens // BLOCK_SIZE)

    def schedule(self) -> tuple[list[tuple[Request, int]], float]:
        """One step's work and its duration: running sequences, then admissions (the engine's order)."""
        budget, batch = self.shape.max_num_batched_tokens, []
        prefill = context = 0
        pairs = 0.0
        for request in self.running:
            if budget <= 0:
                break
            if request.computed < request.prompt:
                num = min(request.prompt - request.computed, budget)
                prefill += num
                pairs += chunk_pairs(request.computed, num)
            else:
                num = 1
                context += request.prompt + request.generated
            budget -= num
            batch.append((request, num))
        while self.waiting and budget > 0 and len(self.running) < self.shape.max_num_seqs:
            request = self.waiting[0]
            need = self.blocks_for(request)
            if need > self.free_blocks:
                break  # head-of-line: nothing is admitted ahead of it
            self.waiting.popleft()
            self.free_blocks -= need
            request.blocks = need
            self.running.append(request)
            num = min(request.prompt - request.computed, budget)
            prefill += num
            pairs += chunk_pairs(request.computed, num)
            budget -= num
            batch.append((request, num))
        return batch, step_time(prefill, pairs, context) if batch else 0.0

    def load_report(self) -> LoadReport:
        """What ``GET /load`` would answer now."""
        pending = sum(r.prompt - r.computed for r in (*self.waiting, *self.running) if r.computed < r.prompt)
        total = self.shape.kv_blocks
        return LoadReport(model=MODEL, pool=self.routed.pool, waiting=len(self.waiting),
                          running=len(self.running), pending_prefill_tokens=pending,
                          kv_usage=1.0 - self.free_blocks / total, num_kv_blocks=total,
                          free_kv_blocks=self.free_blocks, prefix_hit_rate=0.0, num_preemptions=0,
                          tokens_per_s=0.0, step_time_s=0.0, ttft_s=0.0)


# ---- the simulation ----------------------------------------------------------------------------------

@dataclass(eq=False, slots=True)
class Pull:
    request: Request
    source: SimReplica
    target: SimReplica
    tokens: int
    remaining: float  # bytes
    rate: float = 0.0  # bytes a second


class Links:
    """The replicas' NICs, each ``bandwidth`` out and in: the pulls in flight share them max-min fairly
    (progressive filling), recomputed whenever a pull starts or ends."""

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.pulls: list[Pull] = []
        self.at = 0.0
        self.version = 0  # a completion event of an older version is stale

    def advance(self, now: float) -> list[Pull]:
        """Move every pull on to ``now``; the pulls that completed, taken out."""
        for pull in self.pulls:
            pull.remaining -= pull.rate * (now - self.at)
        self.at = now
        done = [p for p in self.pulls if p.remaining <= 1.0]
        self.pulls = [p for p in self.pulls if p.remaining > 1.0]
        return done

    def next_completion(self) -> float | None:
        """Share the bandwidth anew; the time the first pull in flight completes (None: none)."""
        self.version += 1
        ends = lambda pull: (("out", id(pull.source)), ("in", id(pull.target)))  # noqa: E731
        left = {nic: self.bandwidth for pull in self.pulls for nic in ends(pull)}
        unfixed = list(self.pulls)
        while unfixed:  # the NIC with the smallest equal share fixes the rate of its pulls; repeat
            through = Counter(nic for pull in unfixed for nic in ends(pull))
            nic = min(through, key=lambda n: left[n] / through[n])
            share = left[nic] / through[nic]
            for pull in [p for p in unfixed if nic in ends(p)]:
                pull.rate = share
                unfixed.remove(pull)
                for end in ends(pull):
                    left[end] -= share
        return min((self.at + p.remaining / p.rate for p in self.pulls), default=None)


ARRIVE, STEP_END, LINK, PULLED, POLL = range(5)


class Simulation:
    def __init__(self, shape: Shape, topology: str, requests: list[Request]) -> None:
        self.shape, self.requests = shape, requests
        self.now = 0.0
        prefills = prefill_replicas(topology, shape.replicas)
        decode_role = "decode" if prefills else "both"
        roles = [("prefill", PREFILL_POOL)] * prefills + [(decode_role, INTERACTIVE_POOL)] * (
            shape.replicas - prefills)
        urls = [f"http://{role}-{i:03d}:8100" for i, (role, _) in enumerate(roles)]
        pools = {INTERACTIVE_POOL: PoolConfig(replicas=[u for u, (_, p) in zip(urls, roles, strict=True)
                                                        if p == INTERACTIVE_POOL])}
        if prefills:
            pools[PREFILL_POOL] = PoolConfig(replicas=urls[:prefills])
        self.settings = Settings(environment="test", routing_policy=shape.routing_policy, pools=pools,
                                 models=[ModelConfig(name=MODEL, pools=list(pools))],
                                 disagg_min_prompt_tokens=shape.min_prompt_tokens)
        self.router = Router(self.settings, EngineClient(request_timeout_s=1.0), clock=lambda: self.now)
        self.route = self.router.models[MODEL]
        self.sims: dict[str, SimReplica] = {}
        for replica in self.router.replicas:
            role = dict(zip(urls, roles, strict=True))[replica.url][0]
            replica.healthy = True
            replica.info = InfoResponse(
                model=MODEL, pool=replica.pool, max_model_len=32768, vocab_size=128256, block_size=BLOCK_SIZE,
                eos_token_ids=[], num_kv_blocks=shape.kv_blocks, max_num_seqs=shape.max_num_seqs,
                max_num_batched_tokens=shape.max_num_batched_tokens, role=role)
            self.sims[replica.url] = SimReplica(replica, role, shape)
            replica.reported(self.sims[replica.url].load_report())
        self.links = Links(shape.link_gb_s * 1e9)
        self.gaps: list[float] = []
        self._heap: list[tuple[float, int, int, Any]] = []
        self._order = 0
        self._unfinished = len(requests)

    def _push(self, at: float, kind: int, payload: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (at, self._order, kind, payload))

    def run(self) -> None:
        for request in self.requests:
            self._push(request.arrival_s, ARRIVE, request)
        self._push(self.settings.health_poll_interval_s, POLL, None)
        while self._heap and self._unfinished:
            self.now, _, kind, payload = heapq.heappop(self._heap)
            if kind == ARRIVE:
                self._arrive(payload)
            elif kind == STEP_END:
                self._step_end(payload)
            elif kind == LINK:
                if payload == self.links.version:
                    self._links_changed(self.links.advance(self.now))
            elif kind == PULLED:
                self._pulled(payload)
            else:
                for sim in self.sims.values():
                    sim.routed.reported(sim.load_report())
                self._push(self.now + self.settings.health_poll_interval_s, POLL, None)

    def _arrive(self, request: Request) -> None:
        """``Generation._open``: pick the replica, ask whether to prefill elsewhere, send."""
        decode = self.router.pick(MODEL, request.hashes)
        request.decode = decode
        decode.inflight += 1  # from the pick, as the gateway counts it: arrivals during a prefill see it
        ask = GenerateRequest.model_construct(
            request_id=f"r{request.index}", prompt_token_ids=[0] * request.prompt, max_tokens=request.output,
            pooling=None, prompt_logprobs=None)
        if remote_prefill_wanted(self.settings, self.router, self.route, decode, ask, request.hashes,
                                 BLOCK_SIZE):
            request.remote = True
            request.prefill = self.router.pick(MODEL, request.hashes, prefill=True)
            request.prefill.inflight += 1
            self._enqueue(self.sims[request.prefill.url], request)
        else:
            self._send(request)

    def _send(self, request: Request) -> None:
        assert request.decode is not None
        self.router.remember(request.decode, request.hashes)
        if not request.remote:
            self._enqueue(self.sims[request.decode.url], request)

    def _enqueue(self, sim: SimReplica, request: Request) -> None:
        sim.waiting.append(request)
        if sim.batch is None:
            self._start_step(sim)

    def _start_step(self, sim: SimReplica) -> None:
        batch, took = sim.schedule()
        if not batch:
            sim.batch = None
            return
        sim.batch = batch
        sim.busy_s += took
        self._push(self.now + took, STEP_END, sim)

    def _step_end(self, sim: SimReplica) -> None:
        assert sim.batch is not None
        done = False
        for request, num in sim.batch:
            if request.computed < request.prompt:
                request.computed += num
                if request.computed < request.prompt:
                    continue
                if sim.role == "prefill":
                    self._prefilled(sim, request)
                    done = True
                    continue
                request.first_token_s = request.last_token_s = self.now
            else:
                self.gaps.append(self.now - request.last_token_s)
                request.last_token_s = self.now
            request.generated += 1
            if request.generated >= request.output:
                request.finished_s = self.now
                sim.free_blocks += request.blocks
                assert request.decode is not None
                request.decode.inflight -= 1
                self._unfinished -= 1
                done = True
        if done:
            sim.running = [r for r in sim.running if r.finished_s is None and not (
                sim.role == "prefill" and r.computed >= r.prompt)]
        self._start_step(sim)

    def _prefilled(self, sim: SimReplica, request: Request) -> None:
        """The prefill's final record: the gateway sends the decode request with the lease; the decode
        replica pulls the prompt's full blocks."""
        assert request.prefill is not None and request.decode is not None
        request.prefill.inflight -= 1
        self.router.remember(request.prefill, request.hashes)
        self._send(request)
        tokens = (request.prompt - 1) // BLOCK_SIZE * BLOCK_SIZE
        done = self.links.advance(self.now)
        self.links.pulls.append(Pull(request, sim, self.sims[request.decode.url], tokens,
                                     float(tokens * KV_BYTES_PER_TOKEN)))
        self._links_changed(done)

    def _links_changed(self, done: list[Pull]) -> None:
        at = self.links.next_completion()
        if at is not None:
            self._push(at, LINK, self.links.version)
        for pull in done:
            self._push(self.now + LINK_SETUP_S, PULLED, pull)

    def _pulled(self, pull: Pull) -> None:
        """The lease delivered: the prefill replica frees its blocks, the decode replica admits the request
        with the pulled blocks in place."""
        request = pull.request
        pull.source.free_blocks += request.blocks
        request.computed, request.blocks = pull.tokens, 0
        if pull.source.batch is None:
            self._start_step(pull.source)
        self._enqueue(pull.target, request)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def simulate(shape: Shape, trace: Trace, load: float, topology: str) -> dict[str, Any]:
    """One (trace, load, topology) point: the figures of the module docstring."""
    started = time.perf_counter()
    requests = build_trace(trace, shape.requests[trace.name], load, shape)
    sim = Simulation(shape, topology, requests)
    sim.run()
    # (arrival, first token, last token, output tokens) of every request that finished
    done = [(r.arrival_s, r.first_token_s, r.finished_s, r.output) for r in requests
            if r.first_token_s is not None and r.finished_s is not None]
    ttft = [first - arrival for arrival, first, _, _ in done]
    tpot = [(last - first) / max(1, output - 1) for _, first, last, output in done]
    met_ttft = [t <= trace.ttft_s for t in ttft]
    met_tpot = [t <= trace.tpot_s for t in tpot]
    met_tight = [t <= trace.tight_tpot_s for t in tpot]
    span = max(last for _, _, last, _ in done) - requests[0].arrival_s
    busy = {role: [s.busy_s / sim.now for s in sim.sims.values() if s.role == role]
            for role in ("both", "prefill", "decode")}
    return {
        "trace": trace.name, "load": load, "topology": topology, "requests": len(done),
        "requests_expected": len(requests), "offered_rps": len(requests) / requests[-1].arrival_s,
        "remote_share": sum(r.remote for r in requests) / len(requests),
        "remote_by_request": [r.remote for r in requests],
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5), "tpot_p99_s": percentile(tpot, 0.99),
        "itl_p99_s": percentile(sim.gaps, 0.99), "itl_max_s": max(sim.gaps, default=float("nan")),
        "within_ttft": sum(met_ttft) / len(requests), "within_tpot": sum(met_tpot) / len(requests),
        "goodput": sum(a and b for a, b in zip(met_ttft, met_tpot, strict=True)) / len(requests),
        "goodput_tight_tpot": sum(a and b for a, b in zip(met_ttft, met_tight, strict=True)) / len(requests),
        "output_tokens_per_s": sum(output for *_, output in done) / span,
        "utilisation": {role: sum(v) / len(v) for role, v in busy.items() if v},
        "virtual_s": sim.now, "wall_s": time.perf_counter() - started,
    }


def run_grid(shape: Shape, traces: list[str]) -> list[dict[str, Any]]:
    return [simulate(shape, TRACES[name], load, topology)
            for name in traces for load in shape.loads for topology in shape.topologies]


def table(results: list[dict[str, Any]]) -> str:
    ms = lambda s: f"{1000 * s:.0f}"  # noqa: E731
    rows = [[r["trace"], f"{r['load']:.2f}", f"{r['offered_rps']:.1f}", r["topology"],
             f"{r['remote_share']:.0%}",
             f"{ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])}",
             f"{1000 * r['tpot_p50_s']:.1f} / {1000 * r['tpot_p99_s']:.1f}", ms(r["itl_p99_s"]),
             f"{r['within_ttft']:.0%}", f"{r['within_tpot']:.0%}", f"**{r['goodput']:.0%}**",
             f"{r['goodput_tight_tpot']:.0%}", f"{r['output_tokens_per_s']:,.0f}"] for r in results]
    return format_table(["trace", "load", "req/s", "topology", "remote", "TTFT p50 / p99 ms",
                         "TPOT p50 / p99 ms", "ITL p99 ms", "TTFT ok", "TPOT ok", "both ok",
                         "both, tight TPOT", "out tok/s"], rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, help="replicas of each topology (8; a multiple of 4)")
    parser.add_argument("--loads",
                        help="offered loads, shares of a colocated fleet's capacity (0.25,0.5,0.75,1)")
    parser.add_argument("--requests", help="requests a point, long,short (1000,3000)")
    parser.add_argument("--traces", default="long,short")
    parser.add_argument("--topologies", help="colocated and/or P:D splits (colocated,1:1,1:3)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--link-gb-s", type=float, help="KV transfer bandwidth, GB/s (25)")
    parser.add_argument("--kv-gib", type=float, help="KV pool of a replica, GiB (48)")
    parser.add_argument("--min-prompt-tokens", type=int,
                        help="the gateway's disagg_min_prompt_tokens (its default, 1024)")
    parser.add_argument("--routing", help="the gateway's routing_policy (index; round_robin, affinity)")
    parser.add_argument("--quick", action="store_true", help="a small configuration that runs in seconds")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    base: dict[str, Any] = dict(QUICK) if args.quick else {}
    if args.loads:
        base["loads"] = tuple(float(x) for x in args.loads.split(","))
    if args.requests:
        counts = (int(x) for x in args.requests.split(","))
        base["requests"] = dict(zip(("long", "short"), counts, strict=True))
    if args.routing:
        base["routing_policy"] = args.routing
    for name in ("replicas", "seed", "link_gb_s", "kv_gib", "min_prompt_tokens"):
        if getattr(args, name) is not None:
            base[name] = getattr(args, name)
    if args.topologies:
        base["topologies"] = tuple(args.topologies.split(","))
    shape = Shape(**base)
    traces = args.traces.split(",")
    results = run_grid(shape, traces)
    print(table(results))
    targets = "; ".join(f"{t.name} TTFT <= {t.ttft_s:g} s, TPOT <= {1000 * t.tpot_s:g} ms (tight: "
                        f"{1000 * t.tight_tpot_s:g} ms)" for t in (TRACES[name] for name in traces))
    print(f"{shape.replicas} replicas ({', '.join(shape.topologies)}; P:D prefill:decode), KV transfer "
          f"{shape.link_gb_s:g} GB/s, remote prefill at >= {shape.min_prompt_tokens} uncached prompt tokens; "
          f"targets: {targets}")
    if args.out:
        write_json(args.out, {"benchmark": "disaggregation", "part": "b",
                              "date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "machine": f"{os.cpu_count()}-core CPU (virtual clock)",
                              "shape": asdict(shape), "traces": {t: asdict(TRACES[t]) for t in traces},
                              "step_model_s": {"fixed": STEP_FIXED_S, "per_prefill_token": PREFILL_TOKEN_S,
                                               "per_attention_pair": ATTENTION_PAIR_S,
                                               "per_decode_context_token": CONTEXT_TOKEN_S},
                              "link_setup_s": LINK_SETUP_S,
                              "results": [{k: v for k, v in r.items() if k != "remote_by_request"}
                                          for r in results]})
    return results


if __name__ == "__main__":
    main()
