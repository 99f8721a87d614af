"""Tile sweep of the two attention kernels on a GPU: which ``TileConfig`` (tile sizes, warps, pipeline
stages) and which decode split-K policy to launch, measured rather than guessed.

For each candidate the kernel's median time (``triton.testing.do_bench``, L2 flushed between
repetitions) is turned into a fraction of its floor, measured on the machine as in
``benchmarks/kernels.py``: paged decode is memory-bound (K/V bytes over the device copy bandwidth),
extend attention compute-bound (FLOPs over the bf16 matmul rate). Candidates that do not fit the
device (shared memory, registers) are reported as such. Every candidate's output is checked against
the kernel's reference before it is timed, so a fast wrong tile cannot win.

Shapes: Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128) and Qwen3-0.6B's (16 / 8 /
128), bf16, 16-token blocks with shuffled ids.

    python benchmarks/attention_tuning.py --out benchmarks/out/attention_tuning.json

The winners go into ``decode_tile_config`` / ``extend_tile_config`` and the split policy constants of
``kernels/paged_decode_attention.py``; record the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels as K  # noqa: E402
from benchmarks.common import format_table, machine_description, write_json  # noqa: E402
from benchmarks.kernels import as_graph, measure_copy_bandwidth, measure_matmul_rate  # noqa: E402
from kernels._common import TileConfig, next_power_of_2  # noqa: E402

# The module (the package re-exports its launcher under the same name).
decode_module = importlib.import_module("kernels.paged_decode_attention")
MODELS = {"llama3-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}
DECODE_SHAPES = ((1, 32768), (8, 4096), (4, 16384), (64, 2048), (256, 1024))
EXTEND_SHAPES = ((1, 4096, 0), (4, 1024, 0), (4, 512, 3584))
BLOCK_SIZE = 16


def paged_cache(seq_lens: list[int], num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    blocks = [math.ceil(n / BLOCK_SIZE) for n in seq_lens]
    cache = torch.randn((2, sum(blocks), BLOCK_SIZE, num_kv_heads, head_dim), dtype=dtype, device="cuda")
    perm = torch.randperm(sum(blocks), device="cuda").to(torch.int32)
    tables = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32, device="cuda")
    start = 0
    for b, nb in enumerate(blocks):
        tables[b, :nb] = perm[start : start + nb]
        start += nb
    return cache, tables, torch.tensor(seq_lens, dtype=torch.int32, device="cuda")


def bench(fn) -> float:
    """Median ms of a CUDA graph of ``fn`` (L2 flushed between replays), as benchmarks/kernels.py."""
    from triton.testing import do_bench

    return float(do_bench(as_graph(fn, torch.device("cuda")), warmup=10, rep=40, return_mode="median"))


def try_time(run, check) -> float | str:
    """Median ms, or why the candidate cannot run (out of resources, wrong result)."""
    try:
        check()
        return bench(run)
    except Exception as exc:  # noqa: BLE001 - a candidate that fails is a row of the table
        name = type(exc).__name__
        return "does not fit" if "OutOfResources" in name or "out of resource" in str(exc) else f"{name}"


def splits_for(batch: int, num_kv_heads: int, context: int, per_sm: int, max_splits: int,
               min_tokens: int = 256) -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wanted = math.ceil(per_sm * sms / max(1, batch * num_kv_heads))
    return max(1, min(wanted, max(1, math.ceil(context / min_tokens)), max_splits))


def decode_sweep(dtype: torch.dtype, bandwidth: float, tiles: list[TileConfig],
                 policies: list[tuple[int, int]]) -> list[dict[str, Any]]:
    rows = []
    for model, (heads, kv_heads, head_dim) in MODELS.items():
        group = heads // kv_heads
        for batch, context in DECODE_SHAPES:
            cache, tables, lens = paged_cache([context] * batch, kv_heads, head_dim, dtype)
            q = torch.randn((batch, heads, head_dim), dtype=dtype, device="cuda")
            out = torch.empty_like(q)
            floor_ms = 2 * batch * context * kv_heads * head_dim * dtype.itemsize / bandwidth * 1e3
            scale = head_dim**-0.5
            want = K.paged_decode_attention_reference(q, cache[0], cache[1], tables, lens, scale=scale)
            for tile, (per_sm, max_splits) in itertools.product(tiles, policies):
                if tile.block_m != max(16, group):
                    tile = TileConfig(max(16, group), tile.block_n, tile.num_warps, tile.num_stages)
                splits = splits_for(batch, kv_heads, context, per_sm, max_splits)

                def run(q=q, cache=cache, tables=tables, lens=lens, out=out, tile=tile, splits=splits,
                        scale=scale):
                    return K.paged_decode_attention(q, cache[0], cache[1], tables, lens, scale=scale,
                                                    num_splits=splits, out=out, tile=tile)  # fmt: skip

                def check(run=run, want=want, out=out):
                    out.fill_(float("nan"))
                    torch.testing.assert_close(run().float(), want.float(), atol=2e-2, rtol=2e-2)

                ms = try_time(run, check)
                rows.append(dict(kernel="paged_decode_attention", model=model,
                                 shape=f"B={batch} ctx={context}", tile=tile.__dict__, per_sm=per_sm,
                                 max_splits=max_splits, splits=splits, ms=ms, floor_ms=floor_ms,
                                 fraction=floor_ms / ms if isinstance(ms, float) else None))  # fmt: skip
            del cache
    return rows


def extend_sweep(dtype: torch.dtype, flops_rate: float, tiles: list[TileConfig]) -> list[dict[str, Any]]:
    rows = []
    for model, (heads, kv_heads, head_dim) in MODELS.items():
        for batch, new, prefix in EXTEND_SHAPES:
            total = prefix + new
            cache, tables, lens = paged_cache([total] * batch, kv_heads, head_dim, dtype)
            q = torch.randn((batch * new, heads, head_dim), dtype=dtype, device="cuda")
            qsl = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            pairs = batch * (new * prefix + new * (new + 1) // 2)
            floor_ms = 4 * pairs * heads * head_dim / flops_rate * 1e3
            args = (q, cache[0], cache[1], tables, qsl, lens)
            scale = head_dim**-0.5
            want = K.extend_attention_reference(*args, scale=scale)
            for rows_tile in tiles:
                tile = TileConfig(max(1, rows_tile.block_m // next_power_of_2(heads // kv_heads)),
                                  rows_tile.block_n, rows_tile.num_warps, rows_tile.num_stages)

                def run(args=args, out=out, tile=tile, new=new, scale=scale):
                    return K.extend_attention(*args, max_query_len=new, scale=scale, out=out, tile=tile)

                def check(run=run, want=want, out=out):
                    out.fill_(float("nan"))
                    torch.testing.assert_close(run().float(), want.float(), atol=2e-2, rtol=2e-2)

                ms = try_time(run, check)
                rows.append(dict(kernel="extend_attention", model=model,
                                 shape=f"B={batch} new={new} prefix={prefix}", tile=rows_tile.__dict__,
                                 ms=ms, floor_ms=floor_ms,
                                 fraction=floor_ms / ms if isinstance(ms, float) else None))  # fmt: skip
            del cache
    return rows


def summarise(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[list[Any]]:
    """Per candidate (``keys``): geometric mean of the fraction of floor over all shapes, worst shape."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(str(row[k]) for k in keys), []).append(row)
    table = []
    for key, members in groups.items():
        fractions = [m["fraction"] for m in members]
        if any(f is None for f in fractions):
            table.append([*key, "-", "-", next(str(m["ms"]) for m in members if m["fraction"] is None)])
            continue
        geo = math.exp(sum(math.log(f) for f in fractions) / len(fractions))
        worst = min(members, key=lambda m: m["fraction"])
        table.append([*key, f"{geo:.0%}", f"{worst['fraction']:.0%} ({worst['model']} {worst['shape']})", ""])
    table.sort(key=lambda r: -float(r[len(keys)].rstrip("%")) if r[len(keys)] != "-" else 1.0)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--only", choices=["decode", "extend"], default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_tuning needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    bandwidth = measure_copy_bandwidth(torch.device("cuda"), 2**30)
    flops = measure_matmul_rate(torch.device("cuda"), dtype, 8192)
    device = machine_description("cuda")
    print(f"{device}: copy {bandwidth / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    payload: dict[str, Any] = dict(device=device, date=datetime.now(UTC).isoformat(),
                                   copy_bandwidth=bandwidth, matmul_flops=flops)  # fmt: skip
    if args.only in (None, "decode"):
        current = (decode_module._PROGRAMS_PER_SM, decode_module._MAX_SPLITS)
        candidates = itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))
        tiles = [TileConfig(16, n, w, s) for n, w, s in candidates]
        rows = decode_sweep(dtype, bandwidth, tiles, [current])
        table = summarise(rows, ("tile",))
        print(f"\npaged decode, tiles (split policy {current[0]} per SM, max {current[1]}):")
        print(format_table(["tile", "geomean of floor", "worst", "note"], table[:12]))
        best = [r for r in rows if r["fraction"] is not None]
        by_tile: dict[str, list[float]] = {}
        for r in best:
            by_tile.setdefault(str(r["tile"]), []).append(math.log(r["fraction"]))
        top = max(by_tile, key=lambda t: sum(by_tile[t]) / len(by_tile[t]))
        top_tile = next(TileConfig(**r["tile"]) for r in best if str(r["tile"]) == top)
        policies = list(itertools.product((1, 2, 4, 8), (16, 32, 64, 128)))
        split_rows = decode_sweep(dtype, bandwidth, [top_tile], policies)
        print(f"\npaged decode, split policies with tile {top_tile}:")
        print(format_table(["per SM", "max splits", "geomean of floor", "worst", "note"],
                           summarise(split_rows, ("per_sm", "max_splits"))))  # fmt: skip
        payload["decode"] = rows + split_rows
    if args.only in (None, "extend"):
        # block_m here is the tile's rows (query tokens x padded group); extend_sweep converts to tokens.
        tiles = [TileConfig(m, n, w, s) for m, n, w, s in
                 itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))]  # fmt: skip
        rows = extend_sweep(dtype, flops, tiles)
        print("\nextend attention, tiles:")
        print(format_table(["model", "tile", "geomean of floor", "worst", "note"],
                           summarise(rows, ("model", "tile"))[:16]))
        payload["extend"] = rows
    if args.out:
        write_json(args.out, payload)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
