"""Ahead-of-time compilation of the engine's Triton kernels for NVIDIA GPUs, on a machine without one.

``triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32))``
lowers a kernel to PTX and assembles it with the ``ptxas`` that Triton ships; no GPU or driver is
involved. What this module adds is *which* specialisations to compile: it calls every launcher the way
the engine's forward pass does (``store_kv_cache``, ``paged_decode_attention`` at every split count the
engine can choose, ``extend_attention``, ``rms_norm`` with and without the fused residual and over
head rows for q/k-norm, ``rotary_embedding``, ``silu_and_mul``, and ``fused_moe``'s grouped GEMMs for
the mixtures of experts) on CPU tensors laid out as the engine
lays them out (q/k/v views of one qkv projection, a ``[2, blocks, 16, kv_heads, head_dim]`` cache),
under :func:`kernels._common.recorded_launches`. The launchers' own checks and choice functions
(``decode_tile_config``, ``extend_tile_config``, block sizes, ``num_warps``) therefore decide what is
compiled: a change to a launcher is compiled too. Each recorded launch is bound with Triton's own JIT
binder for the target backend, which yields the signature, constexprs, divisibility attributes and
options that a real launch of those tensors would compile with.

Each compile is checked against the target's limits: dynamic shared memory within what one block may
use (:data:`SHARED_MEMORY_LIMIT`), registers per thread within 255 and per block within the SM's 64K,
and no register spills (ptxas's ``-v`` report, as Triton's own ``ptxas`` run writes it: its log is read
when Triton compiles, and kept beside the cubin in Triton's cache for later hits; ``ptxas`` runs again on
the PTX only for a cached kernel compiled before that report was kept).

It must run where Triton compiles rather than interprets: on a host without CUDA, ``kernels`` turns the
interpreter on unless ``TRITON_INTERPRET`` is already set, so set it to 0 (``tests/kernels`` run
interpreted, so ``tests/kernels/test_aot_compile.py`` runs this in a subprocess):

    TRITON_INTERPRET=0 python -m kernels.aot            # every served shape, sm_80 + sm_90, bf16 + fp16
    TRITON_INTERPRET=0 python -m kernels.aot --arch 90 --dtype bfloat16 --shape llama3-8b --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

# Maximum dynamic shared memory one block may opt into (bytes): CUDA C Programming Guide, table of
# compute capabilities ("maximum amount of shared memory per thread block").
SHARED_MEMORY_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
# Shared memory of one SM, of which the driver reserves 1 KiB per resident block, and warps per SM
# (same table: "maximum amount of shared memory per SM", "maximum number of resident warps per SM").
SHARED_MEMORY_PER_SM = {80: 164 * 1024, 86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}
WARPS_PER_SM = {80: 64, 86: 48, 89: 48, 90: 64}
REGISTERS_PER_THREAD = 255
REGISTERS_PER_BLOCK = 64 * 1024
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16  # the engine's KV block size
# Split counts paged decode may be launched with: 1 (unsplit), then one per merge-kernel
# specialisation (SPLITS_PAD = next power of 2) up to the launcher's maximum, plus a count that is a
# multiple of 16 (Triton specialises integer arguments divisible by 16).
DECODE_SPLITS = (1, 2, 3, 4, 8, 16, 32)


@dataclass(frozen=True)
class ServedShape:
    """The dimensions of a served model that the kernels are specialised on (from its config.json)."""

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    qk_norm: bool = False  # Qwen3's per-head RMSNorm of q and k
    # Mixtures of experts (engine/models/moe.py): experts per layer, experts per token, each expert's
    # intermediate size. 0 experts: a dense model.
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    # gpt-oss: attention sinks and sliding-window layers (beside full ones), biased experts.
    sliding_window: int = 0
    attention_sinks: bool = False
    expert_bias: bool = False
    # FP8 linear layers (engine.models.fp8): "channel" (per-channel / per-tensor scales) or "block" (128).
    fp8: str = ""
    kv_fp8: bool = False  # --kv-cache-dtype fp8: the attention kernels read e4m3 bytes

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


# Head dims 64 and 128 at GQA ratios 1, 2, 4 and 8, each the shape of a published checkpoint.
SERVED_SHAPES = {
    s.name: s
    for s in (
        ServedShape("llama3-8b", 32, 8, 128, 4096, 14336),
        ServedShape("qwen3-0.6b", 16, 8, 128, 1024, 3072, qk_norm=True),
        ServedShape("qwen3-32b", 64, 8, 128, 5120, 25600, qk_norm=True),
        ServedShape("llama2-7b", 32, 32, 128, 4096, 11008),
        ServedShape("llama3.2-1b", 32, 8, 64, 2048, 8192),
        ServedShape("tinyllama-1.1b", 32, 4, 64, 2048, 5632),
        ServedShape("qwen1.5-0.5b", 16, 16, 64, 1024, 2816),
        ServedShape("qwen3-30b-a3b", 32, 4, 128, 2048, 6144, qk_norm=True, num_experts=128, top_k=8,
                    moe_intermediate_size=768),
        ServedShape("mixtral-8x7b", 32, 8, 128, 4096, 14336, num_experts=8, top_k=2,
                    moe_intermediate_size=14336),
        ServedShape("gpt-oss-120b", 64, 8, 64, 2880, 2880, num_experts=128, top_k=4,
                    moe_intermediate_size=2880, sliding_window=128, attention_sinks=True, expert_bias=True),
        ServedShape("llama3-8b-fp8", 32, 8, 128, 4096, 14336, fp8="channel", kv_fp8=True),
        # Block FP8 for the dense linears (attention) and the experts alike.
        ServedShape("qwen3-30b-a3b-fp8-block", 32, 4, 128, 2048, 6144, qk_norm=True, num_experts=128, top_k=8,
                    moe_intermediate_size=768, fp8="block"),
    )
}


@dataclass
class CompileResult:
    kernel: str
    shape: str
    dtype: str
    arch: int
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    shared_bytes: int = 0
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    seconds: float = 0.0
    error: str | None = None
    # Shared-memory buffers Triton's software pipeliner allocated for the loads of the kernel's loops,
    # as "depth x tile x dtype" (e.g. "2x64x128xbf16": two buffers of a 64 x 128 tile, one loading while
    # the loop computes on the other).
    pipeline_buffers: list[str] = field(default_factory=list)

    def programs_per_sm(self) -> int:
        """How many programs of this compile one SM holds at once: the least of what its registers
        (allocated 256 per warp at a time), shared memory and warp slots allow."""
        per_warp = math.ceil(self.registers * 32 / 256) * 256
        by_registers = REGISTERS_PER_BLOCK // max(1, per_warp * self.num_warps)
        by_shared = SHARED_MEMORY_PER_SM[self.arch] // (self.shared_bytes + 1024)
        return min(by_registers, by_shared, WARPS_PER_SM[self.arch] // self.num_warps)

    def problems(self) -> list[str]:
        """What is wrong with this compile for its target (empty when it is fit to launch)."""
        if self.error is not None:
            return [f"does not compile: {self.error}"]
        found = []
        limit = SHARED_MEMORY_LIMIT[self.arch]
        if self.shared_bytes > limit:
            found.append(f"shared memory {self.shared_bytes} B > sm_{self.arch}'s {limit} B")
        if self.registers > REGISTERS_PER_THREAD:
            found.append(f"{self.registers} registers per thread > {REGISTERS_PER_THREAD}")
        if self.registers * self.num_warps * 32 > REGISTERS_PER_BLOCK:
            threads = self.num_warps * 32
            found.append(f"{self.registers} registers x {threads} threads > {REGISTERS_PER_BLOCK}")
        if self.spill_stores or self.spill_loads:
            found.append(f"register spills: {self.spill_stores} B stored, {self.spill_loads} B loaded")
        return found

    def label(self) -> str:
        consts = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        return f"{self.kernel}[{consts}] {self.shape} {self.dtype} sm_{self.arch}"


def require_compiled_triton() -> None:
    """Refuse to run in a process whose kernels are interpreted (nothing would be compiled)."""
    from kernels._common import kernels_are_interpreted

    if kernels_are_interpreted():
        raise RuntimeError(
            "kernels.aot needs Triton's compiler, but this process interprets the kernels "
            "(TRITON_INTERPRET=1 when triton was imported); run it in a process with TRITON_INTERPRET=0"
        )


def engine_launches(shape: ServedShape, dtype: torch.dtype, arch: int = 90) -> list[Any]:
    """Every distinct launch the engine's forward makes for ``shape`` in ``dtype`` on an ``sm_{arch}``
    GPU, recorded from the launchers themselves (a decode step at each split count, a prefill/extend
    step)."""
    import kernels
    from kernels._common import recorded_launches

    h, kvh, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    tokens, seqs, context, max_positions = 5, 3, 100, 4096
    eps, scale = 1e-6, d**-0.5

    def qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # As the model's attention: views of one fused projection, split then viewed per head.
        q, k, v = torch.empty((n, (h + 2 * kvh) * d), dtype=dtype).split([h * d, kvh * d, kvh * d], dim=-1)
        return q.view(n, h, d), k.view(n, kvh, d), v.view(n, kvh, d)

    blocks_per_seq = math.ceil(context / BLOCK_SIZE)
    kv_cache = torch.empty((2, seqs * blocks_per_seq + 1, BLOCK_SIZE, kvh, d), dtype=dtype)
    block_tables = torch.arange(seqs * blocks_per_seq, dtype=torch.int32).view(seqs, blocks_per_seq)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    cos_sin = kernels.rope_cos_sin_cache(d, max_positions, 10000.0)  # float32, as the engine keeps it
    with recorded_launches(capability=divmod(arch, 10)) as launches:
        x = torch.empty((tokens, shape.hidden_size), dtype=dtype)
        residual = torch.empty_like(x)
        weight = torch.empty(shape.hidden_size, dtype=dtype)
        kernels.rms_norm(x, weight, eps)
        kernels.rms_norm(x, weight, eps, residual)
        q, k, v = qkv(tokens)
        if shape.qk_norm:
            head_weight = torch.empty(d, dtype=dtype)
            q = kernels.rms_norm(q.reshape(-1, d), head_weight, eps).view(tokens, h, d)
            k = kernels.rms_norm(k.reshape(-1, d), head_weight, eps).view(tokens, kvh, d)
        kernels.rotary_embedding(q, k, torch.arange(tokens, dtype=torch.int64), cos_sin)
        kernels.store_kv_cache(k, v, kv_cache[0], kv_cache[1], torch.arange(tokens, dtype=torch.int64))
        # Prefill / chunked prefill / mixed steps: the extend kernel over the paged context.
        query_start_loc = torch.tensor([0, 2, 4, tokens], dtype=torch.int32)
        kernels.extend_attention(q, kv_cache[0], kv_cache[1], block_tables, query_start_loc, seq_lens,
                                 max_query_len=2, scale=scale)  # fmt: skip
        # Decode steps: one query token per sequence, at every split count.
        q, _, _ = qkv(seqs)
        for splits in DECODE_SPLITS:
            kernels.paged_decode_attention(q, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale=scale,
                                           max_seq_len=context, num_splits=splits)  # fmt: skip
        if shape.attention_sinks or shape.sliding_window:
            # gpt-oss's layers: sinks on every layer, a window on every other one.
            sinks = torch.empty(h, dtype=torch.float32) if shape.attention_sinks else None
            for window in {shape.sliding_window or None, None}:
                q, _, _ = qkv(tokens)
                kernels.extend_attention(q, kv_cache[0], kv_cache[1], block_tables, query_start_loc, seq_lens,
                                         max_query_len=2, scale=scale, sinks=sinks, window=window)
                q, _, _ = qkv(seqs)
                for splits in (1, 4):
                    kernels.paged_decode_attention(q, kv_cache[0], kv_cache[1], block_tables, seq_lens,
                                                   scale=scale, max_seq_len=context, num_splits=splits,
                                                   sinks=sinks, window=window)
        kernels.silu_and_mul(torch.empty((tokens, 2 * shape.intermediate_size), dtype=dtype))
        lora_launches(shape, dtype, tokens)
        if shape.kv_fp8:
            fp8_cache = torch.empty(kv_cache.shape, dtype=torch.float8_e4m3fn)
            q, k, v = qkv(tokens)
            kernels.store_kv_cache(k, v, fp8_cache[0], fp8_cache[1], torch.arange(tokens, dtype=torch.int64))
            kernels.extend_attention(q, fp8_cache[0], fp8_cache[1], block_tables, query_start_loc, seq_lens,
                                     max_query_len=2, scale=scale, kv_scale=(0.5, 0.5))
            q, _, _ = qkv(seqs)
            for splits in (1, 4):
                kernels.paged_decode_attention(q, fp8_cache[0], fp8_cache[1], block_tables, seq_lens,
                                               scale=scale, max_seq_len=context, num_splits=splits,
                                               kv_scale=(0.5, 0.5))
        if shape.fp8:
            # Every FP8 linear of a layer at a decode batch and a prefill chunk (W8A8 on sm_89+,
            # weight-only before).
            hidden, inter = shape.hidden_size, shape.intermediate_size
            for n_out, k_in in ((h * d + 2 * kvh * d, hidden), (hidden, h * d), (2 * inter, hidden),
                                (hidden, inter)):
                groups = 1 if shape.fp8 == "channel" else -(-k_in // 128)
                weight = torch.empty((n_out, k_in), dtype=torch.float8_e4m3fn)
                for m in (seqs, 512):
                    kernels.fp8_linear(torch.empty((m, k_in), dtype=dtype), weight,
                                       torch.empty((n_out, groups), dtype=torch.float32))
        if shape.num_experts:
            # The grouped GEMMs at a decode batch and at a prefill's token count (their tiles differ).
            e, inter = shape.num_experts, shape.moe_intermediate_size
            w13 = torch.empty((e, 2 * inter, shape.hidden_size), dtype=dtype)
            w2 = torch.empty((e, shape.hidden_size, inter), dtype=dtype)
            w13_scale: torch.Tensor | None = None
            w2_scale: torch.Tensor | None = None
            w13_bias: torch.Tensor | None = None
            w2_bias: torch.Tensor | None = None
            if shape.fp8:  # FP8 experts: e4m3 weights with row scales (per channel, or 128-column blocks)
                w13 = torch.empty((e, 2 * inter, shape.hidden_size), dtype=torch.float8_e4m3fn)
                w2 = torch.empty((e, shape.hidden_size, inter), dtype=torch.float8_e4m3fn)
                g13 = 1 if shape.fp8 == "channel" else -(-shape.hidden_size // 128)
                g2 = 1 if shape.fp8 == "channel" else -(-inter // 128)
                w13_scale = torch.empty((e, 2 * inter, g13), dtype=torch.float32)
                w2_scale = torch.empty((e, shape.hidden_size, g2), dtype=torch.float32)
            if shape.expert_bias:  # gpt-oss's experts (16-bit here: MXFP4 is dequantized at load)
                w13_bias = torch.empty((e, 2 * inter), dtype=dtype)
                w2_bias = torch.empty((e, shape.hidden_size), dtype=dtype)
            activation = "swiglu_oai" if shape.expert_bias else "silu"
            for n in (seqs, 512):
                ids = torch.arange(n * shape.top_k, dtype=torch.int64).remainder(e).view(n, shape.top_k)
                kernels.fused_moe(torch.empty((n, shape.hidden_size), dtype=dtype), w13, w2,
                                  torch.empty((n, shape.top_k), dtype=torch.float32), ids, w13_bias=w13_bias,
                                  w2_bias=w2_bias, activation=activation, w13_scale=w13_scale,
                                  w2_scale=w2_scale)
    return launches


def lora_launches(shape: ServedShape, dtype: torch.dtype, tokens: int = 5) -> None:
    """LoRA's shrink and expand on every projection ``engine.lora.layers`` wraps (fused q/k/v and gate/up
    with a rank block per part; attention only on a mixture of experts), two adapters' groups of tokens,
    ranks up to 16 and 64 (their tiles differ). Launched as the engine launches them; record them with
    :func:`kernels._common.recorded_launches`."""
    import kernels

    h, kvh, d, hidden = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.hidden_size
    inter = shape.intermediate_size
    projections = [((h * d, kvh * d, kvh * d), hidden), ((hidden,), h * d)]  # (parts' widths, in)
    if not shape.num_experts:
        projections += [((inter, inter), hidden), ((hidden,), inter)]
    rows = torch.arange(tokens, dtype=torch.int64)
    starts = torch.tensor([0, 2, tokens], dtype=torch.int64)
    slots = torch.tensor([1, 3], dtype=torch.int64)
    ranks = torch.tensor([0, 8, 0, 16, 0], dtype=torch.int32)
    for max_rank in (16, 64):
        for widths, k_in in projections:
            parts, n_out = len(widths), sum(widths)
            bounds = tuple(sum(widths[:i]) for i in range(1, parts))
            a = torch.empty((5, parts * max_rank, k_in), dtype=dtype)
            b = torch.empty((5, n_out, parts * max_rank), dtype=dtype)
            shrunk = kernels.lora_shrink(torch.empty((tokens, k_in), dtype=dtype), a, rows, starts, slots, 3,
                                         ranks=ranks, rank_stride=max_rank)
            kernels.lora_expand(shrunk, b, rows, starts, slots, 3, torch.empty((tokens, n_out), dtype=dtype),
                                ranks=ranks, rank_stride=max_rank, part_bounds=bounds)


def _bind(launch: Any, backend: Any) -> tuple[Any, dict, dict, dict]:
    """What Triton's JIT would compile for this launch on ``backend``'s target: options, signature,
    constexprs and attributes, from its own binder (the one ``kernel[grid](...)`` runs)."""
    from triton.runtime.jit import create_function_from_signature

    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return kernel._pack_args(backend, launch.kwargs, bound, specialization, options)


# A shared-memory allocation with no initial value, written by asynchronous copies: a pipeline buffer.
_PIPELINE_BUFFER = re.compile(r"ttg\.local_alloc : \(\) -> !ttg\.memdesc<([0-9x]+x[a-z0-9]+),")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas_log(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas ``-v``'s report."""
    registers = max((int(n) for n in _PTXAS_REGISTERS.findall(log)), default=0)
    spills = [(int(a), int(b)) for a, b in _PTXAS_SPILLS.findall(log)]
    return registers, sum(a for a, _ in spills), sum(b for _, b in spills)


