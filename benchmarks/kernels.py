"""Kernel benchmark: each Triton kernel's time against its floor and against a PyTorch baseline.

Floors are measured on the machine, never taken from a datasheet:
- memory floor = bytes the kernel must move (read + write, each byte once) / measured HBM copy
  bandwidth (``dst.copy_(src)`` of 1 GiB, counting read + write);
- compute floor = FLOPs / measured dense bf16 matmul rate (8192^3 ``torch.mm``).
A kernel's floor is the larger of the two; "% of floor" = floor / measured time (100% is the best a
kernel can do). Attention kernels are also timed against PyTorch SDPA (``enable_gqa``) on *contiguous*
K/V of the same size, i.e. without paging; the other ops against their eager PyTorch reference.

Shapes are Llama-3-8B's (32 query heads, 8 KV heads, head_dim 128, hidden 4096, MLP 14336), bf16,
16-token KV blocks with shuffled block ids. Timing: ``triton.testing.do_bench`` (warm-up, L2 flush
between repetitions, median) of a CUDA graph of the call, as the engine replays its decode steps: the
GPU time of the work itself, without the Python launch overhead that would otherwise dominate the
small cases (a call that cannot be captured is timed eagerly, and its row says so).

Paged decode is also timed, side by side in the same run, with the pipeline depths the launcher does not
choose (:data:`DECODE_VARIANTS`: rows marked with the variant, no baseline). Triton spends a pipeline
stage on each level of indirection, and the K/V addresses come from the block table read in the same
loop: at 3 or 4 stages K and V get one shared-memory buffer each, waited for at the top of every tile,
while 5 stages give them two (``python benchmarks/attention_tuning.py --compile-only`` shows the buffers
of each candidate without a GPU). Which is faster is measured here, not assumed.

    python benchmarks/kernels.py                      # on a CUDA GPU: table + benchmarks/results/kernels.json
    python benchmarks/kernels.py --smoke              # without a GPU: tiny shapes in Triton's interpreter

Without CUDA the real figures cannot be measured: the script refuses unless ``--smoke`` is given, which
runs every case at toy sizes in float32 through the interpreter, checks each result against its
reference, and prints the table with the times marked as interpreter times (not performance figures).
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (see kernels/_common.py)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch.nn.functional as F  # noqa: E402

import kernels as K  # noqa: E402
from benchmarks.common import format_table, machine_description, write_json  # noqa: E402
from kernels._common import TileConfig, target_capability  # noqa: E402
from kernels.paged_decode_attention import decode_tile_config, gather_paged_kv  # noqa: E402


@dataclass
class Shapes:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    intermediate: int = 14336
    block_size: int = 16
    decode: tuple[tuple[int, int], ...] = ((1, 1024), (1, 32768), (8, 4096), (64, 2048), (256, 1024))
    # (sequences, new tokens per sequence, cached prefix per sequence)
    extend: tuple[tuple[int, int, int], ...] = ((1, 4096, 0), (4, 1024, 0), (4, 512, 3584))
    tokens: int = 8192
    # The fused MoE layer (Qwen3-30B-A3B: hidden 2048, 128 experts of width 768, top 8) at decode batches.
    moe_hidden: int = 2048
    moe_experts: int = 128
    moe_intermediate: int = 768
    moe_top_k: int = 8
    moe_batches: tuple[int, ...] = (1, 16, 64)


SMOKE = Shapes(
    num_heads=4, num_kv_heads=2, head_dim=64, hidden=96, intermediate=80, block_size=16,
    decode=((2, 40),), extend=((2, 20, 0), (1, 9, 23)), tokens=24,
    moe_hidden=64, moe_experts=8, moe_intermediate=32, moe_top_k=2, moe_batches=(3,),
)  # fmt: skip


@dataclass
class Case:
    kernel: str
    shape: str
    run: Callable[[], Any]
    check: Callable[[], None]
    bytes_moved: int
    flops: int
    baseline_name: str
    baseline: Callable[[], Any] | None  # None: a variant of a kernel case, whose baseline row it shares
    variant: str | None = None


def _paged_cache(seq_lens: list[int], s: Shapes, dtype: torch.dtype, device: torch.device):
    """Random K/V for ``seq_lens`` in a paged cache with shuffled block ids; also the contiguous copy."""
    blocks = [math.ceil(n / s.block_size) for n in seq_lens]
    num_blocks = sum(blocks)
    cache = torch.randn((2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim), dtype=dtype, device=device)
    perm = torch.randperm(num_blocks, device=device)
    block_tables = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32, device=device)
    start = 0
    for b, nb in enumerate(blocks):
        block_tables[b, :nb] = perm[start : start + nb].to(torch.int32)
        start += nb
    return cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32, device=device)


def _contiguous(cache: torch.Tensor, block_tables: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, ...]:
    """[B, kv_heads, seq_len, head_dim] K and V for SDPA (every sequence has length ``seq_len``)."""
    k = torch.stack([gather_paged_kv(cache[0], t, seq_len) for t in block_tables])
    v = torch.stack([gather_paged_kv(cache[1], t, seq_len) for t in block_tables])
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# Paged decode launched with another tile than decode_tile_config's: (label, keys per tile, warps, stages).
DECODE_VARIANTS = (("5 stages", 64, 4, 5), ("7 stages", 64, 4, 7), ("32 keys, 5 stages", 32, 4, 5))


def decode_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> tuple[list[Case], list[Case]]:
    """Paged decode at each of ``s.decode``'s (batch, context) with the launcher's own tile, and again,
    over the same tensors, with each of :data:`DECODE_VARIANTS`' tiles (leaving out one that is the
    launcher's choice). A variant is checked against the reference like the kernel's own case and has no
    baseline (the kernel's own row has it)."""
    chosen = decode_tile_config(s.head_dim, s.num_heads // s.num_kv_heads, dtype, target_capability(device))
    tiles = [(label, TileConfig(chosen.block_m, block_n, warps, stages))
             for label, block_n, warps, stages in DECODE_VARIANTS]  # fmt: skip
    own: list[Case] = []
    variants: list[Case] = []
    size = dtype.itemsize
    scale = s.head_dim**-0.5
    gqa = s.num_heads != s.num_kv_heads
    for batch, context in s.decode:
        cache, tables, lens = _paged_cache([context] * batch, s, dtype, device)
        q = torch.randn((batch, s.num_heads, s.head_dim), dtype=dtype, device=device)
        out = torch.empty_like(q)
        k, v = _contiguous(cache, tables, context)
        kv_bytes = 2 * batch * context * s.num_kv_heads * s.head_dim * size

        def decode(tile=None, q=q, cache=cache, tables=tables, lens=lens, out=out, context=context):
            return K.paged_decode_attention(q, cache[0], cache[1], tables, lens, scale=scale,
                                            max_seq_len=context, out=out, tile=tile)  # fmt: skip

        def check(decode=decode, q=q, cache=cache, tables=tables, lens=lens):
            want = K.paged_decode_attention_reference(q, cache[0], cache[1], tables, lens, scale=scale)
            _assert_close(decode(), want, "paged_decode_attention")

        def sdpa(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=gqa)

        case = Case(
            "paged_decode_attention", f"B={batch} ctx={context}", decode, check,
            kv_bytes + 2 * q.numel() * size + tables.numel() * 4,
            4 * batch * s.num_heads * context * s.head_dim, "SDPA contiguous KV", sdpa,
        )  # fmt: skip
        own.append(case)
        for label, tile in tiles:
            if tile != chosen:
                run = functools.partial(decode, tile)
                variants.append(replace(case, run=run, check=functools.partial(check, run), baseline_name="-",
                                        baseline=None, variant=label))  # fmt: skip
    return own, variants


def build_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """Every case, the decode variants last (a run cut short keeps every kernel's own row)."""
    cases, decode_variants = decode_cases(s, dtype, device)
    size = dtype.itemsize
    scale = s.head_dim**-0.5
    gqa = s.num_heads != s.num_kv_heads

    for batch, new, prefix in s.extend:
        total = prefix + new
        cache, tables, lens = _paged_cache([total] * batch, s, dtype, device)
        q = torch.randn((batch * new, s.num_heads, s.head_dim), dtype=dtype, device=device)
        qsl = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        k, v = _contiguous(cache, tables, total)
        q_sdpa = q.view(batch, new, s.num_heads, s.head_dim).transpose(1, 2).contiguous()
        mask = None
        if prefix:  # bottom-right aligned causal mask: SDPA's is_causal aligns top-left
            key_pos = torch.arange(total, device=device)
            mask = key_pos[None, :] <= key_pos[prefix:, None]
        # Causal: query i (at position prefix + i) attends prefix + i + 1 keys; 2 matmuls, 2 FLOPs/MAC.
        pairs = batch * (new * prefix + new * (new + 1) // 2)

        def extend(q=q, cache=cache, tables=tables, qsl=qsl, lens=lens, out=out, new=new):
            return K.extend_attention(q, cache[0], cache[1], tables, qsl, lens, max_query_len=new,
                                      scale=scale, out=out)  # fmt: skip

        def check(extend=extend, q=q, cache=cache, tables=tables, qsl=qsl, lens=lens):
            want = K.extend_attention_reference(q, cache[0], cache[1], tables, qsl, lens, scale=scale)
            _assert_close(extend(), want, "extend_attention")

        def sdpa(q=q_sdpa, k=k, v=v, mask=mask):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
            )

        cases.append(Case(
            "extend_attention", f"B={batch} new={new} prefix={prefix}", extend, check,
            (2 * batch * total * s.num_kv_heads + 2 * q.shape[0] * s.num_heads) * s.head_dim * size,
            4 * pairs * s.num_heads * s.head_dim, "SDPA contiguous KV", sdpa,
        ))  # fmt: skip

    t = s.tokens
    key = torch.randn((t, s.num_kv_heads, s.head_dim), dtype=dtype, device=device)
    value = torch.randn_like(key)
    num_blocks = math.ceil(t / s.block_size) + 1
    cache_shape = (2, num_blocks, s.block_size, s.num_kv_heads, s.head_dim)
    kv_cache = torch.zeros(cache_shape, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * s.block_size, device=device)[:t]

    def store():
        K.store_kv_cache(key, value, kv_cache[0], kv_cache[1], slots)

    def check_store():
        store()
        want = torch.zeros_like(kv_cache)
        K.store_kv_cache_reference(key, value, want[0], want[1], slots)
        _assert_close(kv_cache, want, "store_kv_cache")

    cases.append(Case(
        "store_kv_cache", f"T={t}", store, check_store, 4 * key.numel() * size + slots.numel() * 8, 0,
        "torch reference", lambda: K.store_kv_cache_reference(key, value, kv_cache[0], kv_cache[1], slots),
    ))  # fmt: skip

    x = torch.randn((t, s.hidden), dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(s.hidden, dtype=dtype, device=device)

    def check_rms_norm():
        got = K.rms_norm(x, weight, 1e-5, residual)
        for a, b in zip(got, K.rms_norm_reference(x, weight, 1e-5, residual), strict=True):
            _assert_close(a, b, "rms_norm")

    cases.append(Case(
        "rms_norm+residual", f"T={t} hidden={s.hidden}", lambda: K.rms_norm(x, weight, 1e-5, residual),
        check_rms_norm, 4 * x.numel() * size, 0,
        "torch reference", lambda: K.rms_norm_reference(x, weight, 1e-5, residual),
    ))  # fmt: skip

    q = torch.randn((t, s.num_heads, s.head_dim), dtype=dtype, device=device)
    k_rot = torch.randn((t, s.num_kv_heads, s.head_dim), dtype=dtype, device=device)
    cos_sin = K.rope_cos_sin_cache(s.head_dim, 8192, 500000.0, device=device)
    positions = torch.randint(0, 8192, (t,), device=device)
    cases.append(Case(
        "rotary_embedding", f"T={t} heads={s.num_heads}+{s.num_kv_heads}",
        lambda: K.rotary_embedding(q, k_rot, positions, cos_sin),
        lambda: [_assert_close(a, b, "rotary_embedding") for a, b in zip(
            K.rotary_embedding(q, k_rot, positions, cos_sin),
            K.rotary_embedding_reference(q, k_rot, positions, cos_sin), strict=True)],
        2 * (q.numel() + k_rot.numel()) * size + t * s.head_dim * 4, 0,
        "torch reference", lambda: K.rotary_embedding_reference(q, k_rot, positions, cos_sin),
    ))  # fmt: skip

    gate_up = torch.randn((t, 2 * s.intermediate), dtype=dtype, device=device)
    cases.append(Case(
        "silu_and_mul", f"T={t} I={s.intermediate}", lambda: K.silu_and_mul(gate_up),
        lambda: _assert_close(K.silu_and_mul(gate_up), K.silu_and_mul_reference(gate_up), "silu_and_mul"),
        3 * gate_up.numel() // 2 * size, 0, "torch reference", lambda: K.silu_and_mul_reference(gate_up),
    ))  # fmt: skip
    return cases + moe_cases(s, dtype, device) + decode_variants


def moe_cases(s: Shapes, dtype: torch.dtype, device: torch.device) -> list[Case]:
    """The fused MoE layer at decode batches: its floor is the bytes of the experts the batch routes to
    (each read once) plus activations; baseline, the engine's PyTorch path (one GEMM pair per expert)."""
    from engine.models.moe import grouped_experts

    e, h, inter, k = s.moe_experts, s.moe_hidden, s.moe_intermediate, s.moe_top_k
    w13 = (torch.randn((e, 2 * inter, h), device=device) * h**-0.5).to(dtype)
    w2 = (torch.randn((e, h, inter), device=device) * inter**-0.5).to(dtype)
    cases = []
    for batch in s.moe_batches:
        x = torch.randn((batch, h), device=device).to(dtype)
        weights, ids = torch.topk(torch.randn((batch, e), device=device).softmax(-1), k)
        weights = weights / weights.sum(-1, keepdim=True)
        touched = int(torch.unique(ids).numel())
        moved = touched * (3 * h * inter) * dtype.itemsize + 2 * batch * h * dtype.itemsize

        def run(x=x, weights=weights, ids=ids):
            return K.fused_moe(x, w13, w2, weights, ids)

        def check(run=run, x=x, weights=weights, ids=ids):
            _assert_close(run(), grouped_experts(x, w13, w2, weights, ids), "fused_moe")

        cases.append(Case(
            "fused_moe", f"B={batch} E={e} I={inter} top{k} ({touched} experts)", run, check, moved,
            2 * batch * k * 3 * h * inter, "grouped torch experts",
            lambda x=x, weights=weights, ids=ids: grouped_experts(x, w13, w2, weights, ids),
        ))  # fmt: skip
    return cases


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def as_graph(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """On CUDA, ``fn`` captured once into a CUDA graph (its replay as the callable); else ``fn``."""
    if device.type != "cuda":
        return fn
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as exc:
        print(f"not capturable, timed eagerly: {exc}", file=sys.stderr)
        return fn
    return graph.replay


def measure_copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second moved by a device copy (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, reps=5)
    return 2 * nbytes / (ms * 1e-3)


def measure_matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """Dense matmul FLOP/s at n x n x n."""
    a = torch.randn((n, n), dtype=dtype, device=device)
    b = torch.randn((n, n), dtype=dtype, device=device)
    ms = time_ms(lambda: torch.mm(a, b), device, reps=3)
    return 2 * n**3 / (ms * 1e-3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="toy shapes in the interpreter (no GPU needed)")
    parser.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/)")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and not K.kernels_are_interpreted()
    if not cuda and not args.smoke:
        print(
            "benchmarks/kernels.py needs a CUDA GPU: its figures are fractions of measured HBM bandwidth\n"
            "and bf16 matmul rate. Without one, `--smoke` runs toy shapes through Triton's interpreter to\n"
            "check that every case runs and matches its reference (its times are not performance figures).",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes = Shapes() if cuda and not args.smoke else SMOKE
    torch.manual_seed(0)

    copy_bw = measure_copy_bandwidth(device, 2**30 if cuda else 2**24)
    matmul_rate = measure_matmul_rate(device, dtype, 8192 if cuda else 256)
    what = machine_description(str(device))
    default_name = "kernels.json" if cuda else "kernels_smoke.json"
    out = Path(args.out or Path(__file__).parent / "results" / default_name)
    rows: list[list[Any]] = []
    records: list[dict[str, Any]] = []
    for case in build_cases(shapes, dtype, device):
        case.check()
        ms = time_ms(as_graph(case.run, device), device, reps=3)
        base_ms = time_ms(as_graph(case.baseline, device), device, reps=3) if case.baseline else None
        floor_ms = max(case.bytes_moved / copy_bw, case.flops / matmul_rate) * 1e3
        bound = "memory" if case.bytes_moved / copy_bw >= case.flops / matmul_rate else "compute"
        records.append(dict(
            kernel=case.kernel, variant=case.variant, shape=case.shape, time_us=ms * 1e3,
            floor_us=floor_ms * 1e3, bound=bound, fraction_of_floor=floor_ms / ms, bytes=case.bytes_moved,
            flops=case.flops, baseline=case.baseline_name,
            baseline_us=None if base_ms is None else base_ms * 1e3,
            speedup_vs_baseline=None if base_ms is None else base_ms / ms,
        ))  # fmt: skip
        name = case.kernel if case.variant is None else f"{case.kernel} [{case.variant}]"
        rows.append([name, case.shape, f"{ms * 1e3:.1f}", f"{floor_ms * 1e3:.1f} ({bound})",
                     f"{100 * floor_ms / ms:.0f}%", case.baseline_name,
                     "-" if base_ms is None else f"{base_ms * 1e3:.1f}",
                     "-" if base_ms is None else f"{base_ms / ms:.2f}x"])  # fmt: skip
        # Written after every case: a run stopped at its time limit keeps what it measured.
        write_json(out, dict(
            benchmark="kernels", created_at=datetime.now(UTC).isoformat(), device=what,
            interpreter=not cuda, dtype=str(dtype).removeprefix("torch."), copy_bandwidth_bytes_per_s=copy_bw,
            matmul_flops_per_s=matmul_rate, results=records,
        ))  # fmt: skip

    if not cuda:
        what += ", Triton interpreter: NOT performance figures"
    print(f"Kernels on {what}; {str(dtype).removeprefix('torch.')}")
    print(f"measured copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write), "
          f"{str(dtype).removeprefix('torch.')} matmul {matmul_rate / 1e12:.3f} TFLOP/s")  # fmt: skip
    print(format_table(["kernel", "shape", "time us", "floor us", "% of floor", "baseline", "baseline us",
                        "speedup"], rows))  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
