"""Prefill / extend attention: causal attention of a batch of new-token chunks over the paged cache.

Each sequence ``b`` brings ``q_len = query_start_loc[b + 1] - query_start_loc[b]`` new tokens that sit
at positions ``[seq_lens[b] - q_len, seq_lens[b])``; their K/V have already been written to the cache
(``store_kv_cache`` runs first), and positions before them are a cached prefix (a prefix-cache hit or
the earlier chunks of a chunked prefill). Query ``i`` attends to cache positions ``0 .. its own``. So a
plain prefill (no prefix), a chunked prefill, a prefix-cache hit and a decode token (``q_len = 1``) are
all the same computation, read entirely through the block table.

Shapes:
  q                [T, num_heads, head_dim]   new tokens of all sequences, packed
  key/value_cache  [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables     [B, max_blocks] int32/int64 (arbitrary block ids; entries past the context unread)
  query_start_loc  [B + 1] int32/int64, cumulative; seq_lens [B] (context including the new tokens)
  sinks            optional [num_heads] float32 attention-sink logits (gpt-oss), in every softmax's sum
  window           optional sliding window: query at position p sees positions (p - window, p]
  out              [T, num_heads, head_dim]

Design:
- GQA: a program owns (sequence, kv head, BLOCK_M query tokens) and stacks the ``group`` query heads
  of those tokens into the rows of one tile (row = token * GROUP_PAD + head), so each K/V tile is read
  once for the whole group and feeds a single ``tl.dot`` of BLOCK_M * GROUP_PAD rows.
- The KV loop stops at the last position this tile's tokens can see, so causal tiles above the
  diagonal are never loaded; tiles wholly before the tile's first query (the cached prefix, earlier
  parts of the chunk) run without any mask, and only the tiles crossing the diagonal are masked.
- Online softmax in base 2, fp32 accumulation, finite initial max (fully masked padding rows give 0).
- The grid covers ``cdiv(max_query_len, BLOCK_M)`` query tiles per sequence; tiles past a sequence's
  own length exit at once, so ``max_query_len`` (host metadata) is the only host-side number needed.
- A sliding window starts the KV loop at the tile's first query's window (earlier tiles are never
  loaded) and masks every tile (``SLIDING``: rows of one tile see different windows). Sinks rescale the
  running sum once at the end, as the decode kernel does.
"""

from __future__ import annotations

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
from kernels.paged_decode_attention import (
    check_sinks_and_window,
    dequantized_cache,
    fp8_cache_bytes,
    gather_paged_kv,
    softmax_with_sinks,
)

# Rows (query tokens x group heads) per program, keys per tile, warps and pipeline stages: see
# extend_tile_config().
_ROWS = 64
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 3
_LOG2E = 1.4426950408889634