def ptxas_report(ptx: str, arch: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from ptxas ``-v`` on ``ptx``, assembled with
    the flags Triton's CUDA backend uses."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
               f"--gpu-name={sm_arch_from_capability(arch)}", src,
               "-o", os.path.join(tmp, "kernel.cubin")]  # fmt: skip
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    return parse_ptxas_log(log)


_REPORT_FILE = "ptxas-report.json"


def _compile_with_report(src: Any, target: Any, options: dict[str, Any]) -> tuple[Any, tuple[int, int, int]]:
    """``triton.compile`` and the ``ptxas -v`` report of the cubin it returns.

    A compile prints ptxas's log when ``TRITON_DUMP_PTXAS_LOG`` is on (a knob outside the cache key), so
    the report costs nothing extra; it is stored in the kernel's cache directory, because a cache hit
    runs no ptxas."""
    import triton
    from triton import knobs
    from triton.runtime.cache import get_cache_manager

    printed = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(printed):
        knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(src, target=target, options=options)
    cache = get_cache_manager(compiled.hash)
    if _PTXAS_REGISTERS.search(printed.getvalue()):
        report = parse_ptxas_log(printed.getvalue())
    else:
        stored = cache.get_file(_REPORT_FILE)
        if stored is not None:
            with open(stored) as f:
                return compiled, tuple(json.load(f))
        report = ptxas_report(compiled.asm["ptx"], target.arch)
    cache.put(json.dumps(report), _REPORT_FILE, binary=False)
    return compiled, report


