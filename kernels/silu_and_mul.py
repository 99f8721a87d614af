"""SiLU-and-mul, the gated MLP activation: ``out = silu(x[..., :I]) * x[..., I:]`` for ``x [..., 2I]``.

The model's fused ``gate_up`` projection produces ``[gate | up]`` along the last dimension; fusing the
activation reads that once and writes half of it, instead of three elementwise passes. Computed in fp32
and rounded once to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import FLOAT_DTYPES, check_tensor, count_launch, launcher_for

# Columns per program. 1024 fp16 elements = 2 KiB per operand: long enough rows for full-width
# vector loads, small enough that an 11008-wide Llama MLP still spreads over 11 programs per row.
_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x_row,
    stride_out_row,
    INTERMEDIATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    gate = tl.load(x_ptr + row * stride_x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x_row + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g), in fp32 so large |g| neither overflows nor loses the product's precision.
    act = gate / (1.0 + tl.exp(-gate))
    tl.store(out_ptr + row * stride_out_row + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., 2 * I]`` -> ``out [..., I]`` = ``silu(gate) * up``."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, last_dim_contiguous=True)
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension [..., 2 * intermediate], got {tuple(x.shape)}")
    intermediate = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], intermediate)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    else:
        check_tensor("out", out, dtypes=(x.dtype,), device=x.device, last_dim_contiguous=True)
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape}, got {tuple(out.shape)}")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or intermediate == 0:
        return out
    # Flatten leading dims without copying: allowed when they collapse to one stride.
    x2 = x.view(rows, x.shape[-1]) if x.is_contiguous() else x.reshape(rows, x.shape[-1])
    out2 = out.view(rows, intermediate) if out.is_contiguous() else None
    if out2 is None:
        raise ValueError("out must be contiguous")
    count_launch("silu_and_mul")
    launcher_for(_silu_and_mul_kernel, x.device, x.dtype)[(rows, triton.cdiv(intermediate, _BLOCK))](
        x2, out2, x2.stride(0), out2.stride(0), INTERMEDIATE=intermediate, BLOCK=_BLOCK
    )
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)
