"""RMSNorm, optionally fused with the residual add that precedes it in every decoder layer.

Without residual: ``out = x / sqrt(mean(x^2) + eps) * weight``.
With residual:    ``residual_out = x + residual``; ``out = rmsnorm(residual_out) * weight``.

Rounding follows the unfused Hugging Face Llama code so both backends agree: the sum is rounded to the
activation dtype (it is what the next layer's residual stream stores), its square-mean is taken in fp32,
the normalised value is rounded to the activation dtype and then scaled by ``weight``.

One program per row: a row (hidden size <= 16k) fits one tile, so the row is read once, reduced in
registers and written once. ``out``/``residual_out`` may alias ``x``/``residual`` (each program reads
its whole row before writing it), which is how the runner does it in place.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from kernels._common import FLOAT_DTYPES, check_tensor, count_launch, launcher_for, next_power_of_2

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.sum(xf * xf, axis=0) / HIDDEN
    normed = (xf * (1.0 / tl.sqrt(mean_sq + eps))).to(out_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * stride_o + cols,
        (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def _as_rows(name: str, t: torch.Tensor, rows: int, hidden: int) -> torch.Tensor:
    try:
        return t.view(rows, hidden)
    except RuntimeError as exc:
        raise ValueError(f"{name} must be viewable as [{rows}, {hidden}] (rows with one stride)") from exc


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None, *,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
) -> torch.Tensor: ...


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, *,
    out: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x [..., hidden]``; with ``residual`` returns ``(out, residual_out)``."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    device, dtype = x.device, x.dtype
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension [..., hidden]")
    hidden = x.shape[-1]
    if not 0 < hidden <= _MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {_MAX_HIDDEN}], got {hidden}")
    check_tensor("weight", weight, ndim=1, dtypes=FLOAT_DTYPES, device=device, last_dim_contiguous=True)
    if weight.shape[0] != hidden:
        raise ValueError(f"weight has {weight.shape[0]} elements for hidden size {hidden}")
    if not eps > 0.0:
        raise ValueError(f"eps must be positive, got {eps}")
    rows = x.numel() // hidden
    if out is None:
        out = torch.empty_like(x)
    check_tensor("out", out, dtypes=(dtype,), device=device, last_dim_contiguous=True)
    if out.shape != x.shape:
        raise ValueError(f"out shape {tuple(out.shape)} != x shape {tuple(x.shape)}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=(dtype,), device=device, last_dim_contiguous=True)
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual_out is None:
            residual_out = torch.empty_like(x)
        check_tensor("residual_out", residual_out, dtypes=(dtype,), device=device, last_dim_contiguous=True)
        if residual_out.shape != x.shape:
            raise ValueError(f"residual_out shape {tuple(residual_out.shape)} != x shape {tuple(x.shape)}")
    elif residual_out is not None:
        raise ValueError("residual_out given without residual")
    if rows:
        x2, out2 = _as_rows("x", x, rows, hidden), _as_rows("out", out, rows, hidden)
        r2 = _as_rows("residual", residual, rows, hidden) if residual is not None else x2
        ro2 = _as_rows("residual_out", residual_out, rows, hidden) if residual_out is not None else out2
        count_launch("rms_norm")
        launcher_for(_rms_norm_kernel, device, dtype)[(rows,)](
            x2, r2, weight, out2, ro2,
            x2.stride(0), r2.stride(0), out2.stride(0), ro2.stride(0), float(eps),
            HIDDEN=hidden, BLOCK=next_power_of_2(hidden), HAS_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, next_power_of_2(hidden) // 256)),
        )  # fmt: skip
    if residual is None:
        return out
    if residual_out is None:  # allocated above whenever residual is given
        raise RuntimeError("rms_norm: residual_out missing for a residual call")
    return out, residual_out


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Unfused PyTorch RMSNorm with the same rounding points as the kernel."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)).to(x.dtype)
    out = (normed.float() * weight.float()).to(x.dtype)
    return out if residual is None else (out, x)