def compile_launch(launch: Any, arch: int, *, shape: str = "", dtype: str = "") -> CompileResult:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    options, signature, constexprs, attrs = _bind(launch, backend)
    named = {launch.kernel.arg_names[path[0]]: value for path, value in constexprs.items() if len(path) == 1}
    shown = {k: v for k, v in named.items() if k in launch.kwargs}
    name = launch.kernel.fn.__name__.strip("_").removesuffix("_kernel")
    result = CompileResult(kernel=name, shape=shape, dtype=dtype, arch=arch, constexprs=shown,
                           num_warps=options.num_warps, num_stages=options.num_stages)  # fmt: skip
    start = time.perf_counter()
    try:
        compiled, report = _compile_with_report(ASTSource(launch.kernel, signature, constexprs, attrs),
                                                target, options.__dict__)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - a compile error is this result's finding
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        # Triton's CompilationError: "at LINE:COL:", the source, then the cause on the last line.
        result.error = f"{type(exc).__name__}: {lines[0]} {lines[-1] if len(lines) > 1 else ''}".strip()
        return result
    result.shared_bytes = int(compiled.metadata.shared)
    result.pipeline_buffers = _PIPELINE_BUFFER.findall(compiled.asm.get("ttgir", ""))
    result.registers, result.spill_stores, result.spill_loads = report
    result.seconds = time.perf_counter() - start
    return result


