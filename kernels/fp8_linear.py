"""FP8 linear layer: ``y = x W^T`` with ``W`` in FP8 (e4m3) and fp32 scales per output row and group of
input columns (the engine's one layout for channel, tensor and block FP8: ``engine.models.fp8``).

Shapes:
  x             [M, K]  float16 / bfloat16 / float32
  weight        [N, K]  float8_e4m3fn
  weight_scale  [N, G]  float32, G = ceil(K / group): scale of row n over columns [g * group, (g+1) * group)
  out           [M, N]  x's dtype

Two modes, one kernel (``W8A8`` constexpr):
- W8A8 (sm_89 and later: FP8 tensor cores; 16-bit activations): the activations are quantized to FP8 per
  token and group of ``group`` columns, in PyTorch (``quantize_activations``: its rounding is exact,
  where Triton's interpreter rounds fp32 -> fp8 wrongly on a few values), and the kernel runs FP8 x FP8
  ``tl.dot`` with fp32 accumulation, scaling each group's partial product by both scales;
- weight-only (sm_80/86 have no FP8 tensor cores, and Triton has no e4m3 type there at all; fp32
  activations): the weight is read as bytes and decoded from e4m3 in registers (exactly:
  ``kernels._common.e4m3_to_f32``), cast to the activation's dtype, and the scales applied the same way.
With one group per row (channel and tensor scales) both scales multiply the accumulator once at the end;
with several (block FP8), each ``BLOCK_K`` step lies inside one group (``BLOCK_K`` divides ``group``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    check_tensor,
    count_launch,
    e4m3_to_f32,
    launcher_for,
    target_capability,
)

FP8_MAX = 448.0


@triton.jit
def _fp8_linear_kernel(
    a_ptr,
    a_scale_ptr,
    b_ptr,
    b_scale_ptr,
    c_ptr,
    M,
    N,
    K,
    group,
    stride_am,
    stride_asm,
    stride_bn,
    stride_bsn,
    stride_cm,
    W8A8: tl.constexpr,
    PER_ROW: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if not W8A8:  # bytes of e4m3 (see the module docs)
            b = e4m3_to_f32(b).to(a.dtype)
        if IEEE:
            part = tl.dot(a, b, input_precision="ieee")
        else:
            part = tl.dot(a, b)
        if PER_ROW:
            acc += part
        else:  # this K step lies inside one scale group
            g = k0 // group
            b_s = tl.load(b_scale_ptr + offs_n * stride_bsn + g, mask=n_mask, other=0.0)
            if W8A8:
                a_s = tl.load(a_scale_ptr + offs_m * stride_asm + g, mask=m_mask, other=0.0)
                acc += part * a_s[:, None] * b_s[None, :]
            else:
                acc += part * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if PER_ROW:
        b_s = tl.load(b_scale_ptr + offs_n * stride_bsn, mask=n_mask, other=0.0)
        acc = acc * b_s[None, :]
        if W8A8:
            a_s = tl.load(a_scale_ptr + offs_m * stride_asm, mask=m_mask, other=0.0)
            acc = acc * a_s[:, None]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(x_fp8 [M, K], scale [M, ceil(K / group)])``, dynamically per token and group."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group)[:, :k].contiguous(), scale


def use_w8a8(device: torch.device, dtype: torch.dtype) -> bool:
    """FP8 activations where FP8 tensor cores exist (sm_89+) and the activations are 16-bit."""
    capability = target_capability(device)
    return capability is not None and capability >= (8, 9) and dtype in (torch.float16, torch.bfloat16)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    w8a8: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [M, K] @ (weight * scale)^T`` -> ``[M, N]`` (module docs); ``w8a8``: force a mode (tests)."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    check_tensor("weight", weight, ndim=2, dtypes=(torch.float8_e4m3fn,), device=x.device)
    check_tensor("weight_scale", weight_scale, ndim=2, dtypes=(torch.float32,), device=x.device)
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [N, {k}], got {tuple(weight.shape)}")
    groups = weight_scale.shape[1]
    if weight_scale.shape[0] != n or groups < 1:
        raise ValueError(f"weight_scale must be [{n}, groups], got {tuple(weight_scale.shape)}")
    group = -(-k // groups)
    w8a8 = use_w8a8(x.device, x.dtype) if w8a8 is None else w8a8
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    per_row = groups == 1
    # Weight-only decodes a [BLOCK_K, BLOCK_N] tile in registers: 64 deep keeps it without spills on sm_80.
    widest = 128 if w8a8 else 64
    block_k = widest if per_row or group % widest == 0 else group
    if not per_row and (group % block_k or block_k < 16 or block_k & (block_k - 1)):
        raise ValueError(f"FP8 weight groups of {group} columns: the kernel needs a power of two >= 16")
    if w8a8:
        a, a_scale = quantize_activations(x, group)
        b = weight
    else:
        a, a_scale = x, weight_scale  # never read
        b = weight.view(torch.uint8)
    block_m = 16 if m <= 16 else 64
    # Weight-only decodes its tile in registers: a 64 x 128 tile of it spills on sm_80 (ptxas: 64 B a
    # thread, tests/kernels/test_aot_compile.py), 64 x 64 does not.
    block_n = 128 if w8a8 and n > 4096 and m > 16 else 64
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    count_launch("fp8_linear")
    launcher_for(_fp8_linear_kernel, x.device, x.dtype)[grid](
        a, a_scale, b, weight_scale, out, m, n, k, group,
        a.stride(0), a_scale.stride(0), weight.stride(0), weight_scale.stride(0), out.stride(0),
        W8A8=w8a8, PER_ROW=per_row, IEEE=x.dtype == torch.float32 and not w8a8,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3,
    )  # fmt: skip
    return out


def fp8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *, w8a8: bool = False
) -> torch.Tensor:
    """In fp32: the weight dequantized (and with ``w8a8`` the activations quantized as the kernel does)."""
    k = x.shape[1]
    group = -(-k // weight_scale.shape[1])
    w = weight.float() * weight_scale.repeat_interleave(group, dim=1)[:, :k]
    a = x.float()
    if w8a8:
        q, s = quantize_activations(x, group)
        a = q.float() * s.repeat_interleave(group, dim=1)[:, :k]
    return (a @ w.T).to(x.dtype)
