"""ModelRunner driven by hand-built ScheduledBatches: however a prompt is split into chunks, whatever
blocks it lives in, and whatever else shares the step, it yields the logits of one full forward."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from engine.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.model_runner import ModelRunner, _zeros_on_huge_pages
from engine.sampling_params import SamplingParams
from engine.sequence import ScheduledBatch, ScheduledSeq, Sequence

BLOCK = 16
NUM_BLOCKS = 48
_ids = itertools.count()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    d = request.getfixturevalue(f"tiny_{request.param}_dir")
    return ModelRunner(EngineConfig(model=str(d), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK))


@pytest.fixture(scope="module")
def qwen2_runner(tiny_qwen2_dir: Path) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(tiny_qwen2_dir), num_kv_blocks=NUM_BLOCKS, block_size=BLOCK))


def full_forward(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Reference: logits [len(tokens), vocab] of one whole-prompt forward into a fresh, contiguous cache."""
    args, n = runner.args, len(tokens)
    num_blocks = -(-n // BLOCK)
    caches = [
        torch.zeros(2, num_blocks, BLOCK, args.num_kv_heads, args.head_dim) for _ in range(args.num_layers)
    ]
    meta = AttentionMetadata(
        torch.arange(n), torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
        torch.arange(num_blocks, dtype=torch.int32)[None], n, n, [n], [n], BLOCK,
    )  # fmt: skip
    with torch.inference_mode():
        return runner.model.compute_logits(
            runner.model(torch.tensor(tokens), torch.arange(n), caches, meta)
        ).float()


def make_seq(tokens: list[int], blocks: list[int]) -> Sequence:
    seq = Sequence(request_id=f"r{next(_ids)}", token_ids=list(tokens), params=SamplingParams(max_tokens=8))
    seq.block_table = list(blocks)
    return seq


def run_chunks(runner: ModelRunner, seq: Sequence, chunks: list[int]) -> torch.Tensor:
    """Compute seq's remaining tokens in the given chunk sizes; returns the last step's logits."""
    logits = None
    for n in chunks:
        logits = runner.run(ScheduledBatch([ScheduledSeq(seq, n)]))
        seq.num_computed_tokens += n
    return logits


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_one_chunk_many_chunks_and_shuffled_blocks_agree(runner: ModelRunner) -> None:
    tokens = prompt(53, 0, runner.vocab_size)
    expected = full_forward(runner, tokens)[-1]
    whole = run_chunks(runner, make_seq(tokens, [0, 1, 2, 3]), [53])
    assert whole.shape == (1, runner.vocab_size) and whole.dtype == torch.float32
    torch.testing.assert_close(whole[0], expected, atol=1e-4, rtol=1e-4)

    seq = make_seq(tokens, [40, 7, 33, 12])  # shuffled, non-contiguous
    partial = runner.run(ScheduledBatch([ScheduledSeq(seq, 5)]))
    assert partial.shape == (0, runner.vocab_size)  # a partial prefill chunk samples nothing
    seq.num_computed_tokens = 5
    last = run_chunks(runner, seq, [16, 3, 28, 1])
    torch.testing.assert_close(last[0], expected, atol=1e-4, rtol=1e-4)


def test_decode_steps_match_full_forward(runner: ModelRunner) -> None:
    tokens = prompt(30, 1, runner.vocab_size)
    seq = make_seq(tokens, [9, 21, 4])
    logits = run_chunks(runner, seq, [30])
    for _ in range(6):  # greedy decode across a block boundary (position 31 -> 32)
        seq.append_token(int(logits[0].argmax()))
        logits = run_chunks(runner, seq, [1])
        torch.testing.assert_close(logits[0], full_forward(runner, seq.token_ids)[-1], atol=1e-4, rtol=1e-4)


def test_mixed_batch_of_prefill_chunk_prefix_hit_and_decode(qwen2_runner: ModelRunner) -> None:
    r = qwen2_runner
    shared = prompt(32, 2, r.vocab_size)
    # A: computes the shared 2-block prefix plus a tail.
    a = make_seq(shared + prompt(10, 3, r.vocab_size), [11, 3, 30])
    run_chunks(r, a, [42])
    # B: a prefix-cache hit on A's first two blocks, then its own tail in a fresh block.
    b = make_seq(shared + prompt(7, 4, r.vocab_size), [11, 3, 17])
    b.num_computed_tokens = 32
    # C: a long prompt computed in two chunks; D: decoding after a prefill.
    c = make_seq(prompt(40, 5, r.vocab_size), [1, 2, 5])
    run_chunks(r, c, [25])
    d = make_seq(prompt(12, 6, r.vocab_size), [8])
    run_chunks(r, d, [12])
    d.append_token(7)
    a.append_token(99)

    logits = r.run(
        ScheduledBatch([ScheduledSeq(a, 1), ScheduledSeq(b, 7), ScheduledSeq(c, 10), ScheduledSeq(d, 1)])
    )
    # C's chunk stops short of its end (35 of 40 tokens): no row for it.
    assert logits.shape == (3, r.vocab_size)
    for row, seq in zip(logits, (a, b, d), strict=True):
        torch.testing.assert_close(row, full_forward(r, seq.token_ids)[-1], atol=1e-4, rtol=1e-4)
    c.num_computed_tokens = 35
    torch.testing.assert_close(
        run_chunks(r, c, [5])[0], full_forward(r, c.token_ids)[-1], atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize(
    ("blocks", "num_tokens", "start", "match"),
    [
        ([0], 20, 0, "need 2 blocks"),
        ([0, NUM_BLOCKS], 20, 0, "block ids must be in"),
        ([0, -1], 20, 0, "block ids must be in"),
        ([0, 1], 21, 0, "outside its 20 tokens"),
        ([0, 1], 0, 0, "outside its 20 tokens"),
    ],
)
def test_malformed_batches_raise(
    qwen2_runner: ModelRunner, blocks: list[int], num_tokens: int, start: int, match: str
) -> None:
    seq = make_seq(prompt(20, 7, qwen2_runner.vocab_size), blocks)
    seq.num_computed_tokens = start
    with pytest.raises(ValueError, match=match):
        qwen2_runner.run(ScheduledBatch([ScheduledSeq(seq, num_tokens)]))
    with pytest.raises(ValueError, match="empty batch"):
        qwen2_runner.run(ScheduledBatch([]))


def test_runner_exposes_model_facts(qwen2_runner: ModelRunner, tiny_qwen2_dir: Path) -> None:
    r = qwen2_runner
    args = r.args
    assert r.num_kv_blocks == NUM_BLOCKS and r.max_model_len == 2048 and r.vocab_size == args.vocab_size
    assert r.kv_bytes_per_token == 2 * args.num_layers * args.num_kv_heads * args.head_dim * 4
    assert len(r.kv_caches) == args.num_layers
    assert r.kv_caches[0].shape == (2, NUM_BLOCKS, BLOCK, args.num_kv_heads, args.head_dim)
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(tiny_qwen2_dir)
    assert r.eos_token_ids == tok.eos_token_ids and tok.token_to_id("<|im_end|>") in r.eos_token_ids


def test_kv_blocks_sized_from_memory_and_max_model_len(tiny_qwen3_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_qwen3_dir), kv_cache_memory_gb=0.01, max_model_len=512)
    r = ModelRunner(config)
    assert r.num_kv_blocks == int(0.01 * 2**30) // (BLOCK * r.kv_bytes_per_token)
    assert r.max_model_len == 512
    seq = make_seq(prompt(520, 8, r.vocab_size), list(range(33)))
    with pytest.raises(ValueError, match="exceed max_model_len 512"):
        r.run(ScheduledBatch([ScheduledSeq(seq, 520)]))
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        ModelRunner(EngineConfig(model=str(tiny_qwen3_dir), num_kv_blocks=4, max_model_len=4096))


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident set from /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_cpu_kv_cache_is_zeros_that_cost_memory_only_once_written(dtype: torch.dtype) -> None:
    # 64-128 MiB: above the 32 MiB from which a CPU runner has malloc map fresh pages (as a layer's cache is)
    shape = (2, 8192, BLOCK, 4, 64)
    before = _resident_bytes()
    cache = _zeros_on_huge_pages(shape, dtype, torch.device("cpu"))
    assert _resident_bytes() - before < 4 << 20  # nothing written yet: no page of it is resident
    assert cache.shape == shape and cache.dtype == dtype and cache.is_contiguous()
    assert cache.data_ptr() % (2 << 20) == 0  # on a huge-page boundary
    assert not cache.any()
    cache[1, 7].fill_(3.0)
    assert cache.sum() == 3.0 * BLOCK * 4 * 64


def test_bfloat16_runner_tracks_float32(tiny_qwen2_dir: Path, qwen2_runner: ModelRunner) -> None:
    bf16 = ModelRunner(EngineConfig(model=str(tiny_qwen2_dir), num_kv_blocks=8, dtype="bfloat16"))
    assert bf16.kv_caches[0].dtype == torch.bfloat16
    assert bf16.kv_bytes_per_token * 2 == qwen2_runner.kv_bytes_per_token
    tokens = prompt(20, 9, bf16.vocab_size)
    ours = run_chunks(bf16, make_seq(tokens, [3, 5]), [20])[0]
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours, full_forward(qwen2_runner, tokens)[-1], atol=0.1, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_eager(tiny_llama_dir: Path) -> None:
    def make(enforce_eager: bool) -> ModelRunner:
        return ModelRunner(
            EngineConfig(
                model=str(tiny_llama_dir),
                device="cuda",
                dtype="float32",
                num_kv_blocks=64,
                max_num_seqs=5,
                enforce_eager=enforce_eager,
            )
        )

    graphed, eager = make(False), make(True)
    assert graphed._graphs is not None and eager._graphs is None
    outs = []
    for r in (graphed, eager):
        seqs = [
            make_seq(prompt(10 + 7 * i, 20 + i, r.vocab_size), [3 * i, 3 * i + 1, 3 * i + 2])
            for i in range(3)
        ]
        r.run(ScheduledBatch([ScheduledSeq(s, len(s)) for s in seqs]))
        steps = []
        for _ in range(4):
            for s in seqs:
                s.num_computed_tokens = len(s)
                s.append_token(5)
            steps.append(r.run(ScheduledBatch([ScheduledSeq(s, 1) for s in seqs])).cpu())
        outs.append(torch.stack(steps))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-3, rtol=1e-3)
