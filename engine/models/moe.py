"""The mixture-of-experts feed-forward: a router picks each token's top-k experts, the experts run as
grouped GEMMs, and a shared expert (where the family has one) adds its output.

Parameters (the loader stacks the checkpoint's per-expert tensors into them):
  gate.weight                  [E, hidden]               the router, whole on every rank
  gate.e_score_correction_bias [E]                       sigmoid_grouped routers only
  gate.bias                    [E]                       topk_softmax routers only (gpt-oss)
  experts.w13                  [E_local, 2 * I_local, hidden]  gate rows, then up rows, of each held expert
  experts.w2                   [E_local, hidden, I_local]
  experts.w13_bias / w2_bias   [E_local, 2 * I_local] / [E_local, hidden]   gpt-oss only
  shared_experts.*             a dense ``MLP`` of the shared expert's size (families that have one)

Routers, as the reference implementations compute them (``route``), in float32 (gpt-oss's
``topk_softmax``: the top k logits, softmaxed over the k, is the third):
- ``softmax`` (Qwen3-MoE, Mixtral): softmax over all experts, the top k, renormalised over the k when
  the config says so;
- ``sigmoid_grouped`` (GLM-4.5, DeepSeek-V3): sigmoid scores; experts are chosen on score + correction
  bias, only within the ``topk_groups`` best of ``num_groups`` groups (a group's strength: the sum of its
  two best biased scores); weights are the unbiased scores, renormalised, times ``routed_scaling``.

Experts: with the Triton kernels (``fused_kernels``: CUDA + triton), ``kernels.fused_moe`` (two launches
for all experts); else
``grouped_experts``, which sorts the (token, expert) slots by expert and runs each expert's rows as one
GEMM pair (a loop over the experts that were chosen, never over tokens). With tensor parallelism the
output is a partial sum that ``MoE`` all-reduces (``engine.distributed``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import ShardSizes, TensorParallel
from engine.models.config import Fp8Args, MoEArgs
from engine.models.fp8 import FP8_DTYPE, dequantize_fp8, keep_dtypes


def route(logits: torch.Tensor, moe: MoEArgs, correction_bias: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k] float32, topk_ids [T, k] int64)`` from router ``logits [T, E]``."""
    logits = logits.float()
    if moe.router == "topk_softmax":  # gpt-oss: choose on the logits, weigh by a softmax over the k
        values, ids = torch.topk(logits, moe.top_k, dim=-1)
        return torch.softmax(values, dim=-1), ids
    if moe.router == "softmax":
        probs = torch.softmax(logits, dim=-1)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids
    scores = logits.sigmoid()
    biased = scores if correction_bias is None else scores + correction_bias.float()
    if moe.num_groups > 1:
        per_group = moe.num_experts // moe.num_groups
        grouped = biased.view(-1, moe.num_groups, per_group)
        group_strength = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, groups]
        best_groups = group_strength.topk(moe.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_strength, dtype=torch.bool).scatter_(1, best_groups, True)
        biased = biased.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = biased.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling, ids


def gated_activation(gate_up: torch.Tensor, moe: MoEArgs | None = None) -> torch.Tensor:
    """``[n, 2I]`` (gate | up) -> ``[n, I]``: SiLU(gate) * up, or gpt-oss's clamped SwiGLU."""
    gate, up = gate_up.chunk(2, dim=-1)
    if moe is None or moe.activation == "silu":
        return F.silu(gate) * up
    limit = moe.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))