def _launch_key(launch: Any, arch: int) -> str:
    """Identity of what a launch compiles to, so identical specialisations compile once."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    options, signature, constexprs, attrs = _bind(launch, make_backend(GPUTarget("cuda", arch, 32)))
    return repr((launch.kernel.fn.__qualname__, signature, sorted(constexprs.items()), sorted(attrs.items()),
                 sorted(options.__dict__.items())))  # fmt: skip


def compile_all(
    shapes: Iterable[ServedShape], dtypes: Iterable[str], archs: Iterable[int]
) -> list[CompileResult]:
    """Every distinct specialisation the engine launches for ``shapes`` x ``dtypes``, compiled for each
    arch (a specialisation shared by two shapes is compiled once, under the first shape's name)."""
    require_compiled_triton()
    results, seen = [], set()
    for arch in archs:
        for shape in shapes:
            for dtype in dtypes:
                for launch in engine_launches(shape, DTYPES[dtype], arch):
                    key = _launch_key(launch, arch)
                    if key not in seen:
                        seen.add(key)
                        results.append(compile_launch(launch, arch, shape=shape.name, dtype=dtype))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(SHARED_MEMORY_LIMIT))
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--shape", nargs="+", default=list(SERVED_SHAPES), choices=list(SERVED_SHAPES))
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = compile_all([SERVED_SHAPES[s] for s in args.shape], args.dtype, args.arch)
    failed = [r for r in results if r.problems()]
    for r in results:
        status = "; ".join(r.problems()) or "ok"
        print(f"{r.label()}: warps={r.num_warps} stages={r.num_stages} smem={r.shared_bytes / 1024:.0f}KiB "
              f"regs={r.registers} {r.seconds:.1f}s {status}")  # fmt: skip
    print(f"{len(results)} specialisations compiled, {len(failed)} unfit to launch")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) | {"problems": r.problems(),
                                    "programs_per_sm": 0 if r.problems() else r.programs_per_sm()}
                       for r in results], f, indent=1)  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
