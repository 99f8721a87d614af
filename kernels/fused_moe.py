"""Fused mixture-of-experts: every token's top-k experts in two grouped GEMMs, one launch each.

A MoE layer sends each of T tokens to k of E experts (its ``topk_ids [T, k]``, weighted by
``topk_weights [T, k]``); each expert is a gated MLP, ``w13 [E, 2I, H]`` (gate rows, then up rows) and
``w2 [E, H, I]``. Running each expert as its own pair of matmuls costs 2E launches and a gather per
expert; a dense loop over tokens reads every expert's weights T times. Instead:

1. ``moe_align_block_size`` sorts the T*k (token, expert) *slots* by expert and pads each expert's run
   of slots to a multiple of ``BLOCK_M`` rows, so that a block of ``BLOCK_M`` rows belongs to one
   expert (``expert_ids[block]``). Padding rows hold the sentinel ``T*k``. It is made of device ops
   whose sizes depend only on T, k, E and ``BLOCK_M`` (no host sync), so a CUDA graph can capture it.
2. ``_fused_moe_kernel`` runs one grouped GEMM over those blocks: a program loads its block's token
   rows of the input (slot ``s`` reads row ``s // TOP_K``: the token for the first GEMM, the slot itself
   for the second), its expert's weight tile, accumulates in fp32, optionally multiplies each row by its
   slot's routing weight, and writes the rows back at their slot. Blocks past the padded length exit.
3. Between the two launches SiLU-and-mul (``kernels.silu_and_mul``); after them, the k slots of each
   token are summed (in fp32, rounded once).

Expert parallelism: ``expert_map [E_global]`` maps a global expert id to this rank's local index, or
-1 for an expert another rank holds; those slots are left out of the sort, so their output rows stay
zero and the caller's all-reduce adds the other ranks' share.

Tile sizes: ``fused_moe_config`` picks them by the number of tokens (small decode batches want small
``BLOCK_M``: most of a block would be padding otherwise); a JSON file of measured configs for a GPU
(``kernels/moe_configs/E=..,N=..,device_name=...json``, written by ``benchmarks/moe.py --tune``) takes
precedence. fp32 operands use IEEE products (``input_precision="ieee"``), not TF32, so float32 runs are
exact enough to compare with a PyTorch reference.

Shapes:
  x             [T, H]           float32 / float16 / bfloat16
  w13           [E_local, 2I, H]
  w2            [E_local, H, I]
  topk_weights  [T, k] float32;  topk_ids [T, k] int32/int64 (global expert ids)
  out           [T, H]
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_tensor,
    count_launch,
    e4m3_to_f32,
    launcher_for,
    target_capability,
)
from kernels.silu_and_mul import silu_and_mul

CONFIG_DIR = Path(__file__).parent / "moe_configs"


@dataclass(frozen=True)
class MoETileConfig:
    """One launch of the grouped GEMM: rows (slots) per block, output columns, reduction step, how many
    row blocks share a column band (``group_m``: consecutive programs reuse the same weight tile from
    L2), warps and pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


def _default_config(num_tokens: int, capability: tuple[int, int] | None) -> MoETileConfig:
    """Untuned defaults. A decode batch routes few slots to each expert, so a block of 16 rows wastes
    least on padding; prefill batches fill 64-row blocks. The interpreter (capability None) runs one
    program at a time, so fewer, larger tiles are faster there."""
    if capability is None:
        return MoETileConfig(block_m=16, block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=1)
    if num_tokens <= 64:
        return MoETileConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    return MoETileConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def config_file_name(num_experts: int, n: int, device_name: str) -> str:
    return f"E={num_experts},N={n},device_name={device_name.replace(' ', '_')}.json"


@functools.cache
def _tuned_configs(file_name: str) -> dict[int, MoETileConfig]:
    return read_tuned_configs(CONFIG_DIR / file_name)


