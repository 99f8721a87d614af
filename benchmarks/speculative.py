"""Speculative decoding through the whole platform, with the official ``openai`` SDK: Predicted Outputs on a
code-edit workload, automatic speculation on an agent-loop workload, and a saturated replica.

Set-up (real processes, by ``benchmarks.gateway_overhead.platform``): a private Postgres and Redis, one
gateway worker, one CPU engine replica (``tollgate engine``, ``--max-num-seqs 64``), requests through
``AsyncOpenAI`` (non-streamed chat completions, greedy). Three platforms, one after the other:

- **code edit** (the tiny random-weight Qwen3 of ``engine.tiny``, speculation ``auto``, the default): the
  "file" of each request is the model's own greedy answer of ``--file-tokens`` tokens to its prompt; the
  request asks again with, as ``prediction``, that file with about ``--edit-share`` of its lines edited
  (lines of about 64 characters: a word replaced, half the line deleted, words inserted, in turn). At 1 and
  ``--concurrent`` requests at once, with the prediction and without: output tok/s (completion tokens
  over the wall time of the batch of requests), forward passes (the engine's ``tollgate_engine_steps``)
  per output token, and the accepted / rejected prediction tokens the clients were told.
- **own answer predicted** (the default tiny model of ``tollgate up``, ``engine.tiny``'s Llama): the
  prediction is the model's own previous answer, unedited, one request at a time (the gateway tokenizes
  the prediction's text its own way; the engine follows it by text, so the model's other tokenization of
  the same characters does not lose it).
- **agent loop** (the copying model of ``engine.copying``, speculation ``auto`` against ``off``, two
  platforms): each request is a system prompt and a tool's output (a one-line JSON document of ~300
  tokens, new per request) that the model's answer quotes, as an agent relaying a tool's result does; one
  request at a time, ``--agent-requests`` of them. Nothing is predicted by the client: the drafts are the
  engine's prompt lookup.
- **saturated**: ``--saturated`` agent-loop requests at once on the same two platforms (the policy stops
  speculating above ``speculative_max_batch`` = 16 running sequences).

Each figure is the best of ``--repeat`` runs; both sides of a comparison run on the same machine in the same
invocation. "same answers" is the share of answers equal with and without speculation (greedy: all but
where two continuations tie to within float rounding; the copying model ties where a stretch of its
context repeats, and the batch's make-up and the prefix cache's hits change the rounding).

    python benchmarks/speculative.py --out benchmarks/out/speculative.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402
from benchmarks.gateway_overhead import Platform, platform  # noqa: E402

MODEL = "tiny-spec"
WORDS = (
    "ledger invoice account tenant quota budget refund audit policy contract vendor payment review "
    "approve reject escalate summary report quarter revenue expense forecast customer"
).split()
SYSTEM = "You are a careful agent. Relay the tool's result to the user as it is."


async def run_batch(p: Platform, key: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Send ``requests`` (chat completion arguments) at once; totals of what the clients were told."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{p.gateway_url}/v1", api_key=key, max_retries=0, timeout=600)
    steps_before = sum(p.engine_counters("tollgate_engine_steps_total"))
    started = time.perf_counter()
    try:
        answers = await asyncio.gather(
            *(client.chat.completions.create(model=MODEL, temperature=0, **r) for r in requests)
        )
    finally:
        await client.close()
    wall = time.perf_counter() - started
    steps = sum(p.engine_counters("tollgate_engine_steps_total")) - steps_before
    details = [a.usage.completion_tokens_details for a in answers]
    rejected = sum((d.rejected_prediction_tokens or 0) if d else 0 for d in details)
    # completion_tokens counts rejected prediction tokens too (billed as output, as OpenAI does).
    tokens = sum(a.usage.completion_tokens for a in answers) - rejected
    return {
        "requests": len(requests),
        "output_tokens": tokens,
        "seconds": wall,
        "tok_s": tokens / wall,
        "steps": steps,
        "steps_per_token": steps / tokens,
        "accepted_prediction_tokens": sum((d.accepted_prediction_tokens or 0) if d else 0 for d in details),
        "rejected_prediction_tokens": rejected,
        "texts": [a.choices[0].message.content or "" for a in answers],
    }


def same_share(a: list[str], b: list[str]) -> float:
    """The share of answers equal on both sides (greedy: all, but where two continuations tie to within
    float rounding, which differs with the batch's make-up, the prefix cache's hits and the drafts)."""
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def best_of(repeat: int, run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    runs = [run() for _ in range(repeat)]
    return min(runs, key=lambda r: r["seconds"])


def edit_lines(text: str, share: float, seed: int) -> str:
    """``text`` with about ``share`` of its lines (newline-ended, or 64-character pieces of a longer
    line) edited: a word replaced, half the line deleted, words inserted, in turn."""
    rng = random.Random(seed)
    lines = [
        piece
        for line in text.splitlines(keepends=True)
        for piece in (line[i : i + 64] for i in range(0, len(line), 64))
    ]
    out, edited = [], 0
    for line in lines:
        if rng.random() < share:
            kind = edited % 3
            edited += 1
            if kind == 0:
                words = line.split(" ")
                words[len(words) // 2] = rng.choice(WORDS)
                line = " ".join(words)
            elif kind == 1:
                line = line[: len(line) // 2]
            else:
                line = line + " " + " ".join(rng.choice(WORDS) for _ in range(3)) + " "
        out.append(line)
    return "".join(out)


def tool_output(rng: random.Random) -> str:
    """A search tool's result on one line: ten records of words and figures (no 10-token stretch in it
    twice, where the copying model would fork; see ``engine.copying``)."""
    records = [
        f"{rng.choice(WORDS)} {rng.randrange(10_000)} for {rng.choice(WORDS)} {rng.choice(WORDS)}: "
        f"{round(rng.uniform(-50, 5000), 2)} EUR, {rng.choice(WORDS)} by {rng.choice(WORDS)}"
        for _ in range(10)
    ]
    return json.dumps({"query": " ".join(rng.choice(WORDS) for _ in range(4)), "results": records})


def code_edit(args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine.tiny import create_tiny_checkpoint

    results = []
    engine_args = ["--max-num-seqs", "64", "--num-kv-blocks", "2048"]
    with platform(
        real_engine_args=engine_args,
        model=MODEL,
        checkpoint=lambda d: create_tiny_checkpoint(d, arch="qwen3", seed=0),
    ) as p:
        key = p.create_tenant_key(rpm_limit=10**6, tpm_limit=10**9)
        prompts = [
            [{"role": "user", "content": f"Write module number {i} of the billing service."}]
            for i in range(args.concurrent)
        ]
        first = asyncio.run(
            run_batch(p, key, [{"messages": m, "max_tokens": args.file_tokens} for m in prompts])
        )
        files = first["texts"]
        predictions = [edit_lines(f, args.edit_share, i) for i, f in enumerate(files)]
        for concurrent in (1, args.concurrent):
            row: dict[str, Any] = {"workload": "code_edit", "concurrent": concurrent}
            for side in ("without", "with"):

                def one(side: str = side, concurrent: int = concurrent) -> dict[str, Any]:
                    requests = [
                        {
                            "messages": prompts[i],
                            "max_tokens": args.file_tokens,
                            **(
                                {"prediction": {"type": "content", "content": predictions[i]}}
                                if side == "with"
                                else {}
                            ),
                        }
                        for i in range(concurrent)
                    ]
                    return asyncio.run(run_batch(p, key, requests))

                row[side] = best_of(args.repeat, one)
            row["speedup"] = row["with"]["tok_s"] / row["without"]["tok_s"]
            row["same_answers"] = same_share(row["without"]["texts"], row["with"]["texts"])
            results.append(row)
    return results


def own_output(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The prediction is the model's own previous answer, unedited, one request at a time, on the
    platform's default tiny model (``tollgate up``'s): the gateway tokenizes that text its own way, which
    the model's tokens need not follow."""
    from engine.tiny import create_tiny_checkpoint

    engine_args = ["--max-num-seqs", "64", "--num-kv-blocks", "2048"]
    with platform(
        real_engine_args=engine_args, model=MODEL, checkpoint=lambda d: create_tiny_checkpoint(d)
    ) as p:
        key = p.create_tenant_key(rpm_limit=10**6, tpm_limit=10**9)
        prompts = [
            [{"role": "user", "content": f"Write module number {i} of the billing service."}]
            for i in range(4)
        ]
        first = asyncio.run(
            run_batch(p, key, [{"messages": m, "max_tokens": args.file_tokens} for m in prompts])
        )
        row: dict[str, Any] = {"workload": "own_output", "concurrent": 1}
        for side in ("without", "with"):

            def one(side: str = side) -> dict[str, Any]:
                return asyncio.run(
                    run_batch(
                        p,
                        key,
                        [
                            {
                                "messages": m,
                                "max_tokens": args.file_tokens,
                                **(
                                    {"prediction": {"type": "content", "content": text}}
                                    if side == "with"
                                    else {}
                                ),
                            }
                            for m, text in zip(prompts[:1], first["texts"][:1], strict=True)
                        ],
                    )
                )

            row[side] = best_of(args.repeat, one)
        row["speedup"] = row["with"]["tok_s"] / row["without"]["tok_s"]
        row["same_answers"] = same_share(row["without"]["texts"], row["with"]["texts"])
    return [row]


