"""Reference attention backend in plain PyTorch (CPU and GPU): correctness first, vectorised where easy.

Implements the contract of ``engine.attention.base`` for any mix of prefills, prefill chunks after a
prefix-cache hit or earlier chunks, and decode tokens:

- store: the new K/V rows are scattered into the cache through ``slot_mapping`` (``-1`` rows skipped);
- decode tokens (query length 1), float32 on the CPU: one call of the fused paged-decode kernel of
  ``engine.cpu_kernels`` for all of them, reading K/V once from the block-shaped cache (no
  gather, no mask); used when it could be built (a C compiler), else the SDPA path below;
- otherwise a decode-only step (every query length 1) sorts the sequences into buckets of similar
  length; each bucket gathers its sequences' blocks at once (``[b, max_blocks * block_size]`` keys,
  masked past ``seq_lens``) and runs one batched SDPA with the query heads of a KV head on the query
  axis. The buckets, their block ids and additive masks are built once per step (``plan``) and shared
  by every layer;
- in any other step, the sequences with one new token go through the same path, and the others are
  looped over: a whole prompt (no cached context) runs causal SDPA over its own new K/V; a chunk after
  cached context gathers its own ``cdiv(seq_len, block_size)`` blocks and runs SDPA of its new queries
  with a causal mask offset by that context.

Unused block-table entries are never read past ``seq_lens`` (the decode gather reads padding blocks but
masks them out), so stale or zero blocks cannot change a result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.attention.base import AttentionBackend, AttentionMetadata


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` in e4m3 (an FP8 KV cache's contents), saturated at 448 rather than overflowing."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


@dataclass(slots=True, frozen=True)
class _DecodeBucket:
    rows: torch.Tensor | None  # [n] token rows of its sequences; None when it is the whole batch, in order
    blocks: torch.Tensor  # [n * num_blocks] block ids, row after row
    bias: torch.Tensor  # [n, 1, 1, num_blocks * block_size] additive mask: 0, or -inf past seq_lens
    num_seqs: int


@dataclass(slots=True, frozen=True)
class _NativeDecode:
    """The one-token sequences for ``cpu_kernels.paged_decode``."""

    kernels: cpu_kernels.Library
    rows: torch.Tensor | None  # [n] int64 token rows; None when it is the whole batch, in order
    block_tables: torch.Tensor  # [n, max_blocks] int32
    seq_lens: torch.Tensor  # [n] int32
    max_len: int


@dataclass(slots=True, frozen=True)
class _Plan:
    all_slots_valid: bool  # no -1 in slot_mapping: store without filtering
    decode_buckets: list[_DecodeBucket]  # the sequences with one new token (all of them, or in a mixed step)
    native_decode: _NativeDecode | None = None  # instead of decode_buckets, when the kernel applies


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._scratch: torch.Tensor | None = None  # decode gathers land here (see _workspace)

    def plan(self, meta: AttentionMetadata, dtype: torch.dtype) -> _Plan:
        """Per-step index tensors and masks, built once instead of once per layer (with 4 layers and 64
        decodes this was ~30% of the decode attention's CPU time)."""
        all_valid = bool((meta.slot_mapping >= 0).all())
        if meta.is_decode_only:
            decodes = list(range(meta.num_seqs))
        else:
            decodes = [b for b, n in enumerate(meta.query_lens_cpu) if n == 1]
        if not decodes:
            return _Plan(all_valid, [])
        device, block_size = meta.seq_lens.device, meta.block_size
        query_rows = None if meta.is_decode_only else meta.query_start_loc[:-1]  # token row of each seq
        kernel = self._native_kernel(device, dtype)
        if kernel is not None:
            if query_rows is None:
                native = _NativeDecode(kernel, None, meta.block_tables.contiguous(),
                                       meta.seq_lens.contiguous(), meta.max_seq_len)
            else:
                seqs = torch.tensor(decodes, device=device)
                native = _NativeDecode(kernel, query_rows[seqs].long(), meta.block_tables[seqs],
                                       meta.seq_lens[seqs], max(meta.seq_lens_cpu[b] for b in decodes))
            return _Plan(all_valid, [], native)
        buckets = []
        for members in _length_buckets([meta.seq_lens_cpu[b] for b in decodes]):
            members = [decodes[i] for i in members]
            n = len(members)
            num_blocks = -(-max(meta.seq_lens_cpu[b] for b in members) // block_size)
            if query_rows is None and n == meta.num_seqs and members == sorted(members):
                rows, tables, seq_lens = None, meta.block_tables, meta.seq_lens
            else:
                seqs = torch.tensor(members, device=device)
                rows = seqs if query_rows is None else query_rows[seqs].long()
                tables, seq_lens = meta.block_tables[seqs], meta.seq_lens[seqs]
            key_pos = torch.arange(num_blocks * block_size, device=device)
            bias = torch.zeros(n, 1, 1, key_pos.numel(), dtype=dtype, device=device)
            bias.masked_fill_((key_pos[None, :] >= seq_lens[:, None])[:, None, None, :], float("-inf"))
            buckets.append(_DecodeBucket(rows, tables[:, :num_blocks].reshape(-1), bias, n))
        return _Plan(all_valid, buckets)

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
        # q: [T, H, D]; k, v: [T, KVH, D]; kv_cache: [2, NB, BS, KVH, D]
        plan = meta.plan if isinstance(meta.plan, _Plan) else self.plan(meta, q.dtype)
        fp8 = kv_cache.dtype == torch.float8_e4m3fn
        if fp8:
            k, v = quantize_kv(k, kv_scale[0]), quantize_kv(v, kv_scale[1])
        self.store(k, v, kv_cache, meta.slot_mapping, all_valid=plan.all_slots_valid)
        if meta.num_seqs == 0:
            return torch.empty_like(q)
        if window or sinks is not None or fp8:
            return self._windowed(q, kv_cache, meta, window or 0, sinks, kv_scale)
        native = plan.native_decode
        if native is not None and not (q.is_contiguous() and kv_cache.is_contiguous()):
            q, kv_cache = q.contiguous(), kv_cache.contiguous()
        if meta.is_decode_only and native is None:
            return self._decode(q, kv_cache, plan.decode_buckets)
        out = torch.empty_like(q)
        if native is not None:
            cpu_kernels.paged_decode(native.kernels, q, out, native.rows, kv_cache, native.block_tables,
                                    native.seq_lens, native.max_len, self.scale)
            if meta.is_decode_only:
                return out
        elif plan.decode_buckets:
            self._decode(q, kv_cache, plan.decode_buckets, out)
        self._extend(q, k, v, kv_cache, meta, out)
        return out

    def _windowed(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, window: int,
                  sinks: torch.Tensor | None, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:
        """Sliding-window and/or attention-sink layers, and FP8 caches, sequence by sequence in fp32:
        each sequence's visible keys (its last ``window + query_len - 1`` positions at most) gathered from
        the cache (an FP8 one dequantized with ``kv_scale``), an explicit causal and window mask, and the
        sinks as an extra logit column of the softmax."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        group = self.num_heads // num_kv_heads
        block_size = meta.block_size
        out = torch.empty_like(q)
        start = 0
        for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + query_len
            first = max(0, seq_len - query_len - window + 1) if window else 0
            first_block = first // block_size
            blocks = meta.block_tables[b, first_block:-(-seq_len // block_size)]
            offset = first_block * block_size  # position of the first gathered key
            keys = kv_cache[0].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len - offset]
            values = kv_cache[1].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len - offset]
            keys, values = keys.float() * kv_scale[0], values.float() * kv_scale[1]
            queries = q[start:end].view(query_len, num_kv_heads, group, head_dim).float()
            scores = torch.einsum("qkgd,skd->kgqs", queries, keys) * self.scale  # [KVH, G, Lq, S]
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            key_pos = torch.arange(offset, seq_len, device=q.device)[None, :]
            hidden = key_pos > query_pos
            if window:
                hidden |= key_pos <= query_pos - window
            scores.masked_fill_(hidden, float("-inf"))
            if sinks is not None:
                sink = sinks.float().view(num_kv_heads, group, 1, 1).expand(-1, -1, query_len, 1)
                probs = torch.cat([scores, sink], dim=-1).softmax(dim=-1)[..., :-1]
            else:
                probs = scores.softmax(dim=-1)
            o = torch.einsum("kgqs,skd->qkgd", probs, values)
            out[start:end] = o.reshape(query_len, self.num_heads, head_dim).to(q.dtype)
            start = end
        return out

    def _native_kernel(self, device: torch.device, dtype: torch.dtype) -> cpu_kernels.Library | None:
        """The fused CPU kernels if their decode applies to this device, dtype and head geometry."""
        group = self.num_heads // self.num_kv_heads
        if not cpu_kernels.decode_supported(device, dtype, self.head_dim, group):
            return None
        return cpu_kernels.library()

    @staticmethod
    def store(
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        all_valid: bool | None = None,
    ) -> None:
        """Scatter ``k``/``v`` into the cache at ``slot_mapping``, skipping ``-1`` rows (``all_valid``:
        the caller already knows there are none)."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        if kv_cache.dtype == torch.float8_e4m3fn:  # index_copy_ has no e4m3 kernel on the CPU: move bytes
            kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
        k_flat = kv_cache[0].view(-1, num_kv_heads, head_dim)  # [NB * BS, KVH, D]
        v_flat = kv_cache[1].view(-1, num_kv_heads, head_dim)
        if all_valid is None:
            all_valid = bool((slot_mapping >= 0).all())
        if not all_valid:
            valid = slot_mapping >= 0
            slot_mapping, k, v = slot_mapping[valid], k[valid], v[valid]
        k_flat.index_copy_(0, slot_mapping, k)
        v_flat.index_copy_(0, slot_mapping, v)

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        buckets: list[_DecodeBucket],
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the one-token queries of ``buckets``, written to their rows of ``out``."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        group = self.num_heads // num_kv_heads
        if out is None and (len(buckets) > 1 or buckets[0].rows is not None):
            out = torch.empty_like(q)
        for bucket in buckets:
            n = bucket.num_seqs
            # keys, values: [n, num_blocks * BS, KVH, D] -> [n, KVH, S, D]. index_select on the block
            # axis copies whole blocks (3.5x less CPU than advanced indexing with the 2-D table).
            # K and V in one call, into a reused workspace: fresh multi-MB tensors every layer and step
            # cost page faults.
            gathered = self._workspace(kv_cache, bucket.blocks.numel())
            torch.index_select(kv_cache, 1, bucket.blocks, out=gathered)
            keys, values = gathered.view(2, n, -1, num_kv_heads, head_dim).transpose(2, 3)
            queries = q if bucket.rows is None else q[bucket.rows]
            # The query heads sharing a KV head ride on SDPA's query-length axis ([n, KVH, group, D]):
            # no K/V repeat for GQA, and no causal mask is needed for a single new token.
            o = F.scaled_dot_product_attention(
                queries.view(n, num_kv_heads, group, head_dim), keys, values, attn_mask=bucket.bias,
                scale=self.scale,
            ).reshape(n, self.num_heads, head_dim)  # fmt: skip
            if out is None:
                return o
            out[bucket.rows] = o
        if out is None:  # unreachable: without out, the single bucket returned above
            raise RuntimeError("decode attention got no buckets")
        return out

    def _workspace(self, kv_cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """A ``[2, num_blocks, BS, KVH, D]`` view of a scratch buffer that lives as long as the backend
        (the runner calls it from one thread) and grows to the largest gather seen."""
        shape = (2, num_blocks, *kv_cache.shape[2:])
        numel = math.prod(shape)
        buffer = self._scratch
        if buffer is None or buffer.numel() < numel or buffer.dtype != kv_cache.dtype \
                or buffer.device != kv_cache.device:
            buffer = self._scratch = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
        return buffer[:numel].view(shape)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        out: torch.Tensor,
    ) -> None:
        """Attention of the sequences with more than one new token, one at a time, into ``out``."""
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        group = self.num_heads // num_kv_heads
        block_size = meta.block_size
        start = 0
        for b, (query_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            end = start + query_len
            if query_len == 1:  # planned with the decodes
                start = end
                continue
            if query_len == seq_len:
                # No cached context: this step's own K/V and a plain causal mask, which lets SDPA's flash
                # kernel skip the tiles above the diagonal (1.2-1.9x less CPU than the masked path below
                # for 60-300 tokens).
                o = F.scaled_dot_product_attention(
                    q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                    v[start:end].transpose(0, 1)[None], is_causal=True, scale=self.scale,
                    enable_gqa=group > 1,
                )  # fmt: skip
                out[start:end] = o[0].transpose(0, 1)
                start = end
                continue
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[b, :num_blocks]
            # keys, values: [S, KVH, D] -> [1, KVH, S, D]
            keys = kv_cache[0].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
            values = kv_cache[1].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
            keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
            # The query heads of a KV head ride on the query axis ([1, KVH, group * Lq, D]), with the
            # causal mask repeated per head: SDPA's CPU flash kernel takes this, while enable_gqa sends
            # it to the math fallback (2x the CPU for prefills of 50-300 tokens).
            queries = q[start:end].view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
            query_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
            mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [Lq, S]
            o = F.scaled_dot_product_attention(
                queries.reshape(1, num_kv_heads, group * query_len, head_dim), keys, values,
                attn_mask=mask.repeat(group, 1), scale=self.scale,
            )  # fmt: skip
            out[start:end] = o.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3).reshape(
                query_len, self.num_heads, head_dim
            )
            start = end


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

