"""The attention-backend seam: ``AttentionMetadata`` (built once per step by the runner) and
``AttentionBackend`` (called once per layer by the model).

KV cache layout (one tensor per layer, allocated by the runner, zero-initialised):

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]     kv_cache[0] = K, kv_cache[1] = V

Token at logical position ``p`` of a sequence lives in physical block ``block_table[p // block_size]`` at
offset ``p % block_size``; its flat slot is ``block_id * block_size + offset`` (the cache viewed as
``[num_blocks * block_size, num_kv_heads, head_dim]``). Block ids are arbitrary: shuffled, with holes.

A step is a batch of B sequences; sequence ``b`` brings ``query_len_b >= 1`` new tokens (a whole prompt,
a prefill chunk after a prefix-cache hit or earlier chunks, or one decode token), packed into T rows:

- ``slot_mapping [T]`` int64: flat slot of every new token; ``-1`` means "do not store" (padding rows).
- ``query_start_loc [B + 1]`` int32: cumulative query lengths; rows of ``b`` are
  ``query_start_loc[b] : query_start_loc[b + 1]``.
- ``seq_lens [B]`` int32: context length *including* the new tokens; the new tokens sit at positions
  ``seq_lens[b] - query_len_b .. seq_lens[b] - 1``, everything before them is already in the cache.
- ``block_tables [B, max_blocks]`` int32, ``max_blocks = cdiv(max_seq_len, block_size)``: rows padded
  with ``0`` (a valid id, so vectorised gathers stay in bounds); entries past ``cdiv(seq_lens[b],
  block_size)`` are never meaningful and must never influence the result.
- ``max_query_len``, ``max_seq_len``: host ints (grid sizes, no device sync); ``query_lens_cpu`` /
  ``seq_lens_cpu``: the same numbers as host lists, for backends that loop over sequences.
- ``plan``: whatever the backend derives from the fields above once per step (``AttentionBackend.plan``,
  called by the runner) and reuses in every layer; ``None`` when nobody planned, and a backend then
  derives it per call.

Contract of ``forward(q, k, v, kv_cache, meta, window=None, sinks=None)``: first store ``k``/``v`` of
the new tokens at ``slot_mapping``, then return, for each new token, causal attention of its query over
positions ``0 .. its own`` of its sequence (read through the cache; with a sliding ``window``, only the
last ``window`` of them), with GQA (query head ``h`` uses kv head ``h // (num_heads // num_kv_heads)``),
softmax scale ``scale``, and each head's sink logit ``sinks[h]`` added to its softmax's denominator.
The cache keeps every position either way: a sliding-window layer only reads fewer.
Shapes: ``q [T, num_heads, head_dim]``,
``k``/``v [T, num_kv_heads, head_dim]`` (possibly strided views of the fused qkv projection; only the last
dimension is guaranteed contiguous), output ``[T, num_heads, head_dim]`` in ``q``'s dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        """Every sequence brings exactly one token (the paged-decode fast path applies)."""
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Attention over the paged KV cache for one model (shared by its layers; holds no per-step state)."""

    name: str = ""
    # Fixed split-K factor of the decode kernel, for backends that split long contexts (triton): the
    # runner sets it while capturing CUDA graphs, then resets it. None: chosen per step. Backends
    # without split-K decode ignore it.
    decode_num_splits: int | None = None

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        if num_heads <= 0 or num_kv_heads <= 0 or head_dim <= 0:
            raise ValueError("num_heads, num_kv_heads and head_dim must be positive")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def plan(self, meta: AttentionMetadata, dtype: torch.dtype) -> object | None:
        """Per-step work shared by every layer (index tensors, masks in ``dtype``), stored by the runner
        as ``meta.plan``. The default plans nothing."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
        kv_scale: tuple[float, float] = (1.0, 1.0),
    ) -> torch.Tensor:
        """Store ``k``/``v`` into ``kv_cache`` at ``meta.slot_mapping``; return attention ``[T, H, D]``.
        An FP8 cache (``float8_e4m3fn``) stores ``k / kv_scale[0]`` and ``v / kv_scale[1]`` in e4m3 and
        every read multiplies them back.
        ``window``: this layer's sliding window (a query at position p sees (p - window, p]); ``sinks``
        ``[num_heads]`` float32: attention-sink logits in each head's softmax sum (gpt-oss)."""
