"""Tensor parallelism on the CPU (gloo): a model split over 2 ranks computes what the whole model does.

The shards are checked against the checkpoint (pure loading, no processes); then real 2-rank replicas
(rank 1 a spawned process): logits within float32 tolerance of the single-rank runner, greedy outputs
identical with prefix-cache hits, chunked prefill and preemption in one run, and with the host and disk
tiers (blocks offloaded, loaded back, read from disk after a restart).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from engine import LLM, SamplingParams
from engine.attention import get_backend
from engine.config import EngineConfig
from engine.distributed import ShardSizes, TensorParallel, check_divisible
from engine.loader import load_model
from engine.model_runner import ModelRunner
from engine.models.config import ModelArgs
from engine.rank_workers import RANK_DIED_EXIT_CODE
from engine.sampling_params import SamplingParams as Params
from engine.sequence import ScheduledBatch, ScheduledSeq, Sequence
from tests.polling import wait_until
from tollgate.local_services import free_port
from tollgate.processes import children, pid_alive

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _args(**overrides: object) -> ModelArgs:
    base = dict(architecture="LlamaForCausalLM", model_type="llama", vocab_size=1001, hidden_size=64,
                intermediate_size=96, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8,
                max_position_embeddings=64)  # fmt: skip
    return ModelArgs(**{**base, **overrides})  # type: ignore[arg-type]


def test_shards_split_heads_mlp_and_vocabulary() -> None:
    args = _args()
    shards = [ShardSizes.of(args, r, 2) for r in range(2)]
    assert [(s.num_heads, s.first_head, s.num_kv_heads, s.first_kv_head) for s in shards] == [(4, 0, 1, 0),
                                                                                               (4, 4, 1, 1)]
    assert [s.intermediate_size for s in shards] == [48, 48]
    assert [(s.vocab_start, s.vocab_rows, s.vocab_per_rank) for s in shards] == [(0, 501, 501),
                                                                                  (501, 500, 501)]
    # 8 ranks over 2 KV heads: each KV head replicated on 4 consecutive ranks.
    assert [ShardSizes.of(args, r, 8).first_kv_head for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ShardSizes.of(args) == ShardSizes(0, 1, 8, 2, 0, 0, 96, 1001, 1001)


@pytest.mark.parametrize("size, message", [(3, "8 attention heads"), (0, ">= 1")])
def test_a_size_that_does_not_divide_the_model_is_refused(size: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_divisible(_args(), size)
    with pytest.raises(ValueError, match="intermediate size"):
        check_divisible(_args(intermediate_size=90), 4)
    with pytest.raises(ValueError, match="KV heads"):
        check_divisible(_args(num_heads=12, num_kv_heads=6), 4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_each_rank_loads_only_its_slice_of_the_checkpoint(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    args = ModelArgs.from_pretrained(model_dir)
    backend = get_backend("torch")(args.num_heads // 2, args.num_kv_heads // 2, args.head_dim, scale=1.0)
    ranks = [load_model(model_dir, backend, torch.float32, "cpu", tp=TensorParallel(r, 2)) for r in range(2)]
    with safe_open(str(next(model_dir.glob("*.safetensors"))), framework="pt") as f:
        whole = {name: f.get_tensor(name) for name in f.keys()}
    d, v = args.head_dim, args.vocab_size
    q, kv = args.q_size // 2, args.kv_size // 2
    layer = "model.layers.0"
    for r, model in enumerate(ranks):
        params = dict(model.named_parameters())
        qkv = params[f"{layer}.self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[:q], whole[f"{layer}.self_attn.q_proj.weight"][r * q:(r + 1) * q])
        assert torch.equal(qkv[q:q + kv], whole[f"{layer}.self_attn.k_proj.weight"][r * kv:(r + 1) * kv])
        assert torch.equal(qkv[q + kv:], whole[f"{layer}.self_attn.v_proj.weight"][r * kv:(r + 1) * kv])
        o = whole[f"{layer}.self_attn.o_proj.weight"]
        assert torch.equal(params[f"{layer}.self_attn.o_proj.weight"], o[:, r * q:(r + 1) * q])
        inter = args.intermediate_size // 2
        down = whole[f"{layer}.mlp.down_proj.weight"]
        assert torch.equal(params[f"{layer}.mlp.down_proj.weight"], down[:, r * inter:(r + 1) * inter])
        norm = f"{layer}.input_layernorm.weight"
        assert torch.equal(params[norm], whole[norm])
        rows = -(-v // 2)
        embed = params["model.embed_tokens.weight"]
        real = whole["model.embed_tokens.weight"][r * rows:(r + 1) * rows]
        assert torch.equal(embed[:len(real)], real) and not embed[len(real):].any()  # padding: zeros
        assert d * args.num_heads == args.q_size


BLOCK, NUM_BLOCKS = 4, 64
_ids = itertools.count()


def _seq(tokens: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(request_id=f"r{next(_ids)}", token_ids=list(tokens), params=Params(max_tokens=8))
    seq.block_table = list(blocks)
    return seq


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a prefill batch of two prompts (one in two chunks), then three decode steps of both."""
    g = torch.Generator().manual_seed(3)
    a = _seq(torch.randint(0, runner.vocab_size, (13,), generator=g).tolist(), list(range(0, 8)))
    b = _seq(torch.randint(0, runner.vocab_size, (6,), generator=g).tolist(), list(range(8, 16)))
    out = [runner.run(ScheduledBatch([ScheduledSeq(a, 7), ScheduledSeq(b, 6)]))]  # b's row only
    a.num_computed_tokens, b.num_computed_tokens = 7, 6
    out.append(runner.run(ScheduledBatch([ScheduledSeq(a, 6)])))
    a.num_computed_tokens += 6
    rows = (out[1][0], out[0][0])
    for _ in range(3):
        for seq, logits in zip((a, b), rows, strict=True):
            seq.append_token(int(logits.argmax()))
        out.append(runner.run(ScheduledBatch([ScheduledSeq(a, 1), ScheduledSeq(b, 1)])))
        a.num_computed_tokens += 1
        b.num_computed_tokens += 1
        rows = (out[-1][0], out[-1][1])
    return out


