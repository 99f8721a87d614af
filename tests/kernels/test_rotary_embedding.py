"""Rotary embedding vs its reference, and the llama3 frequency table vs Hugging Face's."""

from __future__ import annotations

import pytest
import torch

from kernels import launch_counts, rope_cos_sin_cache, rotary_embedding, rotary_embedding_reference
from kernels.rotary_embedding import rope_inv_freq

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 64), (12, 3, 128), (8, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(
    dtype, num_heads, num_kv_heads, head_dim, partial, is_neox, device, rng, nan_output
):
    num_tokens, max_position = 19, 300
    rotary_dim = head_dim // 2 if partial else head_dim
    cos_sin = rope_cos_sin_cache(rotary_dim, max_position, 500000.0, LLAMA3, device=device)
    q = torch.randn((num_tokens, num_heads, head_dim), generator=rng).to(dtype).to(device)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=rng).to(dtype).to(device)
    positions = torch.randint(0, max_position, (num_tokens,), generator=rng).to(device)
    q_out, k_out = nan_output(q.shape, dtype, device), nan_output(k.shape, dtype, device)
    before = launch_counts["rotary_embedding"]

    rotary_embedding(q, k, positions, cos_sin, is_neox=is_neox, q_out=q_out, k_out=k_out)

    assert launch_counts["rotary_embedding"] == before + 1
    q_ref, k_ref = rotary_embedding_reference(q, k, positions, cos_sin, is_neox=is_neox)
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])


def test_in_place_on_fused_qkv(device, rng):
    """The runner's form: rotate the q and k slices of a fused qkv buffer in place."""
    qkv = torch.randn((7, 6 + 2 + 2, 64), generator=rng).to(device)
    q, k = qkv[:, :6], qkv[:, 6:8]
    v_before = qkv[:, 8:].clone()
    positions = torch.arange(7, device=device) * 3
    cos_sin = rope_cos_sin_cache(64, 32, 10000.0, device=device)
    q_ref, k_ref = rotary_embedding_reference(q, k, positions, cos_sin)
    rotary_embedding(q, k, positions, cos_sin, q_out=q, k_out=k)
    torch.testing.assert_close(q, q_ref, **TOL[torch.float32])
    torch.testing.assert_close(k, k_ref, **TOL[torch.float32])
    assert torch.equal(qkv[:, 8:], v_before)


def test_llama3_frequencies_match_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {**LLAMA3, "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, max_position_embeddings=131072,
        rope_parameters=params,
    )  # fmt: skip
    expected, attention_scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_scaling == 1.0
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, params), expected, atol=0, rtol=1e-6)


def test_linear_scaling_divides_frequencies():
    plain = rope_inv_freq(64, 10000.0)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, {"type": "linear", "factor": 4.0}), plain / 4)
    torch.testing.assert_close(rope_inv_freq(64, 10000.0, {"rope_type": "default"}), plain)


def test_rejects_bad_inputs(device):
    q, k = torch.randn((3, 4, 64), device=device), torch.randn((3, 2, 64), device=device)
    cos_sin = rope_cos_sin_cache(64, 16, 10000.0, device=device)
    with pytest.raises(ValueError, match="positions has 2 entries"):
        rotary_embedding(q, k, torch.arange(2, device=device), cos_sin)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_embedding(q, k, torch.arange(3, device=device), torch.randn((16, 66), device=device))
    with pytest.raises(ValueError, match="k shape"):
        rotary_embedding(q, torch.randn((3, 2, 32), device=device), torch.arange(3, device=device), cos_sin)
    with pytest.raises(ValueError, match="unsupported rope_scaling"):
        rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
