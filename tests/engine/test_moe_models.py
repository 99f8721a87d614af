"""Mixtures of experts (Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss) against transformers, and split over two ranks.

Checkpoints come from two writers: transformers' own classes (``hf_moe_dirs``: ``from_config`` then
``save_pretrained``, float32) and ``engine.tiny`` (``tollgate model create-tiny --family``). Held to:
logits within float32 tolerance of transformers' forward; greedy output token for token equal to
transformers' ``generate`` with prefix caching on and off, chunked prefill and preemption (gpt-oss's
16-token sliding window is shorter than the prompts and the outputs); the Triton fused-MoE path equal to
the PyTorch one; gpt-oss through the Triton attention kernels (windows and sinks) equal to the PyTorch
backend; its MXFP4 experts equal to transformers' dequantizing path; tensor parallelism over two CPU
ranks (experts split on their intermediate dimension, or whole experts per rank with expert
parallelism) equal to one rank.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the fused-kernel test runs Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from safetensors import safe_open  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from engine.distributed import ShardSizes, TensorParallel, check_divisible  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.models.config import ModelArgs, MoEArgs  # noqa: E402
from engine.models.moe import MoE, grouped_experts, route  # noqa: E402
from tests.engine.test_llm_greedy import check_greedy_against_transformers, check_greedy_on_gpu  # noqa: E402
from tests.engine.test_models import BLOCK, _prefill_meta  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
transformers = pytest.importorskip("transformers")
FAMILIES = ("qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")


def _load(d: Path, **kwargs: object) -> torch.nn.Module:
    args = ModelArgs.from_pretrained(d)
    backend = TorchAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)
    device = str(kwargs.pop("device", "cpu"))
    return load_model(d, backend, torch.float32, device, **kwargs)  # type: ignore[arg-type]


def _prefill_logits(
    model: torch.nn.Module, prompts: list[torch.Tensor], device: str = "cpu"
) -> list[torch.Tensor]:
    args = model.args
    lengths = [len(p) for p in prompts]
    meta, num_blocks = _prefill_meta(lengths, blocks_per_seq=4)
    meta = dataclasses.replace(meta, **{
        f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    })  # fmt: skip
    dtype = model.model.embed_tokens.weight.dtype  # the model's (its FP8 layers' weights are not)
    caches = [torch.zeros(2, num_blocks, BLOCK, args.num_kv_heads, args.head_dim, device=device, dtype=dtype)
              for _ in range(args.num_layers)]  # fmt: skip
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.cat(prompts).to(device), positions, caches, meta)).cpu()
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    return [logits[starts[b]:starts[b + 1]] for b in range(len(prompts))]


def assert_logits_equal_transformers(model: torch.nn.Module, reference_dir: Path) -> None:
    """``model``'s prefill logits of three random prompts within float32 tolerance of transformers' on
    the checkpoint in ``reference_dir``."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    prompts = _prompts(model.args.vocab_size)
    with torch.inference_mode():
        for ours, prompt in zip(_prefill_logits(model, prompts), prompts, strict=True):
            torch.testing.assert_close(ours, hf(prompt[None]).logits[0], atol=1e-4, rtol=1e-4)


def _prompts(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in (37, 5, 64)]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("writer", ["transformers", "create-tiny"])
def test_logits_equal_transformers(family: str, writer: str, hf_moe_dirs: dict[str, Path],
                                   request: pytest.FixtureRequest) -> None:
    d = hf_moe_dirs[family] if writer == "transformers" else request.getfixturevalue(f"tiny_{family}_dir")
    model = _load(d)
    assert model.args.moe is not None
    assert_logits_equal_transformers(model, d)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family: str, hf_moe_dirs: dict[str, Path]) -> None:
    check_greedy_against_transformers(hf_moe_dirs[family], family)


def test_mxfp4_experts_equal_transformers_dequantized(tmp_path: Path) -> None:
    """A gpt-oss checkpoint with its experts in MXFP4 (``_blocks`` + ``_scales``, as released), loaded
    dequantized, gives transformers' logits on the same file (its dequantizing path)."""
    from engine.tiny import create_tiny_checkpoint

    d = create_tiny_checkpoint(tmp_path / "gpt-oss-mxfp4", arch="gpt_oss", mxfp4=True)
    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj_blocks" in f.keys()
    model = _load(d)
    assert_logits_equal_transformers(model, d)


