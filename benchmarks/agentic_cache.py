"""An agentic multi-turn workload through the whole platform: prefix-cache hit rate by routing policy and
KV tiers, against the ideal hit rate of the same trace.

Set-up (all real processes, started here by ``benchmarks.gateway_overhead.platform``): private Postgres
and Redis, a gateway with ``--gateway-workers`` worker processes (2 by default: each routes on its own,
as in production), and two real CPU engine replicas of a tiny random-weight Llama whose device KV pools
(``--num-kv-blocks``, default 128 blocks of 16 tokens each) are far too small to hold every session.

Workload: ``--tenants`` tenants, each with its own long system prompt, each running ``--sessions``
sessions of ``--turns`` turns. A turn sends the session's whole transcript (system prompt, every earlier
user message and assistant answer) plus a short new user message, as an agent loop does, streamed with
the official ``openai`` SDK (``stream_options.include_usage``). The sessions are interleaved: every
session's turn 1 (in a seeded random order), then every session's turn 2, and so on, ``--concurrency``
requests at a time; one session's turns never overlap. Greedy decoding, ``--max-tokens`` per answer.

Configurations, each on a fresh platform (cold caches):
1. ``round_robin``: routing without affinity;
2. ``affinity``: today's guess (where this gateway process sent the prefix before);
3. ``index``: routing by the replicas' real holdings (their ``/kv/events``);
4. ``affinity+tiers`` and ``index+tiers``: those two with host (``--host-blocks``) and disk
   (``--disk-blocks``) tiers on the replicas.

Reported per configuration: hit rate (cached / prompt tokens, from the usage the clients were told),
prefill tokens the engines computed (their ``computed_prefill_tokens`` counters, recompute included),
TTFT p50/p95 of returning turns (turn >= 2, send to first content token, client side), cost billed (sum
of the usage records' cost), and each hit rate against the ideal. The ideal hit rate of the same trace:
an infinite cache with perfect routing, from the prompts' token ids (the chat template rendered as the
gateway renders it): each prompt's leading full blocks already seen in an earlier prompt of the same
tenant are hits, leaving the last prompt token uncached. Generated tokens do not enter the ideal (a
random model's answer re-tokenizes differently when resent), so a configuration can exceed it slightly.

``python benchmarks/agentic_cache.py --out benchmarks/out/agentic_cache.json`` prints a table and writes
JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, write_json  # noqa: E402
from benchmarks.gateway_overhead import Platform, platform  # noqa: E402

MODEL = "tiny-agent"
WORDS = ("ledger invoice account tenant quota budget refund audit policy contract vendor payment review "
         "approve reject escalate summary report quarter revenue expense forecast customer support ticket "
         "priority region cluster replica engine cache token prompt session agent tool result").split()
CONFIGS = ("round_robin", "affinity", "index", "affinity+tiers", "index+tiers")


@dataclass
class Turn:
    session: int
    turn: int
    tenant: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0


@dataclass
class Session:
    tenant: int
    key: str
    messages: list[dict[str, str]]
    turns: list[Turn] = field(default_factory=list)


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


async def run_turn(client: Any, session: Session, number: int, index: int, rng: random.Random,
                   max_tokens: int) -> tuple[Turn, list[dict[str, str]]]:
    session.messages.append({"role": "user", "content": sentence(rng, 12)})
    sent = list(session.messages)
    started = time.perf_counter()
    first: float | None = None
    text, usage = [], None
    stream = await client.chat.completions.create(
        model=MODEL, messages=sent, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    session.messages.append({"role": "assistant", "content": "".join(text) or "..."})
    cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
    turn = Turn(index, number, session.tenant, usage.prompt_tokens, cached or 0,
                (first or time.perf_counter()) - started)
    return turn, sent


def ideal_hits(prompts: list[tuple[int, list[int]]], block_size: int) -> int:
    """Hit tokens of an infinite cache with perfect routing over ``(tenant, prompt token ids)`` in order."""
    from engine.kv.block_hash import prefix_block_hashes

    seen: set[bytes] = set()
    hits = 0
    for tenant, tokens in prompts:
        hashes = prefix_block_hashes(tokens, block_size, f"tenant-{tenant}")
        usable = (len(tokens) - 1) // block_size
        for digest in hashes[:usable]:
            if digest not in seen:
                break
            hits += block_size
        seen.update(hashes)
    return hits


def computed_prefill(p: Platform) -> float:
    """Prompt tokens the replicas computed so far (recompute after preemption included)."""
    return sum(p.engine_counters("tollgate_engine_computed_prefill_tokens_total"))


async def workload(p: Platform, args: argparse.Namespace,
                   keys: list[str]) -> tuple[list[Turn], list[tuple[int, list[int]]]]:
    from openai import AsyncOpenAI

    rng = random.Random(args.seed)
    sessions: list[Session] = []
    for tenant, key in enumerate(keys):
        system = " ".join(sentence(rng, 15) for _ in range(args.system_sentences))
        for _ in range(args.sessions):
            sessions.append(Session(tenant, key, [{"role": "system", "content": system}]))
    clients = {s.key: AsyncOpenAI(base_url=f"{p.gateway_url}/v1", api_key=s.key, max_retries=0, timeout=600)
               for s in sessions}
    limit = asyncio.Semaphore(args.concurrency)
    turns: list[Turn] = []
    trace: list[tuple[int, int, int, list[dict[str, str]]]] = []  # (turn, order, tenant, messages)

    async def one(index: int, number: int, order: int) -> None:
        session = sessions[index]
        async with limit:
            turn, sent = await run_turn(clients[session.key], session, number, index, rng, args.max_tokens)
        turns.append(turn)
        trace.append((number, order, session.tenant, sent))

    for number in range(1, args.turns + 1):
        order = list(range(len(sessions)))
        rng.shuffle(order)
        await asyncio.gather(*(one(index, number, position) for position, index in enumerate(order)))
    for client in clients.values():
        await client.close()
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(p.tokenizer_dir)
    prompts = [(tenant, tokenizer.encode_chat(messages)) for _, _, tenant, messages in sorted(trace)]
    return turns, prompts


def run_config(name: str, args: argparse.Namespace) -> dict[str, Any]:
    engine_args = ["--num-kv-blocks", str(args.kv_blocks), "--max-num-seqs", "8"]
    if name.endswith("+tiers"):
        block_bytes = 16 * 1024  # the tiny Llama: 16 tokens x K,V x 2 layers x 2 heads x 32 dims x 4 bytes
        engine_args += ["--host-kv-gb", f"{args.host_blocks * block_bytes / 2**30:.9f}",
                        "--disk-kv-gb", f"{args.disk_blocks * block_bytes / 2**30:.9f}",
                        "--kv-disk-dir", "{root}/kv{replica}"]
    policy = name.removesuffix("+tiers")
    with platform(real_engine_args=engine_args, model=MODEL, replicas=2, gateway_workers=args.gateway_workers,
                  gateway_env={"TOLLGATE_ROUTING_POLICY": policy,
                               "TOLLGATE_KV_INDEX_POLL_INTERVAL_S": str(args.kv_index_poll_s)}) as p:
        keys = [p.create_tenant_key(rpm_limit=10**6, tpm_limit=10**9) for _ in range(args.tenants)]
        before = computed_prefill(p)
        started = time.perf_counter()
        turns, prompts = asyncio.run(workload(p, args, keys))
        elapsed = time.perf_counter() - started
        prefill = computed_prefill(p) - before
        by_replica = p.engine_counters("tollgate_engine_prompt_tokens_total")
        records = p.usage_records()
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    returning = sorted(t.ttft_s for t in turns if t.turn >= 2)
    ideal = ideal_hits(prompts, 16)
    return {
        "config": name, "requests": len(turns), "prompt_tokens": prompt, "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else 0.0, "ideal_hit_rate": ideal / prompt if prompt else 0.0,
        "prefill_tokens_computed": int(prefill),
        "ttft_returning_p50_ms": 1000 * statistics.median(returning) if returning else float("nan"),
        "ttft_returning_p95_ms": 1000 * returning[min(len(returning) - 1, int(0.95 * len(returning)))]
        if returning else float("nan"),
        "cost_billed_usd": sum(r.cost_pico_usd for r in records) / 1e12, "usage_records": len(records),
        "template_tokens_match": sum(len(t) for _, t in prompts) == prompt, "elapsed_s": elapsed,
        # The share of prompt tokens the busier replica was sent (0.5: an even spread).
        "busiest_replica_share": max(by_replica) / sum(by_replica) if sum(by_replica) else 0.0,
    }


def mean_of(name: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The runs' means (counts and rates), with each run's hit rate kept for the spread."""
    numeric = [k for k, v in runs[0].items() if isinstance(v, int | float) and not isinstance(v, bool)]
    mean = {k: statistics.fmean(r[k] for r in runs) for k in numeric}
    return {"config": name, **mean, "hit_rates": [r["hit_rate"] for r in runs],
            "template_tokens_match": all(r["template_tokens_match"] for r in runs), "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=4, help="sessions per tenant")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-sentences", type=int, default=14, help="~16 tokens each")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-blocks", type=int, default=128, help="device KV blocks per replica")
    parser.add_argument("--host-blocks", type=int, default=256, help="host tier blocks per replica")
    parser.add_argument("--disk-blocks", type=int, default=4096, help="disk tier blocks per replica")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--gateway-workers", type=int, default=2,
                        help="gateway processes (each routes on its own; affinity guesses per process)")
    parser.add_argument("--kv-index-poll-s", type=float, default=0.1,
                        help="how often the gateway follows the replicas' block events")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs per configuration (the replicas' ports, and so the rendezvous order, "
                             "differ between runs); the table shows means, the JSON every run")
    args = parser.parse_args()
    runs = {name: [run_config(name, args) for _ in range(args.repeat)] for name in args.configs.split(",")}
    results = [mean_of(name, rs) for name, rs in runs.items()]
    by_name = {r["config"]: r for r in results}
    base = by_name.get("round_robin", {}).get("hit_rate")
    rows = [[r["config"], f"{r['hit_rate']:.1%} ({min(r['hit_rates']):.0%}-{max(r['hit_rates']):.0%})",
             f"{r['hit_rate'] / r['ideal_hit_rate']:.0%}" if r["ideal_hit_rate"] else "-",
             f"{r['hit_rate'] / base:.2f}x" if base else "-", f"{r['prefill_tokens_computed']:.0f}",
             f"{r['ttft_returning_p50_ms']:.0f} / {r['ttft_returning_p95_ms']:.0f}",
             f"${r['cost_billed_usd']:.6f}", f"{r['elapsed_s']:.0f}"] for r in results]
    print(format_table(["config", "hit rate (range)", "of ideal", "vs round robin", "prefill tokens computed",
                        "TTFT returning p50/p95 ms", "cost billed", "wall s"], rows))
    print(f"ideal hit rate of the trace: {results[0]['ideal_hit_rate']:.1%} "
          f"({results[0]['requests']:.0f} requests, {results[0]['prompt_tokens']:.0f} prompt tokens; "
          f"chat template as the gateway renders it: {all(r['template_tokens_match'] for r in results)})")
    if args.out:
        write_json(args.out, {"args": vars(args) | {"out": str(args.out)}, "results": results,
                              "machine": f"{os.cpu_count()}-core CPU", "load_average": os.getloadavg(),
                              "date": datetime.now(UTC).isoformat(timespec="seconds")})


if __name__ == "__main__":
    main()
