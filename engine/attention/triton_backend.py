"""Triton attention backend: the paged kernels of ``kernels/`` behind the ``AttentionBackend`` seam.

Per layer and step (contract in ``engine.attention.base``):

1. ``kernels.store_kv_cache`` scatters the new K/V rows into ``kv_cache[0]``/``kv_cache[1]`` through
   ``meta.slot_mapping`` (``-1`` rows skipped);
2. a decode-only step (one token per sequence, no padding rows) runs ``kernels.paged_decode_attention``
   (GQA-grouped, split-K over long contexts); every other step (prefills, chunked prefills, prefix-cache
   hits, mixed prefill + decode batches) runs ``kernels.extend_attention`` over the paged cache, which
   handles decode rows (query length 1) as well.

Nothing here falls back to PyTorch: a step either runs the Triton kernels (each counted in
``kernels.launch_counts``) or raises. No host sync: every grid size comes from host metadata
(``max_query_len``, ``max_seq_len``) or the fixed ``decode_num_splits``.

On a GPU this is the default backend (bf16 KV cache). On the CPU it runs under Triton's interpreter
(``TRITON_INTERPRET=1``, which ``kernels`` turns on for CUDA-less hosts) in float32 or float16; that is
for tests that prove the kernels give the engine the same tokens as the ``torch`` backend, not for speed.

CUDA graphs: ``decode_num_splits`` fixes the decode split-K factor so the grid does not depend on
``max_seq_len``; the runner sets it per padded batch size while capturing (then resets it to ``None``),
so each captured graph serves every context length up to ``max_model_len``. Padding rows (slot ``-1``)
store nothing, and their attention output is finite and discarded.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from kernels import extend_attention, paged_decode_attention, store_kv_cache


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        decode_num_splits: int | None = None,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if decode_num_splits is not None and decode_num_splits < 1:
            raise ValueError(f"decode_num_splits must be >= 1, got {decode_num_splits}")
        # None: chosen per step from max_seq_len and the device (kernels.default_num_splits).
        self.decode_num_splits = decode_num_splits

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
        # q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, num_blocks, block_size, KVH, D]
        expected = (2, self.num_kv_heads, self.head_dim)
        if kv_cache.dim() != 5 or (kv_cache.shape[0], *kv_cache.shape[3:]) != expected:
            raise ValueError(
                f"kv_cache must be [2, num_blocks, block_size, {self.num_kv_heads}, {self.head_dim}], "
                f"got {tuple(kv_cache.shape)}"
            )
        if kv_cache.shape[2] != meta.block_size:
            raise ValueError(f"kv_cache block size {kv_cache.shape[2]} != meta.block_size {meta.block_size}")
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        store_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping, kv_scale=kv_scale)
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:
            return paged_decode_attention(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens,
                scale=self.scale, max_seq_len=meta.max_seq_len, num_splits=self.decode_num_splits,
                sinks=sinks, window=window, kv_scale=kv_scale,
            )  # fmt: skip
        return extend_attention(
            q, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            max_query_len=meta.max_query_len, scale=self.scale, sinks=sinks, window=window, kv_scale=kv_scale,
        )  # fmt: skip