@triton.jit
def _extend_attention_tile(
    q,
    m_i,
    l_i,
    acc,
    k_base,
    v_base,
    block_table_row,
    q_pos,
    dims,
    dim_mask,
    tile_start,
    kv_end,
    window,
    k_scale,
    v_scale,
    sm_scale_log2,
    stride_kc_block,
    stride_kc_slot,
    stride_vc_block,
    stride_vc_slot,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One K/V tile of the online softmax; ``MASKED`` applies the length and causal masks, ``SLIDING``
    the window too; ``KV_FP8``: the cache holds e4m3 bytes, dequantized here with the layer's scales."""
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    n_mask = offs_n < kv_end
    in_block = (offs_n % PAGE_SIZE).to(tl.int64)
    if MASKED:
        block_ids = tl.load(block_table_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & dim_mask[None, :]
    else:
        block_ids = tl.load(block_table_row + offs_n // PAGE_SIZE).to(tl.int64)
        kv_mask = dim_mask[None, :]
    k_rows = k_base + block_ids[:, None] * stride_kc_block + in_block[:, None] * stride_kc_slot
    k = tl.load(k_rows + dims[None, :], mask=kv_mask, other=0)
    if KV_FP8:
        k = (e4m3_to_f32(k) * k_scale).to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
    if MASKED:
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_rows = v_base + block_ids[:, None] * stride_vc_block + in_block[:, None] * stride_vc_slot
    v = tl.load(v_rows + dims[None, :], mask=kv_mask, other=0)
    if KV_FP8:
        v = (e4m3_to_f32(v) * v_scale).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _extend_attention_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    out_ptr,
    sm_scale_log2,
    window,
    k_scale,
    v_scale,
    stride_qt,
    stride_qh,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    KV_FP8: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    q_tile = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start).to(tl.int32)
    if q_tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    prefix_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M * GROUP_PAD)
    token = q_tile * BLOCK_M + rows // GROUP_PAD
    head = rows % GROUP_PAD
    row_mask = (token < q_len) & (head < GROUP)
    q_pos = prefix_len + token
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_heads = kv_head * GROUP + head
    q_offsets = (q_start + token.to(tl.int64))[:, None] * stride_qt + q_heads[:, None] * stride_qh
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + q_offsets + dims[None, :], mask=io_mask, other=0.0)

    m_i = tl.full([BLOCK_M * GROUP_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], dtype=tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt
    k_base = key_cache_ptr + kv_head * stride_kc_head
    v_base = value_cache_ptr + kv_head * stride_vc_head
    # The last token of this tile sees up to its own position; nothing after it is loaded.
    kv_end = tl.minimum(seq_len, prefix_len + (q_tile + 1) * BLOCK_M)

    # Keys before the first query of this tile are visible to every row: those tiles (the cached prefix
    # and the part of the chunk already behind the tile) need neither the causal nor the length mask.
    # Only the tiles that cross the diagonal pay for masking.
    unmasked_end = tl.minimum(prefix_len + q_tile * BLOCK_M + 1, kv_end) // BLOCK_N * BLOCK_N
    masked_start = unmasked_end
    if SLIDING:  # every tile masked, from the first query's window on
        unmasked_end = 0
        masked_start = tl.maximum(prefix_len + q_tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _extend_attention_tile(
            q, m_i, l_i, acc, k_base, v_base, block_table_row, q_pos, dims, dim_mask, tile_start, kv_end,
            window, k_scale, v_scale, sm_scale_log2, stride_kc_block, stride_kc_slot, stride_vc_block,
            stride_vc_slot, PAGE_SIZE, BLOCK_N, False, False, KV_FP8, DOT_PRECISION,
        )  # fmt: skip
    for tile_start in range(masked_start, kv_end, BLOCK_N):
        m_i, l_i, acc = _extend_attention_tile(
            q, m_i, l_i, acc, k_base, v_base, block_table_row, q_pos, dims, dim_mask, tile_start, kv_end,
            window, k_scale, v_scale, sm_scale_log2, stride_kc_block, stride_kc_slot, stride_vc_block,
            stride_vc_slot, PAGE_SIZE, BLOCK_N, True, SLIDING, KV_FP8, DOT_PRECISION,
        )  # fmt: skip

    if HAS_SINKS:
        sink = tl.load(sinks_ptr + q_heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_new)
    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_offsets = (q_start + token.to(tl.int64))[:, None] * stride_ot + q_heads[:, None] * stride_oh
    tl.store(out_ptr + out_offsets + dims[None, :], acc.to(out_ptr.dtype.element_ty), mask=io_mask)


def extend_tile_config(
    head_dim: int, group: int, dtype: torch.dtype, capability: tuple[int, int] | None = None
) -> TileConfig:
    """The launch of the extend kernel for a model's shape on a GPU of compute ``capability`` (None:
    the interpreter): ``block_m`` is the query *tokens* of a program (its tile has ``block_m *
    next_power_of_2(group)`` rows), ``block_n`` the keys per tile.

    sm_90 runs the tile measured best on an H100 (benchmarks/attention_tuning.py). Before Hopper the
    MMA accumulators and operands live in registers: with head_dim 128 the 4-warp tile needs more than
    255 registers a thread and spills (ptxas, sm_80: 72 B a thread; tests/kernels/test_aot_compile.py),
    so 8 warps share it (184-192 registers, no spills). Not timed on an A100: none was available."""
    warps = _NUM_WARPS
    if capability is not None and capability[0] < 9 and head_dim > 64:
        warps = 2 * _NUM_WARPS
    return TileConfig(block_m=max(1, _ROWS // next_power_of_2(group)), block_n=_BLOCK_N,
                      num_warps=warps, num_stages=_NUM_STAGES)  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    tile: TileConfig | None = None,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    kv_scale: tuple[float, float] | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their paged context; returns ``out [T, H, D]``.
    An FP8 cache is dequantized in registers with ``kv_scale`` (as ``paged_decode_attention``).
    ``tile`` overrides :func:`extend_tile_config` (for tuning); ``sinks``/``window``: attention sinks
    and a sliding window (module docs).

    ``max_query_len`` must be at least the longest chunk (it sizes the grid; a smaller value would
    leave tokens unwritten), which is why it is required rather than read back from the device.
    """
    check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device, dtype = q.device, q.dtype
    num_tokens, num_heads, head_dim = q.shape
    key_cache, value_cache, kv_fp8 = fp8_cache_bytes(key_cache, value_cache)
    page_size, num_kv_heads = check_paged_kv_cache(
        key_cache, value_cache, dtype=torch.uint8 if kv_fp8 else dtype, device=device, head_dim=head_dim
    )
    k_scale, v_scale = kv_scale or (1.0, 1.0)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=device)
    batch = seq_lens.shape[0]
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc has {query_start_loc.shape[0]} entries for {batch} sequences")
    check_block_tables(block_tables, batch, device)
    check_sinks_and_window(sinks, window, num_heads, device)
    if num_tokens and not 1 <= max_query_len <= num_tokens:
        raise ValueError(f"max_query_len must be in [1, {num_tokens}] (the token count), got {max_query_len}")
    if out is None:
        out = torch.empty_like(q)
    else:
        check_tensor("out", out, ndim=3, dtypes=(dtype,), device=device, last_dim_contiguous=True)
        if out.shape != q.shape:
            raise ValueError(f"out shape {tuple(out.shape)} != q shape {tuple(q.shape)}")
    if batch == 0 or num_tokens == 0:
        return out

    group = num_heads // num_kv_heads
    tile = tile or extend_tile_config(head_dim, group, dtype, target_capability(device))
    count_launch("extend_attention")
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len, tile.block_m))
    launcher_for(_extend_attention_kernel, device, dtype)[grid](
        q, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
        q if sinks is None else sinks, out, scale * _LOG2E, window or 0, k_scale, v_scale,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=next_power_of_2(group), HEAD_DIM=head_dim,
        BLOCK_D=max(16, next_power_of_2(head_dim)), PAGE_SIZE=page_size, BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n, SLIDING=bool(window), HAS_SINKS=sinks is not None, KV_FP8=kv_fp8,
        DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
        **tile.launch_options,
    )  # fmt: skip
    return out


def extend_attention_reference(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
    kv_scale: tuple[float, float] | None = None,
) -> torch.Tensor:
    """PyTorch reference: per sequence, gather the context and run causal softmax attention in fp32."""
    out = torch.empty_like(q)
    k_scale, v_scale = kv_scale or (1.0, 1.0)
    key_cache = dequantized_cache(key_cache, k_scale, torch.float32)
    value_cache = dequantized_cache(value_cache, v_scale, torch.float32)
    group = q.shape[1] // key_cache.shape[2]
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_b = q[starts[b] : starts[b + 1]].float()
        q_len = q_b.shape[0]
        k = gather_paged_kv(key_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        v = gather_paged_kv(value_cache, block_tables[b], seq_len).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q_b, k) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        hidden = key_pos > q_pos
        if window:
            hidden |= key_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = softmax_with_sinks(scores, sinks)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out
