"""LoRA adapters served beside the base model: what a mixed workload costs, and what a cold load costs.

Set-up: the engine's offline API (``engine.llm.LLM``) on ``engine.tiny``'s Llama (float32, the torch
path on the CPU; on a GPU when one is present and ``--device cuda``), ``--max-loras`` device slots.
Adapters are PEFT bundles written by PEFT itself (``init_lora_weights=False``), rank ``--rank`` on every
projection the engine wraps (attention q/k/v/o and the MLP's gate/up/down).

Mixed workload: ``--requests`` requests of ``--prompt-tokens`` random prompt tokens and ``--output-tokens``
greedy output tokens (``ignore_eos``), all submitted at once, spread round-robin over K distinct adapters
(K = 0: the base model alone; then 1, 8 and 64), best of ``--repeat`` runs, interleaved across K.
Reported: output tokens per second over the run's wall time and its ratio to the base model's (the
issue's target: 8 adapters >= 0.8), steps, and the slot loads the run caused (64 adapters through 8 slots
swap).

Cold load: reading a bundle and checking it (``engine.lora.adapter.load_adapter``), and copying it into a
device slot, median of ``--repeat``.

    python benchmarks/lora.py [--requests 64] [--max-loras 8] [--rank 16] [--out benchmarks/out/lora.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_COUNTS = (0, 1, 8, 64)


def write_bundles(base_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` random PEFT bundles of ``rank`` on every wrapped projection."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_TARGETS, init_lora_weights=False,
                             task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(model, config)
    bundles = []
    for i in range(count):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, parameter in peft_model.named_parameters():
                if "lora_" in name:
                    parameter.normal_(0, 0.02)
        path = out / f"adapter-{i}"
        peft_model.save_pretrained(path)
        bundles.append(path)
    return bundles


def mixed_run(llm: Any, prompts: list[list[int]], output_tokens: int, adapters: list[Any]) -> dict[str, Any]:
    from engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    loras = [adapters[i % len(adapters)] if adapters else None for i in range(len(prompts))]
    runner = llm.engine.runner
    loads, steps = (runner.lora.loads if runner.lora else 0), llm.engine.stats().num_steps
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - started
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "steps": llm.engine.stats().num_steps - steps,
            "slot_loads": (runner.lora.loads if runner.lora else 0) - loads}


def cold_load(llm: Any, bundles: list[Path], repeat: int) -> dict[str, float]:
    from engine.lora.adapter import load_adapter

    runner = llm.engine.runner
    reads, copies = [], []
    for i in range(repeat):
        bundle = bundles[i % len(bundles)]
        started = time.perf_counter()
        adapter = load_adapter(bundle, runner.args)
        read = time.perf_counter()
        runner.lora.load(1, adapter)  # the copy into a device slot, as the runner makes it
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        reads.append(read - started)
        copies.append(time.perf_counter() - read)
    return {"read_ms": 1000 * statistics.median(reads), "slot_copy_ms": 1000 * statistics.median(copies)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--counts", default=",".join(str(c) for c in ADAPTER_COUNTS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "lora.json"))
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    from engine.llm import LLM
    from engine.lora.registry import LoRARequest
    from engine.tiny import create_tiny_checkpoint

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2900, (args.prompt_tokens,), generator=gen).tolist()
               for _ in range(args.requests)]
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = create_tiny_checkpoint(Path(tmp) / "tiny", arch="llama", seed=0)
        bundles = write_bundles(base_dir, Path(tmp), max(counts), args.rank)
        requests = [LoRARequest(f"adapter-{i}", str(b)) for i, b in enumerate(bundles)]
        with LLM(str(base_dir), device=args.device, max_num_seqs=args.requests,  # type: ignore[arg-type]
                 max_loras=args.max_loras, max_lora_rank=args.rank, max_cpu_loras=max(counts) + 1,
                 enable_prefix_caching=False) as llm:
            mixed_run(llm, prompts[:4], 4, requests[:2])  # warm up: both paths, the bundles' first reads
            for requests_of in [requests[:k] for k in counts]:
                for adapter in requests_of:  # read every bundle once before timing (host cache)
                    llm.engine.adapters.get(adapter)
            # Interleaved (each repeat runs every count once), so a busy moment of a shared machine lands on
            # one run of each count rather than on every run of one: the ratios compare like with like.
            runs: dict[int, list[dict[str, Any]]] = {k: [] for k in counts}
            for _ in range(args.repeat):
                for k in counts:
                    runs[k].append(mixed_run(llm, prompts, args.output_tokens, requests[:k]))
            for k in counts:
                results[str(k)] = max(runs[k], key=lambda r: r["tokens_per_s"])
            base = results[str(counts[0])]["tokens_per_s"] if counts[0] == 0 else None
            for k in counts:
                r = results[str(k)]
                ratio = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
                rows.append([k or "base only", f"{r['tokens_per_s']:.0f}", ratio, r["steps"],
                             r["slot_loads"]])
            load = cold_load(llm, bundles, max(3, args.repeat))
    print(f"LoRA adapters mixed in one workload ({machine_description(args.device)}; engine.tiny llama, "
          f"{args.requests} requests of {args.prompt_tokens} + {args.output_tokens} tokens, rank {args.rank} "
          f"on all 7 projections, {args.max_loras} slots; best of {args.repeat})")
    print(format_table(["adapters", "output tok/s", "vs base", "steps", "slot loads"], rows))
    print(f"cold load: read and check a bundle {load['read_ms']:.1f} ms, copy into a slot "
          f"{load['slot_copy_ms']:.1f} ms (median)")
    write_json(args.out, {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                          "machine": machine_description(args.device), "args": vars(args),
                          "mixed": results, "cold_load": load})
    return 0


if __name__ == "__main__":
    sys.exit(main())
