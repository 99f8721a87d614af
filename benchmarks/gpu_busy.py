"""How much of the time the device is busy during nano-vllm's offline workload, with the step loop
overlapped and not (issue #22's "the GPU never waits on Python").

The engine runs the workload of ``benchmarks/engine_throughput.py`` (CUDA: Qwen3-0.6B shape, bf16, 256
requests, prompt and output lengths uniform in 100-1024; ``--device cpu``: its small CPU shape) and, over
a window of ``--active`` steps after ``--skip`` steps (decode-heavy by then), measures:

- CUDA: the union of the GPU's kernel and copy intervals from ``torch.profiler``, over the window's wall
  time: the GPU-busy fraction. The profiler costs host time itself, so the figure is a lower bound; the
  unprofiled output tok/s is ``benchmarks/engine_throughput.py``'s (``--timed`` adds a run here);
- CPU (a dry run of the same code): the device thread's busy time (``engine.device`` executors count
  it) over the window's wall time.

    python benchmarks/gpu_busy.py --device cuda --out benchmarks/out/gpu_busy.json
    python benchmarks/gpu_busy.py --device cpu --num-seqs 32 --skip 20 --active 40   # dry run
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    QWEN3_0_6B,
    QWEN3_CPU_SMALL,
    create_checkpoint,
    format_table,
    machine_description,
    write_json,
)
from benchmarks.engine_throughput import TEMPERATURE, _tokenizer_size, make_workload  # noqa: E402


def busy_fraction(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """The share of ``[start, end]`` covered by the union of ``intervals`` (any unit, the same one)."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for lo, hi in sorted(intervals):
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered / (end - start)


def _engine(model_dir: Path, args: argparse.Namespace, overlap: bool) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    cuda = args.device.startswith("cuda")
    return LLMEngine(EngineConfig(model=str(model_dir), device=args.device,
                                  dtype="bfloat16" if cuda else "float32", max_num_seqs=args.num_seqs,
                                  max_num_batched_tokens=16384 if cuda else 2048, overlap=overlap,
                                  gpu_memory_utilization=0.9))


def _add(engine: Any, prompts: list[list[int]], outputs: list[int], tag: str) -> None:
    from engine.sampling_params import SamplingParams

    for i, (prompt, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, SamplingParams(temperature=TEMPERATURE, max_tokens=n,
                                                                  ignore_eos=True), cache_salt=tag)


def _throughput(engine: Any, prompts: list[list[int]], outputs: list[int], tag: str) -> float:
    _add(engine, prompts, outputs, tag)
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return sum(outputs) / (time.perf_counter() - started)


def _window(engine: Any, args: argparse.Namespace, prompts: list[list[int]], outputs: list[int],
            tag: str) -> dict[str, float]:
    """Busy fraction over ``args.active`` steps after ``args.skip``."""
    import torch

    _add(engine, prompts, outputs, tag)
    for _ in range(args.skip):
        engine.step()
    cuda = args.device.startswith("cuda")
    executor = engine.runner.executor
    profile = engine.profile.snapshot()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    if cuda:
        torch.cuda.synchronize()
    busy_before = executor.busy_s
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(args.active):
            engine.step()
        wall = time.perf_counter() - started
    host = engine.profile.since(profile)
    if cuda:
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        intervals = [(e.time_range.start, e.time_range.end) for e in events]
        cpu = torch.autograd.DeviceType.CPU
        starts = [e.time_range.start for e in prof.events() if e.device_type == cpu]
        ends = [e.time_range.end for e in prof.events()]
        busy = busy_fraction(intervals, min(starts), max(ends)) if intervals and starts else 0.0
    else:
        busy = (executor.busy_s - busy_before) / wall
    engine.abort_all()  # the rest of the workload tells nothing more
    while engine.has_unfinished():
        engine.step()
    return {"busy_fraction": busy, "step_ms": wall / args.active * 1e3,
            "host_ms": host.host_s / args.active * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--skip", type=int, default=200, help="steps before the window (prefills done)")
    parser.add_argument("--active", type=int, default=100, help="steps profiled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timed", action="store_true", help="also time the whole workload unprofiled")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    cuda = args.device.startswith("cuda")
    args.num_seqs = args.num_seqs or (256 if cuda else 64)
    dims = QWEN3_0_6B if cuda else QWEN3_CPU_SMALL
    lengths = ((100, 1024), (100, 1024)) if cuda else ((50, 300), (50, 200))
    if not cuda:
        torch.set_num_threads(1)
    model_dir = Path(tempfile.gettempdir()) / f"tollgate-bench-{'cuda' if cuda else 'cpu'}"
    model_dir = create_checkpoint(model_dir, dims, seed=args.seed)
    vocab = min(dims.get("vocab_size", 10**9), _tokenizer_size(model_dir))
    prompts, outputs = make_workload(args.num_seqs, lengths[0], lengths[1], vocab, args.seed)
    rows, results = [], {}
    for overlap in (True, False):
        engine = _engine(model_dir, args, overlap)
        _throughput(engine, prompts[:4], [8] * 4, "warm-up")
        tok_s = _throughput(engine, prompts, outputs, "timed") if args.timed else None
        window = _window(engine, args, prompts, outputs, "profiled")
        engine.close()
        # Free this engine's KV pool and graphs before the next one sizes its pool from free memory:
        # otherwise the second loop would run with the few GiB the first left (and preempt all along).
        del engine
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        name = "overlapped" if overlap else "synchronous"
        results[name] = {"output_tok_s": tok_s, **window}
        rows.append([name, "-" if tok_s is None else f"{tok_s:.0f}", f"{window['busy_fraction']:.1%}",
                     f"{window['step_ms']:.2f}", f"{window['host_ms']:.2f}"])
    print(f"{args.num_seqs} requests on {machine_description(args.device)}; busy over {args.active} steps "
          f"after {args.skip}")
    print(format_table(["loop", "output tok/s", "device busy", "step ms (profiled)", "host ms / step"], rows))
    if args.out:
        date = datetime.now(UTC).isoformat(timespec="seconds")
        write_json(args.out, {"benchmark": "gpu_busy", "date": date, "device": args.device,
                              "machine": machine_description(args.device),
                              "num_seqs": args.num_seqs, "skip": args.skip, "active": args.active,
                              "results": results})


if __name__ == "__main__":
    main()
