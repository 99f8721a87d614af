"""The engine's host work per decode step, and the overlapped step loop against a device that is slower.

Workload: ``--seqs`` sequences (64 and 256) of the tiny test model (``engine.tiny``'s Qwen3 shape,
float32 on the CPU, one torch thread: its forward pass is cheap, so the host's share shows), 20-token
random prompts, every sequence decoding (``ignore_eos``), greedy and sampled (temperature 0.8). After
the prefills and a warm-up, ``--steps`` decode steps are timed; each configuration runs ``--repeat``
times, interleaved with the others, and the best run of each is kept.

Three tables:

1. **Host work per step** (``overlap=False``, device work inline on the engine thread): the engine's
   step profile (``engine.step_profile``) split into schedule / prepare / sample / postprocess, with the
   device's own time (the forward pass, sampling; measured by the executor) taken out of prepare and
   sample: ``host`` = step − device.
2. **Overlapped, on this CPU** (``overlap=True``: the device is a thread running the model on one core,
   the host the engine thread): step time against the sum of (1), the device's busy time per step, and
   the critical path: step − device busy, the time per step the device waited for the host.
3. **Simulated device** (``--device-ms``, 10: ``engine.device.SimulatedDevice``, each step stretched to
   that time): the step with the overlap off (about host + device) and on (target: ≤ 1.1 ×
   max(host, device), host being the engine thread's work per step measured in that run).

``--source DIR`` measures another checkout's engine (one without the step profile: the phases are then
timed by wrapping its scheduler, runner and sampler methods) for table 1, e.g. the commit before the
overlapped loop::

    git worktree add /tmp/before 1f09416
    python benchmarks/host_overhead.py --source /tmp/before --out benchmarks/out/host_overhead_before.json
    python benchmarks/host_overhead.py --out benchmarks/out/host_overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 20
WARMUP_STEPS = 8


def _engine(source: Path, model: Path, seqs: int, **config: Any) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32", max_num_seqs=seqs,
                                  max_num_batched_tokens=max(2048, seqs * 8), num_kv_blocks=seqs * 48,
                                  **config))


def _fill(engine: Any, seqs: int, temperature: float, steps: int) -> None:
    from engine.sampling_params import SamplingParams

    rng = random.Random(seqs)
    params = SamplingParams(temperature=temperature, max_tokens=steps + 4 * WARMUP_STEPS, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(f"r{i}", [rng.randrange(100, 2000) for _ in range(PROMPT_LEN)], params)
    for _ in range(WARMUP_STEPS):
        engine.step()


def measure_host(source: Path, model: Path, seqs: int, temperature: float, steps: int) -> dict[str, float]:
    """Table 1: per-step milliseconds of each host phase and of the device, synchronous loop."""
    legacy = not (source / "engine" / "step_profile.py").is_file()
    engine = _engine(source, model, seqs) if legacy else _engine(source, model, seqs, overlap=False)
    _fill(engine, seqs, temperature, steps)
    if legacy:
        return _measure_legacy(engine, steps)
    executor = engine.runner.executor
    profile, busy, step_busy = engine.profile.snapshot(), executor.busy_s, executor.step_busy_s
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - started
    phases = engine.profile.since(profile)
    forward = executor.step_busy_s - step_busy
    device = executor.busy_s - busy
    ms = 1e3 / steps
    row = {"schedule": phases.schedule_s * ms, "prepare": (phases.prepare_s - forward) * ms,
           "sample": (phases.sample_s - (device - forward)) * ms, "postprocess": phases.postprocess_s * ms,
           "device": device * ms, "step": wall * ms}
    row["host"] = row["step"] - row["device"]
    engine.close()
    return row


def _measure_legacy(engine: Any, steps: int) -> dict[str, float]:
    """The phases of an engine without a step profile, by wrapping its methods."""
    spent = {"schedule": 0.0, "prepare": 0.0, "run": 0.0, "sample": 0.0}

    def timed(obj: Any, name: str, key: str) -> None:
        method = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - started

        setattr(obj, name, wrapper)

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "prepare", "prepare")
    timed(engine.runner, "run", "run")
    timed(engine.sampler, "sample", "sample")
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - started
    ms = 1e3 / steps
    forward = (spent["run"] - spent["prepare"]) * ms
    # The old sampler ran on the calling thread: all of it is counted as host work, as it was then.
    row = {"schedule": spent["schedule"] * ms, "prepare": spent["prepare"] * ms,
           "sample": spent["sample"] * ms, "device": forward, "step": wall * ms}
    row["postprocess"] = row["step"] - forward - row["schedule"] - row["prepare"] - row["sample"]
    row["host"] = row["step"] - forward
    return row


def measure_overlap(source: Path, model: Path, seqs: int, temperature: float, steps: int,
                    device_ms: float | None) -> dict[str, float]:
    """Tables 2 and 3: per-step milliseconds with the loop overlapped (and, with ``device_ms``, not)."""
    row: dict[str, float] = {}
    for overlap in (False, True) if device_ms is not None else (True,):
        engine = _engine(source, model, seqs, overlap=overlap, simulated_step_ms=device_ms)
        _fill(engine, seqs, temperature, steps)
        executor = engine.runner.executor
        profile, busy = engine.profile.snapshot(), executor.busy_s
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - started
        phases = engine.profile.since(profile)
        ms = 1e3 / steps
        key = "overlap" if overlap else "sync"
        row[f"{key}_step"] = wall * ms
        row[f"{key}_device"] = (executor.busy_s - busy) * ms
        row[f"{key}_host"] = phases.host_s * ms
        engine.close()
    row["critical"] = row["overlap_step"] - row["overlap_device"]
    if device_ms is not None:
        host, device = row["overlap_host"], row["overlap_device"]
        row["bound"] = max(host, device)
        row["ratio"] = row["overlap_step"] / row["bound"]
    return row


def _child(args: argparse.Namespace) -> None:
    """One measurement in this process (``--run KIND``), printed as JSON."""
    import torch

    torch.set_num_threads(1)
    source = Path(args.source).resolve()
    model = Path(args.model)
    if args.run == "host":
        out = measure_host(source, model, args.seqs[0], args.temperature, args.steps)
    else:
        out = measure_overlap(source, model, args.seqs[0], args.temperature, args.steps,
                              args.device_ms if args.run == "simulated" else None)
    print(json.dumps(out))


def _spawn(args: argparse.Namespace, kind: str, seqs: int, temperature: float,
           model: Path) -> dict[str, float]:
    command = [sys.executable, __file__, "--run", kind, "--seqs", str(seqs),
               "--temperature", str(temperature), "--steps", str(args.steps),
               "--device-ms", str(args.device_ms), "--source", args.source, "--model", str(model)]
    source = str(Path(args.source).resolve())
    env = {**os.environ, "PYTHONPATH": source}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=source, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _best(runs: list[dict[str, float]], key: str) -> dict[str, float]:
    return min(runs, key=lambda r: r[key])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device-ms", type=float, default=10.0)
    parser.add_argument("--source", default=str(ROOT), help="the checkout whose engine is measured")
    parser.add_argument("--skip-overlap", action="store_true", help="table 1 only")
    parser.add_argument("--out", default="benchmarks/out/host_overhead.json")
    parser.add_argument("--run", choices=["host", "overlap", "simulated"], help=argparse.SUPPRESS)
    parser.add_argument("--temperature", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _child(args)
        return

    sys.path.insert(0, str(ROOT))
    from benchmarks.common import format_table, machine_description, write_json
    from engine.tiny import create_tiny_checkpoint

    legacy = not (Path(args.source) / "engine" / "step_profile.py").is_file()
    kinds = ["host"] if legacy or args.skip_overlap else ["host", "overlap", "simulated"]
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_checkpoint(Path(tmp) / "tiny", arch="qwen3", seed=0)
        runs: dict[tuple[str, int, float], list[dict[str, float]]] = {}
        for _ in range(args.repeat):
            for seqs in args.seqs:
                for temperature in args.temperatures:
                    for kind in kinds:
                        result = _spawn(args, kind, seqs, temperature, model)
                        runs.setdefault((kind, seqs, temperature), []).append(result)

    host_rows, overlap_rows, simulated_rows, results = [], [], [], []
    for (kind, seqs, temperature), found in runs.items():
        label = [seqs, "greedy" if temperature == 0 else f"T={temperature:g}"]
        if kind == "host":
            best = _best(found, "step")
            phases = ("schedule", "prepare", "sample", "postprocess", "host", "device", "step")
            host_rows.append(label + [f"{best[k]:.2f}" for k in phases])
        elif kind == "overlap":
            best = _best(found, "overlap_step")
            sync = _best(runs[("host", seqs, temperature)], "step")
            overlap_rows.append(label + [f"{sync['step']:.2f}", f"{best['overlap_step']:.2f}",
                                         f"{best['overlap_device']:.2f}", f"{best['overlap_host']:.2f}",
                                         f"{best['critical']:.2f}",
                                         f"{sync['step'] / best['overlap_step']:.2f}x"])
        else:
            best = _best(found, "overlap_step")
            simulated_rows.append(label + [f"{best['sync_step']:.2f}", f"{best['overlap_step']:.2f}",
                                           f"{best['overlap_host']:.2f}", f"{best['overlap_device']:.2f}",
                                           f"{best['bound']:.2f}", f"{best['ratio']:.3f}"])
        results.append({"kind": kind, "seqs": seqs, "temperature": temperature, "best": best, "runs": found})

    print(f"Host work per decode step (ms), synchronous loop, {machine_description('cpu')}, source "
          f"{args.source}:")
    print(format_table(["seqs", "sampling", "schedule", "prepare", "sample", "postprocess", "host",
                        "device", "step"], host_rows))
    if overlap_rows:
        print("\nOverlapped loop on this CPU (ms per step; critical = step - device busy):")
        print(format_table(["seqs", "sampling", "sync step", "overlapped step", "device busy", "host work",
                            "critical", "speed-up"], overlap_rows))
    if simulated_rows:
        print(f"\nSimulated device of {args.device_ms:g} ms per step (ms per step):")
        print(format_table(["seqs", "sampling", "overlap off", "overlap on", "host work", "device",
                            "max(host, device)", "on / max"], simulated_rows))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=args.source, check=False).stdout.strip()
    write_json(args.out, {"benchmark": "host_overhead", "date": datetime.now(UTC).isoformat(),
                          "machine": machine_description("cpu"), "source": args.source, "commit": commit,
                          "steps": args.steps, "repeat": args.repeat, "device_ms": args.device_ms,
                          "results": results})


if __name__ == "__main__":
    main()
