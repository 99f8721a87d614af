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
    python benchmarks/attention_tuning.py --compile-only [--arch 90]    # no GPU needed

``--compile-only`` compiles each decode tile candidate for the target (as ``kernels.aot`` does, no GPU)
and prints what costs no device time to know: shared memory, registers, spills, the pipeline's K/V
buffers and how many programs one SM holds. With one buffer a program loads its next tile only once it
has issued the math of the current one, and waits for it at the top of the next iteration: no load is
in flight while it computes. With two it loads the next tile while it computes on the current one.
Triton spends a pipeline stage on each level of indirection, and the K/V addresses come from the block
table read in the same loop, so 3 and 4 stages compile to the same kernel (one buffer each for K and V,
the block ids prefetched one tile ahead) and 5 is the least that gives two.

The winners go into ``decode_tile_config`` / ``extend_tile_config`` and the split policy constants of
``kernels/paged_decode_attention.py``; record the table in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import math
import os
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--compile-only" in sys.argv[1:]:
    # Triton must compile, not interpret, even without a GPU: decided before it is first imported (the
    # kernels benchmark imported below turns the interpreter on where there is no GPU, unless told).
    os.environ.setdefault("TRITON_INTERPRET", "0")

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


def decode_tile_candidates() -> list[TileConfig]:
    """Keys per tile x warps x pipeline stages (4 stages is left out: it compiles to 3's kernel)."""
    return [TileConfig(16, n, w, s) for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 5, 7))]


def decode_compile_report(arch: int, tiles: list[TileConfig]) -> list[dict[str, Any]]:
    """Each tile of the split decode kernel (Llama-3-8B's attention, bf16) compiled for ``sm_{arch}``:
    its resources and pipeline buffers, from the compiler alone."""
    from dataclasses import replace

    from kernels import aot

    aot.require_compiled_triton()
    launches = aot.engine_launches(aot.SERVED_SHAPES["llama3-8b"], torch.bfloat16, arch)
    split = next(launch for launch in launches
                 if "paged_decode" in launch.kernel.fn.__name__ and launch.kwargs["SPLIT"])  # fmt: skip
    rows = []
    for tile in tiles:
        kwargs = dict(split.kwargs, BLOCK_N=tile.block_n, **tile.launch_options)
        result = aot.compile_launch(replace(split, kwargs=kwargs), arch)
        rows.append(dict(tile=tile.__dict__, arch=arch, shared_bytes=result.shared_bytes,
                         registers=result.registers, spills=result.spill_stores + result.spill_loads,
                         pipeline_buffers=result.pipeline_buffers, problems=result.problems(),
                         programs_per_sm=0 if result.problems() else result.programs_per_sm()))  # fmt: skip
    return rows


def kv_tiles_in_flight(buffers: list[str], block_n: int) -> int:
    """How many shared-memory buffers of ``block_n`` keys the pipeline gave K (and V): 0 when their loads
    were not pipelined through shared memory."""
    dims = [b.split("x") for b in buffers]
    return min((int(d[0]) for d in dims if len(d) == 4 and d[1] == str(block_n)), default=0)


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
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the decode candidates for --arch and report their resources (no GPU)")
    parser.add_argument("--arch", type=int, default=90, help="with --compile-only: 80 or 90")
    args = parser.parse_args(argv)
    if args.compile_only:
        rows = decode_compile_report(args.arch, decode_tile_candidates())
        table = [[f"{t['block_n']} keys, {t['num_warps']} warps, {t['num_stages']} stages",
                  f"{r['shared_bytes'] / 1024:.0f}", r["registers"], r["spills"],
                  kv_tiles_in_flight(r["pipeline_buffers"], t["block_n"]), r["programs_per_sm"],
                  "; ".join(r["problems"]) or "ok"] for r in rows for t in [r["tile"]]]  # fmt: skip
        print(f"paged decode (split), Llama-3-8B attention, bf16, sm_{args.arch}, compiled without a GPU:")
        print(format_table(["tile", "smem KiB", "registers", "spill B", "K/V buffers", "programs/SM",
                            "fit"], table))  # fmt: skip
        if args.out:
            write_json(args.out, dict(arch=args.arch, date=datetime.now(UTC).isoformat(), decode=rows))
        return 0
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
        tiles = decode_tile_candidates()
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