def test_mxfp4_dequantization_equals_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from engine.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    w = 3 * torch.randn(2, 8, 96, generator=torch.Generator().manual_seed(4))
    blocks, scales = quantize_mxfp4(w)
    ours = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(ours, convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2))
    # Within half a step of each block's grid (E2M1's widest step, 4 to 6, at the block's scale).
    block_max = w.abs().view(2, 8, 3, 32).amax(-1, keepdim=True)
    assert ((ours - w).abs().view(2, 8, 3, 32) <= block_max / 3).all()
    with pytest.raises(ValueError, match="do not match scales"):
        dequantize_mxfp4(blocks, scales[..., :1], torch.float32)


@pytest.mark.slow  # Triton's interpreter on a CPU
def test_gpt_oss_through_the_triton_attention_kernels_equals_the_torch_backend(
    tiny_gpt_oss_dir: Path,
) -> None:
    """Sliding windows and sinks in the paged kernels, through the engine: prefill, chunked prefill,
    decode past the window, prefix-cache hits."""
    pytest.importorskip("kernels")
    prompts = [[(13 * i + 5 * j) % 200 + 3 for j in range(21 + 9 * i)] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outputs = {}
    for backend in ("torch", "triton"):
        with LLM(str(tiny_gpt_oss_dir), attention_backend=backend, max_num_batched_tokens=16) as llm:
            outputs[backend] = [o.token_ids for _ in range(2) for o in llm.generate(prompts, params)]
            assert llm.stats.prefix_hit_tokens > 0 and llm.stats.num_partial_prefill_chunks > 0
    assert outputs["triton"] == outputs["torch"]


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "gpt_oss"])
def test_fused_moe_kernel_path_equals_the_torch_path(family: str, hf_moe_dirs: dict[str, Path]) -> None:
    kernels = pytest.importorskip("kernels")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not kernels.kernels_are_interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET was set")
    d = hf_moe_dirs[family]
    prompts = _prompts(ModelArgs.from_pretrained(d).vocab_size)[:2]
    ref = _prefill_logits(_load(d, device=device), prompts, device)
    kernels.reset_launch_counts()
    fused = _prefill_logits(_load(d, device=device, fused_kernels=True), prompts, device)
    args = ModelArgs.from_pretrained(d)
    assert args.moe is not None
    sparse_layers = sum(args.moe.is_sparse(i) for i in range(args.num_layers))
    assert kernels.launch_counts["fused_moe"] == 2 * sparse_layers  # two grouped GEMMs per sparse layer
    for x, y in zip(fused, ref, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_routers_follow_the_reference_rules() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]])
    softmax = MoEArgs(num_experts=4, top_k=2, intermediate_size=8)
    weights, ids = route(logits, softmax)
    assert ids.tolist() == [[1, 3], [0, 2]]
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))  # renormalised over the two
    unnormalised = dataclasses.replace(softmax, renormalize=False)
    torch.testing.assert_close(route(logits, unnormalised)[0], torch.softmax(logits, -1).topk(2).values)
    # Sigmoid, two groups of two experts, one group kept: the bias moves the choice, not the weight.
    grouped = MoEArgs(num_experts=4, top_k=2, intermediate_size=8, router="sigmoid_grouped",
                      num_groups=2, topk_groups=1, routed_scaling=2.5)
    bias = torch.tensor([0.0, 0.0, 10.0, 10.0])
    weights, ids = route(logits, grouped, bias)
    assert sorted(ids[0].tolist()) == [2, 3] and sorted(ids[1].tolist()) == [2, 3]
    scores = logits.sigmoid()[:, 2:]
    expected = 2.5 * scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(weights.sort(-1).values, expected.sort(-1).values)


def test_grouped_experts_skip_experts_held_elsewhere() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 16, generator=g)
    w13, w2 = torch.randn(4, 24, 16, generator=g), torch.randn(4, 16, 12, generator=g)
    moe = MoEArgs(num_experts=4, top_k=2, intermediate_size=12)
    weights, ids = route(torch.randn(6, 4, generator=g), moe)
    whole = grouped_experts(x, w13, w2, weights, ids)
    halves = (grouped_experts(x, w13[:2], w2[:2], weights, ids)
              + grouped_experts(x, w13[2:], w2[2:], weights, ids, first_expert=2))
    torch.testing.assert_close(halves, whole, atol=1e-5, rtol=1e-5)


