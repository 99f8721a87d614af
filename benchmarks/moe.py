"""The mixture-of-experts layer: the engine's expert path against simpler ones, and the fused kernel on a GPU.

CPU table (always): one MoE layer of ``--shape`` (default ``qwen3-moe-cpu``: Qwen3-30B-A3B's routing,
128 experts, top 8, scaled to hidden 1024 and expert width 384 so a 2-core CPU holds it in float32), at
1, 64 and 256 tokens, softmax top-k routing of random hidden states. Three implementations of the
same layer, their outputs checked equal before timing:

- ``engine``: ``engine.models.moe.grouped_experts`` (slots sorted by expert, one GEMM pair per chosen
  expert);
- ``per-token loop``: each token's k experts as matrix-vector products, token by token (what a naive
  port does);
- ``transformers``: transformers' ``Qwen3MoeSparseMoeBlock`` with the same weights (its experts loop
  over one-hot masks).

GPU table (when CUDA is present): ``kernels.fused_moe`` on Qwen3-30B-A3B's real layer shape (hidden
2048, 128 experts of width 768, top 8, bfloat16) at decode batch sizes, against the bytes-read floor:
the weights of the experts the batch actually routes to (each read once) plus activations, at the
device's measured copy bandwidth (a 1 GiB device-to-device copy). Target: at least 0.7 of the floor.

    python benchmarks/moe.py                       # CPU table (+ GPU table on a GPU)
    python benchmarks/moe.py --tokens 1 64 --repeat 3 --out benchmarks/out/moe.json

``--tune`` (GPU only) times the fused kernel's candidate tiles at token counts from 1 to 4096 for a layer
shape (default Qwen3-30B-A3B's; ``--tune-shape E,N,K,TOPK`` for another: N = 2 x the expert width, K =
hidden) and writes the best per token count to ``kernels/moe_configs/E=..,N=..,device_name=...json``,
which ``kernels.fused_moe`` then uses on that GPU model (the nearest measured token count). Each candidate
is checked against the default tile's output first.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402

SHAPES = {
    # hidden, experts, expert width, top-k
    "qwen3-moe-cpu": (1024, 128, 384, 8),
    "qwen3-30b-a3b": (2048, 128, 768, 8),
    "tiny": (64, 8, 32, 2),
}
GPU_BATCHES = (1, 8, 32, 64, 128)


def _timed(fn: Any, repeat: int) -> float:
    """Median seconds of ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def per_token_loop(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def _transformers_block(hidden: int, experts: int, inter: int, top_k: int, router: torch.Tensor,
                        w13: torch.Tensor, w2: torch.Tensor) -> Any:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, num_experts=experts, moe_intermediate_size=inter,
                            num_experts_per_tok=top_k, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
    return block


def cpu_table(
    shape: str, token_counts: list[int], repeat: int, loop_max_tokens: int
) -> list[dict[str, Any]]:
    from engine.models.config import MoEArgs
    from engine.models.moe import grouped_experts, route

    hidden, experts, inter, top_k = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    router = torch.randn(experts, hidden, generator=gen) * hidden**-0.5
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    moe = MoEArgs(num_experts=experts, top_k=top_k, intermediate_size=inter)
    try:
        block = _transformers_block(hidden, experts, inter, top_k, router, w13, w2)
    except ImportError:
        block = None
    rows = []
    with torch.inference_mode():
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, generator=gen)

            def engine_path(x: torch.Tensor = x) -> torch.Tensor:
                weights, ids = route(x @ router.T, moe)
                return grouped_experts(x, w13, w2, weights, ids)

            weights, ids = route(x @ router.T, moe)
            expected = engine_path()
            row: dict[str, Any] = {"tokens": tokens, "engine_ms": 1e3 * _timed(engine_path, repeat)}
            if tokens <= loop_max_tokens:
                looped = per_token_loop(x, w13, w2, weights, ids)
                torch.testing.assert_close(looped, expected, atol=1e-4, rtol=1e-4)
                row["per_token_loop_ms"] = 1e3 * _timed(
                    lambda x=x, weights=weights, ids=ids: per_token_loop(x, w13, w2, weights, ids),
                    max(1, repeat // 2))
            if block is not None:
                torch.testing.assert_close(block(x[None])[0], expected, atol=1e-4, rtol=1e-4)
                row["transformers_ms"] = 1e3 * _timed(lambda x=x: block(x[None]), repeat)
            rows.append(row)
    return rows


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _cuda_timed(lambda: dst.copy_(src), 10)
    return 2 * src.numel() / seconds


def _cuda_timed(fn: Any, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def gpu_table(batches: tuple[int, ...], repeat: int) -> tuple[list[dict[str, Any]], float]:
    import kernels
    from engine.models.config import MoEArgs
    from engine.models.moe import route

    device = torch.device("cuda")
    hidden, experts, inter, top_k = SHAPES["qwen3-30b-a3b"]
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=gen, device=device) * 0.02).to(dtype)
    router = torch.randn(experts, hidden, generator=gen, device=device) * hidden**-0.5
    moe = MoEArgs(num_experts=experts, top_k=top_k, intermediate_size=inter)
    bandwidth = copy_bandwidth(device)
    per_expert = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    rows = []
    for batch in batches:
        x = torch.randn(batch, hidden, generator=gen, device=device).to(dtype)
        weights, ids = route(x.float() @ router.T, moe)
        def run(x: torch.Tensor = x, weights: torch.Tensor = weights, ids: torch.Tensor = ids) -> None:
            kernels.fused_moe(x, w13, w2, weights, ids)

        seconds = _cuda_timed(run, repeat)
        touched = int(torch.unique(ids).numel())
        floor_bytes = touched * per_expert + 2 * batch * hidden * x.element_size()
        rows.append({"batch": batch, "experts_touched": touched, "kernel_us": 1e6 * seconds,
                     "floor_us": 1e6 * floor_bytes / bandwidth,
                     "fraction_of_floor": floor_bytes / bandwidth / seconds})
    return rows, bandwidth


TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def tune_candidates() -> list[Any]:
    from kernels.fused_moe import MoETileConfig

    return [MoETileConfig(block_m=m, block_n=n, block_k=k, group_m=g, num_warps=w, num_stages=s)
            for m in (16, 32, 64) for n in (64, 128) for k in (64, 128) for g in (1, 8) for w in (4, 8)
            for s in (3, 4)]  # fmt: skip


def tune(shape: tuple[int, int, int, int], repeat: int) -> Path:
    """Time every candidate tile at each token count on this GPU; write the best of each (see docs)."""
    import kernels
    from kernels.fused_moe import CONFIG_DIR, config_file_name

    experts, n, hidden, top_k = shape
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(experts, n, hidden, generator=gen, device=device) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, n // 2, generator=gen, device=device) * (n // 2) ** -0.5).to(dtype)
    best: dict[str, dict[str, int]] = {}
    rows = []
    for tokens in TUNE_TOKENS:
        x = torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)
        logits = torch.randn(tokens, experts, generator=gen, device=device)
        weights, ids = torch.topk(logits.softmax(-1), top_k)
        weights = weights / weights.sum(-1, keepdim=True)

        def run(cfg: Any = None, x: torch.Tensor = x, weights: torch.Tensor = weights,
                ids: torch.Tensor = ids) -> torch.Tensor:
            return kernels.fused_moe(x, w13, w2, weights, ids, config=cfg)

        expected = run()
        timed = []
        for cfg in tune_candidates():
            try:
                got = run(cfg)
            except Exception:  # noqa: BLE001 - a tile the GPU cannot run (shared memory) is not a candidate
                continue
            torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
            timed.append((_cuda_timed(lambda cfg=cfg: run(cfg), repeat), cfg))
        seconds, cfg = min(timed, key=lambda item: item[0])
        default_s = _cuda_timed(run, repeat)
        best[str(tokens)] = dataclasses.asdict(cfg)
        tile = f"{cfg.block_m}/{cfg.block_n}/{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"
        rows.append([tokens, f"{1e6 * default_s:.1f}", f"{1e6 * seconds:.1f}", f"{default_s / seconds:.2f}x",
                     tile])
    headers = ["tokens", "current us", "best us", "speed-up", "best tile (M/N/K group warps stages)"]
    print(format_table(headers, rows))
    path = CONFIG_DIR / config_file_name(experts, n, torch.cuda.get_device_name(device))
    write_json(path, best)
    print(f"wrote {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-moe-cpu")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--loop-max-tokens", type=int, default=64,
                        help="time the per-token loop only up to this many tokens (it is slow)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: all)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "moe.json"))
    parser.add_argument("--tune", action="store_true", help="GPU only: measure and write tuned tiles (docs)")
    parser.add_argument("--tune-shape", default="128,1536,2048,8",
                        help="experts, 2 x expert width, hidden, top-k of the layer to tune for")
    args = parser.parse_args(argv)
    if args.tune:
        if not torch.cuda.is_available():
            parser.error("--tune measures the fused kernel on a GPU; this machine has none")
        experts, n, hidden, top_k = (int(v) for v in args.tune_shape.split(","))
        tune((experts, n, hidden, top_k), max(20, args.repeat))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_rows = cpu_table(args.shape, args.tokens, args.repeat, args.loop_max_tokens)
    hidden, experts, inter, top_k = SHAPES[args.shape]
    print(f"MoE layer on the CPU ({machine_description('cpu')}, {torch.get_num_threads()} threads, float32): "
          f"hidden {hidden}, {experts} experts of width {inter}, top {top_k}; median of {args.repeat}")
    headers = ["tokens", "engine ms", "per-token loop ms", "transformers ms", "loop / engine",
               "transformers / engine"]
    table = []
    for r in cpu_rows:
        loop, hf = r.get("per_token_loop_ms"), r.get("transformers_ms")
        table.append([r["tokens"], f"{r['engine_ms']:.2f}", f"{loop:.2f}" if loop else "-",
                      f"{hf:.2f}" if hf else "-", f"{loop / r['engine_ms']:.1f}x" if loop else "-",
                      f"{hf / r['engine_ms']:.2f}x" if hf else "-"])
    print(format_table(headers, table))
    payload: dict[str, Any] = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                               "machine": machine_description("cpu"), "shape": args.shape,
                               "threads": torch.get_num_threads(), "cpu": cpu_rows}
    if torch.cuda.is_available():
        gpu_rows, bandwidth = gpu_table(GPU_BATCHES, max(20, args.repeat))
        print(f"\nfused_moe on {machine_description('cuda')}, Qwen3-30B-A3B layer, bfloat16; copy bandwidth "
              f"{bandwidth / 1e9:.0f} GB/s")
        print(format_table(["batch", "experts touched", "kernel us", "floor us", "fraction of floor"],
                           [[r["batch"], r["experts_touched"], f"{r['kernel_us']:.1f}",
                             f"{r['floor_us']:.1f}", f"{r['fraction_of_floor']:.2f}"] for r in gpu_rows]))
        payload |= {"gpu": gpu_rows, "gpu_machine": machine_description("cuda"), "copy_bandwidth": bandwidth}
    else:
        print("\nno GPU here: the fused kernel's bandwidth table needs one")
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
