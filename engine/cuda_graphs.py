"""CUDA graphs for decode steps: capture the model's forward once per padded batch size, then replay.

A decode step of a small or medium model is dominated by launch overhead (several kernels per layer,
each a few microseconds of work); replaying a captured graph issues them all at once. Prefill steps
are long enough not to care and keep running eagerly.

Hook for the runner (``engine/model_runner.py``), the only change it needs::

    # __init__, after the KV cache is allocated, on CUDA with the triton backend and not enforce_eager:
    self.cuda_graphs = DecodeCudaGraphs(self.model, self.kv_caches, self.attention_backend,
                                        max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                                        block_size=self.block_size)
    self.cuda_graphs.capture()
    # run(), instead of calling the model directly:
    if self.cuda_graphs is not None and self.cuda_graphs.can_run(meta, input_ids.shape[0]):
        hidden = self.cuda_graphs.run(input_ids, positions, meta)
    else:
        hidden = self.model(input_ids, positions, self.kv_caches, meta)

Invariants:
- Only decode-only steps (one new token per sequence, no padding rows) of at most the largest captured
  batch size replay; a batch of ``B`` sequences runs the graph of the smallest captured size ``>= B``.
  Padding rows have slot ``-1`` (their K/V are not stored), context length 0 (attention output 0), and
  token 0 at position 0; their hidden rows are computed and discarded.
- The static inputs are owned here. ``run`` copies the step's device tensors into them on the current
  stream (no host sync) and returns a *view of the static output*: consume it (e.g. index the logits
  rows) before the next ``run``.
- Only the triton backend can be captured: the torch backend is the reference and synchronises with
  the host. Each size is captured with a fixed split-K factor (``kernels.default_num_splits`` for that
  batch size at ``max_model_len``), so one graph serves every context length up to ``max_model_len``;
  eager steps keep choosing the factor per step.
- Block tables are captured ``cdiv(max_model_len, block_size)`` wide; a step's narrower table fills
  the left columns and stale columns to its right are never read (reads stop at each ``seq_len``).
- All graphs share one memory pool, captured largest first so the smaller ones reuse its memory.
- Capture runs the model with every row padded, so it never writes the KV cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


def default_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` (and ``max_num_seqs`` itself):
    padding a batch wastes at most 7 rows while the number of graphs stays ~max_num_seqs / 8."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


class DecodeCudaGraphs:
    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        attention_backend: AttentionBackend,
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        batch_sizes: Sequence[int] | None = None,
    ) -> None:
        if attention_backend.name != "triton":
            raise ValueError(
                f"CUDA graphs need the triton attention backend, not {attention_backend.name!r} (the torch "
                "backend synchronises with the host, which a graph cannot capture)"
            )
        if not kv_caches or kv_caches[0].device.type != "cuda":
            raise ValueError("CUDA graphs need the KV cache on a CUDA device")
        if max_num_seqs < 1 or max_model_len < 1 or block_size < 1:
            raise ValueError("max_num_seqs, max_model_len and block_size must be positive")
        sizes = sorted(set(batch_sizes)) if batch_sizes is not None else default_batch_sizes(max_num_seqs)
        if not sizes or sizes[0] < 1:
            raise ValueError(f"batch sizes must be positive, got {list(batch_sizes or [])}")
        self.model = model
        self.kv_caches = kv_caches
        self.backend = attention_backend
        self.batch_sizes = sizes
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.max_blocks = -(-max_model_len // block_size)
        device = kv_caches[0].device
        largest = sizes[-1]
        # Static inputs, sized for the largest graph; smaller graphs capture prefixes of them.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((largest, self.max_blocks), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._pool: tuple[int, int] | None = None

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _static_meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            # Host copies are for backends that loop over sequences; the triton backend does not.
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[self.max_model_len] * size,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per batch size (largest first). Call once, before serving."""
        from kernels import default_num_splits

        if self.captured:
            raise RuntimeError("CUDA graphs are already captured")
        device = self.input_ids.device
        saved_splits = getattr(self.backend, "decode_num_splits", None)
        try:
            for size in reversed(self.batch_sizes):
                self.backend.decode_num_splits = default_num_splits(  # type: ignore[attr-defined]
                    size, self.backend.num_kv_heads, self.max_model_len, device
                )
                meta = self._static_meta(size)
                args = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta)
                # Eager warm-up: Triton compiles on first launch, and compilation cannot be captured.
                self.model(*args)
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    self.outputs[size] = self.model(*args)
                if self._pool is None:
                    self._pool = graph.pool()
                self.graphs[size] = graph
        finally:
            self.backend.decode_num_splits = saved_splits  # type: ignore[attr-defined]
        torch.cuda.synchronize(device)
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """True for a decode-only step without padding rows that fits a captured graph."""
        return (
            self.captured
            and meta.is_decode_only
            and num_tokens == meta.num_seqs
            and 0 < meta.num_seqs <= self.batch_sizes[-1]
            and meta.block_tables.shape[1] <= self.max_blocks
            and meta.max_seq_len <= self.max_model_len
        )

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the step; returns hidden states ``[B, hidden]``, a view valid until the next ``run``."""
        if not self.can_run(meta, input_ids.shape[0]):
            raise ValueError(
                f"no captured graph for this step (decode-only: {meta.is_decode_only}, {meta.num_seqs} "
                f"sequences, {input_ids.shape[0]} tokens, max_seq_len {meta.max_seq_len}); run it eagerly"
            )
        num_seqs = meta.num_seqs
        size = next(s for s in self.batch_sizes if s >= num_seqs)
        self.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(positions, non_blocking=True)
        self.slot_mapping[:num_seqs].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:num_seqs, : meta.block_tables.shape[1]].copy_(meta.block_tables, non_blocking=True)
        if size > num_seqs:
            # Rows left over from a larger earlier batch must become padding again.
            self.input_ids[num_seqs:size].zero_()
            self.positions[num_seqs:size].zero_()
            self.slot_mapping[num_seqs:size].fill_(-1)
            self.seq_lens[num_seqs:size].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
