"""LoRA shrink/expand (``kernels.lora``) vs their PyTorch references, and the engine's LoRA projection on
the kernels vs its PyTorch path: odd shapes, tokens of several adapters interleaved with base-model tokens
(which no program may touch), float32 and float16 (the interpreter cannot emulate bfloat16: that runs in
``test_bf16_on_a_gpu``, skipped without CUDA). Shapes are tiny: the interpreter runs one program at a
time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels as K
from engine.lora.layers import LoRASlots, install
from kernels._common import kernels_are_interpreted

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.float16]


def _groups(token_slots: list[int], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(rows, starts, slots) of a step whose token ``t`` uses slot ``token_slots[t]`` (0: the base)."""
    order = [t for t in sorted(range(len(token_slots)), key=lambda t: token_slots[t]) if token_slots[t]]
    ids = sorted({s for s in token_slots if s})
    starts = [0]
    for s in ids:
        starts.append(starts[-1] + sum(1 for t in order if token_slots[t] == s))
    as_tensor = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return as_tensor(order), as_tensor(starts), as_tensor(ids)


def _token_slots(num_tokens: int, num_slots: int, rng: torch.Generator) -> list[int]:
    slots = torch.randint(0, num_slots + 1, (num_tokens,), generator=rng).tolist()
    slots[0], slots[-1] = 0, num_slots  # a base-model token and the last slot, always
    return slots


