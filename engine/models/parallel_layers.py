"""The layers whose math changes when a model splits over ranks (``engine.distributed``).

Each is the plain PyTorch layer it subclasses, with the same parameter names (the loader fills this
rank's slice of the checkpoint's tensor), and behaves exactly as that layer in a group of one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import ShardSizes, TensorParallel


class RowParallelLinear(nn.Linear):
    """``y = x W^T + b`` where ``x`` and ``W``'s input columns are split over the ranks: each rank's partial
    product is all-reduced, then the bias (whole on every rank) is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's ``x_r W_r^T``, neither reduced nor biased (a LoRA wrapper adds its own partial
        product before the one all-reduce: ``engine.lora.layers``)."""
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.tp.enabled:
            return super().forward(x)
        y = self.tp.all_reduce(self.partial(x))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """An embedding whose rows (tokens) are split over the ranks, ``shard.vocab_per_rank`` each: a rank
    looks up the ids it holds, zeroes the others, and the rows are all-reduced."""

    def __init__(self, shard: ShardSizes, hidden_size: int, tp: TensorParallel) -> None:
        # The loader fills every weight, so the random init is skipped (``_weight``).
        super().__init__(shard.vocab_per_rank, hidden_size,
                         _weight=torch.empty(shard.vocab_per_rank, hidden_size))  # fmt: skip
        self._tp = tp
        self._start, self._rows = shard.vocab_start, shard.vocab_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self._tp.enabled:
            return super().forward(input_ids)
        local = input_ids - self._start
        outside = (local < 0) | (local >= self._rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self._tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))
