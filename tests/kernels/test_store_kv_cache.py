"""KV-cache store vs its reference: shuffled slots, padding slots (-1), untouched slots stay poisoned."""

from __future__ import annotations

import pytest
import torch

from kernels import launch_counts, store_kv_cache, store_kv_cache_reference


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 128), (8, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, num_kv_heads, head_dim, slot_dtype, device, rng, nan_output):
    num_blocks, block_size, num_tokens = 7, 16, 29
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)  # the engine's per-layer layout
    kv_cache = nan_output(cache_shape, dtype, device)
    expected = kv_cache.clone()
    key = torch.randn((num_tokens, num_kv_heads, head_dim), generator=rng).to(dtype).to(device)
    value = torch.randn((num_tokens, num_kv_heads, head_dim), generator=rng).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=rng)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=rng)[:5]] = -1  # padding tokens
    slots = slots.to(slot_dtype).to(device)
    before = launch_counts["store_kv_cache"]

    store_kv_cache(key, value, kv_cache[0], kv_cache[1], slots)

    assert launch_counts["store_kv_cache"] == before + 1
    store_kv_cache_reference(key, value, expected[0], expected[1], slots)
    # Exact: a store moves bits. NaN where nothing was written, on both sides.
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0, equal_nan=True)
    written = slots[slots >= 0].long()
    assert not kv_cache[:, written // block_size, written % block_size].isnan().any()
    assert kv_cache.isnan().sum() == kv_cache.numel() - 2 * written.numel() * num_kv_heads * head_dim


def test_strided_inputs_from_fused_qkv(device, rng):
    """K and V sliced out of a fused qkv projection output (token stride != heads * head_dim)."""
    qkv = torch.randn((11, 4 + 2 + 2, 64), generator=rng).to(device)
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    kv_cache = torch.zeros((2, 4, 16, 2, 64), device=device)
    slots = torch.arange(11, device=device) * 5
    store_kv_cache(key, value, kv_cache[0], kv_cache[1], slots)
    expected = torch.zeros_like(kv_cache)
    store_kv_cache_reference(key, value, expected[0], expected[1], slots)
    torch.testing.assert_close(kv_cache, expected, atol=0, rtol=0)


def test_rejects_bad_inputs(device):
    key = torch.randn((3, 2, 64), device=device)
    cache = torch.zeros((2, 4, 16, 2, 64), device=device)
    slots = torch.arange(3, device=device)
    with pytest.raises(ValueError, match="slot_mapping has 2 entries for 3 tokens"):
        store_kv_cache(key, key, cache[0], cache[1], slots[:2])
    with pytest.raises(TypeError, match="slot_mapping must have dtype"):
        store_kv_cache(key, key, cache[0], cache[1], slots.float())
    with pytest.raises(TypeError, match="key_cache must have dtype"):
        store_kv_cache(key, key, cache[0].half(), cache[1], slots)
    with pytest.raises(ValueError, match="3 kv heads but the cache has 2"):
        store_kv_cache(torch.randn((3, 3, 64), device=device), torch.randn((3, 3, 64), device=device),
                       cache[0], cache[1], slots)  # fmt: skip
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        store_kv_cache(key.transpose(1, 2).contiguous().transpose(1, 2), key, cache[0], cache[1], slots)


def test_an_fp8_cache_stores_the_scaled_e4m3_rounding(device, rng):
    from kernels import store_kv_cache
    from kernels.store_kv_cache import quantize_kv

    key = (3 * torch.randn((5, 2, 64), generator=rng)).to(device)
    value = torch.randn((5, 2, 64), generator=rng).to(device)
    cache = torch.zeros((2, 4, 16, 2, 64), device=device).to(torch.float8_e4m3fn)
    slots = torch.tensor([3, 17, -1, 40, 63], device=device)
    store_kv_cache(key, value, cache[0], cache[1], slots, kv_scale=(0.5, 0.25))
    flat = cache.view(torch.uint8).view(2, 64, 2, 64)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(flat[0, slot], quantize_kv(key[t], 0.5).view(torch.uint8))
        assert torch.equal(flat[1, slot], quantize_kv(value[t], 0.25).view(torch.uint8))
    assert int(flat[:, 0].sum()) == 0  # untouched slots stay zero
