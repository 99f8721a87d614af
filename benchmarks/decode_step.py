"""One decode step of a full-size model against its bytes-read floor, on a GPU.

A decode step of B sequences at context C must read every weight once (the embedding table excepted:
only B rows of it) and every sequence's K/V for all layers; its floor is those bytes over the device
copy bandwidth measured here (read + write of a 1 GiB copy, as ``benchmarks/kernels.py``). The step is
the engine's own: ``ModelRunner.run`` on a decode-only batch (host-side preparation, the CUDA graph of
the padded batch, the LM head), timed end to end with the device synchronised after each step.

Weights are drawn on the device (``load_format="random"``: no checkpoint needed, only the model's
``config.json`` shape); the KV cache is filled with random values (never zeros) and the sequences'
blocks are shuffled across the pool.

    python benchmarks/decode_step.py --out benchmarks/out/decode_step.json     # Llama-3-8B, B=64, C=2048
    python benchmarks/decode_step.py --model qwen3-0.6b --batch 256 --context 1024
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    DECODE_TILE_HELP,
    QWEN3_0_6B,
    format_table,
    machine_description,
    use_decode_tile,
    write_json,
)

# Meta-Llama-3-8B's config.json dimensions.
LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=128000,
                 eos_token_id=128001)  # fmt: skip
MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b": LLAMA3_8B,
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rms_norm_eps=1e-6,
                       rope_theta=1000000.0, tie_word_embeddings=True, eos_token_id=151645, **QWEN3_0_6B),
}


def write_config(model: str) -> Path:
    out = Path(tempfile.gettempdir()) / f"tollgate-shape-{model}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(MODELS[model], indent=2))
    return out


def floor_bytes(runner: Any, batch: int, context: int) -> dict[str, int]:
    """Bytes a decode step must read: weights (the embedding as B rows) and the K/V of every sequence."""
    embed = runner.model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    tied = runner.args.tie_word_embeddings  # then the LM head reads the whole table anyway
    if not tied:
        weights -= embed.numel() * embed.element_size() - batch * embed.shape[1] * embed.element_size()
    return {"weights": weights, "kv": batch * context * runner.kv_bytes_per_token}


def decode_batch(runner: Any, batch: int, context: int, seed: int):
    from engine.sampling_params import SamplingParams
    from engine.sequence import ScheduledBatch, ScheduledSeq, Sequence

    rng = random.Random(seed)
    per_seq = -(-context // runner.block_size)
    blocks = list(range(runner.num_kv_blocks))
    rng.shuffle(blocks)
    seqs = []
    for i in range(batch):
        tokens = [rng.randrange(runner.vocab_size) for _ in range(context)]
        seq = Sequence(request_id=str(i), token_ids=tokens, params=SamplingParams(max_tokens=1))
        seq.num_computed_tokens = context - 1  # the last token is this step's query
        seq.block_table = blocks[i * per_seq : (i + 1) * per_seq]
        seqs.append(ScheduledSeq(seq, 1))
    return ScheduledBatch(seqs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=sorted(MODELS), default="llama3-8b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--decode-tile", metavar="KEYS,WARPS,STAGES", default=None, help=DECODE_TILE_HELP)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_step needs a CUDA GPU", file=sys.stderr)
        return 2
    decode_tile = use_decode_tile(args.decode_tile)

    from benchmarks.kernels import measure_copy_bandwidth
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner

    per_seq = -(-args.context // 16)
    config = EngineConfig(model=str(write_config(args.model)), device="cuda", dtype="bfloat16",
                          num_kv_blocks=args.batch * per_seq + 16, max_num_seqs=args.batch,
                          max_model_len=per_seq * 16, load_format="random",
                          enforce_eager=args.enforce_eager)  # fmt: skip
    started = time.perf_counter()
    runner = ModelRunner(config)
    for cache in runner.kv_caches:
        cache.normal_()
    setup_s = time.perf_counter() - started
    batch = decode_batch(runner, args.batch, args.context, seed=0)
    for _ in range(3):
        runner.run(batch)
    torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        runner.run(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step_ms = statistics.median(times) * 1e3
    bandwidth = measure_copy_bandwidth(torch.device("cuda"), 2**30)
    need = floor_bytes(runner, args.batch, args.context)
    floor_ms = sum(need.values()) / bandwidth * 1e3
    result = dict(device=machine_description("cuda"), date=datetime.now(UTC).isoformat(), model=args.model,
                  batch=args.batch, context=args.context, cuda_graphs=runner._graphs is not None,
                  step_ms=step_ms, min_step_ms=min(times) * 1e3, floor_ms=floor_ms,
                  fraction_of_floor=floor_ms / step_ms,
                  weight_bytes=need["weights"], kv_bytes=need["kv"], copy_bandwidth=bandwidth,
                  setup_s=setup_s, decode_tile=decode_tile)  # fmt: skip
    print(f"{args.model} decode step on {result['device']}, bfloat16, CUDA graphs "
          f"{'on' if result['cuda_graphs'] else 'off'}; copy bandwidth {bandwidth / 1e9:.0f} GB/s"
          + (f"; decode tile {args.decode_tile}" if decode_tile else ""))
    print(format_table(
        ["batch", "context", "weights GB", "KV GB", "floor ms", "step ms (median)", "of floor"],
        [[args.batch, args.context, f"{need['weights'] / 1e9:.2f}", f"{need['kv'] / 1e9:.2f}",
          f"{floor_ms:.2f}", f"{step_ms:.2f}", f"{floor_ms / step_ms:.0%}"]],
    ))  # fmt: skip
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
