"""Reference attention backend in plain PyTorch (CPU and GPU): correctness first, vectorised where easy.

Implements the contract of ``engine.attention.base`` for any mix of prefills, prefill chunks after a
prefix-cache hit or earlier chunks, and decode tokens:

- store: the new K/V rows are scattered into the cache through ``slot_mapping`` (``-1`` rows skipped);
- a decode-only step (every query length 1) sorts the sequences into buckets of similar length; each
  bucket gathers its sequences' blocks at once (``[b, max_blocks * block_size]`` keys, masked past
  ``seq_lens``) and runs one batched SDPA with the query heads of a KV head on the query axis;
- any other step loops over the sequences: each gathers its own ``cdiv(seq_len, block_size)`` blocks
  and runs SDPA of its new queries with a causal mask offset by its cached context.

Unused block-table entries are never read past ``seq_lens`` (the decode gather reads padding blocks but
masks them out), so stale or zero blocks cannot change a result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, NB, BS, KVH, D]
        self.store(k, v, kv_cache, meta.slot_mapping)
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        if meta.is_decode_only:
            return self._decode(q, kv_cache, meta)
        return self._extend(q, kv_cache, meta)

    @staticmethod
    def store(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [NB * BS, KVH, D]
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
        k_flat.index_copy_(0, slot_mapping, k)
        v_flat.index_copy_(0, slot_mapping, v)

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        group = self.num_heads // num_kv_heads
        out = torch.empty_like(q)
        for members in _length_buckets(meta.seq_lens_cpu):
            n = len(members)
            index = torch.tensor(members, device=q.device)
            num_blocks = -(-max(meta.seq_lens_cpu[i] for i in members) // meta.block_size)
            blocks = meta.block_tables[index, :num_blocks].reshape(-1)
            # keys, values: [n, num_blocks * BS, KVH, D] -> [n, KVH, S, D]. index_select on the block
            # axis copies whole blocks (3.5x less CPU than advanced indexing with the 2-D table).
            keys = kv_cache[0].index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
            values = kv_cache[1].index_select(0, blocks).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
            key_pos = torch.arange(keys.shape[2], device=q.device)
            mask = key_pos[None, :] < meta.seq_lens[index][:, None]  # [n, S]
            # The query heads sharing a KV head ride on SDPA's query-length axis ([n, KVH, group, D]):
            # no K/V repeat for GQA, and no causal mask is needed for a single new token.
            o = F.scaled_dot_product_attention(
                q[index].view(n, num_kv_heads, group, head_dim), keys, values,
                attn_mask=mask[:, None, None, :], scale=self.scale,
            )  # fmt: skip
            out[index] = o.reshape(n, self.num_heads, head_dim)
        return out

    def _extend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        block_size = meta.block_size
        out = torch.empty_like(q)
        start = 0
        for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + query_len
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[b, :num_blocks]
            # keys, values: [S, KVH, D] -> [KVH, S, D]
            keys = kv_cache[0].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
            values = kv_cache[1].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
            keys, values = keys.transpose(0, 1), values.transpose(0, 1)
            queries = q[start:end].transpose(0, 1)  # [H, Lq, D]
            context_len = seq_len - query_len
            if context_len == 0:
                mask, causal = None, True
            else:
                query_pos = torch.arange(context_len, seq_len, device=q.device)
                key_pos = torch.arange(seq_len, device=q.device)
                mask, causal = key_pos[None, :] <= query_pos[:, None], False  # [Lq, S]
            o = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=mask, is_causal=causal, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )  # fmt: skip
            out[start:end] = o.transpose(0, 1)
            start = end
        return out


def _length_buckets(seq_lens: list[int], min_size: int = 8, slack: float = 1.25) -> list[list[int]]:
    """Indices of the decode batch grouped by similar context length (ascending).

    Each bucket gathers K/V padded only to its own longest context; with one bucket, a batch of
    uniformly spread lengths gathers about twice the keys it uses. A bucket closes when it holds
    ``min_size`` sequences and the next is ``slack`` times longer than its first (measured on a 2-core
    CPU, 48 decodes of 50-500 tokens, GQA 4:2: 10.4 ms -> 5.9 ms of CPU per layer)."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    buckets: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if len(current) >= min_size and seq_lens[i] > slack * seq_lens[current[0]]:
            buckets.append(current)
            current = []
        current.append(i)
    buckets.append(current)
    return buckets

