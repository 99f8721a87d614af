"""engine.models / engine.loader / engine.attention: our decoder equals transformers' forward, the loader
rejects broken checkpoints, and the torch attention backend equals dense causal attention."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the fused-kernel test runs Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from safetensors.torch import load_file, save_file

from engine import cpu_kernels
from engine.attention import AttentionMetadata, get_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.loader import load_model
from engine.models.config import ModelArgs
from engine.models.llama import rope_inv_freq

transformers = pytest.importorskip("transformers")
BLOCK = 16


def _load(d: Path) -> torch.nn.Module:
    args = ModelArgs.from_pretrained(d)
    backend = TorchAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)
    return load_model(d, backend, torch.float32, "cpu")


def _prefill_meta(lengths: list[int], blocks_per_seq: int) -> tuple[AttentionMetadata, int]:
    """Metadata for whole prompts of ``lengths``, sequence b owning blocks in a shuffled order."""
    num_blocks = blocks_per_seq * len(lengths)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    tables = perm.view(len(lengths), blocks_per_seq)
    slots = torch.cat(
        [
            tables[b, torch.arange(n) // BLOCK].long() * BLOCK + torch.arange(n) % BLOCK
            for b, n in enumerate(lengths)
        ]
    )
    qsl = torch.tensor([0, *itertools_accumulate(lengths)], dtype=torch.int32)
    meta = AttentionMetadata(
        slots,
        qsl,
        torch.tensor(lengths, dtype=torch.int32),
        tables,
        max(lengths),
        max(lengths),
        list(lengths),
        list(lengths),
        BLOCK,
    )
    return meta, num_blocks


def itertools_accumulate(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        total += x
        out.append(total)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_equal_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    d = request.getfixturevalue(f"tiny_{arch}_dir")
    model = _load(d)
    args = model.args
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [37, 5, 64]
    prompts = [torch.randint(0, args.vocab_size, (n,), generator=g) for n in lengths]
    meta, num_blocks = _prefill_meta(lengths, blocks_per_seq=4)
    caches = [
        torch.zeros(2, num_blocks, BLOCK, args.num_kv_heads, args.head_dim) for _ in range(args.num_layers)
    ]
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.cat(prompts), positions, caches, meta))
        for b, prompt in enumerate(prompts):
            ref = hf(prompt[None]).logits[0]
            ours = logits[meta.query_start_loc[b] : meta.query_start_loc[b + 1]]
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_triton_ops_equal_torch_ops(arch: str, request: pytest.FixtureRequest) -> None:
    kernels = pytest.importorskip("kernels")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not kernels.kernels_are_interpreted():
        pytest.skip("triton was imported before TRITON_INTERPRET was set")
    d = request.getfixturevalue(f"tiny_{arch}_dir")
    args = ModelArgs.from_pretrained(d)
    backend = TorchAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)
    ref = load_model(d, backend, torch.float32, device)
    fused = load_model(d, backend, torch.float32, device, fused_kernels=True)
    lengths = [9, 4]
    meta, num_blocks = _prefill_meta(lengths, blocks_per_seq=1)
    meta = dataclasses.replace(meta, **{
        f.name: getattr(meta, f.name).to(device) for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    })  # fmt: skip
    tokens = torch.randint(0, args.vocab_size, (sum(lengths),), generator=torch.Generator().manual_seed(5))
    positions = torch.cat([torch.arange(n) for n in lengths])
    outs = []
    kernels.reset_launch_counts()
    for model in (ref, fused):
        caches = [torch.zeros(2, num_blocks, BLOCK, args.num_kv_heads, args.head_dim, device=device)
                  for _ in range(args.num_layers)]  # fmt: skip
        with torch.inference_mode():
            outs.append(model.compute_logits(model(tokens.to(device), positions.to(device), caches, meta)))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    launches = dict(kernels.launch_counts)
    assert launches["rms_norm"] >= 2 * args.num_layers + 1 and launches["silu_and_mul"] == args.num_layers
    assert launches["rotary_embedding"] == args.num_layers


def test_variants_are_read_from_config(
    tiny_llama_dir: Path, tiny_qwen2_dir: Path, tiny_qwen3_dir: Path
) -> None:
    llama, qwen2, qwen3 = (
        ModelArgs.from_pretrained(d) for d in (tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir)
    )
    assert llama.rope_type == "llama3" and not llama.tie_word_embeddings and not llama.qkv_bias
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.tie_word_embeddings and qwen2.sliding_window is None
    assert qwen3.qk_norm and qwen3.q_size != qwen3.hidden_size


def test_rope_inv_freq_matches_transformers(tiny_llama_dir: Path) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.AutoConfig.from_pretrained(tiny_llama_dir)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, torch.device("cpu"))
    ours = rope_inv_freq(ModelArgs.from_pretrained(tiny_llama_dir))
    torch.testing.assert_close(ours, ref.float())
    # The tiny config exercises all three bands of the llama3 rule.
    plain = 1.0 / (500000.0 ** (torch.arange(0, 32, 2).float() / 32))
    ratio = ours / plain
    assert (ratio == 1).any() and (ratio == 0.25).any() and ((ratio > 0.25) & (ratio < 1)).any()


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_and_attention_factor_match_transformers(truncate: bool, tmp_path: Path) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.models.llama import rope_attention_factor

    cfg = _base_config(architectures=["GptOssForCausalLM"], model_type="gpt_oss", head_dim=32,
                       max_position_embeddings=4096, num_local_experts=4, num_experts_per_tok=2,
                       rope_theta=150000.0,
                       rope_scaling={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": truncate, "original_max_position_embeddings": 256})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ref, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](transformers.AutoConfig.from_pretrained(tmp_path), None)
    args = ModelArgs.from_hf_config(cfg)
    torch.testing.assert_close(rope_inv_freq(args), ref.float())
    assert rope_attention_factor(args) == pytest.approx(ref_factor)
    assert rope_attention_factor(args) > 1  # YaRN scales cos and sin up


def _base_config(**overrides: object) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
    }
    cfg.update(overrides)
    return cfg


def test_model_args_accepts_transformers5_rope_parameters() -> None:
    cfg = _base_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0})
    args = ModelArgs.from_hf_config(cfg)
    assert (args.rope_type, args.rope_theta, args.rope_params["factor"], args.head_dim) == (
        "linear",
        1234.0,
        2.0,
        16,
    )
    assert (
        ModelArgs.from_hf_config(_base_config(model_type="mistral", sliding_window=128)).sliding_window == 128
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"num_key_value_heads": 3}, "multiple of"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope type 'longrope'"),
        ({"hidden_size": 0}, "hidden_size must be a positive"),
    ],
)
def test_model_args_rejects_unsupported_configs(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelArgs.from_hf_config(_base_config(**overrides))


def test_unknown_architecture_is_rejected(tmp_path: Path, tiny_qwen2_dir: Path) -> None:
    shutil.copytree(tiny_qwen2_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture 'GPT2LMHeadModel'"):
        _load(tmp_path)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (
            lambda w: w.pop("model.layers.1.mlp.up_proj.weight"),
            "lacks weights: model.layers.1.mlp.up_proj.weight",
        ),
        (lambda w: w.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(3, 3)}), "has shape"),
        (lambda w: w.update({"model.layers.0.extra.weight": torch.zeros(3)}), "unexpected tensor"),
    ],
)
def test_loader_rejects_broken_checkpoints(tmp_path: Path, tiny_qwen2_dir: Path, edit, match: str) -> None:
    shutil.copytree(tiny_qwen2_dir, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    edit(weights)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        _load(tmp_path)


def test_tied_head_shares_the_embedding(tiny_qwen2_dir: Path) -> None:
    model = _load(tiny_qwen2_dir)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.rotary_emb.cos_sin.dtype == torch.float32


def test_get_backend() -> None:
    assert get_backend("torch") is TorchAttentionBackend
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        get_backend("flash")


def _dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q.shape[0] positions over k/v [S, KVH, D]; plain loops of math."""
    num_q, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    for i in range(num_q):
        pos = seq_len - num_q + i
        for h in range(num_heads):
            scores = (k[: pos + 1, h // group] @ q[i, h]) * scale
            out[i, h] = torch.softmax(scores, 0) @ v[: pos + 1, h // group]
    return out


# Decodes of spread lengths fill several length buckets (of >= 8 sequences); mixed steps send their
# one-token sequences through the same buckets and the others through the per-sequence loop.
_MANY_DECODES = [1] * 21
_MIXED = [1, 1, 5, *[1] * 9, 12, 1, 1]
_FRESH = [30, 1, 64, 5]  # its multi-token sequences have no cached context (whole prompts)


@pytest.mark.parametrize("decode", ["native", "sdpa"])
@pytest.mark.parametrize("planned", [False, True], ids=["per-call", "planned"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1], [7, 1, 20, 1], [33], _MANY_DECODES, _MIXED, _FRESH],
                         ids=["decodes", "mixed", "prefill", "many-decodes", "many-mixed", "whole-prompts"])
def test_torch_backend_matches_dense_attention_over_paged_cache(
    query_lens: list[int], planned: bool, decode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode tokens go through the C kernel where it builds ("native"), else through SDPA over gathered
    blocks ("sdpa", forced here by hiding the kernel)."""
    if decode == "sdpa":
        monkeypatch.setattr(cpu_kernels, "library", lambda: None)
    elif cpu_kernels.library() is None:
        pytest.skip("the native CPU kernels cannot be built here")
    g = torch.Generator().manual_seed(len(query_lens))
    num_heads, num_kv_heads, head_dim = 6, 2, 8
    backend = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale=1 / math.sqrt(head_dim))
    context_lens = [int(torch.randint(0, 90, (1,), generator=g)) for _ in query_lens]
    if query_lens is _FRESH:
        context_lens = [0 if n > 1 else c for n, c in zip(query_lens, context_lens, strict=True)]
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in zip(context_lens, query_lens, strict=True)) + 3
    seq_lens = [c + n for c, n in zip(context_lens, query_lens, strict=True)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[perm.pop() for _ in range(-(-s // BLOCK))] for s in seq_lens]
    max_blocks = max(len(t) for t in tables)
    # Random (never zero) cache contents, including the context that "earlier steps" stored.
    cache = torch.randn(2, num_blocks, BLOCK, num_kv_heads, head_dim, generator=g)
    full_k = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    full_v = [torch.randn(s, num_kv_heads, head_dim, generator=g) for s in seq_lens]
    for t, k, v, c in zip(tables, full_k, full_v, context_lens, strict=True):
        for p in range(c):
            cache[0, t[p // BLOCK], p % BLOCK], cache[1, t[p // BLOCK], p % BLOCK] = k[p], v[p]
    q = [torch.randn(n, num_heads, head_dim, generator=g) for n in query_lens]
    slots = torch.tensor(
        [
            t[p // BLOCK] * BLOCK + p % BLOCK
            for t, c, s in zip(tables, context_lens, seq_lens, strict=True)
            for p in range(c, s)
        ]
    )
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.tensor([0, *itertools_accumulate(query_lens)], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        block_size=BLOCK,
    )
    if planned:
        meta.plan = backend.plan(meta, torch.float32)
    new_k = torch.cat([k[c:] for k, c in zip(full_k, context_lens, strict=True)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, context_lens, strict=True)])
    out = backend.forward(torch.cat(q), new_k, new_v, cache, meta)
    expected = torch.cat(
        [_dense_attention(qb, k, v, backend.scale) for qb, k, v in zip(q, full_k, full_v, strict=True)]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # The new tokens' K/V are in the cache where the slot mapping says.
    flat_k = cache[0].view(-1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots], new_k)


def test_torch_backend_skips_padding_slots() -> None:
    backend = TorchAttentionBackend(2, 1, 4, scale=0.5)
    cache = torch.zeros(2, 2, BLOCK, 1, 4)
    k = torch.randn(2, 1, 4)
    meta = AttentionMetadata(
        torch.tensor([3, -1]),
        torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([4, 1], dtype=torch.int32),
        torch.tensor([[0], [1]], dtype=torch.int32),
        1,
        4,
        [1, 1],
        [4, 1],
        BLOCK,
    )
    backend.forward(torch.randn(2, 2, 4), k, k.clone(), cache, meta)
    assert (
        torch.equal(cache[0, 0, 3], k[0])
        and cache[0, 1].abs().sum() == 0
        and cache[0, 0, :3].abs().sum() == 0
    )


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    args, n = model.args, tokens.shape[0]
    meta, num_blocks = _prefill_meta([n], blocks_per_seq=-(-n // BLOCK))
    caches = [
        torch.zeros(2, num_blocks, BLOCK, args.num_kv_heads, args.head_dim) for _ in range(args.num_layers)
    ]
    with torch.inference_mode():
        return model.compute_logits(model(tokens, torch.arange(n), caches, meta))


def test_mistral_checkpoint_equals_transformers(tmp_path: Path, tiny_llama_dir: Path) -> None:
    shutil.copytree(tiny_llama_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(
        architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None, rope_theta=10000.0
    )
    del cfg["rope_scaling"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tokens = torch.randint(0, cfg["vocab_size"], (21,), generator=torch.Generator().manual_seed(3))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MistralForCausalLM"
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    torch.testing.assert_close(_logits(_load(tmp_path), tokens), ref, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads_like_a_single_file(tmp_path: Path, tiny_qwen3_dir: Path) -> None:
    shutil.copytree(tiny_qwen3_dir, tmp_path, dirs_exist_ok=True)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, tmp_path / file)
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokens = torch.randint(0, 100, (7,), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(_logits(_load(tmp_path), tokens), _logits(_load(tiny_qwen3_dir), tokens))
