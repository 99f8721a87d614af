"""KV-cache store: scatter this step's keys and values into the paged cache through a slot mapping.

Cache layout (per layer, as the engine allocates it): ``kv_cache[2, num_blocks, block_size, num_kv_heads,
head_dim]``; this op takes the two halves ``key_cache = kv_cache[0]`` and ``value_cache = kv_cache[1]``
and reads every stride from the tensors, so only "head_dim is contiguous" is assumed.

``slot_mapping[t]`` is the flat slot ``block_id * block_size + offset`` of token ``t``. A negative slot
(the runner pads batches, e.g. for CUDA graphs, with ``-1``) means "skip this token": the program returns
before touching the cache. A slot past the end of the cache is skipped too, because a kernel cannot raise
without a host sync and an out-of-bounds store would corrupt memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_paged_kv_cache,
    check_tensor,
    count_launch,
    launcher_for,
    next_power_of_2,
)


@triton.jit
def _store_kv_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    num_slots,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: it moves all heads of K and V for that token (num_kv_heads * head_dim
    # elements, at most a few KiB), so a single tile covers it.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)

    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    kc = key_cache_ptr + block_id * stride_kc_block + block_offset * stride_kc_slot + heads * stride_kc_head
    vc = value_cache_ptr + block_id * stride_vc_block + block_offset * stride_vc_slot + heads * stride_vc_head
    tl.store(kc + dims, k, mask=mask)
    tl.store(vc + dims, v, mask=mask)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3, saturated at its largest finite value (448) rather than overflowing."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def store_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: tuple[float, float] | None = None,
) -> None:
    """Write ``key``/``value`` ``[T, num_kv_heads, head_dim]`` into ``key_cache``/``value_cache``
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` at ``slot_mapping[T]`` (int32/int64; -1 skips).

    An FP8 cache (``float8_e4m3fn``) stores ``key / kv_scale[0]`` and ``value / kv_scale[1]`` (1.0 each by
    default) rounded to e4m3: the rounding is done by PyTorch (exact, where Triton's interpreter rounds a
    few values wrongly, and sm_80 has no e4m3 type in Triton), and the kernel moves the bytes."""
    if key_cache.dtype == torch.float8_e4m3fn:
        k_scale, v_scale = kv_scale or (1.0, 1.0)
        key = quantize_kv(key, k_scale).view(torch.uint8)
        value = quantize_kv(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    check_tensor("key", key, ndim=3, dtypes=(*FLOAT_DTYPES, torch.uint8), last_dim_contiguous=True)
    device = key.device
    check_tensor("value", value, ndim=3, dtypes=(key.dtype,), device=device, last_dim_contiguous=True)
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} must equal key shape {tuple(key.shape)}")
    num_tokens, num_kv_heads, head_dim = key.shape
    cache_kv_heads = check_paged_kv_cache(
        key_cache, value_cache, dtype=key.dtype, device=device, head_dim=head_dim
    )[1]
    if cache_kv_heads != num_kv_heads:
        raise ValueError(f"key has {num_kv_heads} kv heads but the cache has {cache_kv_heads}")
    check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")
    if num_tokens == 0:
        return
    num_blocks, block_size = key_cache.shape[:2]
    count_launch("store_kv_cache")
    launcher_for(_store_kv_cache_kernel, device, key.dtype)[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_blocks * block_size,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
    )


def store_kv_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """PyTorch reference of :func:`store_kv_cache` (same skipping rules)."""
    num_blocks, block_size = key_cache.shape[:2]
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < num_blocks * block_size)
    slots = slots[keep]
    key_cache[slots // block_size, slots % block_size] = key[keep]
    value_cache[slots // block_size, slots % block_size] = value[keep]