def agent_loop(args: argparse.Namespace) -> list[dict[str, Any]]:
    from engine.copying import create_copying_checkpoint

    rng = random.Random(0)
    documents = [tool_output(rng) for _ in range(max(args.agent_requests, args.saturated))]

    def request(doc: str) -> dict[str, Any]:
        return {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": doc}],
            "max_tokens": 512,
        }

    sides: dict[str, dict[str, Any]] = {}
    for speculation in ("off", "auto"):
        engine_args = ["--max-num-seqs", "64", "--num-kv-blocks", "2048", "--speculation", speculation]
        with platform(real_engine_args=engine_args, model=MODEL, checkpoint=create_copying_checkpoint) as p:
            key = p.create_tenant_key(rpm_limit=10**6, tpm_limit=10**9)
            asyncio.run(run_batch(p, key, [request(documents[0])]))  # warm-up

            def sequential(p: Platform = p, key: str = key) -> dict[str, Any]:
                runs = [
                    asyncio.run(run_batch(p, key, [request(d)])) for d in documents[: args.agent_requests]
                ]
                total = {
                    k: sum(r[k] for r in runs)
                    for k in (
                        "output_tokens",
                        "seconds",
                        "steps",
                        "accepted_prediction_tokens",
                        "rejected_prediction_tokens",
                    )
                }
                return {
                    **total,
                    "requests": len(runs),
                    "tok_s": total["output_tokens"] / total["seconds"],
                    "steps_per_token": total["steps"] / total["output_tokens"],
                    "texts": [t for r in runs for t in r["texts"]],
                }

            sides[speculation] = {
                "agent": best_of(args.repeat, sequential),
                "saturated": best_of(
                    args.repeat,
                    lambda p=p, key=key: asyncio.run(
                        run_batch(p, key, [request(d) for d in documents[: args.saturated]])
                    ),
                ),
            }
    results = []
    for workload, concurrent in (("agent", 1), ("saturated", args.saturated)):
        off, auto = sides["off"][workload], sides["auto"][workload]
        quoted = sum(t in d for t, d in zip(off["texts"], documents, strict=False)) / len(off["texts"])
        results.append(
            {
                "workload": f"agent_loop_{workload}",
                "concurrent": concurrent,
                "without": off,
                "with": auto,
                "speedup": auto["tok_s"] / off["tok_s"],
                "answers_quoting": quoted,
                "same_answers": same_share(off["texts"], auto["texts"]),
            }
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file-tokens", type=int, default=256)
    parser.add_argument("--edit-share", type=float, default=0.1)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--agent-requests", type=int, default=8)
    parser.add_argument("--saturated", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/out/speculative.json")
    parser.add_argument("--skip-agent-loop", action="store_true", help="only the Predicted Outputs workloads")
    args = parser.parse_args()

    results = code_edit(args) + own_output(args) + ([] if args.skip_agent_loop else agent_loop(args))
    labels = {
        "code_edit": "code edit, prediction vs none",
        "agent_loop_agent": "agent loop, auto vs off",
        "own_output": "own answer predicted, prediction vs none",
        "agent_loop_saturated": "saturated agent loop, auto vs off",
    }
    rows = [
        [
            f"{labels[r['workload']]}, {r['concurrent']} at once",
            f"{r['without']['tok_s']:,.0f}",
            f"{r['with']['tok_s']:,.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['without']['steps_per_token'] * r['concurrent']:.2f}",
            f"{r['with']['steps_per_token'] * r['concurrent']:.2f}",
            f"{r['with']['accepted_prediction_tokens']} / {r['with']['rejected_prediction_tokens']}",
            f"{r['same_answers']:.0%}",
        ]
        for r in results
    ]
    print(
        f"Speculative decoding through the platform (official openai SDK), {machine_description('cpu')}, "
        f"best of {args.repeat}"
    )
    print(
        format_table(
            [
                "workload",
                "tok/s without",
                "tok/s with",
                "speed-up",
                "steps/token/request without",
                "with",
                "accepted / rejected",
                "same answers",
            ],
            rows,
        )
    )
    for r in results:
        for side in ("without", "with"):
            r[side].pop("texts")
    write_json(
        args.out,
        {
            "benchmark": "speculative",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine_description("cpu"),
            "file_tokens": args.file_tokens,
            "edit_share": args.edit_share,
            "repeat": args.repeat,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