def test_expert_shards_and_their_checks() -> None:
    args = ModelArgs.from_hf_config(_qwen3_moe_config())
    split = [ShardSizes.of(args, r, 2) for r in range(2)]
    assert [(s.num_experts, s.first_expert, s.moe_intermediate_size) for s in split] == [(6, 0, 20)] * 2
    ep = [ShardSizes.of(args, r, 2, expert_parallel=True) for r in range(2)]
    assert [(s.num_experts, s.first_expert, s.moe_intermediate_size) for s in ep] == [(3, 0, 40), (3, 3, 40)]
    with pytest.raises(ValueError, match="must divide the model's 6 experts"):
        check_divisible(args, 4, expert_parallel=True)
    with pytest.raises(ValueError, match="experts' intermediate size 41"):
        check_divisible(ModelArgs.from_hf_config({**_qwen3_moe_config(), "moe_intermediate_size": 41}), 2)
    check_divisible(ModelArgs.from_hf_config({**_qwen3_moe_config(), "moe_intermediate_size": 41}), 2,
                    expert_parallel=True)  # whole experts per rank: any intermediate size
    dense = dataclasses.replace(args, moe=None)
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        check_divisible(dense, 1, expert_parallel=True)
    with pytest.raises(ValueError, match="exceeds the 6 experts"):
        ModelArgs.from_hf_config({**_qwen3_moe_config(), "num_experts_per_tok": 7})


def _qwen3_moe_config() -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 100,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 40}


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["split-experts", "expert-parallel"])
def test_each_rank_loads_only_its_share_of_the_experts(
    expert_parallel: bool, tiny_qwen3_moe_dir: Path
) -> None:
    args = ModelArgs.from_pretrained(tiny_qwen3_moe_dir)
    assert args.moe is not None
    inter = args.moe.intermediate_size
    with safe_open(str(tiny_qwen3_moe_dir / "model.safetensors"), framework="pt") as f:
        for rank in range(2):
            model = _load(tiny_qwen3_moe_dir, tp=TensorParallel(rank, 2, expert_parallel))
            mlp = model.model.layers[1].mlp
            assert isinstance(mlp, MoE)
            w13, w2 = mlp.experts.w13, mlp.experts.w2
            for local in range(w13.shape[0]):
                if expert_parallel:
                    expert, rows = rank * w13.shape[0] + local, slice(0, inter)
                else:
                    expert, rows = local, slice(rank * inter // 2, (rank + 1) * inter // 2)
                prefix = f"model.layers.1.mlp.experts.{expert}."
                gate, up = w13[local].chunk(2, dim=0)
                torch.testing.assert_close(gate, f.get_tensor(prefix + "gate_proj.weight")[rows])
                torch.testing.assert_close(up, f.get_tensor(prefix + "up_proj.weight")[rows])
                torch.testing.assert_close(w2[local], f.get_tensor(prefix + "down_proj.weight")[:, rows])
            assert w13.shape[0] == (args.moe.num_experts // 2 if expert_parallel else args.moe.num_experts)


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
TP_PROMPTS = [[(31 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
TP_PROMPTS.append(TP_PROMPTS[3][:48] + [11, 12, 13])
TIGHT = dict(block_size=16, num_kv_blocks=10, max_num_seqs=5, max_num_batched_tokens=16)


@pytest.mark.slow  # a spawned rank per replica
@pytest.mark.parametrize(("family", "expert_parallel"),
                         [("qwen3_moe", False), ("qwen3_moe", True), ("glm4_moe", False),
                          ("gpt_oss", False), ("gpt_oss", True)],
                         ids=["qwen3_moe-split", "qwen3_moe-ep", "glm4_moe-split", "gpt_oss-split",
                              "gpt_oss-ep"])
def test_two_ranks_give_the_single_rank_tokens(family: str, expert_parallel: bool,
                                               request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{family}_dir")
    with LLM(str(model_dir), **TIGHT) as whole:  # type: ignore[arg-type]
        expected = [out.token_ids for _ in range(2) for out in whole.generate(TP_PROMPTS, GREEDY)]
    with LLM(str(model_dir), tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             **TIGHT) as split:  # type: ignore[arg-type]
        got = [out.token_ids for _ in range(2) for out in split.generate(TP_PROMPTS, GREEDY)]
        stats = split.stats
    assert got == expected
    assert stats.num_partial_prefill_chunks > 0 and stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_moe_greedy_matches_transformers_on_gpu(
    family: str, dtype: str, hf_moe_dirs: dict[str, Path]
) -> None:
    """The GPU path as deployed (triton attention with windows and sinks, the fused-MoE kernel, CUDA-graph
    decode, chunked prefill) against transformers on the same GPU in the same dtype."""
    check_greedy_on_gpu(hf_moe_dirs[family], dtype, family)
