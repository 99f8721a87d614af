"""FP8 checkpoints in the engine: written by ``tollgate model quantize`` (compressed-tensors per channel,
block FP8) from tiny Llama, Qwen3 and Qwen3-MoE checkpoints, or quantized at load (``--quantization
fp8``). Held to a dequantized float32 reference: transformers' own dequantizing path for block FP8, and
for compressed-tensors a float32 checkpoint whose weights are ``weight * weight_scale`` (transformers'
compressed-tensors path emulates FP8 activations too, which the CPU reference path does not). Logits
within float32 tolerance, greedy output token for token; tensor parallelism over two ranks equal to
one; the accuracy against the 16-bit original is measured in ``benchmarks/fp8.py``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the FP8 kernel test runs Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.loader import quantized_args  # noqa: E402
from engine.models.config import Fp8Args, ModelArgs  # noqa: E402
from engine.models.fp8 import FP8_DTYPE, Fp8Linear  # noqa: E402
from engine.quantize import quantize_checkpoint  # noqa: E402
from tests.engine.test_llm_greedy import MAX_NEW_TOKENS, PROMPTS, _assert_matches, _hf_greedy  # noqa: E402
from tests.engine.test_moe_models import (  # noqa: E402
    _load,
    _prefill_logits,
    _prompts,
    assert_logits_equal_transformers,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers")
SCHEMES = ("fp8-channel", "fp8-block")


def _dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """The float32 checkpoint an FP8 one stands for: each FP8 weight times its scale (per row, or per
    block of the config's size), everything else as it is."""
    shutil.copytree(fp8_dir, out)
    config = json.loads((out / "config.json").read_text())
    q = config.pop("quantization_config")
    block = q.get("weight_block_size")
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    dense = {}
    for name, t in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if t.dtype == FP8_DTYPE:
            if block:
                s = tensors[name + "_scale_inv"]
                s = s.repeat_interleave(block[0], 0)[: t.shape[0]]
                s = s.repeat_interleave(block[1], 1)[:, : t.shape[1]]
            else:
                s = tensors[name + "_scale"]
            t = t.float() * s
        dense[name] = t.contiguous()
    save_file(dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory, tiny_llama_dir, tiny_qwen3_dir, tiny_qwen3_moe_dir) -> dict:
    """(arch, scheme) -> (the FP8 checkpoint, its dequantized float32 reference checkpoint)."""
    dirs = {}
    sources = (("llama", tiny_llama_dir), ("qwen3", tiny_qwen3_dir), ("qwen3_moe", tiny_qwen3_moe_dir))
    for arch, src in sources:
        for scheme in SCHEMES:
            root = tmp_path_factory.mktemp(f"{arch}-{scheme}")
            # 32-column blocks: the tiny models' projections are 64-256 wide (real checkpoints use 128).
            fp8 = quantize_checkpoint(src, root / "fp8", scheme, (32, 32))
            dirs[(arch, scheme)] = fp8, _dequantized_copy(fp8, root / "dequantized")
    return dirs


def test_quantize_writes_the_published_formats(fp8_dirs) -> None:
    channel, _ = fp8_dirs[("llama", "fp8-channel")]
    block, _ = fp8_dirs[("llama", "fp8-block")]
    t = load_file(str(channel / "model.safetensors"))
    q_proj = "model.layers.0.self_attn.q_proj."
    assert t[q_proj + "weight"].dtype == FP8_DTYPE
    assert t[q_proj + "weight_scale"].shape == (t[q_proj + "weight"].shape[0], 1)
    assert t["model.embed_tokens.weight"].dtype == t["lm_head.weight"].dtype == torch.float32
    b = load_file(str(block / "model.safetensors"))
    w = b["model.layers.0.mlp.down_proj.weight"]
    assert b["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (-(-w.shape[0] // 32),
                                                                        -(-w.shape[1] // 32))
    assert ModelArgs.from_pretrained(channel).fp8 == Fp8Args(scheme="channel", ignore=("lm_head",))
    assert ModelArgs.from_pretrained(block).fp8.block == (32, 32)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="already quantized"):
        quantize_checkpoint(channel, channel.parent / "again", "fp8-block")


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_logits_equal_the_dequantized_reference(arch: str, scheme: str, fp8_dirs) -> None:
    fp8, dequantized = fp8_dirs[(arch, scheme)]
    model = _load(fp8)
    assert any(isinstance(m, Fp8Linear) for m in model.modules())
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == FP8_DTYPE
    if arch == "qwen3_moe":  # the experts stay FP8 in memory too
        assert model.model.layers[0].mlp.experts.w13.dtype == FP8_DTYPE
    # Block FP8: transformers reads the FP8 file itself and dequantizes it on the CPU.
    assert_logits_equal_transformers(model, fp8 if scheme == "fp8-block" else dequantized)


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_the_fp8_kernel_path_equals_the_dequantizing_path(arch: str, scheme: str, fp8_dirs) -> None:
    """``kernels.fp8_linear`` and the fused MoE kernel over FP8 experts (here in Triton's interpreter,
    weight-only: the CPU has no FP8 tensor cores) give the model the dequantize-then-matmul logits."""
    kernels = pytest.importorskip("kernels")
    if not kernels.kernels_are_interpreted() and not torch.cuda.is_available():
        pytest.skip("triton was imported before TRITON_INTERPRET was set")
    fp8, _ = fp8_dirs[(arch, scheme)]
    prompts = _prompts(ModelArgs.from_pretrained(fp8).vocab_size)[:2]
    reference = _prefill_logits(_load(fp8), prompts)
    kernels.reset_launch_counts()
    fused = _prefill_logits(_load(fp8, fused_kernels=True), prompts)
    layers = ModelArgs.from_pretrained(fp8).num_layers
    if arch == "qwen3_moe":  # attention's two linears, then the experts' two grouped GEMMs
        assert kernels.launch_counts["fp8_linear"] == kernels.launch_counts["fused_moe"] == 2 * layers
    else:
        assert kernels.launch_counts["fp8_linear"] == 4 * layers
    for x, y in zip(fused, reference, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_greedy_output_equals_the_dequantized_reference(scheme: str, fp8_dirs) -> None:
    fp8, dequantized = fp8_dirs[("qwen3", scheme)]
    with LLM(str(fp8), max_num_batched_tokens=16) as llm:
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        outputs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
        assert llm.stats.num_partial_prefill_chunks > 0
    reference = _hf_greedy(dequantized, prompt_ids)
    for i, (out, (theirs, logits)) in enumerate(zip(outputs, reference, strict=True)):
        _assert_matches(out.token_ids, theirs, logits, f"{scheme}/prompt {i}")


def test_quantizing_at_load_equals_the_quantized_checkpoint(tiny_qwen3_dir: Path, fp8_dirs) -> None:
    """``--quantization fp8`` on the 16-bit checkpoint is the same model as ``tollgate model quantize
    --scheme fp8-channel`` then loading that: same FP8 bytes, same scales, same logits."""
    args = quantized_args(ModelArgs.from_pretrained(tiny_qwen3_dir), "fp8")
    assert args.fp8 is not None and args.fp8.quantize_at_load
    at_load = _load(tiny_qwen3_dir, args=args)
    written = _load(fp8_dirs[("qwen3", "fp8-channel")][0])
    for (name, a), (_, b) in zip(at_load.state_dict().items(), written.state_dict().items(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                                                  b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), name
    with LLM(str(tiny_qwen3_dir), quantization="fp8") as llm:
        assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj, Fp8Linear)
    with pytest.raises(ValueError, match="quantization must be fp8"):
        LLM(str(tiny_qwen3_dir), quantization="int4")


@pytest.mark.slow  # a spawned rank per replica
@pytest.mark.parametrize("scheme", SCHEMES)
def test_two_ranks_give_the_single_rank_tokens(scheme: str, fp8_dirs) -> None:
    fp8, _ = fp8_dirs[("qwen3", scheme)]
    prompts = [[(31 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(fp8)) as whole:
        expected = [o.token_ids for o in whole.generate(prompts, params)]
    with LLM(str(fp8), tensor_parallel_size=2) as split:
        assert [o.token_ids for o in split.generate(prompts, params)] == expected


def test_block_scales_split_inside_a_block_are_refused(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    """qwen3's o_proj has 128 input columns: two ranks split it at 64, inside a 128-column block."""
    from engine.distributed import TensorParallel

    fp8 = quantize_checkpoint(tiny_qwen3_dir, tmp_path / "fp8", "fp8-block", (128, 128))
    with pytest.raises(ValueError, match="inside a 128-column FP8 block"):
        _load(fp8, tp=TensorParallel(0, 2))


def test_fbgemm_fp8_checkpoints_are_read_as_per_channel(fp8_dirs, tmp_path: Path) -> None:
    """fbgemm's per-channel FP8 is compressed-tensors' channel layout under another quantization_config
    (and an ``input_scale_ub`` per layer, skipped): the same model."""
    channel, _ = fp8_dirs[("qwen3", "fp8-channel")]
    fbgemm = tmp_path / "fbgemm"
    shutil.copytree(channel, fbgemm)
    config = json.loads((fbgemm / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                                     "modules_to_not_convert": ["lm_head"]}
    (fbgemm / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(fbgemm / "model.safetensors"))
    tensors |= {name.removesuffix("weight_scale") + "input_scale_ub": torch.tensor([1200.0])
                for name in list(tensors) if name.endswith("weight_scale")}
    save_file(tensors, str(fbgemm / "model.safetensors"))
    assert ModelArgs.from_pretrained(fbgemm).fp8 == Fp8Args(scheme="channel", ignore=("lm_head",))
    prompts = _prompts(ModelArgs.from_pretrained(fbgemm).vocab_size)[:2]
    ours, theirs = _prefill_logits(_load(fbgemm), prompts), _prefill_logits(_load(channel), prompts)
    assert all(torch.equal(x, y) for x, y in zip(ours, theirs, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_on_the_gpu_agrees_with_the_cpu_reference(arch: str, dtype: str, fp8_dirs) -> None:
    """The GPU path as deployed (the FP8 linear kernel: weight-only in float32, W8A8 in bf16 on sm_89+;
    FP8 experts in the fused MoE kernel) against the CPU's dequantize-then-matmul logits."""
    fp8, _ = fp8_dirs[(arch, "fp8-block")]
    prompts = _prompts(ModelArgs.from_pretrained(fp8).vocab_size)
    reference = _prefill_logits(_load(fp8), prompts)
    model = _load(fp8, device="cuda", fused_kernels=True) if dtype == "float32" else None
    if model is None:
        from engine.attention.torch_backend import TorchAttentionBackend
        from engine.loader import load_model

        args = ModelArgs.from_pretrained(fp8)
        backend = TorchAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)
        model = load_model(fp8, backend, torch.bfloat16, "cuda", fused_kernels=True)
    gpu = _prefill_logits(model, prompts, "cuda")
    for ours, ref in zip(gpu, reference, strict=True):
        if dtype == "float32":
            torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
        else:  # bf16 activations, quantized to FP8 per token: a few percent of the logits' spread
            assert (ours.float() - ref).abs().mean() < 0.1 * ref.std()
