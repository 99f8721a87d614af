"""Every Triton kernel the engine launches, compiled ahead of time for sm_80 and sm_90 (no GPU needed).

``kernels.aot`` records each launcher's launches for the served model shapes (head dims 64 and 128,
GQA 1 to 8, block size 16, bf16 and fp16) and compiles them with Triton's ptxas. This process runs
the kernels interpreted (conftest sets ``TRITON_INTERPRET=1`` on CPU hosts), so the compiles run in a
subprocess with ``TRITON_INTERPRET=0``, once per session; the tests read its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from kernels import aot
from kernels._common import recorded_launches

ROOT = Path(__file__).resolve().parents[2]
ARCHS = (80, 90)
# One worker runs the module, so the compiles (the module-scoped fixture) run once per test run.
pytestmark = [pytest.mark.xdist_group("aot_compile"), pytest.mark.slow]


def _compiled_env() -> dict[str, str]:
    return {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kernels.aot", "--arch", *map(str, ARCHS), "--json", str(out)],
        cwd=ROOT, env=_compiled_env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert out.is_file(), f"kernels.aot wrote nothing (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


def test_every_engine_kernel_compiles_within_each_architectures_limits(compiled):
    unfit = [f"{r['kernel']} {r['shape']} {r['dtype']} sm_{r['arch']} {r['constexprs']}: {r['problems']}"
             for r in compiled if r["problems"]]  # fmt: skip
    assert not unfit, "\n".join(unfit)
    assert all(r["shared_bytes"] <= aot.SHARED_MEMORY_LIMIT[r["arch"]] for r in compiled)


def test_every_kernel_is_compiled_for_each_arch_and_dtype(compiled):
    seen = defaultdict(set)
    for r in compiled:
        seen[r["kernel"]].add((r["arch"], r["dtype"]))
    want = {(arch, dtype) for arch in ARCHS for dtype in aot.DTYPES}
    kernels = {"rms_norm", "rotary_embedding", "silu_and_mul", "store_kv_cache", "paged_decode_attention",
               "merge_splits", "extend_attention", "fused_moe", "fp8_linear", "lora_shrink",
               "lora_expand"}  # fmt: skip
    assert set(seen) == kernels
    assert all(seen[k] == want for k in kernels), dict(seen)


def test_attention_is_compiled_at_every_head_dim_group_and_split_mode(compiled):
    """Extend attention is specialised per GQA group (its tile's rows are tokens x group); decode is not:
    its tile pads every group to 16 rows, so one compile per head dim and split mode serves them all."""
    for kernel, split_modes, groups in (("paged_decode_attention", {True, False}, {None}),
                                        ("extend_attention", {None}, {1, 4, 8})):  # fmt: skip
        found = defaultdict(set)
        for r in compiled:
            if r["kernel"] == kernel:
                c = r["constexprs"]
                key = (c["HEAD_DIM"], c.get("GROUP"), c["PAGE_SIZE"], c.get("SPLIT"))
                found[(r["arch"], r["dtype"])].add(key)
        want = {(d, g, 16, s) for d in (64, 128) for g in groups for s in split_modes}
        assert all(want <= got for got in found.values()), (kernel, dict(found))
    decode = [r for r in compiled if r["kernel"] == "paged_decode_attention"
              and not r["constexprs"]["HAS_SINKS"] and not r["constexprs"]["KV_FP8"]]
    per_target = defaultdict(list)
    for r in decode:
        per_target[(r["arch"], r["dtype"], r["constexprs"]["HEAD_DIM"])].append(r)
    # The shapes (groups 1, 2, 4 and 8 at head dim 128; 1, 4 and 8 at 64), three decode specialisations
    # each (unsplit; split in 2-8; split in 16 or 32, where the split count and the log-sum-exp stride are
    # multiples of 16, which Triton specialises on): compiled three times per head dim, not 21 times.
    assert all(len(rows) == 3 for rows in per_target.values()), {k: len(v) for k, v in per_target.items()}
    pads = {r["constexprs"]["SPLITS_PAD"] for r in compiled if r["kernel"] == "merge_splits"}
    assert pads == {2, 4, 8, 16, 32}


def test_paged_decode_pipelines_k_and_v_through_one_buffer_each(compiled):
    """The launcher's 3 stages pipeline the block ids one tile ahead, and K and V through one buffer each
    (Triton spends a stage on the indirection): what benchmarks/kernels.py's deeper variants are timed
    against on a GPU."""
    for r in compiled:
        if r["kernel"] == "paged_decode_attention":
            block_n, block_d = r["constexprs"]["BLOCK_N"], r["constexprs"]["BLOCK_D"]
            element = "i8" if r["constexprs"]["KV_FP8"] else "bf16" if r["dtype"] == "bfloat16" else "f16"
            kv = f"1x{block_n}x{block_d}x{element}"
            assert sorted(r["pipeline_buffers"]) == sorted([f"1x{block_n}xi32", kv, kv]), r
            assert r["programs_per_sm"] >= 2, r


def test_decode_tile_candidates_report_their_pipeline_depth():
    """``attention_tuning --compile-only`` without a GPU: 3 and 4 stages compile to one K and one V
    buffer, 5 stages to two, 7 to three; each with how many programs one SM holds."""
    script = textwrap.dedent("""
        import json
        from benchmarks.attention_tuning import decode_compile_report, kv_tiles_in_flight
        from kernels._common import TileConfig
        rows = decode_compile_report(90, [TileConfig(16, 64, 4, s) for s in (3, 4, 5, 7)])
        print(json.dumps([[kv_tiles_in_flight(r["pipeline_buffers"], 64), r["programs_per_sm"], r["problems"]]
                          for r in rows]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_compiled_env(), capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout.splitlines()[-1])
    assert [depth for depth, _, _ in rows] == [1, 1, 2, 3]
    assert all(problems == [] and per_sm >= 2 for _, per_sm, problems in rows), rows
    # Deeper pipelines take more shared memory, so an SM holds fewer of them.
    assert rows[0][1] >= rows[2][1] >= rows[3][1]


def test_programs_per_sm_is_the_tightest_of_registers_shared_memory_and_warps():
    fields = dict(kernel="k", shape="s", dtype="bfloat16", arch=90, constexprs={}, num_stages=3)
    kib72 = 72 * 1024
    # 122 registers round up to 128 per thread: 16K per 4-warp block, 4 blocks in 64K registers.
    assert aot.CompileResult(**fields, num_warps=4, registers=122, shared_bytes=39168).programs_per_sm() == 4
    # 72 KiB of shared memory (+1 KiB reserved each): 3 blocks in 228 KiB; sm_80's 164 KiB: 2.
    assert aot.CompileResult(**fields, num_warps=4, registers=64, shared_bytes=kib72).programs_per_sm() == 3
    ampere = fields | {"arch": 80}
    assert aot.CompileResult(**ampere, num_warps=4, registers=64, shared_bytes=kib72).programs_per_sm() == 2
    # 8 warps of 32 registers: 8 blocks by registers and 64 warps by warp slots.
    assert aot.CompileResult(**fields, num_warps=8, registers=32, shared_bytes=0).programs_per_sm() == 8


def test_the_compiled_tiles_are_the_launchers_choices(compiled):
    """What was compiled is what ``decode_tile_config``/``extend_tile_config`` choose for the arch."""
    import importlib

    decode = importlib.import_module("kernels.paged_decode_attention")
    extend = importlib.import_module("kernels.extend_attention")
    choosers = {"paged_decode_attention": decode.decode_tile_config,
                "extend_attention": extend.extend_tile_config}  # fmt: skip
    for r in compiled:
        if r["kernel"] in choosers:
            c = r["constexprs"]
            dtype, capability = aot.DTYPES[r["dtype"]], divmod(r["arch"], 10)
            group = c.get("GROUP", aot.SERVED_SHAPES[r["shape"]].group)
            tile = choosers[r["kernel"]](c["HEAD_DIM"], group, dtype, capability)
            assert (r["num_warps"], r["num_stages"], c["BLOCK_N"]) == (tile.num_warps, tile.num_stages,
                                                                       tile.block_n), r  # fmt: skip
            assert c.get("BLOCK_M", c.get("GROUP_PAD")) == tile.block_m, r


def test_llama3_8b_and_qwen3_shapes_are_compiled(compiled):
    shapes = {r["shape"] for r in compiled}
    assert {"llama3-8b", "qwen3-0.6b"} <= shapes
    qk_norm_rows = [r for r in compiled if r["kernel"] == "rms_norm" and r["constexprs"]["HIDDEN"] == 128]
    assert qk_norm_rows, "Qwen3's per-head q/k RMSNorm (rows of head_dim) is not compiled"


def test_fp8_linears_compile_as_w8a8_on_hopper_and_weight_only_on_ampere(compiled):
    """sm_90 multiplies FP8 by FP8 on its tensor cores; sm_80 has no e4m3 type in Triton and decodes the
    weight's bytes itself. Both for per-channel and for 128-column block scales."""
    for arch, w8a8 in ((90, True), (80, False)):
        rows = [r["constexprs"] for r in compiled if r["kernel"] == "fp8_linear" and r["arch"] == arch]
        assert {c["W8A8"] for c in rows} == {w8a8}, (arch, rows)
        assert {c["PER_ROW"] for c in rows} == {True, False}, (arch, rows)


def test_fp8_experts_compile_for_each_arch(compiled):
    for arch in ARCHS:
        rows = [r["constexprs"] for r in compiled if r["kernel"] == "fused_moe" and r["arch"] == arch
                and r["constexprs"].get("B_FP8")]
        assert {c["PER_ROW"] for c in rows} == {False} and {c["BLOCK_M"] for c in rows} == {16, 64}, rows


def test_attention_over_an_fp8_kv_cache_compiles_for_each_arch(compiled):
    """The extend and decode kernels reading e4m3 bytes (decoded in registers, so sm_80 too), and the
    store moving them."""
    for arch in ARCHS:
        rows = [r for r in compiled if r["arch"] == arch and r["constexprs"].get("KV_FP8")]
        assert {r["kernel"] for r in rows} == {"extend_attention", "paged_decode_attention"}, (arch, rows)
        assert {r["constexprs"].get("SPLIT") for r in rows if r["kernel"] == "paged_decode_attention"} == {
            True, False}


def test_gpt_oss_attention_compiles_with_sinks_and_sliding_windows(compiled):
    """gpt-oss's layers: sinks everywhere, a sliding window every other layer, in both attention kernels
    (decode split and unsplit, and the merge that adds the sink), and its biased experts."""
    for arch in ARCHS:
        rows = [r for r in compiled if r["arch"] == arch and r["shape"] == "gpt-oss-120b"]
        extend = {r["constexprs"]["SLIDING"] for r in rows if r["kernel"] == "extend_attention"
                  and r["constexprs"]["HAS_SINKS"]}
        decode = {r["constexprs"]["SPLIT"] for r in rows if r["kernel"] == "paged_decode_attention"
                  and r["constexprs"]["HAS_SINKS"]}
        assert extend == {True, False} and decode == {True, False}, (arch, extend, decode)
        assert any(r["kernel"] == "merge_splits" and r["constexprs"]["HAS_SINKS"] for r in rows)
        assert any(r["kernel"] == "fused_moe" and r["constexprs"]["HAS_BIAS"] for r in rows)


def test_mixtures_of_experts_compile_both_grouped_gemms_at_decode_and_prefill_tiles(compiled):
    """Each MoE shape's two grouped GEMMs (gate_up over tokens, down weighted over slots), at the tile a
    decode batch gets and the one a prefill gets."""
    for shape in ("qwen3-30b-a3b", "mixtral-8x7b"):
        for arch in ARCHS:
            rows = [r["constexprs"] for r in compiled if r["kernel"] == "fused_moe" and r["arch"] == arch]
            top_k = aot.SERVED_SHAPES[shape].top_k
            assert {(c["TOP_K"], c["MUL_ROUTED_WEIGHT"], c["BLOCK_M"]) for c in rows} >= {
                (top_k, False, 16), (top_k, False, 64), (1, True, 16), (1, True, 64)}, (shape, arch, rows)


def test_recorded_launches_run_nothing_and_follow_the_recording_arch():
    """Under ``recorded_launches`` the launchers validate and choose as usual but launch nothing."""
    shape = aot.SERVED_SHAPES["llama3-8b"]

    def extend_warps(arch: int) -> int:
        launches = aot.engine_launches(shape, torch.float16, arch=arch)
        names = [launch.kernel.fn.__name__ for launch in launches]
        assert "_paged_decode_attention_kernel" in names
        return launches[names.index("_extend_attention_kernel")].kwargs["num_warps"]

    assert (extend_warps(80), extend_warps(90)) == (8, 4)  # head_dim 128: see extend_tile_config
    out = torch.full((2, 8), 7.0)
    with recorded_launches() as recorded:
        import kernels

        kernels.silu_and_mul(torch.ones((2, 16)), out=out)
    assert len(recorded) == 1 and recorded[0].grid[0] == 2
    assert torch.equal(out, torch.full((2, 8), 7.0))


def test_launcher_checks_still_apply_while_recording():
    import kernels

    with recorded_launches(), pytest.raises(ValueError, match="slot_mapping"):
        cache = torch.empty((4, 16, 2, 64))
        kernels.store_kv_cache(torch.empty((3, 2, 64)), torch.empty((3, 2, 64)), cache, cache.clone(),
                               torch.zeros(2, dtype=torch.int64))  # fmt: skip


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        (dict(shared_bytes=228 * 1024), "shared memory"),
        (dict(registers=168, num_warps=16), "registers x 512 threads"),
        (dict(spill_stores=72, spill_loads=68), "register spills"),
        (dict(error="CompilationError: at 3:4"), "does not compile"),
    ],
)
def test_compile_results_outside_the_targets_limits_are_reported(result, problem):
    fields = dict(kernel="k", shape="s", dtype="bfloat16", arch=90, constexprs={}, num_warps=4, num_stages=3)
    assert any(problem in p for p in aot.CompileResult(**(fields | result)).problems())
    assert aot.CompileResult(**fields, shared_bytes=227 * 1024, registers=128).problems() == []