def grouped_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
    moe: MoEArgs | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts in PyTorch: each held expert's slots as one ``[n, hidden] @ [hidden, 2I]`` GEMM, the
    gated activation, one ``[n, I] @ [I, hidden]`` GEMM, weighted, added into their tokens' rows in
    expert order (as the reference implementations add them). ``first_expert``: global id of ``w13[0]``
    (expert parallelism); slots of experts not held here add nothing."""
    num_tokens, top_k = topk_ids.shape
    held = w13.shape[0]
    out = torch.zeros_like(x)
    local = topk_ids.reshape(-1) - first_expert
    order = torch.argsort(local, stable=True)
    counts = torch.bincount(local.clamp(-1, held).add(1), minlength=held + 2)[1:held + 1].tolist()
    start = int((local < 0).sum())  # other ranks' lower experts sort first
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start:start + n]
        start += n
        tokens = slots // top_k
        up_weight, down_weight = w13[expert], w2[expert]
        if w13_scale is not None and w2_scale is not None:  # FP8 experts: dequantized one at a time
            up_weight = dequantize_fp8(up_weight, w13_scale[expert], x.dtype)
            down_weight = dequantize_fp8(down_weight, w2_scale[expert], x.dtype)
        gate_up = F.linear(x[tokens], up_weight, None if w13_bias is None else w13_bias[expert])
        down_bias = None if w2_bias is None else w2_bias[expert]
        h = F.linear(gated_activation(gate_up, moe), down_weight, down_bias)
        h = h * topk_weights.reshape(-1)[slots].unsqueeze(-1).to(h.dtype)
        out.index_add_(0, tokens, h)
    return out


class Experts(nn.Module):
    """This rank's experts, stacked (see module docs)."""

    def __init__(self, moe: MoEArgs, shard: ShardSizes, hidden_size: int, use_kernel: bool,
                 fp8: Fp8Args | None = None) -> None:
        super().__init__()
        self.moe = moe
        inter = shard.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(shard.num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(shard.num_experts, hidden_size, inter))
        # FP8 experts (engine.models.fp8's layout, per expert): e4m3 weights, fp32 scales per output row
        # and group of input columns.
        self.w13_scale: nn.Parameter | None = None
        self.w2_scale: nn.Parameter | None = None
        if fp8 is not None:
            e = shard.num_experts
            groups13, groups2 = -(-hidden_size // fp8.group(hidden_size)), -(-inter // fp8.group(inter))

            def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
                return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

            self.w13, self.w2 = frozen(e, 2 * inter, hidden_size, dtype=FP8_DTYPE), frozen(
                e, hidden_size, inter, dtype=FP8_DTYPE)
            self.w13_scale = frozen(e, 2 * inter, groups13, dtype=torch.float32)
            self.w2_scale = frozen(e, hidden_size, groups2, dtype=torch.float32)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if moe.expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(shard.num_experts, 2 * inter))
            self.w2_bias = nn.Parameter(torch.empty(shard.num_experts, hidden_size))
        # With the intermediate dimension split, each rank's down projection is a partial sum: its bias
        # is added by rank 0 alone, before the all-reduce.
        self._add_down_bias = shard.expert_parallel or shard.rank == 0
        self.first_expert = shard.first_expert
        self.expert_parallel = shard.expert_parallel
        self._use_kernel = use_kernel
        # Expert parallelism: global expert id -> index in w13, -1 for experts held elsewhere. A buffer on
        # the model's device, computed once there (``reset_cache``), never during a forward pass (which
        # a CUDA graph may be capturing).
        self.expert_map: torch.Tensor | None
        if shard.expert_parallel:
            expert_map = torch.empty(moe.num_experts, dtype=torch.int32)
            self.register_buffer("expert_map", expert_map, persistent=False)
            if expert_map.device.type != "meta":
                self.reset_cache()
        else:
            self.expert_map = None

    def _apply(self, fn: Any, recurse: bool = True) -> Any:  # noqa: ANN401 - nn.Module's signature
        if self.w13_scale is None:
            return super()._apply(fn, recurse)
        return keep_dtypes(self, lambda: super(Experts, self)._apply(fn, recurse),
                           ("w13", "w2", "w13_scale", "w2_scale"))

    def reset_cache(self) -> None:
        """(Re)compute ``expert_map`` on its device (the loader calls it once the model is materialised)."""
        if self.expert_map is None:
            return
        held = self.w13.shape[0]
        m = torch.full_like(self.expert_map, -1)
        m[self.first_expert:self.first_expert + held] = torch.arange(held, dtype=m.dtype, device=m.device)
        self.expert_map = m

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                num_experts: int) -> torch.Tensor:
        w2_bias = self.w2_bias if self._add_down_bias else None
        if self._use_kernel:
            import kernels

            moe = self.moe
            return kernels.fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, expert_map=self.expert_map,
                                     w13_bias=self.w13_bias, w2_bias=w2_bias, activation=moe.activation,
                                     swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit,
                                     w13_scale=self.w13_scale, w2_scale=self.w2_scale)
        return grouped_experts(x, self.w13, self.w2, topk_weights, topk_ids, self.first_expert, self.moe,
                               self.w13_bias, w2_bias, self.w13_scale, self.w2_scale)


class Router(nn.Module):
    def __init__(self, moe: MoEArgs, hidden_size: int) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.e_score_correction_bias: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if moe.router == "sigmoid_grouped":
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))
        if moe.router == "topk_softmax":
            self.bias = nn.Parameter(torch.empty(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The sigmoid routers score in float32 (the references run their router in float32).
        if self.moe.router == "sigmoid_grouped":
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight, self.bias)
        return route(logits, self.moe, self.e_score_correction_bias)


class MoE(nn.Module):
    """Router + experts (+ shared expert); ``forward(x [T, hidden]) -> [T, hidden]``, whole on every
    rank."""

    def __init__(self, moe: MoEArgs, hidden_size: int, shard: ShardSizes, tp: TensorParallel,
                 use_kernel: bool, shared_experts: nn.Module | None = None,
                 fp8: Fp8Args | None = None) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(moe, hidden_size)
        self.experts = Experts(moe, shard, hidden_size, use_kernel, fp8)
        self.shared_experts = shared_experts  # a dense MLP whose down projection does not all-reduce
        self._tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = self.gate(x)
        out = self.experts(x, topk_weights, topk_ids, self.moe.num_experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self._tp.all_reduce(out)
