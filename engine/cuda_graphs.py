"""CUDA graphs of decode-only forward passes (see ``engine.model_runner``'s invariants).

Decode-only steps of up to ``max_num_seqs`` sequences replay a graph captured for the next padded batch
size, over static input buffers. Padding rows have slot ``-1`` (nothing stored) and a 1-token context,
and their outputs are dropped. The split-K factor is fixed at capture for ``max_model_len``, so one
graph serves every context length. If capture fails the runner logs it and stays eager.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from engine.attention import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


class GraphedRunner(Protocol):
    """What capturing needs of the model runner."""

    config: Any  # EngineConfig: max_num_seqs
    args: Any  # ModelArgs: num_kv_heads
    device: torch.device
    max_model_len: int
    block_size: int
    attention_backend: AttentionBackend
    kv_caches: list[torch.Tensor]

    @property
    def model(self) -> torch.nn.Module: ...  # read-only, so that a runner's model may be any subclass


class DecodeGraphs:
    """CUDA graphs of decode-only forwards, one per padded batch size, over static input buffers."""

    def __init__(self, runner: GraphedRunner) -> None:
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
    def capture(cls, runner: GraphedRunner) -> DecodeGraphs | None:
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

    def _meta(self, size: int, runner: GraphedRunner) -> AttentionMetadata:
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