@pytest.mark.parametrize(("tokens", "hidden", "rank", "width", "slots"),
                         [(1, 16, 8, 24, 1), (21, 40, 12, 72, 3), (37, 130, 48, 200, 2)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_shrink_then_expand_match_the_references(tokens, hidden, rank, width, slots, dtype, device, rng):
    token_slots = _token_slots(tokens, slots, rng)
    rows, starts, ids = _groups(token_slots, device)
    max_rows = int((starts[1:] - starts[:-1]).max())
    x = torch.randn((tokens, hidden), generator=rng).to(dtype).to(device)
    a = (torch.randn((slots + 1, rank, hidden), generator=rng) / hidden**0.5).to(dtype).to(device)
    b = torch.randn((slots + 1, width, rank), generator=rng).to(dtype).to(device)
    scaling = torch.rand(slots + 1, generator=rng).to(device) + 0.5
    before = dict(K.launch_counts)
    h = K.lora_shrink(x, a, rows, starts, ids, max_rows)
    torch.testing.assert_close(h, K.lora_shrink_reference(x, a, rows, starts, ids), **TOL[dtype])
    y = torch.randn((tokens, width), generator=rng).to(dtype).to(device)
    base_rows = y[[t for t, s in enumerate(token_slots) if s == 0]].clone()
    expected = K.lora_expand_reference(h, b, rows, starts, ids, y, scaling)
    assert K.lora_expand(h, b, rows, starts, ids, max_rows, y, scaling) is y
    torch.testing.assert_close(y, expected, **TOL[dtype])
    assert torch.equal(y[[t for t, s in enumerate(token_slots) if s == 0]], base_rows)  # never touched
    assert K.launch_counts["lora_shrink"] == before.get("lora_shrink", 0) + 1
    assert K.launch_counts["lora_expand"] == before.get("lora_expand", 0) + 1


@pytest.mark.parametrize(("tokens", "stride", "widths"),
                         [(9, 8, (40, 16, 16)), (23, 16, (24, 40)), (5, 12, (30,))])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_a_fused_projections_layout_reads_only_its_blocks(tokens, stride, widths, dtype, device, rng):
    """Rank rows in blocks of ``stride`` (one per part), each slot reading only its rank's first rows of a
    block, and each part's output columns only its own block of B: what lies outside (random here, zero
    in the engine) is never read."""
    slots = 3
    token_slots = _token_slots(tokens, slots, rng)
    rows, starts, ids = _groups(token_slots, device)
    max_rows = int((starts[1:] - starts[:-1]).max())
    hidden, total, width = 33, stride * len(widths), sum(widths)
    bounds = tuple(int(c) for c in np.cumsum(widths)[:-1])
    ranks = torch.randint(1, stride + 1, (slots + 1,), generator=rng).to(device)
    x = torch.randn((tokens, hidden), generator=rng).to(dtype).to(device)
    a = (torch.randn((slots + 1, total, hidden), generator=rng) / hidden**0.5).to(dtype).to(device)
    b = torch.randn((slots + 1, width, total), generator=rng).to(dtype).to(device)
    layout = dict(ranks=ranks, rank_stride=stride)
    h = K.lora_shrink(x, a, rows, starts, ids, max_rows, **layout)
    torch.testing.assert_close(h, K.lora_shrink_reference(x, a, rows, starts, ids, **layout), **TOL[dtype])
    y = torch.randn((tokens, width), generator=rng).to(dtype).to(device)
    expected = K.lora_expand_reference(h, b, rows, starts, ids, y, part_bounds=bounds, **layout)
    K.lora_expand(h, b, rows, starts, ids, max_rows, y, part_bounds=bounds, **layout)
    torch.testing.assert_close(y, expected, **TOL[dtype])
    whole = K.lora_expand_reference(h, b, rows, starts, ids, y.clone())  # every row of B: not the same
    assert not torch.allclose(whole, expected, **TOL[dtype])


def test_no_grouped_token_launches_nothing(device):
    x, a = torch.randn((3, 16), device=device), torch.randn((2, 8, 16), device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    before = K.launch_counts["lora_shrink"]
    h = K.lora_shrink(x, a, empty, torch.zeros(1, dtype=torch.int64, device=device), empty, 0)
    assert h.shape == (0, 8) and K.launch_counts["lora_shrink"] == before


def test_rejects_bad_inputs(device):
    rows, starts, ids = _groups([1, 0, 1], device)
    x, a = torch.randn((3, 16), device=device), torch.randn((2, 8, 16), device=device)
    with pytest.raises(ValueError, match="input width"):
        K.lora_shrink(x, torch.randn((2, 8, 12), device=device), rows, starts, ids, 2)
    with pytest.raises(TypeError, match="a must have dtype"):
        K.lora_shrink(x, a.half(), rows, starts, ids, 2)
    with pytest.raises(ValueError, match="starts must have one entry more"):
        K.lora_shrink(x, a, rows, starts[:1], ids, 2)
    h = torch.randn((2, 8), device=device)
    with pytest.raises(ValueError, match="output width"):
        K.lora_expand(h, torch.randn((2, 5, 8), device=device), rows, starts, ids, 2, torch.randn((3, 6),
                                                                                            device=device))


class _Layer(torch.nn.Module):
    """One decoder layer's projections as ``install`` walks them: fused qkv, o, fused gate/up, down."""

    def __init__(self, hidden: int, q: int, kv: int, inter: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        attn, mlp = torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = torch.nn.Linear(hidden, q + 2 * kv, dtype=dtype, device=device)
        attn.o_proj = torch.nn.Linear(q, hidden, dtype=dtype, device=device)
        mlp.gate_up_proj = torch.nn.Linear(hidden, 2 * inter, dtype=dtype, device=device)
        mlp.down_proj = torch.nn.Linear(inter, hidden, dtype=dtype, device=device)
        layer = torch.nn.Module()
        layer.self_attn, layer.mlp = attn, mlp
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_the_engine_projection_on_the_kernels_equals_its_torch_path(dtype, device, rng):
    """``LoRALinear`` with ``use_kernels`` (the CUDA path) against the batched PyTorch path, on the fused
    q/k/v and gate/up parts and o and down, adapters of different ranks that leave parts out, three slots
    and base tokens in one pass."""
    from engine.lora.adapter import LoRAAdapter
    from engine.models.config import ModelArgs

    args = ModelArgs(architecture="LlamaForCausalLM", model_type="llama", vocab_size=32, hidden_size=24,
                     intermediate_size=40, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4,
                     max_position_embeddings=32)  # fmt: skip
    q, kv, inter = 16, 8, 40
    model = _Layer(24, q, kv, inter, dtype, device)
    shapes = {"q_proj": (24, q), "k_proj": (24, kv), "v_proj": (24, kv), "o_proj": (q, 24),
              "gate_proj": (24, inter), "up_proj": (24, inter), "down_proj": (inter, 24)}
    adapters = []
    for i, (rank, targets) in enumerate([(2, ("q_proj", "v_proj", "up_proj")), (4, tuple(shapes)),
                                         (3, ("o_proj", "gate_proj", "down_proj"))]):
        weights = {m: (torch.randn((rank, shapes[m][0]), generator=rng),
                       torch.randn((shapes[m][1], rank), generator=rng)) for m in targets}
        adapters.append(LoRAAdapter(rank, 0.5 + i, targets, f"digest{i}", {0: weights}))
    token_slots = np.array(_token_slots(13, 3, rng), dtype=np.int64)
    x = torch.randn((13, 24), generator=rng).to(dtype).to(device)
    h = torch.randn((13, inter), generator=rng).to(dtype).to(device)
    outputs = []
    for use_kernels in (False, True):
        import copy

        wrapped = copy.deepcopy(model)
        lora: LoRASlots = install(wrapped, args, 3, 4, use_kernels=use_kernels)
        assert [lora.assign([a])[a.digest] for a in adapters] == [1, 2, 3]
        lora.bind(token_slots, device)
        launched = K.launch_counts["lora_expand"]
        projections = [wrapped.model.layers[0].self_attn, wrapped.model.layers[0].mlp]
        inputs = [x, x[:, :q].contiguous(), x, h]
        names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
        owners = [projections[0], projections[0], projections[1], projections[1]]
        outputs.append([getattr(o, n)(i) for o, n, i in zip(owners, names, inputs, strict=True)])
        lora.unbind()
        assert K.launch_counts["lora_expand"] == launched + (4 if use_kernels else 0)
        layer = model.model.layers[0]
        bases = [layer.self_attn, layer.self_attn, layer.mlp, layer.mlp]
        plain = [getattr(o, n)(i) for o, n, i in zip(bases, names, inputs, strict=True)]
        for got, base in zip(outputs[-1], plain, strict=True):  # the adapters did change the outputs
            assert not torch.allclose(got, base)
    for got, want in zip(outputs[1], outputs[0], strict=True):
        torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or kernels_are_interpreted(),
                    reason="needs a CUDA GPU with compiled (not interpreted) Triton kernels")
def test_bf16_on_a_gpu(rng):
    cuda = torch.device("cuda")
    token_slots = _token_slots(300, 6, rng)
    rows, starts, ids = _groups(token_slots, cuda)
    max_rows = int((starts[1:] - starts[:-1]).max())
    x = torch.randn((300, 4096), generator=rng).bfloat16().to(cuda)
    a = (torch.randn((7, 48, 4096), generator=rng) / 64).bfloat16().to(cuda)
    b = torch.randn((7, 6144, 48), generator=rng).bfloat16().to(cuda)
    h = K.lora_shrink(x, a, rows, starts, ids, max_rows)
    torch.testing.assert_close(h, K.lora_shrink_reference(x, a, rows, starts, ids), atol=2e-2, rtol=2e-2)
    y = torch.randn((300, 6144), generator=rng).bfloat16().to(cuda)
    expected = K.lora_expand_reference(h, b, rows, starts, ids, y)
    torch.testing.assert_close(K.lora_expand(h, b, rows, starts, ids, max_rows, y), expected, atol=5e-2,
                               rtol=2e-2)


@pytest.mark.slow  # a tiny engine's steps through the interpreter
@pytest.mark.skipif(not kernels_are_interpreted(), reason="the CPU engine runs the kernels interpreted")
def test_the_engine_on_the_kernels_gives_the_torch_paths_tokens(tmp_path):
    """The runner's whole LoRA path with ``use_kernels`` (as on CUDA: slots planned, groups bound and
    uploaded, both kernels in every wrapped projection), on the CPU through the interpreter: a batch of
    three adapters and the base model generates the PyTorch path's greedy tokens."""
    from engine.llm import LLM
    from engine.lora.registry import LoRARequest
    from engine.sampling_params import SamplingParams
    from engine.tiny import create_tiny_checkpoint
    from tests.engine.test_lora_serving import PROMPTS, TARGETS, strong_bundle

    base = create_tiny_checkpoint(tmp_path / "tiny", arch="llama", seed=0)
    adapters = [LoRARequest(f"a{i}", str(strong_bundle(base, tmp_path / f"a{i}", i + 1, targets, 4 + 4 * i)))
                for i, targets in enumerate(TARGETS)]
    cases = [(prompt, adapter) for prompt in PROMPTS[:2] for adapter in (None, *adapters)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(str(base), num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2,
             enable_prefix_caching=False) as llm:
        lora = llm.engine.runner.lora
        assert lora is not None and not lora.use_kernels  # the CPU's default: the PyTorch path
        runs = []
        for use_kernels in (False, True):
            lora.use_kernels = use_kernels
            before = K.launch_counts["lora_expand"]
            outputs = llm.generate([p for p, _ in cases], params, lora_request=[a for _, a in cases])
            runs.append([o.outputs[0].token_ids for o in outputs])
            assert (K.launch_counts["lora_expand"] > before) is use_kernels
    assert runs[1] == runs[0]
    assert runs[0][1] != runs[0][0]  # the adapters change the tokens


_COMPILE = textwrap.dedent("""
    import json, sys
    import torch
    from kernels import aot
    from kernels._common import recorded_launches
    results = []
    for shape in ("llama3-8b", "qwen3-30b-a3b"):
        for dtype in (torch.bfloat16, torch.float16):
            with recorded_launches((9, 0)) as launches:
                aot.lora_launches(aot.SERVED_SHAPES[shape], dtype)
            seen = set()
            for launch in launches:
                key = aot._launch_key(launch, 90)
                if key not in seen:
                    seen.add(key)
                    r = aot.compile_launch(launch, 90, shape=shape, dtype=str(dtype))
                    results.append([r.label(), r.problems()])
    json.dump(results, sys.stdout)
""")


@pytest.mark.slow  # Triton's compiler in a subprocess (this one interprets the kernels)
def test_the_kernels_compile_for_sm_90_within_its_limits():
    """Every specialisation the engine launches (``kernels.aot.lora_launches``: each wrapped projection of
    a dense and a mixture-of-experts shape, bf16 and fp16, two max ranks) compiled for sm_90 with Triton's
    ptxas: no compile error, shared memory and registers within limits, no spills."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _COMPILE], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(root)}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)
    assert {label.split("[")[0] for label, _ in results} == {"lora_shrink", "lora_expand"}
    assert len(results) >= 8
    assert not [(label, problems) for label, problems in results if problems]
