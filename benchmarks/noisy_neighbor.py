"""Noisy neighbour: does one tenant saturating the engine slow another tenant's first tokens?

Set-up (``benchmarks.gateway_overhead.platform``): private Postgres and Redis, the real CPU engine over
the tiny random-weight model (``tollgate engine --model <tiny> --max-num-seqs 16``), ``tollgate gateway``.
Tenants A and B are at the same tier (``default``) with generous limits, so nothing but the engine's
scheduling decides who waits.

1. B alone: ``--b-requests`` streamed chat completions at ``--b-rate`` RPS (open loop), TTFT measured by
   the client (send → first content delta).
2. The same B schedule while A keeps ``--a-streams`` streams of ``--a-tokens`` tokens running back to
   back (A within its own limits, enough to fill every engine slot and queue more).
Target: B's p95 TTFT with A ≤ 1.5x B's p95 alone. The engine shares a saturated replica fairly between
tenants of one priority; without that, B would queue behind A's whole backlog.

Both load generators run in separate processes (asyncio ``httpx``), so they do not take the gateway's
CPU under its event loop. ``python benchmarks/noisy_neighbor.py --out benchmarks/out/noisy_neighbor.json``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, write_json  # noqa: E402
from benchmarks.gateway_overhead import platform  # noqa: E402

MODEL = "tiny"


async def _first_token_s(client: Any, url: str, body: dict[str, Any]) -> float | None:
    started = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            return None
        first = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                    first = time.perf_counter() - started
        return first


async def _tenant_b(url: str, key: str, rate: float, count: int, max_tokens: int) -> dict[str, Any]:
    import httpx

    ttfts: list[float] = []
    failures = 0
    async with httpx.AsyncClient(timeout=120.0, headers={"Authorization": f"Bearer {key}"}) as client:

        async def one(i: int) -> None:
            nonlocal failures
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"B asks question {i}"}],
                    "max_tokens": max_tokens, "stream": True, "temperature": 0}
            ttft = await _first_token_s(client, url, body)
            if ttft is None:
                failures += 1
            else:
                ttfts.append(ttft)

        start = time.perf_counter()
        tasks = []
        for i in range(count):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return {"ttfts": ttfts, "failures": failures}


async def _tenant_a(url: str, key: str, streams: int, max_tokens: int, stop_file: str) -> dict[str, Any]:
    import httpx

    done = 0
    async with httpx.AsyncClient(timeout=300.0, headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=streams * 2)) as client:

        async def loop(j: int) -> None:
            nonlocal done
            i = 0
            while not os.path.exists(stop_file):
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"A floods {j}-{i}"}],
                        "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
                await _first_token_s(client, url, body)
                done += 1
                i += 1

        await asyncio.gather(*(loop(j) for j in range(streams)))
    return {"completed": done}


def _child(fn_name: str, args: tuple[Any, ...], conn: Any) -> None:
    conn.send(asyncio.run(globals()[fn_name](*args)))
    conn.close()


def _spawn(fn_name: str, *args: Any) -> tuple[Any, Any]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn_name, args, child))
    proc.start()
    return proc, parent


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--b-rate", type=float, default=2.0)
    parser.add_argument("--b-requests", type=int, default=40)
    parser.add_argument("--b-tokens", type=int, default=8)
    parser.add_argument("--a-streams", type=int, default=32)
    parser.add_argument("--a-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    with platform(model=MODEL, real_engine_args=["--num-kv-blocks", "1024", "--max-num-seqs", "16"]) as p:
        key_a = p.create_tenant_key(tier="default")
        key_b = p.create_tenant_key(tier="default")
        url = f"{p.gateway_url}/v1/chat/completions"
        # Warm-up (engine, tokenizer, connections).
        proc, conn = _spawn("_tenant_b", url, key_b, 4.0, 8, args.b_tokens)
        conn.recv()
        proc.join()

        marks = [time.time()]
        proc, conn = _spawn("_tenant_b", url, key_b, args.b_rate, args.b_requests, args.b_tokens)
        alone = conn.recv()
        proc.join()
        marks.append(time.time())

        stop_file = str(p.root / "stop-a")
        a_proc, a_conn = _spawn("_tenant_a", url, key_a, args.a_streams, args.a_tokens, stop_file)
        time.sleep(3.0)  # let A fill the engine before B starts measuring
        proc, conn = _spawn("_tenant_b", url, key_b, args.b_rate, args.b_requests, args.b_tokens)
        noisy = conn.recv()
        proc.join()
        marks.append(time.time())
        Path(stop_file).touch()
        a_result = a_conn.recv()
        a_proc.join()
        # The engine's own TTFT of B's requests (queueing in the engine + prefill), from the usage records:
        # it separates waiting for the engine's scheduler from waiting for CPU in the gateway.
        b_records = [r for r in p.usage_records() if r.tenant_id == p.tenant_ids[key_b] and r.ttft_ms]
        for result, (lo, hi) in ((alone, marks[0:2]), (noisy, marks[1:3])):
            result["engine_ttfts"] = [r.ttft_ms / 1000 for r in b_records
                                      if lo <= r.created_at.timestamp() < hi]

    rows = []
    for name, result in (("B alone", alone), ("B with A saturating", noisy)):
        t = result["ttfts"]
        rows.append([name, len(t), result["failures"], f"{1000 * statistics.median(t):.0f}",
                     f"{1000 * p95(t):.0f}", f"{1000 * p95(result['engine_ttfts']):.0f}"])
    ratio = p95(noisy["ttfts"]) / p95(alone["ttfts"])
    print(format_table(["run", "B requests", "B failures", "B TTFT p50 ms", "B TTFT p95 ms",
                        "B engine-side TTFT p95 ms"], rows))
    print(f"p95 ratio (with A / alone): {ratio:.2f}x (target <= 1.5x); A completed {a_result['completed']} "
          f"streams of {args.a_tokens} tokens meanwhile")
    if args.out:
        write_json(args.out, {
            "alone": alone, "with_a": noisy, "a": a_result, "p95_ratio": ratio, "args": vars(args) | {
                "out": str(args.out)},
            "machine": f"{os.cpu_count()}-core CPU", "load_average": os.getloadavg(),
            "date": datetime.now(UTC).isoformat(timespec="seconds")})


if __name__ == "__main__":
    main()