def read_tuned_configs(path: Path) -> dict[int, MoETileConfig]:
    """A tuned-config file: ``{"<tokens>": {block_m, block_n, block_k, group_m, num_warps, num_stages}}``
    (empty when there is none)."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        return {int(tokens): MoETileConfig(**cfg) for tokens, cfg in json.load(f).items()}


def nearest_config(tuned: dict[int, MoETileConfig], num_tokens: int) -> MoETileConfig:
    """The config measured at the token count nearest ``num_tokens`` (the smaller one on a tie)."""
    return tuned[min(tuned, key=lambda t: (abs(t - num_tokens), t))]


def fused_moe_config(
    num_tokens: int, num_experts: int, n: int, device: torch.device
) -> MoETileConfig:
    """The tile for ``num_tokens`` tokens through experts with ``n`` output columns of the first GEMM
    (``2I``) on ``device``: a measured one for this GPU (the nearest measured token count) if a config
    file exists, else the default."""
    capability = target_capability(device)
    if capability is not None and device.type == "cuda":
        tuned = _tuned_configs(config_file_name(num_experts, n, torch.cuda.get_device_name(device)))
        if tuned:
            return nearest_config(tuned, num_tokens)
    return _default_config(num_tokens, capability)


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    b_scale_ptr,
    bias_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_padded_rows,
    num_valid_slots,
    scale_group,
    stride_am,
    stride_be,
    stride_bn,
    stride_bse,
    stride_bsn,
    stride_bias_e,
    stride_cm,
    TOP_K: tl.constexpr,
    B_FP8: tl.constexpr,
    PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # C[slot, n] = sum_k A[slot // TOP_K, k] * B[expert(slot), n, k]   (B rows are output columns)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(num_padded_rows, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row blocks walk a column band together, reusing B's tiles from L2.
    group = pid // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_size
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_size
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_token_ids_ptr + offs_m).to(tl.int64)
    slot_mask = slots < num_valid_slots
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (slots // TOP_K)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0)
        if B_FP8:  # e4m3 bytes, decoded here (weight-only: every target, sm_80 included)
            b = e4m3_to_f32(b).to(a.dtype)
            if PER_ROW:
                part = tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)
                acc += part
            else:  # this K step lies in one scale group
                b_s = tl.load(b_scale_ptr + expert * stride_bse + offs_n * stride_bsn + k0 // scale_group,
                              mask=n_mask, other=0.0)
                part = tl.dot(a, b, input_precision="ieee") if IEEE else tl.dot(a, b)
                acc += part * b_s[None, :]
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if B_FP8 and PER_ROW:
        row_scale = tl.load(b_scale_ptr + expert * stride_bse + offs_n * stride_bsn, mask=n_mask, other=0.0)
        acc = acc * row_scale[None, :]
    if HAS_BIAS:  # the expert's bias, before the routing weight (as the reference adds it)
        bias = tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_mask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights_ptr + slots, mask=slot_mask, other=0.0)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + slots[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=slot_mask[:, None] & n_mask[None, :])


def max_padded_rows(num_slots: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the sorted, padded slot count: each non-empty expert adds under ``block_m``
    rows of padding, and at most ``min(E, slots)`` experts are non-empty."""
    return num_slots + min(num_experts, num_slots) * (block_m - 1)


