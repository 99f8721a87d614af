"""Faults survived, judged by the ledger: the real platform under a mixed multi-tenant load while Redis,
Postgres, an engine replica, a gateway worker and the Celery worker are killed and come back.

The platform is ``tollgate up --engine-replicas 2 --workers 2`` over a Postgres and a Redis this benchmark
owns (``benchmarks.chaos_platform``). ``--tenants`` tenants' clients (``--concurrency`` of them in all) run
chat streamed and not, streams they abandon, cache lifetimes, Responses stored, streamed and in the
background, embeddings, and batches (``benchmarks.chaos_load``), with no client retries. Meanwhile the
faults of ``benchmarks.chaos_faults`` run one every ``--fault-interval-s``, in turn, until ``--minutes``
have passed and every kind ran at least twice (``--short``: each kind once, ``--fault-interval-s`` after the
previous kill rather than after its recovery, so the faults combine). Then, with everything
flushed, the judge (``benchmarks.chaos_judge``) compares every request the clients made with the ledger:
lost, doubled, mismatched, 500s, admission counters and spend, batch lines run once. It prints the tables,
writes JSON and exits 1 when a check failed.

    python benchmarks/chaos.py --minutes 10 --out benchmarks/out/chaos.json
    python benchmarks/chaos.py --short            # combined faults in ~20 s; what the test suite runs
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.chaos_faults import FAULTS, Faults, wait_platform_quiet  # noqa: E402
from benchmarks.chaos_judge import judge, settle  # noqa: E402
from benchmarks.chaos_load import Load, Tenant, system_prompt  # noqa: E402
from benchmarks.chaos_platform import ChaosPlatform  # noqa: E402
from benchmarks.common import format_table, machine_description, write_json  # noqa: E402


def _schedule(short: bool, minutes: float, interval_s: float) -> list[str]:
    if short:
        return list(FAULTS)
    rounds = max(2, round(minutes * 60 / interval_s / len(FAULTS) + 0.5))
    return [kind for _ in range(rounds) for kind in FAULTS]


def _stat(values: list[float | None], fn: Any) -> str:
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    return f"{fn(present):.2f}"


async def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    platform = ChaosPlatform(root, engine_replicas=2, gateway_workers=2)
    started_platform = time.monotonic()
    platform.start()
    startup_s = time.monotonic() - started_platform
    try:
        tenants = []
        for i in range(args.tenants):
            name = f"chaos-{i}"
            tenants.append(Tenant(name, platform.tenant(name), system_prompt(name)))
        load = Load(platform.base_url, tenants, seed=args.seed, concurrency=args.concurrency)
        started = time.monotonic()
        load_task = asyncio.create_task(load.run())
        for tenant in tenants:
            await load.submit_batch(tenant, args.batch_lines)
        faults = Faults(
            platform, load, tenants, down_s=args.down_s, batch_lines=args.batch_lines, started_at=started
        )
        stop = asyncio.Event()
        deadline = started + args.minutes * 60
        schedule = _schedule(args.short, args.minutes, args.fault_interval_s)
        await faults.run(schedule, args.fault_interval_s, stop, overlap=args.short)
        remaining = deadline - time.monotonic()
        if not args.short and remaining > 0:
            await asyncio.sleep(remaining)
        load.stop()
        await load_task
        load_s = time.monotonic() - started
        await asyncio.to_thread(wait_platform_quiet, platform)
        last_fault_at = max((r.killed_at for r in faults.records), default=started)
        finals = await settle(platform, load, tenants, last_fault_at)
        settle_s = time.monotonic() - started - load_s
        verdict = await judge(platform, load.log, tenants, finals, faults.records)
        judge_s = time.monotonic() - started - load_s - settle_s
    finally:
        stopping = time.monotonic()
        platform.stop()
        stop_s = time.monotonic() - stopping
    by_kind: dict[str, list[Any]] = {}
    for record in faults.records:
        by_kind.setdefault(record.kind, []).append(record)
    fault_rows = [
        [
            kind,
            len(records),
            _stat([r.component_s for r in records], statistics.median),
            _stat([r.component_s for r in records], max),
            _stat([r.recovery_s for r in records], statistics.median),
            _stat([r.recovery_s for r in records], max),
        ]
        for kind, records in by_kind.items()
    ]
    return {
        "benchmark": "chaos",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description("cpu"),
        "args": vars(args),
        "startup_s": round(startup_s, 1),
        "load_s": round(load_s, 1),
        "settle_s": round(settle_s, 1),  # children healthy, batches ended, leases expired, outbox drained
        "judge_s": round(judge_s, 1),
        "stop_s": round(stop_s, 1),
        "faults": [asdict(r) for r in faults.records],
        "fault_table": fault_rows,
        **verdict,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        f"chaos: {result['load_s']} s of load, {len(result['faults'])} faults, "
        f"{result['requests']} requests, {result['ledger_rows']} ledger rows "
        f"({result['ledger_rows_checked']} matched to a client's request), "
        f"{result['batches']} batches ({result['batch_lines']} lines); abandoned streams left unbilled by a "
        f"killed gateway worker: {result['abandoned_unbilled_worker_killed']}; answers billed, then lost "
        f"with their killed gateway worker: {result['billed_undelivered_worker_killed']}",
        "",
    ]
    lines.append(
        format_table(
            ["fault", "count", "back p50 s", "back max s", "refused until p50 s", "refused until max s"],
            result["fault_table"],
        )
    )
    lines.append("")
    lines.append(
        format_table(["operation/outcome", "requests"], [[k, v] for k, v in result["outcomes"].items()])
    )
    lines.append("")
    statuses = [[k, v] for k, v in sorted(result["error_statuses"].items())] or [["-", 0]]
    lines.append(format_table(["error status", "requests"], statuses))
    lines.append("")
    lines.append(format_table(["check", "failures"], [[k, v] for k, v in result["checks"].items()]))
    for check, examples in result["examples"].items():
        lines.append(f"  {check}: {'; '.join(examples)}")
    lines.append("")
    lines.append("PASS" if result["passed"] else "FAIL")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--minutes", type=float, default=10.0, help="load duration (at least: every fault twice)"
    )
    parser.add_argument(
        "--short", action="store_true", help="every fault once, quickly (the test suite's run)"
    )
    parser.add_argument("--tenants", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=6, help="clients in all")
    parser.add_argument(
        "--fault-interval-s", type=float, default=None, help="pause before each fault (default 20, --short 2)"
    )
    parser.add_argument("--down-s", type=float, default=3.0, help="how long Redis and Postgres stay down")
    parser.add_argument(
        "--batch-lines", type=int, default=None, help="lines per batch (default 16, --short 6)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the platform's directory (logs) afterwards")
    parser.add_argument("--out", default="benchmarks/out/chaos.json")
    args = parser.parse_args()
    if args.fault_interval_s is None:
        args.fault_interval_s = 2.0 if args.short else 20.0
    if args.batch_lines is None:
        args.batch_lines = 6 if args.short else 16
    if args.short:
        args.minutes = 0.0
        args.down_s = min(args.down_s, 2.0)
    root = Path(tempfile.mkdtemp(prefix="tollgate-chaos-"))
    try:
        result = asyncio.run(run(args, root))
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"platform directory kept: {root}", file=sys.stderr)
    print(report(result))
    write_json(args.out, result)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
