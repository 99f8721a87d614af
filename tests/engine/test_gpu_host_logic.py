"""The GPU path's host-side logic, tested without a GPU: what the engine decides on the host before any
kernel runs. Only what needs a device is faked (free device memory, the SM count, a captured graph);
the rest is the engine's own code on CPU tensors.

- CUDA-graph batch sizes: the buckets ``DecodeGraphs`` captures for ``max_num_seqs``, the bucket a
  decode batch replays, the padding rows (slot -1, one-token context, zero block table) and the
  metadata the graphs were captured with.
- Device and dtype selection: the attention backend and CUDA graphs follow the device; a CUDA device
  without CUDA is refused at start-up.
- KV-cache sizing from ``gpu_memory_utilization`` of the free device memory, minus the step's
  activations, and the error when nothing is left.
- ``load_format="random"``: a checkpoint's shape from its ``config.json`` alone, deterministic per seed.
- The split-K factor of the decode kernel for an SM count, and the launchers' tile choices per target.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.distributed import ShardSizes
from engine.model_runner import ModelRunner
from engine.models.config import ModelArgs
from kernels import default_num_splits
from kernels.extend_attention import extend_tile_config
from kernels.paged_decode_attention import decode_tile_config

BLOCK = 16
# The module (the package re-exports a function of the same name).
paged_decode_module = importlib.import_module("kernels.paged_decode_attention")


def _graphs(max_num_seqs: int, max_model_len: int = 256) -> DecodeGraphs:
    runner = SimpleNamespace(config=SimpleNamespace(max_num_seqs=max_num_seqs), device=torch.device("cpu"),
                             max_model_len=max_model_len, block_size=BLOCK)
    return DecodeGraphs(runner)  # type: ignore[arg-type]


@pytest.mark.parametrize(("max_num_seqs", "sizes"), [
    (1, [1]),
    (3, [1, 2, 3]),
    (10, [1, 2, 4, 8, 10]),
    (16, [1, 2, 4, 8, 16]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    (70, [1, 2, 4, 8, 16, 32, 48, 64, 70]),
])  # fmt: skip
def test_graph_buckets_cover_every_batch_size_up_to_max_num_seqs(max_num_seqs: int, sizes: list[int]) -> None:
    graphs = _graphs(max_num_seqs)
    assert graphs.sizes == sizes
    for n in range(1, max_num_seqs + 1):  # each batch has a bucket, and it is the smallest that fits
        bucket = next(s for s in graphs.sizes if s >= n)
        assert bucket >= n and all(s < n for s in graphs.sizes if s < bucket)


def _decode_meta(seq_lens: list[int], tables: list[list[int]], slots: list[int]) -> AttentionMetadata:
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        query_lens_cpu=[1] * n,
        seq_lens_cpu=seq_lens,
        block_size=BLOCK,
    )


class _RecordingGraph:
    """Stands in for a captured ``torch.cuda.CUDAGraph``: a replay snapshots the static buffers it
    would read."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size, self.replays = graphs, size, []

    def replay(self) -> None:
        g, n = self.graphs, self.size
        self.replays.append({name: getattr(g, name)[:n].clone() for name in
                             ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")})


def _with_recording_graphs(graphs: DecodeGraphs, hidden_size: int = 4) -> dict[int, _RecordingGraph]:
    recorders = {size: _RecordingGraph(graphs, size) for size in graphs.sizes}
    for size, recorder in recorders.items():
        hidden = torch.arange(size * hidden_size, dtype=torch.float32).reshape(size, hidden_size)
        graphs.graphs[size] = (recorder, hidden)  # type: ignore[assignment]
    return recorders


def test_replay_pads_to_the_bucket_with_rows_that_store_nothing() -> None:
    graphs = _graphs(max_num_seqs=16)
    recorders = _with_recording_graphs(graphs)
    # Five sequences first (bucket 8), then three (bucket 4): the three must not see the five's rows.
    five = _decode_meta([17, 33, 5, 40, 2], [[3, 4], [5, 6, 7], [8], [9, 10, 11], [12]],
                        [3 * 16 + 0, 7 * 16 + 0, 8 * 16 + 4, 11 * 16 + 7, 12 * 16 + 1])
    out = graphs.replay(torch.tensor([11, 12, 13, 14, 15]), torch.tensor([16, 32, 4, 39, 1]), five)
    assert out.shape == (5, 4) and torch.equal(out, graphs.graphs[8][1][:5])  # the bucket's rows, cut to n
    three = _decode_meta([9, 20, 3], [[1], [2, 6], [4]], [1 * 16 + 8, 6 * 16 + 3, 4 * 16 + 2])
    graphs.replay(torch.tensor([21, 22, 23]), torch.tensor([8, 19, 2]), three)

    assert [len(r.replays) for r in recorders.values()] == [0, 0, 1, 1, 0]  # sizes 1, 2, 4, 8, 16
    eight = recorders[8].replays[0]
    assert eight["input_ids"][:5].tolist() == [11, 12, 13, 14, 15]
    assert eight["slot_mapping"].tolist()[5:] == [-1, -1, -1]  # padding stores nothing
    assert eight["seq_lens"].tolist() == [17, 33, 5, 40, 2, 1, 1, 1]  # padding: a one-token context
    assert (eight["block_tables"][5:] == 0).all()
    four = recorders[4].replays[0]
    assert four["input_ids"][:3].tolist() == [21, 22, 23] and four["positions"][:3].tolist() == [8, 19, 2]
    assert four["slot_mapping"].tolist() == [24, 99, 66, -1]
    assert four["seq_lens"].tolist() == [9, 20, 3, 1]
    assert four["block_tables"][:3, :2].tolist() == [[1, 0], [2, 6], [4, 0]]
    assert (four["block_tables"][3] == 0).all()


def test_graphs_cover_decode_only_batches_up_to_the_largest_bucket() -> None:
    graphs = _graphs(max_num_seqs=4)
    assert graphs.covers(_decode_meta([5] * 4, [[1]] * 4, [0, 1, 2, 3]))
    assert not graphs.covers(_decode_meta([5] * 5, [[1]] * 5, [0, 1, 2, 3, 4]))  # eager beyond the buckets
    prefill = _decode_meta([5, 5], [[1], [2]], [0, 1])
    prefill.max_query_len, prefill.query_lens_cpu = 3, [3, 1]
    assert not graphs.covers(prefill)


def test_captured_metadata_spans_max_model_len_so_one_graph_serves_every_context() -> None:
    graphs = _graphs(max_num_seqs=8, max_model_len=1000)
    runner = SimpleNamespace(max_model_len=1000, block_size=BLOCK)
    meta = graphs._meta(4, runner)  # type: ignore[arg-type]
    assert graphs.block_tables.shape == (8, 63)  # ceil(1000 / 16) blocks: the longest table
    assert meta.num_seqs == 4 and meta.is_decode_only
    assert meta.max_seq_len == 1000 and meta.seq_lens_cpu == [1000] * 4
    assert meta.block_tables.shape == (4, 63) and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    # Views of the static buffers: what replay() writes is what the graph reads.
    assert meta.slot_mapping.data_ptr() == graphs.slot_mapping.data_ptr()
    assert meta.block_tables.data_ptr() == graphs.block_tables.data_ptr()


def test_attention_backend_and_graphs_follow_the_device() -> None:
    assert EngineConfig(model="m", device="cuda").attention_backend == "triton"
    assert EngineConfig(model="m", device="cuda:1").attention_backend == "triton"
    assert EngineConfig(model="m").attention_backend == "torch"
    assert EngineConfig(model="m", device="cpu", attention_backend="triton").attention_backend == "triton"
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(model="m", dtype="float64")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="m", device="cuda", gpu_memory_utilization=1.5)


def test_the_default_dtype_follows_the_device() -> None:
    """bfloat16 on a GPU (float32 there would double the weights' and the KV cache's bytes and spill the
    attention kernels' registers), float32 on the CPU, whose kernels are float32; a choice stands."""
    assert EngineConfig(model="m", device="cuda").dtype == "bfloat16"
    assert EngineConfig(model="m", device="cuda:1").dtype == "bfloat16"
    assert EngineConfig(model="m").dtype == "float32"
    assert EngineConfig(model="m", device="cuda", dtype="float16").dtype == "float16"
    assert EngineConfig(model="m", device="cuda", dtype="float32").dtype == "float32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_a_cuda_device_without_cuda_is_refused_at_start(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="CUDA is not available"):
        ModelRunner(EngineConfig(model=str(tiny_llama_dir), device="cuda", num_kv_blocks=4))


def _cuda_runner(model_dir: Path, dtype: str, **config: Any) -> ModelRunner:
    """A ModelRunner's sizing state for a CUDA device, without the model (nothing here touches it)."""
    runner = object.__new__(ModelRunner)
    runner.config = EngineConfig(model=str(model_dir), device="cuda", dtype=dtype, **config)
    runner.args = ModelArgs.from_pretrained(model_dir)
    runner.dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    runner.kv_dtype = torch.float8_e4m3fn if runner.config.kv_cache_dtype == "fp8" else runner.dtype
    runner.device = torch.device("cuda")
    runner.block_size = runner.config.block_size
    runner.shard = ShardSizes.of(runner.args, 0, runner.config.tensor_parallel_size)
    return runner


def test_kv_blocks_from_free_device_memory(tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = 40 * 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 * 2**30))
    runner = _cuda_runner(tiny_qwen3_dir, "bfloat16", gpu_memory_utilization=0.5, max_num_seqs=8,
                          max_num_batched_tokens=512)
    a = runner.args
    assert runner.kv_bytes_per_token == 2 * a.num_layers * a.num_kv_heads * a.head_dim * 2
    per_token = a.hidden_size * 4 + a.q_size + 2 * a.kv_size + 3 * a.intermediate_size
    activations = 512 * per_token * 2 + 8 * a.vocab_size * (2 * 4 + 5 + 24)  # logits x2, penalties, noise
    assert runner._activation_bytes() == activations
    expected = (free // 2 - activations) // (BLOCK * runner.kv_bytes_per_token)
    assert runner._num_blocks_from_memory() == expected
    # Twice the utilisation, about twice the blocks; float32 halves them.
    assert _cuda_runner(tiny_qwen3_dir, "bfloat16", gpu_memory_utilization=1.0, max_num_seqs=8,
                        max_num_batched_tokens=512)._num_blocks_from_memory() >= 2 * expected
    fp32 = _cuda_runner(tiny_qwen3_dir, "float32", gpu_memory_utilization=0.5, max_num_seqs=8,
                        max_num_batched_tokens=512)
    assert fp32._num_blocks_from_memory() <= expected // 2 + 1
    # A rank of a 2-way split holds half the KV heads: half the bytes per token.
    split = _cuda_runner(tiny_qwen3_dir, "bfloat16", tensor_parallel_size=2)
    assert split.kv_bytes_per_token == runner.kv_bytes_per_token // 2
    # An FP8 KV cache: one byte per element, so twice the blocks of bf16 in the same memory.
    fp8 = _cuda_runner(tiny_qwen3_dir, "bfloat16", gpu_memory_utilization=0.5, max_num_seqs=8,
                       max_num_batched_tokens=512, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == runner.kv_bytes_per_token // 2
    assert fp8._num_blocks_from_memory() >= 2 * expected


def test_no_kv_blocks_left_is_a_clear_error(tiny_qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**20, 80 * 2**30))
    runner = _cuda_runner(tiny_qwen3_dir, "bfloat16")
    with pytest.raises(ValueError, match=r"no memory left for the KV cache \(90% of 0.0 GiB free device"):
        runner._num_blocks_from_memory()


def test_random_load_format_needs_only_config_json(tiny_llama_dir: Path, tmp_path: Path) -> None:
    shape_only = tmp_path / "shape-only"
    shape_only.mkdir()
    (shape_only / "config.json").write_text((tiny_llama_dir / "config.json").read_text())
    with pytest.raises((FileNotFoundError, ValueError)):  # no weights: the default format refuses
        ModelRunner(EngineConfig(model=str(shape_only), num_kv_blocks=4))

    def params(seed: int) -> list[torch.Tensor]:
        runner = ModelRunner(EngineConfig(model=str(shape_only), num_kv_blocks=4, load_format="random",
                                          seed=seed))
        return [p.detach().clone() for p in runner.model.parameters()]

    first, again, other = params(0), params(0), params(1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    config = json.loads((shape_only / "config.json").read_text())
    embed = first[0]
    assert embed.shape == (config["vocab_size"], config["hidden_size"])
    assert 0.01 < embed.float().std().item() < 0.03  # N(0, 0.02), never zeros or the empty allocation


@pytest.mark.parametrize(("sms", "batch", "kv_heads", "max_seq_len", "splits"), [
    (132, 1, 8, 32_768, 32),   # H100, one sequence: as many splits as allowed
    (132, 1, 8, 2_048, 8),     # ... but never a split under 256 tokens
    (132, 64, 8, 2_048, 1),    # a full batch fills the SMs by itself
    (132, 8, 8, 4_096, 5),     # ceil(264 / 64) programs a sequence's head
    (108, 8, 8, 4_096, 4),     # A100: fewer SMs, fewer splits
    (132, 4, 1, 100, 1),       # shorter than one split
])  # fmt: skip
def test_split_k_fills_the_sms(monkeypatch: pytest.MonkeyPatch, sms: int, batch: int, kv_heads: int,
                               max_seq_len: int, splits: int) -> None:
    monkeypatch.setattr(paged_decode_module, "_sm_count", lambda index: sms)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert default_num_splits(batch, kv_heads, max_seq_len, torch.device("cuda")) == splits
    # The interpreter runs one program at a time: it never splits.
    assert default_num_splits(batch, kv_heads, max_seq_len, torch.device("cpu")) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tile_choices_per_target(dtype: torch.dtype) -> None:
    for group in (1, 4, 8):
        decode = decode_tile_config(128, group, dtype, (9, 0))
        assert decode.block_m == 16 and decode == decode_tile_config(128, group, dtype, (8, 0))
    assert decode_tile_config(128, 32, dtype, (9, 0)).block_m == 32  # a group over 16 rows
    # Before Hopper, head_dim 128 takes twice the warps (the 4-warp tile spills on sm_80).
    hopper, ampere = extend_tile_config(128, 4, dtype, (9, 0)), extend_tile_config(128, 4, dtype, (8, 0))
    assert ampere.num_warps == 2 * hopper.num_warps and (ampere.block_m, ampere.block_n) == (
        hopper.block_m, hopper.block_n)
    assert extend_tile_config(64, 4, dtype, (8, 0)) == extend_tile_config(64, 4, dtype, (9, 0))
    # The query tokens of a program shrink as the GQA group grows: the tile's rows stay the same.
    rows = {g: extend_tile_config(128, g, dtype, (9, 0)).block_m * g for g in (1, 2, 4, 8)}
    assert len(set(rows.values())) == 1, rows
