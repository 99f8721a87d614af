"""Rotary position embedding applied to the queries and keys of one step, with a cos/sin table.

``cos_sin_cache [max_position, rotary_dim]`` holds ``cos(pos * inv_freq)`` in its first half and
``sin(pos * inv_freq)`` in its second; :func:`rope_cos_sin_cache` builds it, including the llama3
frequency rescaling (Llama 3.1+ ``rope_scaling = {"rope_type": "llama3", ...}``) and linear scaling.
Rotation styles:
- NeoX / Hugging Face ``rotate_half`` (Llama, Qwen2/3, Mistral): pairs are ``(i, i + rotary_dim / 2)``;
- GPT-J (``is_neox=False``): pairs are ``(2i, 2i + 1)``.
Dimensions past ``rotary_dim`` (partial rotary) are copied unchanged.

One program per token rotates every query and key head of that token: the token's position and its
cos/sin row are loaded once and reused by all heads. Math in fp32, one rounding at the store.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_tensor,
    count_launch,
    launcher_for,
    next_power_of_2,
)


@triton.jit
def _rotary_embedding_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    positions_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    half = ROTARY_DIM // 2
    idx = tl.arange(0, BLOCK_HALF)
    idx_mask = idx < half
    cos_sin_row = cos_sin_ptr + pos * stride_cs
    cos = tl.load(cos_sin_row + idx, mask=idx_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cos_sin_row + half + idx, mask=idx_mask, other=0.0).to(tl.float32)[None, :]
    if IS_NEOX:
        first = idx
        second = idx + half
    else:
        first = 2 * idx
        second = 2 * idx + 1
    first = first[None, :]
    second = second[None, :]

    # Queries.
    heads = tl.arange(0, BLOCK_QH)[:, None]
    mask = (heads < NUM_Q_HEADS) & idx_mask[None, :]
    src = q_ptr + token * stride_qt + heads * stride_qh
    dst = q_out_ptr + token * stride_qot + heads * stride_qoh
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    if ROTARY_DIM < HEAD_DIM:
        rest = ROTARY_DIM + tl.arange(0, BLOCK_PASS)[None, :]
        rest_mask = (heads < NUM_Q_HEADS) & (rest < HEAD_DIM)
        tl.store(dst + rest, tl.load(src + rest, mask=rest_mask), mask=rest_mask)

    # Keys.
    heads = tl.arange(0, BLOCK_KH)[:, None]
    mask = (heads < NUM_K_HEADS) & idx_mask[None, :]
    src = k_ptr + token * stride_kt + heads * stride_kh
    dst = k_out_ptr + token * stride_kot + heads * stride_koh
    x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst + first, (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + second, (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
    if ROTARY_DIM < HEAD_DIM:
        rest = ROTARY_DIM + tl.arange(0, BLOCK_PASS)[None, :]
        rest_mask = (heads < NUM_K_HEADS) & (rest < HEAD_DIM)
        tl.store(dst + rest, tl.load(src + rest, mask=rest_mask), mask=rest_mask)


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` by ``positions [T]``; returns ``(q_out, k_out)``.

    Outputs may alias the inputs (each program reads a token's values before writing them). Positions
    must lie in ``[0, cos_sin_cache.shape[0])``: they are not checked on the device (that would sync).
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device, dtype = q.device, q.dtype
    check_tensor("k", k, ndim=3, dtypes=(dtype,), device=device, last_dim_contiguous=True)
    num_tokens, num_q_heads, head_dim = q.shape
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} must be [{num_tokens}, num_kv_heads, {head_dim}]")
    check_tensor("positions", positions, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if positions.shape[0] != num_tokens:
        raise ValueError(f"positions has {positions.shape[0]} entries for {num_tokens} tokens")
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES, device=device,
                 last_dim_contiguous=True)  # fmt: skip
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos_sin_cache width (rotary_dim) must be even, in [2, {head_dim}]: {rotary_dim}")
    q_out = torch.empty_like(q) if q_out is None else q_out
    k_out = torch.empty_like(k) if k_out is None else k_out
    for name, t, ref in (("q_out", q_out, q), ("k_out", k_out, k)):
        check_tensor(name, t, ndim=3, dtypes=(dtype,), device=device, last_dim_contiguous=True)
        if t.shape != ref.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != input shape {tuple(ref.shape)}")
    if num_tokens == 0:
        return q_out, k_out
    count_launch("rotary_embedding")
    launcher_for(_rotary_embedding_kernel, device, dtype)[(num_tokens,)](
        q, k, q_out, k_out, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin_cache.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=k.shape[1], HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim,
        BLOCK_QH=next_power_of_2(num_q_heads), BLOCK_KH=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(rotary_dim // 2),
        BLOCK_PASS=next_power_of_2(max(1, head_dim - rotary_dim)),
        IS_NEOX=is_neox,
    )  # fmt: skip
    return q_out, k_out


def rope_inv_freq(rotary_dim: int, base: float, rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim / 2]`` (fp32), with Hugging Face's ``rope_scaling`` rules.

    Supported ``rope_type`` (or legacy ``type``): ``default``, ``linear`` (``factor``), ``llama3``
    (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``).
    """
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        old_context = float(rope_scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones kept, and the band
        # between them interpolated smoothly.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[max_position, rotary_dim]`` table: cos in the first half of each row, sin in the second."""
    inv_freq = rope_inv_freq(rotary_dim, base, rope_scaling)
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype=dtype, device=device)


def rotary_embedding_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
        if is_neox:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out.to(x.dtype), rest), dim=-1)

    return rotate(q), rotate(k)
