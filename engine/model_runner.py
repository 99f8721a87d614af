"""``ModelRunner``: the model, its paged KV cache and the per-step inputs (see docs/engine-internals.md).

One runner per engine replica; it is driven from a single thread. Invariants:

- The KV cache is one zero-initialised tensor per layer, ``[2, num_kv_blocks, block_size, num_kv_heads,
  head_dim]`` in the model dtype (layout documented in ``engine.attention.base``). Its size is fixed at
  start-up: ``config.num_kv_blocks`` if given, else ``kv_cache_memory_gb`` on the CPU, else
  ``gpu_memory_utilization`` of the free device memory after loading the weights, minus an estimate
  of the step's activations. On a Linux CPU it is advised onto transparent huge pages.
- On the CPU the runner raises glibc's mmap/trim thresholds for the process, so that each step's
  multi-MB activations reuse heap memory instead of page-faulting fresh mappings.
- ``run(batch)`` computes K/V for ``token_ids[start : start + num_tokens]`` of every scheduled
  sequence, at positions ``start ..``, into the slots its ``block_table`` maps (``block_table[p //
  block_size] * block_size + p % block_size``), and returns float32 logits ``[num_sampled, vocab]``:
  one row per ``ScheduledSeq`` whose chunk reaches the end of its tokens, in batch order, except
  embedding sequences (``seq.pooling``): their chunk's final hidden states are pooled onto the sequence
  (``seq.pooled``) and ``embedding(seq)`` finishes the vector (``engine.pooling``).
- A malformed batch (a chunk past the known tokens or ``max_model_len``, too few or out-of-range
  blocks) raises ``ValueError`` before anything is written to the cache.
- CUDA graphs (CUDA + ``triton`` backend, unless ``enforce_eager``): decode-only steps of up to
  ``max_num_seqs`` sequences replay a graph captured for the next padded batch size. Padding rows have
  slot ``-1`` (nothing stored) and a 1-token context, and their outputs are dropped. The graphs' split-K
  factor is fixed at capture for ``max_model_len``, so one graph serves every context length. If capture
  fails the runner logs it and stays eager: slower, never wrong.
- ``max_model_len`` is the model's limit (``config.max_model_len`` or ``max_position_embeddings``,
  capped at an enabled sliding window, since attention here is always full); the engine further caps
  it at the KV pool's capacity.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.attention import AttentionMetadata, get_backend
from engine.config import EngineConfig
from engine.kv.tiers import TransferPlan
from engine.kv.transfer import KVTransfer, cache_fingerprint
from engine.loader import load_model
from engine.models.config import ModelArgs
from engine.sequence import ScheduledBatch, Sequence

if TYPE_CHECKING:
    from engine.grammar import GrammarBackend
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _checkpoint_eos_ids(model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            ids += [value] if isinstance(value, int) else list(value or [])
    return tuple(dict.fromkeys(ids))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_large_allocations_on_the_heap() -> None:
    """glibc serves allocations above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh
    ``mmap``s and trims freed heap tops, so the multi-MB activations that every CPU step allocates again
    page-fault on every first touch (~45k minor faults per engine_throughput run). Raising both
    thresholds keeps those blocks on the heap for reuse; the heap then holds on to at most about one
    step's peak activations. Process-wide; skipped off glibc or with ``TOLLGATE_MALLOC_TUNING=0``."""
    if os.environ.get("TOLLGATE_MALLOC_TUNING") == "0":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 256 << 20)


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on a Linux CPU the buffer is advised onto transparent huge pages first. Decode
    attention reads blocks scattered over the whole cache (hundreds of MB per layer): with 4 KiB pages
    nearly every block misses the TLB (paged decode of 64 sequences: 2.6 -> 2.25 ms per layer). Advisory:
    where THP is off the kernel ignores it. ``TOLLGATE_KV_HUGEPAGES=0`` skips it."""
    linux_cpu = device.type == "cpu" and sys.platform.startswith("linux")
    if not linux_cpu or os.environ.get("TOLLGATE_KV_HUGEPAGES") == "0":
        return torch.zeros(shape, dtype=dtype, device=device)
    tensor = torch.empty(shape, dtype=dtype, device=device)
    start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (tensor.data_ptr() + tensor.numel() * tensor.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        try:
            madvise = ctypes.CDLL(None).madvise
        except (OSError, AttributeError):
            madvise = None
        if madvise is not None:
            madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
    return tensor.zero_()


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r} requested but CUDA is not available")
        self.dtype = _DTYPES[config.dtype]
        if self.device.type == "cpu":
            _keep_large_allocations_on_the_heap()
        model_dir = Path(config.model)
        self.args = args = ModelArgs.from_pretrained(model_dir)
        self.max_model_len = self._resolve_max_model_len(args, config.max_model_len)
        self.vocab_size: int = args.vocab_size

        backend_cls = get_backend(config.attention_backend or "torch")
        self.attention_backend = backend_cls(
            args.num_heads, args.num_kv_heads, args.head_dim, scale=args.head_dim**-0.5
        )
        # The fused elementwise kernels only pay off (and are only needed) on the GPU; under the CPU
        # interpreter they would just slow the triton backend's tests down.
        fused = self.device.type == "cuda" and self.attention_backend.name == "triton"
        self.model = load_model(model_dir, self.attention_backend, self.dtype, self.device,
                                max_positions=self.max_model_len, args=args, fused_kernels=fused,
                                load_format=config.load_format, seed=config.seed)

        if (model_dir / "tokenizer.json").is_file():
            from engine.tokenizer import Tokenizer

            self.eos_token_ids: tuple[int, ...] = Tokenizer.from_pretrained(model_dir).eos_token_ids
        else:
            self.eos_token_ids = _checkpoint_eos_ids(model_dir)

        self.num_kv_blocks: int = config.num_kv_blocks or self._num_blocks_from_memory()
        self.kv_caches: list[torch.Tensor] = [
            _zeros_on_huge_pages((2, self.num_kv_blocks, self.block_size, args.num_kv_heads, args.head_dim),
                                 self.dtype, self.device)
            for _ in range(args.num_layers)
        ]
        self.kv_transfer: KVTransfer | None = None
        if config.host_tier and config.enable_prefix_caching:
            disk_dir = Path(config.kv_disk_dir) if config.disk_tier and config.kv_disk_dir else None
            block_shape = tuple(self.kv_caches[0].shape[2:])
            slots = config.num_host_kv_blocks
            if slots is None:
                slots = int(config.host_kv_gb * 2**30) // (self.block_size * self.kv_bytes_per_token)
            self.kv_transfer = KVTransfer(self.kv_caches, max(1, slots), disk_dir,
                                          cache_fingerprint(model_dir, self.dtype, block_shape))
        self._graphs: _DecodeGraphs | None = None
        use_graphs = self.device.type == "cuda" and self.attention_backend.name == "triton"
        if use_graphs and not config.enforce_eager:
            self._graphs = _DecodeGraphs.capture(self)
        logger.info("model %s (%s, %s on %s): %d KV blocks of %d tokens (%.2f GiB), max_model_len %d",
                    model_dir.name, args.architecture, config.dtype, self.device, self.num_kv_blocks,
                    self.block_size, self.num_kv_blocks * self.block_size * self.kv_bytes_per_token / 2**30,
                    self.max_model_len)

    @staticmethod
    def _resolve_max_model_len(args: ModelArgs, requested: int | None) -> int:
        limit = args.max_position_embeddings
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
        max_len = requested or limit
        if args.sliding_window is not None and max_len > args.sliding_window:
            logger.warning("max_model_len capped at the sliding window (%d tokens): attention is always full",
                           args.sliding_window)
            max_len = args.sliding_window
        return max_len

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x bytes per element."""
        a = self.args
        return 2 * a.num_layers * a.num_kv_heads * a.head_dim * self.dtype.itemsize

    def _activation_bytes(self) -> int:
        """Upper estimate of one step's activation memory: the largest live tensors of a forward over
        ``max_num_batched_tokens`` tokens, plus float32 logits for ``max_num_seqs`` rows (twice: the
        sampler's working copy)."""
        a, c = self.args, self.config
        per_token = a.hidden_size * 4 + a.q_size + 2 * a.kv_size + 3 * a.intermediate_size
        return (c.max_num_batched_tokens * per_token * self.dtype.itemsize
                + 2 * c.max_num_seqs * a.vocab_size * 4)

    def _num_blocks_from_memory(self) -> int:
        bytes_per_block = self.block_size * self.kv_bytes_per_token
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization) - self._activation_bytes()
            source = f"{self.config.gpu_memory_utilization:.0%} of {free / 2**30:.1f} GiB free device memory"
        else:
            budget = int(self.config.kv_cache_memory_gb * 2**30)
            source = f"kv_cache_memory_gb={self.config.kv_cache_memory_gb}"
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache ({source}, {bytes_per_block} bytes per block)")
        return num_blocks

    def grammar_compiler(self, tokenizer: Tokenizer) -> GrammarBackend:
        """The structured-output backend for this model's vocabulary (lm_head rows) and stop tokens."""
        from engine.grammar import GrammarBackend

        stop_ids = list(tokenizer.eos_token_ids or self.eos_token_ids)
        return GrammarBackend.from_tokenizer_json(Path(self.config.model) / "tokenizer.json", self.vocab_size,
                                                  stop_ids)

    def prepare(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Validate ``batch`` and build ``(input_ids [T], positions [T], metadata, logits_indices [N])``."""
        if not batch.seqs:
            raise ValueError("cannot run an empty batch")
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        token_seq: list[int] = []  # [T] index of each token's sequence in the batch
        logits_indices: list[int] = []
        for s in batch.seqs:
            seq, start, n = s.seq, s.start, s.num_tokens
            end = start + n
            if n < 1 or end > len(seq.token_ids):
                raise ValueError(f"sequence {seq.request_id}: chunk [{start}, {end}) is outside its "
                                 f"{len(seq.token_ids)} tokens")
            if end > self.max_model_len:
                raise ValueError(
                    f"sequence {seq.request_id}: {end} tokens exceed max_model_len {self.max_model_len}"
                )
            num_blocks = -(-end // bs)
            if len(seq.block_table) < num_blocks:
                raise ValueError(f"sequence {seq.request_id}: {end} tokens need {num_blocks} blocks, "
                                 f"its block table has {len(seq.block_table)}")
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            token_seq.extend([len(tables)] * n)
            query_lens.append(n)
            seq_lens.append(end)
            tables.append(seq.block_table[:num_blocks])
            if s.samples and s.seq.pooling is None:
                logits_indices.append(len(input_ids) - 1)
        table_rows = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int32)
        for row, table in zip(table_rows, tables, strict=True):
            row[: len(table)] = table
        block_tables = torch.from_numpy(table_rows)
        lo, hi = int(block_tables.min()), int(block_tables.max())
        if lo < 0 or hi >= self.num_kv_blocks:
            raise ValueError(f"block ids must be in [0, {self.num_kv_blocks}), got {lo if lo < 0 else hi}")

        pos = torch.tensor(positions, dtype=torch.int64)
        lens = torch.tensor(query_lens, dtype=torch.int32)
        slot_mapping = block_tables[torch.tensor(token_seq), pos // bs].to(torch.int64) * bs + pos % bs
        query_start_loc = torch.zeros(len(tables) + 1, dtype=torch.int32)
        torch.cumsum(lens, 0, out=query_start_loc[1:])

        def dev(t: torch.Tensor) -> torch.Tensor:
            if self.device.type == "cpu":
                return t
            return t.pin_memory().to(self.device, non_blocking=True)

        meta = AttentionMetadata(
            slot_mapping=dev(slot_mapping),
            query_start_loc=dev(query_start_loc),
            seq_lens=dev(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=dev(block_tables),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_size=bs,
        )
        meta.plan = self.attention_backend.plan(meta, self.dtype)
        return (dev(torch.tensor(input_ids, dtype=torch.int64)), dev(pos), meta,
                dev(torch.tensor(logits_indices, dtype=torch.int64)))

    def transfer(self, plan: TransferPlan | None) -> None:
        """Make the copies between KV tiers a plan asks for, in device order, and land those that are done."""
        if self.kv_transfer is None:
            return
        if plan is not None:
            self.kv_transfer.execute(plan)
        self.kv_transfer.poll()

    def flush_transfers(self) -> None:
        """Land every copy and finish every queued disk job (tests, shutdown)."""
        if self.kv_transfer is not None:
            self.kv_transfer.flush()

    def close(self) -> None:
        """Finish the disk tier's queued writes (a restart finds every block demoted so far)."""
        if self.kv_transfer is not None:
            self.kv_transfer.flush()
            self.kv_transfer.close()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Make the batch's tier copies, then compute its chunks into the KV cache; float32 logits
        ``[num_sampled, vocab]``."""
        if batch.transfers is not None and self.kv_transfer is not None:
            self.kv_transfer.execute(batch.transfers)  # before the forward pass overwrites an evicted block
        input_ids, positions, meta, logits_indices = self.prepare(batch)
        if self._graphs is not None and self._graphs.covers(meta):
            hidden = self._graphs.replay(input_ids, positions, meta)  # [T, hidden]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        self._pool(batch, hidden)
        if logits_indices.numel() == 0:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return self.model.compute_logits(hidden[logits_indices]).float()  # [N, vocab]


    @staticmethod
    def _pool(batch: ScheduledBatch, hidden: torch.Tensor) -> None:
        """Fold each embedding sequence's chunk of final hidden states into its pooled state."""
        offset = 0
        for s in batch.seqs:
            pooling, n = s.seq.pooling, s.num_tokens
            if pooling is not None:
                rows = hidden[offset:offset + n]
                if pooling.mode == "mean":
                    chunk = rows.float().sum(0)
                    s.seq.pooled = chunk if s.seq.pooled is None else s.seq.pooled + chunk
                elif pooling.mode == "first" and s.start == 0:
                    s.seq.pooled = rows[0].float()
                elif pooling.mode == "last" and s.samples:
                    s.seq.pooled = rows[-1].float()
            offset += n

    @staticmethod
    def embedding(seq: Sequence) -> list[float]:
        """The finished embedding of a sequence whose whole prompt has run; clears its pooled state."""
        pooling, pooled = seq.pooling, seq.pooled
        if pooling is None or pooled is None:
            raise ValueError(f"sequence {seq.request_id} has no pooled state")
        seq.pooled = None
        vector = pooled / seq.num_prompt_tokens if pooling.mode == "mean" else pooled
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu().tolist()


class _DecodeGraphs:
    """CUDA graphs of decode-only forwards, one per padded batch size, over static input buffers."""

    def __init__(self, runner: ModelRunner) -> None:
        n, dev = runner.config.max_num_seqs, runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.sizes = sorted({s for s in (1, 2, 4, 8, *range(16, n + 1, 16)) if s <= n} | {n})
        # Static buffers: graphs read their inputs from here; replay() fills the first rows.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @classmethod
    def capture(cls, runner: ModelRunner) -> _DecodeGraphs | None:
        from kernels import default_num_splits

        graphs = cls(runner)
        backend = runner.attention_backend
        pool = None
        try:
            with torch.inference_mode():
                for size in reversed(graphs.sizes):  # largest first: smaller ones reuse its memory pool
                    backend.decode_num_splits = default_num_splits(
                        size, runner.args.num_kv_heads, runner.max_model_len, runner.device
                    )
                    meta = graphs._meta(size, runner)
                    args = (graphs.input_ids[:size], graphs.positions[:size], runner.kv_caches, meta)
                    runner.model(*args)  # warm-up: compiles the kernels outside the capture
                    torch.cuda.synchronize(runner.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        hidden = runner.model(*args)
                    pool = graph.pool()
                    graphs.graphs[size] = (graph, hidden)
        except Exception:
            logger.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
            return None
        finally:
            backend.decode_num_splits = None
        torch.cuda.synchronize(runner.device)
        return graphs

    def _meta(self, size: int, runner: ModelRunner) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=runner.max_model_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[runner.max_model_len] * size,
            block_size=runner.block_size,
        )

    def covers(self, meta: AttentionMetadata) -> bool:
        return meta.is_decode_only and meta.num_seqs <= self.sizes[-1]

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        n = meta.num_seqs
        size = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[n:size].zero_()
        graph, hidden = self.graphs[size]
        graph.replay()
        return hidden[:n]
