"""FP8 (e4m3) weights: the checkpoint formats, quantisation, and the quantized linear layers.

Formats read (``quantization_config`` in ``config.json``; ``Fp8Args.from_hf_config``):

- compressed-tensors ``float-quantized`` (``quant_method: "compressed-tensors"``): ``X.weight`` in
  F8_E4M3 and an fp32 ``X.weight_scale`` per output channel (``[out, 1]``, strategy ``channel``) or per
  tensor (``[1]``, strategy ``tensor``); modules in ``ignore`` stay 16-bit. Activations are quantized
  dynamically per token here even where the checkpoint has static ``input_scale``s (those are skipped):
  a per-token scale is never coarser than one scale for every token;
- block FP8 (``quant_method: "fp8"``, ``weight_block_size: [bn, bk]``): ``X.weight`` in F8_E4M3 and an
  fp32 ``X.weight_scale_inv [ceil(out / bn), ceil(in / bk)]`` that is *multiplied* in despite its name;
  activations quantized dynamically per token and group of ``bk`` columns; ``modules_to_not_convert``
  stay 16-bit;
- fbgemm's per-channel FP8 (``quant_method: "fbgemm_fp8"``): ``X.weight`` and ``X.weight_scale [out, 1]``,
  read as the channel scheme (its activation bound ``input_scale_ub`` is skipped).

``--quantization fp8`` (``EngineConfig.quantization``) quantizes a 16-bit checkpoint at load: per output
channel weights, dynamic per-token activations (the ``channel`` scheme).

Inside the engine every FP8 weight keeps one layout, whatever its source: ``weight [out, in]`` in
``float8_e4m3fn`` and ``weight_scale [out, ceil(in / group)]`` fp32, one scale per output row and
``group`` input columns (``group = in`` for per-channel and per-tensor weights, ``bk`` for block FP8).
Block scales are expanded to rows at load, so fused projections (q/k/v, gate/up) and tensor-parallel
slices whose row ranges do not fall on ``bn`` boundaries keep their exact scales; a per-tensor scale is a
constant row. ``W = weight * weight_scale`` (each scale over its group's columns).

Compute (``Fp8Linear.forward``): with the Triton kernels (``fused_kernels``: CUDA + triton),
``kernels.fp8_linear`` (activations quantized per token and ``group`` columns, the FP8 GEMM with both
scales applied in fp32; sm_80/86 have no FP8 tensor cores and decode the weight tile in registers
instead); elsewhere the numeric reference: dequantise the weight to the activation's dtype, then
``F.linear``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import TensorParallel
from engine.models.config import Fp8Args
from engine.models.parallel_layers import RowParallelLinear

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def keep_dtypes(module: nn.Module, apply: Any, names: tuple[str, ...]) -> Any:  # noqa: ANN401
    """Run ``apply`` (``nn.Module._apply``) keeping the dtypes of the parameters ``names``: the loader
    materialises a model by casting every floating tensor to the model's dtype, and FP8 weights and their
    fp32 scales must stay as they are."""
    kept = {n: p.dtype for n, p in module._parameters.items() if p is not None and n in names}
    result = apply()
    for name, dtype in kept.items():
        p = module._parameters[name]
        if p is not None and p.dtype != dtype:
            module._parameters[name] = nn.Parameter(p.to(dtype), requires_grad=False)
    return result


def quantize_fp8(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> ``(weight_fp8, weight_scale [out, ceil(in / group)])``: each row's groups of
    ``group`` columns scaled so that their largest magnitude maps to 448 (rounding in PyTorch)."""
    out_features, in_features = weight.shape
    groups = math.ceil(in_features / group)
    padded = F.pad(weight.float(), (0, groups * group - in_features)).view(out_features, groups, group)
    scale = (padded.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    q = (padded / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(out_features, groups * group)[:, :in_features].contiguous(), scale


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight [out, in]`` fp8 with ``scale [out, groups]`` -> ``[out, in]`` in ``dtype``."""
    in_features = weight.shape[1]
    group = math.ceil(in_features / scale.shape[1])
    expanded = scale.repeat_interleave(group, dim=1)[:, :in_features]
    return (weight.float() * expanded).to(dtype)


def checkpoint_scale_rows(scale: torch.Tensor, rows: int, fp8: Fp8Args) -> torch.Tensor:
    """A checkpoint's scale of a weight as the engine keeps it: ``[rows, groups]`` fp32, one row of group
    scales per output row (the first ``rows`` of them): a per-tensor scale repeated, per-channel scales
    as they are, block scales expanded to their rows."""
    scale = scale.float()
    if fp8.scheme == "block":  # [ceil(out / bn), groups]: each block row stands for bn output rows
        return scale.repeat_interleave(fp8.block[0], dim=0)[:rows]
    if fp8.scheme == "tensor":
        return scale.reshape(1, 1).expand(rows, 1)
    return scale.reshape(-1, 1)[:rows]


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> block FP8 ``(weight_fp8, weight_scale_inv [ceil(out/bn), ceil(in/bk)])``
    as the published block-FP8 checkpoints store it."""
    bn, bk = block
    out_features, in_features = weight.shape
    rows, cols = math.ceil(out_features / bn), math.ceil(in_features / bk)
    padded = F.pad(weight.float(), (0, cols * bk - in_features, 0, rows * bn - out_features))
    tiles = padded.view(rows, bn, cols, bk)
    scale = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [rows, cols]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows * bn, cols * bk)[:out_features, :in_features].contiguous(), scale


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in FP8 (see the module docs); ``use_kernel``: the Triton FP8
    GEMM on CUDA, else dequantise-then-matmul. Activations are always quantized dynamically (per token
    and group): a checkpoint's static ``input_scale`` is not used, which is at least as accurate."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: int,
                 use_kernel: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        weight = torch.empty(out_features, in_features, dtype=FP8_DTYPE)
        scale = torch.empty(out_features, math.ceil(in_features / group), dtype=torch.float32)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._use_kernel = use_kernel

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # noqa: ANN401 - nn.Module's signature
        return keep_dtypes(self, lambda: super(Fp8Linear, self)._apply(fn, recurse),
                           ("weight", "weight_scale"))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """``x W^T`` without the bias (a row-parallel layer adds it after the all-reduce)."""
        if self._use_kernel:
            import kernels

            shape = x.shape
            out = kernels.fp8_linear(x.reshape(-1, shape[-1]), self.weight, self.weight_scale)
            return out.view(*shape[:-1], self.out_features)
        return F.linear(x, dequantize_fp8(self.weight, self.weight_scale, x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.partial(x)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 group={self.group}"


class Fp8RowParallelLinear(Fp8Linear):
    """``RowParallelLinear`` with its weight in FP8 (``engine.models.fp8``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: int, tp: TensorParallel,
                 use_kernel: bool = False) -> None:
        super().__init__(in_features, out_features, bias, group, use_kernel)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self.partial(x))
        return y if self.bias is None else y + self.bias


# The model's linear layers and the checkpoint projection whose name decides whether they are quantized.
_FUSED_SOURCES = {"qkv_proj": "q_proj", "gate_up_proj": "gate_proj", "o_proj": "o_proj",
                  "down_proj": "down_proj"}


def use_fp8_layers(model: nn.Module, fp8: Fp8Args, use_kernel: bool) -> int:
    """Replace the model's quantizable linear layers by FP8 ones, in place (on the meta device, before
    the weights are loaded into them). Returns how many were replaced."""
    count = 0
    for prefix, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            source = _FUSED_SOURCES.get(child_name)
            if source is None or not isinstance(child, nn.Linear):
                continue
            if not fp8.quantizes(f"{prefix}.{source}"):
                continue
            group = fp8.group(child.in_features)
            bias = child.bias is not None
            new: Fp8Linear
            if isinstance(child, RowParallelLinear):
                new = Fp8RowParallelLinear(child.in_features, child.out_features, bias, group, child.tp,
                                           use_kernel)
            else:
                new = Fp8Linear(child.in_features, child.out_features, bias, group, use_kernel)
            setattr(module, child_name, new)
            count += 1
    return count
