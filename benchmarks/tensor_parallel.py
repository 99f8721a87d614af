"""Tensor parallelism's cost and gain: one workload on one replica at ``tensor_parallel_size`` 1 and N.

The same random-weight checkpoint and the same greedy workload (``--num-seqs`` requests of random ids,
prompt and output lengths uniform in ``--prompt-len`` / ``--output-len``, ``ignore_eos``) run on a
replica of each size in turn; with ``--repeat R`` each size runs R times (alternating sizes, a fresh
replica each time, its start-up and a warm-up batch not timed) and the best wall time is kept. The
table gives output tokens per second, engine steps, milliseconds per step and the ratio to size 1, and
whether every request's greedy tokens were the same at every size (they must be, up to float near-ties).

- ``--device cpu`` (default): ranks are processes sharing the host's cores over gloo (each rank gets
  ``cores / N`` torch threads; size 1 gets all of them), the Qwen3-shaped ~3.9M-parameter model in
  float32. This measures the collectives' and the extra processes' overhead, not a speed-up: a CPU
  has no more memory bandwidth for two ranks than for one.
- ``--device cuda``: ranks on ``cuda:0..N-1`` over NCCL, Qwen3-0.6B-shaped weights in bfloat16 (needs N
  GPUs; one GPU can only run size 1).

    python benchmarks/tensor_parallel.py --sizes 1 2 --repeat 3 --out benchmarks/out/tensor_parallel_cpu.json
"""

from __future__ import annotations

import argparse
import os
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
from benchmarks.engine_throughput import _tokenizer_size, make_workload  # noqa: E402


def run_once(model_dir: Path, size: int, args: argparse.Namespace, prompts: list[list[int]],
             outputs: list[int]) -> dict[str, Any]:  # fmt: skip
    """One fresh replica of ``size`` ranks: the timed workload, its steps and its tokens."""
    import torch

    from engine import LLM, SamplingParams

    if args.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    with LLM(str(model_dir), device=args.device, dtype=args.dtype, tensor_parallel_size=size,
             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
             num_kv_blocks=args.num_kv_blocks, gpu_memory_utilization=0.8) as llm:  # fmt: skip
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up: every shape
        steps_before = llm.stats.num_steps
        params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n) for n in outputs]
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        results = llm.generate(prompts, params, cache_salt=f"run-{time.monotonic_ns()}")
        wall = time.perf_counter() - started
        steps = llm.stats.num_steps - steps_before
    tokens = [r.token_ids for r in results]
    if sum(map(len, tokens)) != sum(outputs):
        raise RuntimeError(f"size {size} produced {sum(map(len, tokens))} tokens, {sum(outputs)} requested")
    return {"seconds": wall, "steps": steps, "tokens": tokens}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="Default: float32 on CPU, bfloat16 on CUDA.")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="Runs per size (alternating); keep the best.")
    parser.add_argument("--out", type=Path, default=None, help="Write the results as JSON here.")
    args = parser.parse_args(argv)

    cuda = args.device.startswith("cuda")
    dims = QWEN3_0_6B if cuda else QWEN3_CPU_SMALL
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.num_seqs = args.num_seqs or (256 if cuda else 32)
    args.prompt_len = tuple(args.prompt_len or ((100, 1024) if cuda else (50, 300)))
    args.output_len = tuple(args.output_len or ((100, 1024) if cuda else (50, 100)))
    args.max_num_seqs = args.max_num_seqs or (256 if cuda else 32)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (16384 if cuda else 2048)
    model_dir = create_checkpoint(Path(tempfile.gettempdir()) / f"tollgate-bench-{'cuda' if cuda else 'cpu'}",
                                  dims, seed=args.seed)  # fmt: skip
    vocab = min(dims.get("vocab_size", 10**9), _tokenizer_size(model_dir))
    prompts, outputs = make_workload(args.num_seqs, args.prompt_len, args.output_len, vocab, args.seed)

    runs: dict[int, list[dict[str, Any]]] = {size: [] for size in args.sizes}
    for _ in range(args.repeat):
        for size in args.sizes:
            runs[size].append(run_once(model_dir, size, args, prompts, outputs))
    total = sum(outputs)
    best = {size: min(r, key=lambda run: run["seconds"]) for size, r in runs.items()}
    base = best[args.sizes[0]]
    rows, sizes = [], {}
    for size, run in best.items():
        same = all(t == b for t, b in zip(run["tokens"], base["tokens"], strict=True))
        sizes[str(size)] = {"seconds": run["seconds"], "tokens_per_s": total / run["seconds"],
                            "steps": run["steps"], "ms_per_step": 1e3 * run["seconds"] / run["steps"],
                            "speedup": base["seconds"] / run["seconds"], "same_greedy_tokens": same,
                            "all_seconds": [r["seconds"] for r in runs[size]]}  # fmt: skip
        s = sizes[str(size)]
        rows.append([size, total, f"{run['seconds']:.2f}", f"{s['tokens_per_s']:.0f}", run["steps"],
                     f"{s['ms_per_step']:.1f}", f"{s['speedup']:.2f}x", "yes" if same else "NO"])
    print(f"{args.num_seqs} requests, prompt {args.prompt_len}, output {args.output_len}, greedy, "
          f"ignore_eos, {args.dtype} on {machine_description(args.device)}, best of {args.repeat}")
    print(format_table(["ranks", "output tokens", "wall s", "output tok/s", "steps", "ms/step",
                        f"vs {args.sizes[0]} rank(s)", "same tokens"], rows))  # fmt: skip
    result = {
        "benchmark": "tensor_parallel",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": args.device,
        "machine": machine_description(args.device),
        "dtype": args.dtype,
        "model_dims": dims,
        "workload": {"num_seqs": args.num_seqs, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "temperature": 0.0, "ignore_eos": True, "seed": args.seed},
        "repeat": args.repeat,
        "sizes": sizes,
    }
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
