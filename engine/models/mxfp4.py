"""MXFP4 (OCP microscaling FP4), as gpt-oss's released checkpoints store their experts: dequantized at
load time to the model's dtype. No torch kernels read MXFP4 here.

A tensor ``W [..., K]`` is stored as ``blocks [..., K / 32, 16]`` uint8 and ``scales [..., K / 32]``
uint8: each block of 32 values shares one power-of-two scale (E8M0: ``2 ** (scale - 127)``), and each
byte holds two FP4 (E2M1) values, the low nibble first. E2M1's 16 codes are the values below.
"""

from __future__ import annotations

import torch

FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks [..., G, 16]`` uint8 + ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: "
                         "expected blocks [..., G, 16] and scales [..., G]")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble, high nibble, ...
    exponents = scales.to(torch.int32) - 127
    out = torch.ldexp(values, exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def quantize_mxfp4(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., K]`` (K a multiple of 32) -> ``(blocks, scales)`` (round to the nearest FP4 code after
    choosing each block's scale so that its largest magnitude fits in 6): for tests and tiny
    checkpoints shaped as the released ones."""
    *prefix, k = weights.shape
    if k % BLOCK:
        raise ValueError(f"the last dimension ({k}) must be a multiple of {BLOCK}")
    w = weights.float().reshape(*prefix, k // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = w / torch.pow(2.0, exponents).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32)
    codes = (scaled.abs().unsqueeze(-1) - lut).abs().argmin(dim=-1)  # nearest magnitude
    codes = torch.where((scaled < 0) & (codes > 0), codes + 8, codes).to(torch.uint8)
    pairs = codes.reshape(*prefix, k // BLOCK, BLOCK // 2, 2)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponents.to(torch.int32) + 127).to(torch.uint8).contiguous()