def moe_align_block_size(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the slots of ``topk_ids [T, k]`` by (local) expert and pad each expert's run to ``block_m``.

    Returns ``sorted_slots [P]`` (slot indices ``t * k + j``; the sentinel ``T * k`` in padding rows and
    past the end), ``block_experts [cdiv(P, block_m)]`` (the local expert of each block of rows; blocks
    past the padded length repeat the last expert and are never run) and ``num_padded [1]`` (the padded
    length actually used), with ``P = max_padded_rows(T * k, num_experts, block_m)``.
    ``num_experts`` counts this rank's experts; with ``expert_map`` (global id -> local id or -1) slots
    of experts held elsewhere are dropped. Device ops only, sizes fixed by the shapes (no host sync)."""
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_slots = flat.numel()
    if expert_map is not None:
        flat = expert_map.to(torch.int64)[flat]
    flat = torch.where(flat < 0, num_experts, flat)  # other ranks' experts: a bucket past the last
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    size = max_padded_rows(num_slots, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    run_starts = torch.cumsum(counts, 0) - counts
    rank_in_run = torch.arange(num_slots, device=device) - run_starts[sorted_experts]
    # Slots of other ranks' experts go to one extra row past the end, cut off below. (F.pad, not a tensor
    # made from a Python list: no host-to-device copy, which a CUDA graph could not capture.)
    dest_starts = torch.nn.functional.pad(padded_starts, (0, 1), value=size)
    dest = torch.where(sorted_experts < num_experts, dest_starts[sorted_experts] + rank_in_run, size)
    sorted_slots = torch.full((size + 1,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, size, block_m, dtype=torch.int64, device=device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_slots[:size], block_experts.to(torch.int32), padded_ends[-1:].to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    top_k: int,
    mul_routed_weight: bool,
    cfg: MoETileConfig,
    b_scale: torch.Tensor | None = None,
) -> None:
    sorted_slots, block_experts, num_padded = aligned
    n, k = b.shape[1], b.shape[2]
    block_k, group, per_row = cfg.block_k, k, True
    if b_scale is not None:
        b = b.view(torch.uint8)  # e4m3 bytes: Triton has no e4m3 type on sm_80
        per_row = b_scale.shape[2] == 1
        group = -(-k // b_scale.shape[2])
        if not per_row:
            block_k = min(block_k, group)
            if group % block_k or block_k & (block_k - 1) or block_k < 16:
                raise ValueError(f"FP8 expert groups of {group} columns: the kernel needs a power of two "
                                 ">= 16")
    grid = (triton.cdiv(sorted_slots.numel(), cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    count_launch("fused_moe")
    scale = b if b_scale is None else b_scale  # never read without FP8
    launcher_for(_fused_moe_kernel, a.device, a.dtype)[grid](
        a, b, scale, b if bias is None else bias, c, topk_weights, sorted_slots, block_experts, num_padded,
        n, k, sorted_slots.numel(), topk_weights.numel(), group,
        a.stride(0), b.stride(0), b.stride(1),
        0 if b_scale is None else b_scale.stride(0), 0 if b_scale is None else b_scale.stride(1),
        0 if bias is None else bias.stride(0), c.stride(0),
        TOP_K=top_k, B_FP8=b_scale is not None, PER_ROW=per_row, HAS_BIAS=bias is not None,
        MUL_ROUTED_WEIGHT=mul_routed_weight, IEEE=a.dtype == torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    config: MoETileConfig | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * expert(topk_ids[t, j])(x[t])`` for the gated experts
    ``w13``/``w2`` held here (see the module docs); ``config``: an explicit tile (benchmarks).
    ``w13_bias [E, 2I]`` / ``w2_bias [E, H]``: the projections' biases; ``activation``: ``silu`` or
    gpt-oss's clamped ``swiglu_oai`` (``swiglu_alpha``, ``swiglu_limit``). FP8 experts: ``w13``/``w2`` in
    e4m3 with fp32 ``w13_scale [E, 2I, G]`` / ``w2_scale [E, H, G]`` per output row and group of input
    columns (``engine.models.fp8``'s layout), decoded in registers (weight-only)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    weight_dtype = torch.float8_e4m3fn if w13_scale is not None else x.dtype
    check_tensor("w13", w13, ndim=3, dtypes=(weight_dtype,), device=x.device)
    check_tensor("w2", w2, ndim=3, dtypes=(weight_dtype,), device=x.device)
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("FP8 experts need both w13_scale and w2_scale")
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES, device=x.device)
    check_tensor("topk_weights", topk_weights, ndim=2, dtypes=(torch.float32,), device=x.device)
    num_tokens, hidden = x.shape
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    if two_inter % 2 or w13.shape[2] != hidden:
        raise ValueError(f"w13 must be [experts, 2 * intermediate, {hidden}], got {tuple(w13.shape)}")
    if tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"w2 must be {(num_experts, hidden, two_inter // 2)}, got {tuple(w2.shape)}")
    if topk_ids.shape[0] != num_tokens or tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [{num_tokens}, top_k]")
    if expert_map is not None:
        check_tensor("expert_map", expert_map, ndim=1, dtypes=INDEX_DTYPES, device=x.device)
    for name, bias, shape in (("w13_bias", w13_bias, (num_experts, two_inter)),
                              ("w2_bias", w2_bias, (num_experts, hidden))):
        if bias is not None:
            check_tensor(name, bias, ndim=2, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
            if tuple(bias.shape) != shape:
                raise ValueError(f"{name} must be {shape}, got {tuple(bias.shape)}")
    if activation not in ("silu", "swiglu_oai"):
        raise ValueError(f"activation must be silu or swiglu_oai, got {activation!r}")
    for name, t in (("x", x), ("w13", w13), ("w2", w2)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    cfg = config or fused_moe_config(num_tokens, num_experts, two_inter, x.device)
    aligned = moe_align_block_size(topk_ids, num_experts, cfg.block_m, expert_map)
    weights = topk_weights.contiguous().view(-1)
    num_slots = num_tokens * top_k
    # With an expert map, the rows of slots that are not run here (other ranks' experts) are never
    # written: zeros, so that they add nothing to the sum (and the activation reads no garbage).
    alloc = torch.empty if expert_map is None else torch.zeros
    gate_up = alloc((num_slots, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, w13_bias, gate_up, weights, aligned, top_k, False, cfg, w13_scale)
    if activation == "silu":
        act = silu_and_mul(gate_up)
    else:
        act = swiglu_oai(gate_up, swiglu_alpha, swiglu_limit)
    down = alloc((num_slots, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, w2_bias, down, weights, aligned, 1, True, cfg, w2_scale)
    out.copy_(down.view(num_tokens, top_k, hidden).float().sum(dim=1))
    return out


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of ``[n, 2I]`` (gate | up): gate clamped above at ``limit``, up to
    ``[-limit, limit]``, ``(up + 1) * gate * sigmoid(alpha * gate)``; computed in fp32, rounded once."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return ((up + 1) * gate * torch.sigmoid(alpha * gate)).to(gate_up.dtype)


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Slot by slot in fp32: each (token, expert) pair's gated MLP, weighted, summed over the k pairs."""
    if w13_scale is not None and w2_scale is not None:  # FP8 experts, dequantized
        def dequantize(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            group = -(-w.shape[2] // s.shape[2])
            return w.float() * s.repeat_interleave(group, dim=2)[:, :, : w.shape[2]]

        w13, w2 = dequantize(w13, w13_scale), dequantize(w2, w2_scale)
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w13.shape[1] // 2
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(topk_ids[t, j])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            h = w13[e].float() @ x[t].float()
            if w13_bias is not None:
                h += w13_bias[e].float()
            if activation == "silu":
                act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            else:
                act = swiglu_oai(h[None], swiglu_alpha, swiglu_limit)[0]
            y = w2[e].float() @ act
            if w2_bias is not None:
                y += w2_bias[e].float()
            out[t] += float(topk_weights[t, j]) * y
    return out.to(x.dtype)
