"""LoRA shrink and expand for a batch of tokens grouped by adapter slot (the SGMV design).

A step's tokens that run through an adapter are sorted by its device slot: ``rows [N]`` are their token
rows, group ``g`` is ``rows[starts[g]:starts[g + 1]]`` and uses slot ``slots[g]``; the base model's tokens
are in no group, so no program touches them. With A stacked ``[S, R, K]`` and B ``[S, N_out, R]``
(``engine.lora.layers``):

- ``lora_shrink``: ``h[i] = x[rows[i]] @ A[slot]^T`` for every grouped token, ``h [N, R]`` in float32;
- ``lora_expand``: ``y[rows[i]] += scaling[slot] * (h[i] @ B[slot]^T)``, in place (``scaling`` None: 1,
  the engine folds it into B).

The engine's layout (``ranks``, ``rank_stride``, ``part_bounds``): a fused projection's rank rows come in one
block of ``max_rank`` rows per part (q, k, v; gate, up), of which a slot's adapter fills the first ``rank``;
part ``p``'s output columns take only block ``p`` of B. The kernels read nothing else: a rank-8 adapter in
rank-64 slots moves an eighth of the bytes, and an expand tile of q columns reads no k or v block.

Each program computes one ``BLOCK_M`` x ``BLOCK_R`` (shrink) or ``BLOCK_M`` x ``BLOCK_N`` (expand) tile
of one group, looping over the reduced dimension with ``tl.dot`` and float32 accumulation; the grid's
second axis covers the largest group, and programs past their own group's end return at once. A token is
in exactly one group, so no two programs write the same output element (no atomics). ``h`` stays in
float32 between the two launches and is rounded to the weights' dtype for the second product, as the
PyTorch path rounds ``A x`` to the model dtype; the addition into ``y`` is in float32, rounded once.
float32 operands use IEEE products (``input_precision="ieee"``), not TF32.

Tile sizes are fixed, not tuned: there was no GPU to measure on when this was written. ``BLOCK_M`` 16 is
``tl.dot``'s smallest M and a decode step's groups are often a handful of tokens; the rank tile covers a
fused projection's ``parts * max_rank`` rows in 64s; the K and N tiles are the usual 64-128 of a GEMM.
"""

from __future__ import annotations

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

