"""Offline generation throughput: Tollgate's engine vs ``transformers.generate`` on the same checkpoint
and the same workload, in one run.

Workload (nano-vllm's ``bench.py`` setup): ``--num-seqs`` requests of random token ids with prompt and
output lengths drawn uniformly from ``--prompt-len`` and ``--output-len``, ``ignore_eos`` so every
request produces exactly its output length, temperature 0.6. Throughput = requested output tokens /
wall time of the whole workload (prefill included), after one warm-up request on each side; with
``--repeat N`` both sides run N times, interleaved, and the best time of each is kept. The
process CPU time is reported too: on a shared machine it is far less sensitive to other load than the
wall time (with ``--threads 1`` it is exactly the core-seconds spent).

The baseline is transformers used the way its users batch offline work: prompts in input order, in
batches of ``--hf-batch-size``, left-padded, ``generate(max_new_tokens=longest output in the batch)``
with EOS disabled (``min_new_tokens`` = ``max_new_tokens``); only the requested tokens are counted.

- ``--device cpu`` (default): a Qwen3-shaped random-weight model of ~3.9M parameters
  (``QWEN3_CPU_SMALL``), float32, 64 requests, prompts in [50, 300], outputs in [50, 200].
- ``--device cuda``: nano-vllm's exact setup: Qwen3-0.6B-shaped random weights, bfloat16, 256
  requests, prompt and output lengths in [100, 1024].

    python benchmarks/engine_throughput.py --threads 1 --repeat 3 \\
        --out benchmarks/out/engine_throughput_cpu.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    DECODE_TILE_HELP,
    QWEN3_0_6B,
    QWEN3_CPU_SMALL,
    create_checkpoint,
    format_table,
    machine_description,
    use_decode_tile,
    write_json,
)

TEMPERATURE = 0.6


def make_workload(num_seqs: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int,
                  seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randint(0, vocab - 1) for _ in range(rng.randint(*prompt_len))] for _ in range(num_seqs)]
    outputs = [rng.randint(*output_len) for _ in range(num_seqs)]
    return prompts, outputs


class EngineRunner:
    """Tollgate's offline API; each repetition uses its own cache salt, so no run reuses another's
    prefix cache (the workload's prompts are random, so a run never hits its own)."""

    name = "tollgate engine"

    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        from engine import LLM, SamplingParams

        self.llm = LLM(str(model_dir), device=args.device, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                       enable_prefix_caching=True, enforce_eager=args.enforce_eager,
                       gpu_memory_utilization=args.gpu_memory_utilization)
        if args.enforce_eager:
            self.name += " (eager)"
        self.params_type = SamplingParams
        self.runs = 0

    def warm_up(self, prompts: list[list[int]]) -> None:
        self.llm.generate([prompts[0][:16]], self.params_type(max_tokens=4, ignore_eos=True))

    def run(self, prompts: list[list[int]], outputs: list[int]) -> None:
        params = [self.params_type(temperature=TEMPERATURE, ignore_eos=True, max_tokens=n) for n in outputs]
        self.runs += 1
        results = self.llm.generate(prompts, params, cache_salt=f"run-{self.runs}")
        produced = sum(len(r.token_ids) for r in results)
        if produced != sum(outputs):
            raise RuntimeError(f"the engine produced {produced} tokens, {sum(outputs)} were requested")

    def details(self) -> dict[str, Any]:
        stats = self.llm.stats
        return {"steps": stats.num_steps, "preemptions": stats.num_preemptions,
                "partial_prefill_chunks": stats.num_partial_prefill_chunks}


class TransformersRunner:
    """``generate`` over left-padded batches of ``--hf-batch-size`` prompts, in input order."""

    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = args.device
        self.batch_size = args.hf_batch_size
        self.name = f"transformers generate (batch {self.batch_size})"
        dtype = getattr(torch, args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
        self.pad = self.model.generation_config.pad_token_id or 0

    def _generate(self, batch: list[list[int]], new_tokens: int) -> None:
        torch, pad = self.torch, self.pad
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, do_sample=True, temperature=TEMPERATURE, top_p=1.0,
                                top_k=0, pad_token_id=pad)

    def warm_up(self, prompts: list[list[int]]) -> None:
        self._generate([prompts[0][:16]], 4)

    def run(self, prompts: list[list[int]], outputs: list[int]) -> None:
        size = self.batch_size
        for i in range(0, len(prompts), size):
            self._generate(prompts[i : i + size], max(outputs[i : i + size]))

    def details(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size}


def measure(runners: list[Any], prompts: list[list[int]], outputs: list[int], repeat: int, device: str
            ) -> dict[str, dict[str, Any]]:
    """Run the workload ``repeat`` times on each runner, interleaved so that both see the same machine
    conditions; keep the best (smallest) wall and CPU time of each, as ``timeit`` does."""
    for runner in runners:
        runner.warm_up(prompts)
    walls: dict[str, list[float]] = {r.name: [] for r in runners}
    cpus: dict[str, list[float]] = {r.name: [] for r in runners}
    for _ in range(repeat):
        for runner in runners:
            _sync(device)
            started, cpu_started = time.perf_counter(), time.process_time()
            runner.run(prompts, outputs)
            _sync(device)
            walls[runner.name].append(time.perf_counter() - started)
            cpus[runner.name].append(time.process_time() - cpu_started)
    tokens = sum(outputs)
    results = {}
    for runner in runners:
        wall, cpu = min(walls[runner.name]), min(cpus[runner.name])
        results[runner.name] = {"seconds": wall, "cpu_seconds": cpu, "output_tokens": tokens,
                                "tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
                                "all_seconds": walls[runner.name], "all_cpu_seconds": cpus[runner.name],
                                **runner.details()}
    return results


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="Default: float32 on CPU, bfloat16 on CUDA.")
    parser.add_argument("--num-seqs", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--hf-batch-size", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU).")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="Where to write (or reuse) the random-weight checkpoint.")
    parser.add_argument("--dims", default=None,
                        help="Override model dimensions (JSON), e.g. {\"hidden_size\": 256}.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="CUDA: share of free memory for the engine's KV cache. Default 0.9 alone, 0.5 "
                             "beside transformers (which runs in the same process and needs its own).")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: run every engine step eagerly (no CUDA graphs for decode).")
    parser.add_argument("--decode-tile", metavar="KEYS,WARPS,STAGES", default=None, help=DECODE_TILE_HELP)
    parser.add_argument("--repeat", type=int, default=1,
                        help="Run the workload this many times on each side (interleaved); keep the best.")
    parser.add_argument("--out", type=Path, default=None, help="Write the results as JSON here.")
    args = parser.parse_args(argv)

    cuda = args.device.startswith("cuda")
    dims = {**(QWEN3_0_6B if cuda else QWEN3_CPU_SMALL), **json.loads(args.dims or "{}")}
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.num_seqs = args.num_seqs or (256 if cuda else 64)
    args.prompt_len = tuple(args.prompt_len or ((100, 1024) if cuda else (50, 300)))
    args.output_len = tuple(args.output_len or ((100, 1024) if cuda else (50, 200)))
    args.max_num_seqs = args.max_num_seqs or (256 if cuda else 64)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (16384 if cuda else 2048)
    args.hf_batch_size = args.hf_batch_size or (64 if cuda else 16)
    args.gpu_memory_utilization = args.gpu_memory_utilization or (0.9 if args.skip_transformers else 0.5)

    import torch

    decode_tile = use_decode_tile(args.decode_tile)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = args.model_dir or Path(tempfile.gettempdir()) / f"tollgate-bench-{'cuda' if cuda else 'cpu'}"
    if args.dims and not args.model_dir:
        model_dir = model_dir.with_name(model_dir.name + "-custom")
    model_dir = create_checkpoint(model_dir, dims, seed=args.seed)
    vocab = min(dims.get("vocab_size", 10**9), _tokenizer_size(model_dir))
    prompts, outputs = make_workload(args.num_seqs, args.prompt_len, args.output_len, vocab, args.seed)

    runners: list[Any] = [EngineRunner(model_dir, args)]
    if not args.skip_transformers:
        runners.append(TransformersRunner(model_dir, args))
    measured = measure(runners, prompts, outputs, args.repeat, args.device)
    ours = measured[runners[0].name]
    theirs = measured[runners[1].name] if len(runners) > 1 else None
    ratio = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs else None
    cpu_ratio = ours["tokens_per_cpu_s"] / theirs["tokens_per_cpu_s"] if theirs else None

    def row(name: str, r: dict[str, Any], wall: float | None, cpu: float | None) -> list[Any]:
        return [name, r["output_tokens"], f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.0f}",
                "-" if wall is None else f"{wall:.2f}x", f"{r['cpu_seconds']:.1f}",
                f"{r['tokens_per_cpu_s']:.0f}", "-" if cpu is None else f"{cpu:.2f}x"]

    rows = [row(runners[0].name, ours, ratio, cpu_ratio)]
    if theirs:
        rows.append(row(runners[1].name, theirs, 1.0, 1.0))
    print(f"{args.num_seqs} requests, prompt {args.prompt_len}, output {args.output_len}, ignore_eos, "
          f"{args.dtype} on {machine_description(args.device)}, torch threads {torch.get_num_threads()}, "
          f"best of {args.repeat}" + (f", decode tile {args.decode_tile}" if decode_tile else ""))
    print(format_table(["system", "output tokens", "wall s", "output tok/s", "vs transformers", "CPU s",
                        "tok/CPU-s", "vs transformers (CPU)"], rows))
    result = {
        "benchmark": "engine_throughput",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "device": args.device,
        "machine": machine_description(args.device),
        "dtype": args.dtype,
        "model_dims": dims,
        "workload": {"num_seqs": args.num_seqs, "prompt_len": args.prompt_len, "output_len": args.output_len,
                     "temperature": TEMPERATURE, "ignore_eos": True, "seed": args.seed},
        "engine_config": {"max_num_seqs": args.max_num_seqs,
                          "max_num_batched_tokens": args.max_num_batched_tokens,
                          "num_kv_blocks": args.num_kv_blocks, "decode_tile": decode_tile},
        "torch_threads": torch.get_num_threads(),
        "repeat": args.repeat,
        "tollgate": ours,
        "transformers": theirs,
        "speedup": ratio,
        "speedup_cpu_time": cpu_ratio,
    }
    if args.out:
        write_json(args.out, result)
    return result


def _tokenizer_size(model_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=False)


if __name__ == "__main__":
    main()
