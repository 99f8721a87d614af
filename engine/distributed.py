"""Tensor parallelism: how a model splits over ``size`` ranks, and the collectives its forward pass needs.

A replica with ``tensor_parallel_size = N`` runs N processes (ranks), each holding 1/N of the weights
and of the KV cache (``engine.rank_workers`` starts ranks 1..N-1; rank 0 is the engine process). The
split, Megatron-style, needs two all-reduces per decoder layer and nothing else inside a layer:

- attention: the query heads split evenly, the KV heads too (or, with fewer KV heads than ranks, each
  KV head replicated on ``N / num_kv_heads`` consecutive ranks); ``o_proj`` takes its rank's slice of
  the attention output (its input columns) and the partial sums are all-reduced;
- MLP: ``gate``/``up`` split by output rows, ``down_proj`` by input columns, then all-reduced;
- embedding and LM head: the vocabulary split into ``ceil(V / N)`` rows per rank (the last shard padded
  with zero rows); an embedding lookup is all-reduced (each rank contributes its rows), the logits
  all-gathered and cut back to V columns;
- norms, RoPE and biases of all-reduced outputs: whole on every rank (a bias is added once, after the
  sum);
- mixtures of experts: by default every rank holds every expert with its intermediate dimension split
  (as the dense MLP); with expert parallelism (``expert_parallel``) rank r holds experts
  ``[r * E / N, (r + 1) * E / N)`` whole, and runs only the slots routed to them. Either way the router
  is whole on every rank and the layer's output is all-reduced.

``ShardSizes`` is the arithmetic (pure); ``TensorParallel`` wraps ``torch.distributed`` (NCCL on GPUs,
gloo on the CPU). With ``size == 1`` every collective is the identity and nothing is initialised: the
single-device path is unchanged.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.models.config import ModelArgs


@dataclass(frozen=True, slots=True)
class ShardSizes:
    """One rank's share of a model (see module docs)."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    first_head: int  # global index of its first query head
    first_kv_head: int  # global index of its first KV head
    intermediate_size: int
    vocab_size: int  # the whole vocabulary
    vocab_per_rank: int  # rows of the embedding / LM head on each rank (the last shard padded)
    num_experts: int = 0  # experts held on this rank (0: a dense model)
    first_expert: int = 0  # global index of its first expert
    moe_intermediate_size: int = 0  # each held expert's intermediate size on this rank
    shared_intermediate_size: int = 0  # the shared expert's, on this rank
    expert_parallel: bool = False

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's shard that hold real tokens (the rest is padding)."""
        return max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start))

    @classmethod
    def of(cls, args: ModelArgs, rank: int = 0, size: int = 1, expert_parallel: bool = False) -> ShardSizes:
        """Rank ``rank``'s share; ``ValueError`` naming the dimension that ``size`` does not divide."""
        check_divisible(args, size, expert_parallel)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
        heads = args.num_heads // size
        if args.num_kv_heads >= size:
            kv_heads, first_kv = args.num_kv_heads // size, rank * (args.num_kv_heads // size)
        else:  # fewer KV heads than ranks: each is replicated on size / num_kv_heads consecutive ranks
            kv_heads, first_kv = 1, rank // (size // args.num_kv_heads)
        experts: dict[str, int | bool] = {}
        if args.moe is not None:
            moe = args.moe
            experts = dict(shared_intermediate_size=moe.shared_intermediate_size // size,
                           expert_parallel=expert_parallel)
            if expert_parallel:
                held = moe.num_experts // size
                experts |= dict(num_experts=held, first_expert=rank * held,
                                moe_intermediate_size=moe.intermediate_size)
            else:
                experts |= dict(num_experts=moe.num_experts,
                                moe_intermediate_size=moe.intermediate_size // size)
        return cls(rank=rank, size=size, num_heads=heads, num_kv_heads=kv_heads, first_head=rank * heads,
                   first_kv_head=first_kv, intermediate_size=args.intermediate_size // size,
                   vocab_size=args.vocab_size, vocab_per_rank=-(-args.vocab_size // size),
                   **experts)  # type: ignore[arg-type]


def check_divisible(args: ModelArgs, size: int, expert_parallel: bool = False) -> None:
    """``ValueError`` unless a model of ``args`` splits over ``size`` ranks (its experts whole per rank
    with ``expert_parallel``, else each expert's intermediate dimension)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if args.num_heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {args.num_heads} attention "
                         "heads")
    if args.num_kv_heads % size and size % args.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's {args.num_kv_heads} KV heads, "
                         "or be a multiple of them")
    if args.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the model's intermediate size "
                         f"{args.intermediate_size}")
    moe = args.moe
    if expert_parallel and moe is None:
        raise ValueError("expert parallelism needs a mixture-of-experts model")
    if moe is not None:
        if expert_parallel and moe.num_experts % size:
            raise ValueError(f"with expert parallelism, tensor_parallel_size {size} must divide the model's "
                             f"{moe.num_experts} experts")
        if not expert_parallel and moe.intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the experts' intermediate size "
                             f"{moe.intermediate_size} (or use expert parallelism)")
        if moe.shared_intermediate_size % size:
            raise ValueError(f"tensor_parallel_size {size} must divide the shared expert's intermediate size "
                             f"{moe.shared_intermediate_size}")


class TensorParallel:
    """This process's rank in the replica's tensor-parallel group, and its collectives. ``size == 1``: a
    group of one (no ``torch.distributed`` state; every collective returns its input)."""

    def __init__(self, rank: int = 0, size: int = 1, expert_parallel: bool = False) -> None:
        self.rank = rank
        self.size = size
        self.expert_parallel = expert_parallel  # experts split whole over the ranks (see module docs)
        self._started = False

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def start(self, init_method: str, backend: str, timeout_s: float = 1800.0) -> None:
        """Join the group (blocks until every rank has). One group per process at a time."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a tensor-parallel group: one engine with "
                               "tensor_parallel_size > 1 per process")
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._started = True

    def close(self) -> None:
        if self._started:
            import torch.distributed as dist

            self._started = False
            dist.destroy_process_group()

    # ---- collectives (the identity for a group of one) ---------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``x``, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place."""
        if self.size > 1:
            import torch.distributed as dist

            dist.broadcast(x, src=0)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int, device: torch.device) -> int:
        """The smallest of every rank's ``value``."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
