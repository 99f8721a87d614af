"""Batch soaking: interactive time to first token with and without a large batch sharing its replica.

The whole platform runs as ``tollgate up`` does for a user (private Postgres and Redis, one CPU engine
replica with the tiny model in the ``interactive`` pool, gateway, Celery worker and beat). There is no
``batch`` pool, so every batch line runs on the interactive replica: it soaks spare capacity at the
lowest engine priority, admitted by the batch router only while the replica is under its soak
watermark, and preempted by the engine whenever interactive work needs the room.

Two phases with the same interactive workload (``--requests`` streamed chat completions, Poisson
arrivals at ``--rate`` per second, fixed seed, ``--max-tokens`` each; TTFT = time to the first content
chunk, measured by the client):
1. alone;
2. while a batch of ``--batch-lines`` chat lines runs (started first, until its lines are flowing).
Reported: p50/p95 TTFT of both phases and their ratio (pass: p95 with the batch <= 1.5x alone), and
the batch's tokens served by the shared replica during phase 2 ("soaked", from ``batch_items``;
pass: > 0). The batch is cancelled at the end.

    python benchmarks/batch_soak.py --out benchmarks/out/batch_soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402
from tollgate.local_services import free_port  # noqa: E402

MODEL = "tiny"
STARTUP_TIMEOUT_S = 300.0
PASS_RATIO = 1.5


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            name, _, value = line.removeprefix("export ").partition("=")
            env[name] = shlex.split(value)[0]
    return env


def start_platform(root: Path, extra_env: dict[str, str]) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    data_dir = root / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOLLGATE_", "OPENAI_"))}
    env.update(extra_env)
    log = (root / "up.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "tollgate", "up", "--data-dir", str(data_dir), "--port",
                             str(free_port()), "--engine-port", str(free_port())],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while "tollgate is up" not in (root / "up.log").read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"tollgate up did not start:\n{(root / 'up.log').read_text()[-4000:]}")
        time.sleep(0.5)
    env = {**env, **read_env_file(data_dir / "env")}
    # A price for the demo model ($0.50 / $1.50 per million tokens; batch half), from 15 s on (a price row
    # starts once every gateway has loaded it: billing.prices.PRICE_LEAD); until then the demo price.
    subprocess.run([sys.executable, "-m", "tollgate", "prices", "set", MODEL, "--input", "0.5", "--output",
                    "1.5"], env=env, check=True, capture_output=True, cwd=root)
    return proc, env


async def wait_until_served(client: httpx.AsyncClient) -> None:
    """Until the gateway's price book has picked up the price (it refreshes every few seconds)."""
    deadline = time.monotonic() + 60
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    while (await client.post("/chat/completions", json=body)).status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the gateway does not serve the model")
        await asyncio.sleep(0.25)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0}
    started = time.perf_counter()
    ttft = None
    async with client.stream("POST", "/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # read to the end: the request's full cost counts
            if ttft is not None or not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                ttft = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("the stream ended without content")
    return ttft


async def interactive_phase(client: httpx.AsyncClient, requests: int, rate: float, max_tokens: int,
                            seed: int) -> list[float]:
    rng = random.Random(seed)
    tasks = []
    for i in range(requests):
        prompt = f"Question {i}: {rng.random():.6f}?"
        tasks.append(asyncio.create_task(one_request(client, prompt, max_tokens)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def soaked_tokens(database_url: str, batch_id: str, since: datetime,
                        until: datetime) -> tuple[int, int]:
    """(tokens, lines) of the batch answered by the interactive pool's replica between ``since`` and
    ``until``."""
    import psycopg

    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        row = await (await conn.execute(
            "SELECT coalesce(sum(prompt_tokens + completion_tokens), 0), count(*) FROM batch_items"
            " WHERE batch_id = %s AND served_pool = 'interactive' AND status = 'completed'"
            " AND finished_at BETWEEN %s AND %s", (batch_id, since, until))).fetchone()
    return int(row[0]), int(row[1])


async def run(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {env['OPENAI_API_KEY']}"}
    async with httpx.AsyncClient(base_url=env["OPENAI_BASE_URL"], headers=headers, timeout=120) as client:
        await wait_until_served(client)
        await interactive_phase(client, 4, args.rate, args.max_tokens, seed=99)  # warm-up
        alone = await interactive_phase(client, args.requests, args.rate, args.max_tokens, args.seed)

        lines = [json.dumps({"custom_id": f"soak-{i}", "method": "POST", "url": "/v1/chat/completions",
                             "body": {"model": MODEL, "max_tokens": args.batch_max_tokens,
                                      "messages": [{"role": "user", "content": f"Summarise item {i}."}]}})
                 for i in range(args.batch_lines)]
        upload = await client.post("/files", data={"purpose": "batch"},
                                   files={"file": ("soak.jsonl", ("\n".join(lines) + "\n").encode())})
        upload.raise_for_status()
        created = await client.post("/batches", json={"input_file_id": upload.json()["id"],
                                                      "endpoint": "/v1/chat/completions",
                                                      "completion_window": "24h"})
        created.raise_for_status()
        batch_id = created.json()["id"]
        deadline = time.monotonic() + 120
        while (await client.get(f"/batches/{batch_id}")).json()["request_counts"]["completed"] < 5:
            if time.monotonic() > deadline:
                raise RuntimeError("the batch did not start")
            await asyncio.sleep(0.2)
        since = datetime.now(UTC)
        soaking = await interactive_phase(client, args.requests, args.rate, args.max_tokens, args.seed)
        until = datetime.now(UTC)
        status = (await client.get(f"/batches/{batch_id}")).json()
        await client.post(f"/batches/{batch_id}/cancel")
    tokens, answered = await soaked_tokens(env["TOLLGATE_DATABASE_URL"], batch_id, since, until)
    return {"alone_s": alone, "soak_s": soaking, "soaked_tokens": tokens, "soaked_lines": answered,
            "batch_status_at_end": status["status"], "batch_completed_at_end": status["request_counts"],
            "phase_seconds": (until - since).total_seconds()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--rate", type=float, default=3.0, help="interactive requests per second")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--batch-lines", type=int, default=3000)
    parser.add_argument("--batch-max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="tollgate-batch-soak-"))
    os.chmod(root, 0o755)  # the postgres user must reach its data directory
    proc, env = start_platform(root, {"TOLLGATE_BATCH_SWEEP_INTERVAL_S": "1",
                                      "TOLLGATE_HEALTH_POLL_INTERVAL_S": "0.2"})
    try:
        result = asyncio.run(run(args, env))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    alone, soak = result["alone_s"], result["soak_s"]
    p95_alone, p95_soak = percentile(alone, 0.95), percentile(soak, 0.95)
    ratio = p95_soak / p95_alone
    passed = ratio <= PASS_RATIO and result["soaked_tokens"] > 0
    rows = [["interactive alone", f"{statistics.median(alone) * 1000:.1f}", f"{p95_alone * 1000:.1f}", "-"],
            ["interactive + batch soaking", f"{statistics.median(soak) * 1000:.1f}", f"{p95_soak * 1000:.1f}",
             f"{result['soaked_tokens']} tokens / {result['soaked_lines']} lines"]]
    print(format_table(["phase", "TTFT p50 ms", "TTFT p95 ms", "batch soaked on the shared replica"], rows))
    print(f"p95 ratio {ratio:.2f} (limit {PASS_RATIO}); soaked tokens {result['soaked_tokens']} in "
          f"{result['phase_seconds']:.1f} s -> {'PASS' if passed else 'FAIL'}")
    if args.out:
        write_json(args.out, {
            "benchmark": "batch_soak", "machine": machine_description("cpu"),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "args": {k: str(v) for k, v in vars(args).items()},
            "ttft_p50_alone_ms": statistics.median(alone) * 1000, "ttft_p95_alone_ms": p95_alone * 1000,
            "ttft_p50_soak_ms": statistics.median(soak) * 1000, "ttft_p95_soak_ms": p95_soak * 1000,
            "p95_ratio": ratio, "soaked_tokens": result["soaked_tokens"],
            "soaked_lines": result["soaked_lines"],
            "passed": passed,
        })
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