_BLOCK_M = 16


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, h_ptr, rows_ptr, starts_ptr, slots_ptr, ranks_ptr,
    stride_x_row, stride_a_slot, stride_a_rank, stride_h_row,
    K, R, RANK_STRIDE,
    HAS_RANKS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    start = tl.load(starts_ptr + group)
    end = tl.load(starts_ptr + group + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    slot = tl.load(slots_ptr + group).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    tokens = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    if HAS_RANKS:  # rows past the slot's rank in each part are zero: neither read nor multiplied
        mask_r = mask_r & (offs_r % RANK_STRIDE < tl.load(ranks_ptr + slot))
    k_end = tl.where(tl.max(mask_r.to(tl.int32), axis=0) > 0, K, 0)  # a tile of zero rows: no loop
    a_base = a_ptr + slot * stride_a_slot + offs_r.to(tl.int64)[None, :] * stride_a_rank
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_x_row + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [M, K]
        a = tl.load(a_base + offs_k[:, None], mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [K, R]
        if IEEE:
            acc = tl.dot(x, a, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, a, acc)
    h = h_ptr + offs_m.to(tl.int64)[:, None] * stride_h_row + offs_r[None, :]
    tl.store(h, acc, mask=mask_m[:, None] & (offs_r < R)[None, :])


@triton.jit
def _lora_expand_kernel(
    h_ptr, b_ptr, y_ptr, rows_ptr, starts_ptr, slots_ptr, scaling_ptr, ranks_ptr,
    stride_h_row, stride_b_slot, stride_b_out, stride_y_row,
    N, R, RANK_STRIDE, BOUND_1, BOUND_2,
    NUM_PARTS: tl.constexpr, HAS_SCALING: tl.constexpr, HAS_RANKS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    group = tl.program_id(0)
    start = tl.load(starts_ptr + group)
    end = tl.load(starts_ptr + group + 1)
    first = start + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    slot = tl.load(slots_ptr + group).to(tl.int64)
    offs_m = first + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    tokens = tl.load(rows_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
    n0 = tl.program_id(2) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # A fused projection's B is block-diagonal: the columns of part p read only rank rows
    # [p * RANK_STRIDE, (p + 1) * RANK_STRIDE). The parts this tile's columns span bound the loop.
    # A tile that straddles parts reads, for each column, only its own part's block.
    part_of_n = tl.zeros((BLOCK_N,), dtype=tl.int32)
    if NUM_PARTS > 1:
        part_of_n += (offs_n >= BOUND_1).to(tl.int32)
    if NUM_PARTS > 2:
        part_of_n += (offs_n >= BOUND_2).to(tl.int32)
    part_first = tl.min(part_of_n, axis=0)
    part_last = tl.max(tl.where(mask_n, part_of_n, 0), axis=0)
    r_start = part_first * RANK_STRIDE
    r_end = tl.minimum((part_last + 1) * RANK_STRIDE, R)
    rank = RANK_STRIDE
    if HAS_RANKS:
        rank = tl.load(ranks_ptr + slot)
    b_base = b_ptr + slot * stride_b_slot + offs_n.to(tl.int64)[None, :] * stride_b_out
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(r_start, r_end, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = (offs_r < r_end) & (offs_r % RANK_STRIDE < rank)
        h = tl.load(h_ptr + offs_m.to(tl.int64)[:, None] * stride_h_row + offs_r[None, :],
                    mask=mask_m[:, None] & mask_r[None, :], other=0.0)  # [M, R] float32
        own = ((offs_r // RANK_STRIDE)[:, None] == part_of_n[None, :]) & mask_r[:, None] & mask_n[None, :]
        b = tl.load(b_base + offs_r[:, None], mask=own, other=0.0)  # [R, N]
        if IEEE:
            acc = tl.dot(h.to(b.dtype), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(h.to(b.dtype), b, acc)
    if HAS_SCALING:
        acc = acc * tl.load(scaling_ptr + slot)
    y = y_ptr + tokens[:, None] * stride_y_row + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    old = tl.load(y, mask=mask, other=0.0).to(tl.float32)
    tl.store(y, (old + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _check_groups(rows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor, device: torch.device) -> int:
    """Check the grouping; returns the number of groups."""
    check_tensor("rows", rows, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("starts", starts, ndim=1, dtypes=INDEX_DTYPES, device=device)
    check_tensor("slots", slots, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if starts.shape[0] != slots.shape[0] + 1:
        raise ValueError(f"starts must have one entry more than slots ({slots.shape[0] + 1}), got "
                         f"{starts.shape[0]}")
    for name, t in (("rows", rows), ("starts", starts), ("slots", slots)):
        if t.shape[0] > 1 and t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    return slots.shape[0]


def _check_layout(ranks: torch.Tensor | None, rank_stride: int | None, total: int, num_slots: int,
                  device: torch.device) -> int:
    """Check the rank layout; returns the rows per part."""
    stride = total if rank_stride is None else rank_stride
    if stride < 1 or total % stride:
        raise ValueError(f"rank_stride must divide the {total} rank rows, got {rank_stride}")
    if ranks is not None:
        check_tensor("ranks", ranks, ndim=1, dtypes=INDEX_DTYPES, device=device)
        if ranks.shape[0] != num_slots:
            raise ValueError(f"ranks must have one entry per slot ({num_slots}), got {ranks.shape[0]}")
    return stride


def lora_shrink(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                slots: torch.Tensor, max_rows: int, out: torch.Tensor | None = None, *,
                ranks: torch.Tensor | None = None, rank_stride: int | None = None) -> torch.Tensor:
    """``x [T, K]``, ``a [S, R, K]`` -> ``h [N, R]`` float32: ``h[i] = x[rows[i]] @ a[slot of i]^T`` (see the
    module docs; ``max_rows``: the largest group, known on the host). With ``ranks [S]``, the rank rows
    come in blocks of ``rank_stride`` (one per part of a fused projection) of which only the first
    ``ranks[slot]`` are read; the others are zero in ``h``."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("a", a, ndim=3, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
    if a.shape[2] != x.shape[1]:
        raise ValueError(f"a's input width {a.shape[2]} != x's {x.shape[1]}")
    groups = _check_groups(rows, starts, slots, x.device)
    num, rank = rows.shape[0], a.shape[1]
    stride = _check_layout(ranks, rank_stride, rank, a.shape[0], x.device)
    if out is None:
        out = torch.empty((num, rank), dtype=torch.float32, device=x.device)
    else:
        check_tensor("out", out, ndim=2, dtypes=(torch.float32,), device=x.device, last_dim_contiguous=True)
        if tuple(out.shape) != (num, rank):
            raise ValueError(f"out must have shape {(num, rank)}, got {tuple(out.shape)}")
    if num == 0 or groups == 0 or max_rows <= 0:
        return out
    block_r = min(64, max(16, next_power_of_2(rank)))
    block_k = min(128, max(16, next_power_of_2(x.shape[1])))
    grid = (groups, triton.cdiv(max_rows, _BLOCK_M), triton.cdiv(rank, block_r))
    count_launch("lora_shrink")
    launcher_for(_lora_shrink_kernel, x.device, x.dtype)[grid](
        x, a, out, rows, starts, slots, slots if ranks is None else ranks,
        x.stride(0), a.stride(0), a.stride(1), out.stride(0), x.shape[1], rank, stride,
        HAS_RANKS=ranks is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def lora_expand(h: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                slots: torch.Tensor, max_rows: int, y: torch.Tensor, scaling: torch.Tensor | None = None,
                *, ranks: torch.Tensor | None = None, rank_stride: int | None = None,
                part_bounds: tuple[int, ...] = ()) -> torch.Tensor:
    """``y[rows[i]] += scaling[slot] * (h[i] @ b[slot]^T)`` in place, for ``h [N, R]`` (float32),
    ``b [S, N_out, R]``, ``y [T, N_out]`` (``scaling [S]`` float32, None: 1); returns ``y``. A fused
    projection's layout: ``part_bounds``, the output columns where its parts after the first start (at
    most two), part ``p`` reading only rank rows ``[p * rank_stride, (p + 1) * rank_stride)`` of B (B is
    zero elsewhere); with ``ranks [S]``, only the first ``ranks[slot]`` rows of each block."""
    check_tensor("y", y, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("b", b, ndim=3, dtypes=(y.dtype,), device=y.device, last_dim_contiguous=True)
    check_tensor("h", h, ndim=2, dtypes=(torch.float32,), device=y.device, last_dim_contiguous=True)
    if b.shape[1] != y.shape[1]:
        raise ValueError(f"b's output width {b.shape[1]} != y's {y.shape[1]}")
    if h.shape != (rows.shape[0], b.shape[2]):
        raise ValueError(f"h must have shape {(rows.shape[0], b.shape[2])}, got {tuple(h.shape)}")
    groups = _check_groups(rows, starts, slots, y.device)
    if scaling is not None:
        check_tensor("scaling", scaling, ndim=1, dtypes=(torch.float32,), device=y.device)
        if scaling.shape[0] != b.shape[0]:
            raise ValueError(f"scaling must have one entry per slot ({b.shape[0]}), got {scaling.shape[0]}")
    num, rank, width = rows.shape[0], b.shape[2], b.shape[1]
    stride = _check_layout(ranks, rank_stride, rank, b.shape[0], y.device)
    parts = len(part_bounds) + 1
    if parts > 3 or list(part_bounds) != sorted(part_bounds) or not all(0 < c < width for c in part_bounds):
        raise ValueError(f"part_bounds must be at most two increasing columns inside {width}, got "
                         f"{part_bounds}")
    if parts * stride > rank:
        raise ValueError(f"{parts} parts of {stride} rank rows need {parts * stride} rows, b has {rank}")
    if num == 0 or groups == 0 or max_rows <= 0 or width == 0:
        return y
    block_n = min(128, max(16, next_power_of_2(width)))
    block_r = min(64, max(16, next_power_of_2(stride)))
    bounds = (*part_bounds, 0, 0)[:2]
    grid = (groups, triton.cdiv(max_rows, _BLOCK_M), triton.cdiv(width, block_n))
    count_launch("lora_expand")
    launcher_for(_lora_expand_kernel, y.device, y.dtype)[grid](
        h, b, y, rows, starts, slots, h if scaling is None else scaling, slots if ranks is None else ranks,
        h.stride(0), b.stride(0), b.stride(1), y.stride(0), width, rank, stride, bounds[0], bounds[1],
        NUM_PARTS=parts, HAS_SCALING=scaling is not None, HAS_RANKS=ranks is not None,
        IEEE=y.dtype == torch.float32, BLOCK_M=_BLOCK_M, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
    return y


def _used_rows(total: int, stride: int, rank: int | None, device: torch.device) -> torch.Tensor:
    """Which of ``total`` rank rows a slot of ``rank`` reads (blocks of ``stride``), as 0/1 floats."""
    within = torch.arange(total, device=device) % stride
    return (within < (stride if rank is None else rank)).float()


def lora_shrink_reference(x: torch.Tensor, a: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                          slots: torch.Tensor, *, ranks: torch.Tensor | None = None,
                          rank_stride: int | None = None) -> torch.Tensor:
    total = a.shape[1]
    h = torch.zeros((rows.shape[0], total), dtype=torch.float32, device=x.device)
    bounds = starts.tolist()
    for g, slot in enumerate(slots.tolist()):
        picked = rows[bounds[g]:bounds[g + 1]]
        used = _used_rows(total, rank_stride or total, None if ranks is None else int(ranks[slot]), x.device)
        h[bounds[g]:bounds[g + 1]] = x[picked].float() @ (a[slot].float() * used[:, None]).T
    return h


def lora_expand_reference(h: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                          slots: torch.Tensor, y: torch.Tensor, scaling: torch.Tensor | None = None, *,
                          ranks: torch.Tensor | None = None, rank_stride: int | None = None,
                          part_bounds: tuple[int, ...] = ()) -> torch.Tensor:
    total, width = b.shape[2], b.shape[1]
    stride = rank_stride or total
    starts_of_parts = torch.tensor(part_bounds, dtype=torch.int64, device=y.device)
    part_of_column = torch.bucketize(torch.arange(width, device=y.device), starts_of_parts, right=True)
    # Column n of part p reads rank rows [p * stride, (p + 1) * stride) only.
    block = (part_of_column[:, None] == torch.arange(total, device=y.device)[None, :] // stride).float()
    out = y.clone()
    bounds = starts.tolist()
    for g, slot in enumerate(slots.tolist()):
        picked = rows[bounds[g]:bounds[g + 1]]
        used = _used_rows(total, stride, None if ranks is None else int(ranks[slot]), y.device)
        weight = b[slot].float() * block * used[None, :]
        delta = (h[bounds[g]:bounds[g + 1]] * used[None, :]).to(b.dtype).float() @ weight.T
        if scaling is not None:
            delta = delta * scaling[slot]
        out[picked] = (y[picked].float() + delta).to(y.dtype)
    return out
