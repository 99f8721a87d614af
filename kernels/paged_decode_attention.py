"""Paged decode attention: one new query token per sequence against its whole paged KV context.

Shapes (B = number of sequences, one query token each):
  q             [B, num_heads, head_dim]
  key_cache     [num_blocks, block_size, num_kv_heads, head_dim]   (kv_cache[0] of a layer)
  value_cache   same shape as key_cache                             (kv_cache[1])
  block_tables  [B, max_blocks_per_seq] int32/int64: logical block i of sequence b lives in physical
                block ``block_tables[b, i]``; ids are arbitrary (shuffled, with holes) and entries past
                ``cdiv(seq_lens[b], block_size)`` are never read.
  seq_lens      [B] int32/int64: tokens in the cache for each sequence, the new one included.
  sinks         optional [num_heads] float32: a learned logit per head that joins each softmax's
                denominator and weighs no value (gpt-oss's attention sinks)
  window        optional sliding window: the query sees only its last ``window`` positions (itself
                included), as a sliding-window layer does; None or 0: the whole context
  out           [B, num_heads, head_dim]

Design:
- GQA: one program owns one (sequence, kv head) pair and all ``group = num_heads // num_kv_heads`` query
  heads that share it, so every K/V tile is loaded from HBM once per group instead of once per query
  head. The group's query rows are padded to 16 so ``tl.dot`` (tensor cores need M >= 16) applies.
  The group size is a runtime argument (not specialised, not a constexpr): the padded tile is the
  same for every group up to 16, so one compiled kernel serves every GQA ratio up to 16 (MHA's 1
  included) at a given head dim, and a model with a new ratio compiles nothing new.
- Split-K (flash-decoding): a long context is cut into ``num_splits`` contiguous token ranges processed
  by separate programs, each writing a partial output normalised by its own softmax sum plus its
  log-sum-exp; ``_merge_splits_kernel`` rescales and sums them. With few sequences this is what fills
  the GPU: B * num_kv_heads programs alone leave most SMs idle at batch 1-8.
- Online softmax in base 2 (``exp2`` with the scale pre-multiplied by log2(e)), fp32 accumulation.
  The running max starts at a finite -1e30 rather than -inf so a fully masked row yields p = 0, not
  NaN; an empty split (seq shorter than the split start) reports lse = -inf and weighs nothing.
- The split count is a launch parameter, not derived from data on the device, so the grid is fixed for
  a given batch size (CUDA-graph friendly); each program derives its token range from ``seq_lens`` on
  the device, so one grid serves every context length. It is a runtime argument, not a constexpr: one
  compiled kernel serves every split count (only split / unsplit are two specialisations).
- Sliding window: the token range starts at ``seq_len - window`` instead of 0, so keys outside the
  window are never loaded (the splits divide the window, not the context). Sinks: a sink logit ``s`` of
  a head adds ``exp(s - max)`` to its softmax sum; unsplit at the end of the program, split in the merge
  (once, not once per split).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    TileConfig,
    check_block_tables,
    check_paged_kv_cache,
    check_tensor,
    count_launch,
    e4m3_to_f32,
    launcher_for,
    next_power_of_2,
    target_capability,
)

# Tokens per K/V tile, warps and pipeline stages: see decode_tile_config().
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 3
# Split-K: aim for this many programs per SM; a split shorter than _MIN_TOKENS_PER_SPLIT costs more
# in the merge than it gains in parallelism.
_PROGRAMS_PER_SM = 2
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32
_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["group"])
def _paged_decode_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    lse_ptr,
    sm_scale_log2,
    num_splits,
    group,
    window,
    k_scale,
    v_scale,
    stride_qb,
    stride_qh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # A sliding-window layer (window > 0): only the last `window` positions exist for this query.
    first = tl.maximum(seq_len - tl.where(window > 0, window, seq_len), 0)
    # Splits start on tile boundaries (from the window's first key) so only the last tile is ragged.
    split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, BLOCK_D)
    row_mask = rows < group
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * group + rows
    q = tl.load(
        q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt
    k_base = key_cache_ptr + kv_head * stride_kc_head
    v_base = value_cache_ptr + kv_head * stride_vc_head

    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block_ids = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = (offs_n % PAGE_SIZE).to(tl.int64)
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k_rows = k_base + block_ids[:, None] * stride_kc_block + in_block[:, None] * stride_kc_slot
        k = tl.load(k_rows + dims[None, :], mask=kv_mask, other=0)
        if KV_FP8:  # e4m3 bytes and this layer's scale (kernels._common.e4m3_to_f32)
            k = (e4m3_to_f32(k) * k_scale).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows = v_base + block_ids[:, None] * stride_vc_block + in_block[:, None] * stride_vc_slot
        v = tl.load(v_rows + dims[None, :], mask=kv_mask, other=0)
        if KV_FP8:
            v = (e4m3_to_f32(v) * v_scale).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if HAS_SINKS and not SPLIT:  # split: the merge adds the sink once
        sink = tl.load(sinks_ptr + q_heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        m_i = m_new
    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh + split * stride_os + dims[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])
    if SPLIT:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + seq * stride_lb + q_heads * stride_lh + split, lse, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    partial_ptr,
    lse_ptr,
    sinks_ptr,
    out_ptr,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + splits, mask=split_mask, other=float("-inf"))
    # The sink joins the merge as one more "split" with a log-sum-exp of its logit and no values.
    sink = float("-inf")
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
    lse_max = tl.maximum(tl.max(lse, axis=0), sink)
    # Every split empty only for seq_len == 0; subtracting 0 then keeps exp2(-inf) = 0 instead of NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    denom = tl.sum(weights, axis=0) + tl.exp2(sink - lse_max)
    partial = tl.load(
        partial_ptr + seq * stride_pb + head * stride_ph + splits[:, None] * stride_ps + dims[None, :],
        mask=split_mask[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_ob + head * stride_oh + dims,
        merged.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_tile_config(
    head_dim: int, group: int, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> TileConfig:
    """The launch of the decode kernel for a model's shape on a GPU of compute ``capability`` (None:
    the interpreter): ``block_m`` is the query rows of a program (the GQA group padded to 16 for
    ``tl.dot``), ``block_n`` the keys per tile. One tile for every target: the H100 sweep's best
    (benchmarks/attention_tuning.py), which compiles without spills for sm_80 as well."""
    return TileConfig(block_m=max(16, next_power_of_2(group)), block_n=_BLOCK_N, num_warps=_NUM_WARPS,
                      num_stages=_NUM_STAGES)


def default_num_splits(batch_size: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence: enough programs for ``_PROGRAMS_PER_SM`` on every SM, never splits under
    ``_MIN_TOKENS_PER_SPLIT`` tokens."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        target_programs = _PROGRAMS_PER_SM * _sm_count(index)
    else:
        # The interpreter runs one program at a time: splitting only adds the merge.
        target_programs = 1
    wanted = math.ceil(target_programs / max(1, batch_size * num_kv_heads))
    by_length = max(1, math.ceil(max_seq_len / _MIN_TOKENS_PER_SPLIT))
    return max(1, min(wanted, by_length, _MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tile: TileConfig | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    kv_scale: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; returns ``out [B, H, D]``.
    ``sinks``/``window``: attention sinks and a sliding window (see the module docs). An FP8 cache
    (``float8_e4m3fn``, or its bytes) is dequantized in registers with ``kv_scale`` (K's, V's; 1.0 each
    by default).

    ``num_splits`` fixes the split-K factor (keep it fixed under CUDA-graph capture); ``None`` picks it
    from ``max_seq_len``, which is read from ``seq_lens`` (a host sync) if not given. ``tile`` overrides
    :func:`decode_tile_config` (for tuning).
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device, dtype = q.device, q.dtype
    batch, num_heads, head_dim = q.shape
    key_cache, value_cache, kv_fp8 = fp8_cache_bytes(key_cache, value_cache)
    page_size, num_kv_heads = check_paged_kv_cache(
        key_cache, value_cache, dtype=torch.uint8 if kv_fp8 else dtype, device=device, head_dim=head_dim
    )
    k_scale, v_scale = kv_scale or (1.0, 1.0)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_block_tables(block_tables, batch, device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {batch} query rows")
    check_sinks_and_window(sinks, window, num_heads, device)
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, ndim=3, dtypes=(dtype,), device=device, last_dim_contiguous=True)
        if out.shape != q.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item()) if batch else 0
        num_splits = default_num_splits(batch, num_kv_heads, max_seq_len, device)
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    if batch == 0:
        return out

    group = num_heads // num_kv_heads
    tile = tile or decode_tile_config(head_dim, group, dtype, target_capability(device))
    block_d = max(16, next_power_of_2(head_dim))  # tl.dot needs K >= 16
    common = dict(
        GROUP_PAD=tile.block_m,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=tile.block_n,
        SPLIT=num_splits > 1,
        HAS_SINKS=sinks is not None,
        KV_FP8=kv_fp8,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        **tile.launch_options,
    )
    cache_strides = (
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
    )
    count_launch("paged_decode_attention")
    kernel = launcher_for(_paged_decode_attention_kernel, device, dtype)
    grid = (batch, num_kv_heads, num_splits)
    sinks_arg = q if sinks is None else sinks  # never read without sinks
    if num_splits == 1:
        kernel[grid](
            q, key_cache, value_cache, block_tables, seq_lens, sinks_arg, out, out,
            scale * _LOG2E, 1, group, window or 0, k_scale, v_scale, q.stride(0), q.stride(1), *cache_strides,
            block_tables.stride(0),
            out.stride(0), out.stride(1), 0, 0, 0,
            **common,
        )  # fmt: skip
        return out

    # fp32 partials: rounding each split to half precision before the merge would add error that a
    # single-pass kernel does not have.
    partial = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=device)
    lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    kernel[grid](
        q, key_cache, value_cache, block_tables, seq_lens, sinks_arg, partial, lse,
        scale * _LOG2E, num_splits, group, window or 0, k_scale, v_scale, q.stride(0), q.stride(1),
        *cache_strides,
        block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        **common,
    )  # fmt: skip
    launcher_for(_merge_splits_kernel, device, dtype)[(batch, num_heads)](
        partial, lse, sinks_arg, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS_PAD=next_power_of_2(num_splits),
        HAS_SINKS=sinks is not None,
    )  # fmt: skip
    return out


def check_sinks_and_window(sinks: torch.Tensor | None, window: int | None, num_heads: int,
                           device: torch.device) -> None:
    if sinks is not None:
        check_tensor("sinks", sinks, ndim=1, dtypes=(torch.float32,), device=device)
        if sinks.shape[0] != num_heads:
            raise ValueError(f"sinks must have one logit per query head ({num_heads}), got {sinks.shape[0]}")
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be a non-negative int (0: no window), got {window!r}")


def fp8_cache_bytes(key_cache: torch.Tensor, value_cache: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """An FP8 KV cache as the kernels read it: its bytes (Triton has no e4m3 type on sm_80), and True;
    any other cache as it is, and False."""
    if key_cache.dtype == torch.float8_e4m3fn:
        return key_cache.view(torch.uint8), value_cache.view(torch.uint8), True
    return key_cache, value_cache, key_cache.dtype == torch.uint8


def dequantized_cache(cache: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """A cache (or a gathered part of one) in ``dtype``: an FP8 one times its scale, others as they are."""
    if cache.dtype == torch.uint8:
        cache = cache.view(torch.float8_e4m3fn)
    if cache.dtype == torch.float8_e4m3fn:
        return (cache.float() * scale).to(dtype)
    return cache


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dimension of ``scores [H, ..., S]`` (fp32), with each head's sink logit in
    the denominator when ``sinks [H]`` is given (the sink's own probability is dropped)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    sink = sinks.float().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]


def gather_paged_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Contiguous ``[seq_len, num_kv_heads, head_dim]`` view of one sequence's paged K or V (reference)."""
    page_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table.long()[positions // page_size]
    return cache[blocks, positions % page_size]


def paged_decode_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    kv_scale: tuple[float, float] | None = None,
) -> torch.Tensor:
    """PyTorch reference: gather each sequence's K/V, softmax in fp32, output in q's dtype."""
    out = torch.empty_like(q)
    group = q.shape[1] // key_cache.shape[2]
    k_scale, v_scale = kv_scale or (1.0, 1.0)
    key_cache = dequantized_cache(key_cache, k_scale, torch.float32)
    value_cache = dequantized_cache(value_cache, v_scale, torch.float32)
    for b, seq_len in enumerate(seq_lens.tolist()):
        k = gather_paged_kv(key_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_paged_kv(value_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), k) * scale
        if window:
            scores[:, : max(0, seq_len - window)] = float("-inf")
        out[b] = torch.einsum("ht,thd->hd", softmax_with_sinks(scores, sinks), v).to(q.dtype)
    return out