def test_a_kernel_that_does_not_compile_for_sm90_is_reported(tmp_path):
    """The pipeline the suite relies on sees a compile error (here: a shape mismatch in ``tl.dot``)."""
    (tmp_path / "broken_kernel.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def broken(x_ptr, BLOCK: tl.constexpr):
            a = tl.load(x_ptr + tl.arange(0, BLOCK)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :])
            b = tl.load(x_ptr + tl.arange(0, BLOCK))
            tl.store(x_ptr + tl.arange(0, BLOCK), tl.sum(tl.dot(a, b), axis=0))
    """))
    script = textwrap.dedent("""
        import sys, torch
        import triton  # before kernels: compiled, not interpreted
        from broken_kernel import broken
        from kernels import aot
        from kernels._common import Launch
        result = aot.compile_launch(Launch(broken, (1,), (torch.empty(256),), {"BLOCK": 16}), 90)
        print(result.problems())
        sys.exit(0 if result.problems() else 1)
    """)
    env = _compiled_env() | {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "does not compile" in proc.stdout


def test_the_ptxas_report_is_tritons_own_and_is_kept_for_cache_hits(tmp_path):
    """A compile reads the register report from the ptxas run Triton makes anyway; a later compile of the
    same kernel (a cache hit: no ptxas at all) reads the report kept beside the cubin. Both equal what
    ptxas ``-v`` says about the PTX on its own. A cached kernel without a kept report is assembled again."""
    (tmp_path / "add_kernel.py").write_text(textwrap.dedent("""
        import triton
        import triton.language as tl

        @triton.jit
        def add(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + offs, mask=offs < n)
            tl.store(y_ptr + offs, tl.exp(x) * x + 1.0, mask=offs < n)
    """))
    script = textwrap.dedent("""
        import glob, json, os, torch
        import triton  # before kernels: compiled, not interpreted
        from add_kernel import add
        from kernels import aot
        from kernels._common import Launch

        launch = Launch(add, (1,), (torch.empty(4096), torch.empty(4096), 4096), {"BLOCK": 1024})
        reference = aot.ptxas_report
        first = aot.compile_launch(launch, 90)
        kept = glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "ptxas-report.json"))
        calls = []
        aot.ptxas_report = lambda ptx, arch: calls.append(arch) or reference(ptx, arch)
        hit = aot.compile_launch(launch, 90)
        ran_on_hit = len(calls)
        os.remove(kept[0])
        restored = aot.compile_launch(launch, 90)
        ptx = glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.ptx"))[0]
        expected = reference(open(ptx).read(), 90)
        print(json.dumps(dict(first=[first.registers, first.spill_stores, first.spill_loads],
                              hit=[hit.registers, hit.spill_stores, hit.spill_loads],
                              restored=[restored.registers, restored.spill_stores, restored.spill_loads],
                              expected=list(expected), kept=len(kept), ran_on_hit=ran_on_hit,
                              ran_after_removal=len(calls) - ran_on_hit, problems=first.problems())))
    """)
    env = _compiled_env() | {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}",
                             "TRITON_CACHE_DIR": str(tmp_path / "cache")}  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["expected"][0] > 0 and found["problems"] == []
    assert found["first"] == found["hit"] == found["restored"] == found["expected"]
    assert found["kept"] == 1 and found["ran_on_hit"] == 0 and found["ran_after_removal"] == 1