@pytest.mark.slow  # a spawned rank per replica
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_equal_the_single_rank_runner(arch: str, request: pytest.FixtureRequest) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    config = dict(model=str(model_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
    whole = _steps(ModelRunner(EngineConfig(**config)))  # type: ignore[arg-type]
    split_runner = ModelRunner(EngineConfig(**config, tensor_parallel_size=2))  # type: ignore[arg-type]
    try:
        assert split_runner.workers is not None and len(split_runner.workers.pids) == 1
        assert split_runner.kv_caches[0].shape[3] == ModelArgs.from_pretrained(model_dir).num_kv_heads // 2
        split = _steps(split_runner)
    finally:
        split_runner.close()
    for i, (x, y) in enumerate(zip(whole, split, strict=True)):
        assert x.shape == y.shape, i
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5, msg=f"step {i}")


@pytest.mark.slow  # a spawned rank, Triton's interpreter on a CPU
def test_the_triton_kernels_run_unchanged_on_each_rank(tiny_llama_dir: Path) -> None:
    config = dict(model=str(tiny_llama_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK)
    whole = _steps(ModelRunner(EngineConfig(**config)))  # type: ignore[arg-type]
    split_runner = ModelRunner(EngineConfig(**config, tensor_parallel_size=2,  # type: ignore[arg-type]
                                            attention_backend="triton"))  # fmt: skip
    try:
        assert split_runner.attention_backend.name == "triton"
        split = _steps(split_runner)
    finally:
        split_runner.close()
    for i, (x, y) in enumerate(zip(whole, split, strict=True)):
        torch.testing.assert_close(y, x, rtol=1e-4, atol=1e-4, msg=f"step {i}")


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# Five prompts, two sharing a 3-block prefix: run twice, the second round hits the prefix cache.
PROMPTS = [[(31 * i + 7 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
PROMPTS.append(PROMPTS[3][:48] + [11, 12, 13])
# A 16-token step budget (chunked prefill) and a pool too small for all five at once (preemption).
TIGHT = dict(block_size=16, num_kv_blocks=10, max_num_seqs=5, max_num_batched_tokens=16)


def _greedy_rounds(llm: LLM) -> list[list[int]]:
    return [out.token_ids for _ in range(2) for out in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.slow  # a spawned rank per replica
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_outputs_equal_with_cache_hits_chunked_prefill_and_preemption(
    arch: str, request: pytest.FixtureRequest
) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    with LLM(str(model_dir), **TIGHT) as whole:  # type: ignore[arg-type]
        expected = _greedy_rounds(whole)
    with LLM(str(model_dir), tensor_parallel_size=2, **TIGHT) as split:  # type: ignore[arg-type]
        got = _greedy_rounds(split)
        stats = split.stats
    assert got == expected
    assert stats.num_partial_prefill_chunks > 0 and stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0


@pytest.mark.slow  # a spawned rank per replica
def test_host_and_disk_tiers_hold_every_ranks_shard(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Blocks offloaded to the host and loaded back, then after a restart read from disk (every rank's
    files): outputs identical to the single-rank engine's, and the hits come from those tiers."""
    prompts = [[(31 * i + 7 * j) % 250 + 3 for j in range(50)] for i in range(4)]
    small = dict(num_kv_blocks=8, max_num_seqs=2)

    def rounds(llm: LLM) -> list[list[int]]:
        return [llm.generate([p], GREEDY)[0].token_ids for _ in range(2) for p in prompts]

    with LLM(str(tiny_llama_dir), **small) as whole:  # type: ignore[arg-type]
        expected = rounds(whole)
    tiers = dict(num_host_kv_blocks=8, num_disk_kv_blocks=64, kv_disk_dir=str(tmp_path),
                 tensor_parallel_size=2)
    with LLM(str(tiny_llama_dir), **small, **tiers) as split:  # type: ignore[arg-type]
        assert rounds(split) == expected
        moves = split.stats.kv_tier_moves
        assert moves["offloaded_blocks"] > 0 and moves["loaded_blocks"] > 0
    shard_dirs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(shard_dirs) == 2  # one directory of block files per rank
    assert {f.relative_to(shard_dirs[0]) for f in shard_dirs[0].rglob("*.kv")} == {
        f.relative_to(shard_dirs[1]) for f in shard_dirs[1].rglob("*.kv")}
    with LLM(str(tiny_llama_dir), **small, **tiers) as restarted:  # type: ignore[arg-type]
        first = restarted.generate([prompts[0]], GREEDY)[0]
        stats = restarted.stats
    assert first.token_ids == expected[0]
    assert first.num_cached_tokens == 48 and stats.prefix_hit_tokens_by_tier["disk"] >= 48


@contextlib.contextmanager
def _split_replica(model_dir: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``tollgate engine --tensor-parallel-size 2`` once it answers /health, and its rank 1's pid."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tollgate", "engine", "--model", str(model_dir),
                                 "--port", str(port), "--num-kv-blocks", "64", "--tensor-parallel-size", "2"],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            return False

        wait_until(healthy, "the 2-rank engine to answer /health", timeout_s=120, interval_s=0.2)
        workers = [c for c in children(proc.pid) if "spawn_main" in Path(f"/proc/{c}/cmdline").read_text()]
        assert len(workers) == 1, workers
        yield proc, workers[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_killed_rank_ends_the_replica_with_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with _split_replica(tiny_llama_dir, tmp_path / "engine.log") as (proc, rank1):
        os.kill(rank1, signal.SIGKILL)
        assert proc.wait(timeout=60) == RANK_DIED_EXIT_CODE
    log = (tmp_path / "engine.log").read_text()
    assert f"tensor-parallel rank 1 (pid {rank1}) exited with code -9" in log


@pytest.mark.slow
def test_the_other_ranks_exit_when_rank_0_dies(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with _split_replica(tiny_llama_dir, tmp_path / "engine.log") as (proc, rank1):
        proc.kill()
        proc.wait()
        wait_until(lambda: not pid_alive(rank1), "rank 1 to exit after rank 0", timeout_s=30, interval_s=0.1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_two_gpus_over_nccl_give_the_single_gpu_tokens(tiny_llama_dir: Path, enforce_eager: bool) -> None:
    """On two GPUs: NCCL collectives, the Triton kernels on each rank, and decode steps replayed from
    CUDA graphs that captured the collectives; float32, so the tokens must be the single GPU's."""
    common = dict(device="cuda", dtype="float32", enforce_eager=enforce_eager, **TIGHT)
    with LLM(str(tiny_llama_dir), **common) as whole:  # type: ignore[arg-type]
        expected = _greedy_rounds(whole)
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **common) as split:  # type: ignore[arg-type]
        assert split.engine.runner.device == torch.device("cuda", 0)
        assert _greedy_rounds(split) == expected
