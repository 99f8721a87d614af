"""Paged decode attention vs its PyTorch reference: GQA ratios, head dims, split-K, adversarial paging."""

from __future__ import annotations

import pytest
import torch

from kernels import launch_counts, paged_decode_attention, paged_decode_attention_reference

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
# Not multiples of 16: one token, a partial first block, a block boundary + 1, and > 2 K/V tiles.
SEQ_LENS = [1, 13, 17, 150]


@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, group, head_dim, num_splits, device, rng, paged_kv, nan_output):
    num_kv_heads = 2
    kv = paged_kv(SEQ_LENS, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device, gen=rng)
    q = torch.randn((len(SEQ_LENS), num_kv_heads * group, head_dim), generator=rng).to(dtype).to(device)
    out = nan_output(q.shape, dtype, device)
    scale = head_dim**-0.5
    before = launch_counts["paged_decode_attention"]

    result = paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
        scale=scale, num_splits=num_splits, out=out,
    )  # fmt: skip

    assert result is out
    assert launch_counts["paged_decode_attention"] == before + 1
    expected = paged_decode_attention_reference(
        q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale=scale
    )
    torch.testing.assert_close(out, expected, **TOL[dtype])


@pytest.mark.parametrize(("group", "block_size"), [(3, 8), (7, 32)])
def test_non_power_of_two_group_other_block_sizes_default_splits(group, block_size, device, rng, paged_kv):
    """Qwen2-7B has 28 query heads over 4 KV heads: groups need not be powers of two; neither are the
    engine's 16-token blocks the only page size."""
    seq_lens = [5, 300, 33]
    kv = paged_kv(seq_lens, num_kv_heads=1, head_dim=64, dtype=torch.float32, device=device, gen=rng,
                  block_size=block_size)  # fmt: skip
    q = torch.randn((len(seq_lens), group, 64), generator=rng).to(device)
    out = paged_decode_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale=0.3)
    expected = paged_decode_attention_reference(
        q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale=0.3
    )
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_int64_metadata_and_strided_query(device, rng, paged_kv):
    """q sliced out of a fused qkv buffer (non-contiguous heads) and int64 index tensors."""
    seq_lens = [40, 7]
    kv = paged_kv(seq_lens, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device, gen=rng)
    qkv = torch.randn((2, 8 + 2 + 2, 64), generator=rng).to(device)
    q = qkv[:, :8]
    out = paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_tables.long(), kv.seq_lens.long(), scale=0.125, num_splits=2
    )
    expected = paged_decode_attention_reference(
        q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale=0.125
    )
    torch.testing.assert_close(out, expected, **TOL[torch.float32])


def test_rejects_bad_inputs(device, rng, paged_kv):
    kv = paged_kv([9], num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device, gen=rng)
    q = torch.randn((1, 4, 64), device=device)
    args = (kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode_attention(torch.randn((1, 3, 64), device=device), *args, scale=1.0)
    with pytest.raises(TypeError, match="key_cache must have dtype"):
        paged_decode_attention(q, kv.key_cache.half(), kv.value_cache, *args[2:], scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(torch.randn((1, 4, 32), device=device), *args, scale=1.0)
    with pytest.raises(ValueError, match="seq_lens has 2 entries"):
        paged_decode_attention(q, *args[:3], kv.seq_lens.repeat(2), scale=1.0)
    with pytest.raises(TypeError, match="block_tables must have dtype"):
        paged_decode_attention(q, *args[:2], kv.block_tables.float(), kv.seq_lens, scale=1.0)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        paged_decode_attention(q.transpose(1, 2).contiguous().transpose(1, 2), *args, scale=1.0)
    with pytest.raises(ValueError, match="num_splits"):
        paged_decode_attention(q, *args, scale=1.0, num_splits=0)
    with pytest.raises(ValueError, match="out shape"):
        paged_decode_attention(q, *args, scale=1.0, out=torch.empty((1, 4, 32), device=device))
