"""The engine with ``attention_backend="triton"`` gives the same greedy tokens as the ``torch`` backend.

Tiny random-weight checkpoints, float32. Without a GPU the Triton kernels run in Triton's interpreter:
``TRITON_INTERPRET`` must be set before ``triton`` is first imported (its library functions are
decorated at import), hence the assignment above the imports (``kernels`` also sets it on CUDA-less
hosts). ``kernels.launch_counts`` proves the kernels ran: the torch run launches none, the triton run
launches the store, extend and decode kernels — there is no silent fallback to PyTorch.

Configurations force every attention path through the engine: whole prefills and decode steps, chunked
prefill (later chunks attend over the earlier ones in the paged cache, mixed with decode rows), prefix-
cache hits (a second round of prompts extends the first), and split-K decode with a merge.

Tokens must be identical; a difference is accepted only at an honest float near-tie of the torch run
(top-2 logprob gap below 1e-4 with our token one of the two), after which the rest is not compared.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402

kernels = pytest.importorskip("kernels")
paged_decode_module = pytest.importorskip("kernels.paged_decode_attention")

MAX_NEW_TOKENS = 10
TIE_GAP = 1e-4
PROMPTS = [
    "def fibonacci(n):\n    return",
    "The quick brown fox jumps over the lazy dog. " * 4,  # > 2 K/V tiles, not a multiple of 16
    "Hello!",
]
# Second round: each extends a first-round prompt, so its leading full blocks are prefix-cache hits.
FOLLOW_UPS = [PROMPTS[1] + "And then the fox", PROMPTS[0] + " fibonacci(n - 1)"]

# A small pool: after every launch Triton's interpreter copies each tensor argument's whole storage
# back onto itself (the full per-layer cache), so the default 1 GiB CPU pool costs ~0.1 s per launch.
POOL = dict(num_kv_blocks=64)
CONFIGS = {
    "whole-prefill": dict(POOL),
    "chunked-prefill": dict(POOL, max_num_batched_tokens=20),
    "split-k-decode": dict(POOL),  # with the decode split count forced to 3, below
}


def _generate(llm: LLM, prompts: list[str], params: SamplingParams) -> list[tuple[list[int], list]]:
    outs = llm.generate([llm.tokenizer.encode(p) for p in prompts], params)
    return [(out.token_ids, out.logprobs) for out in outs]


def _assert_same_tokens(ours: list[int], theirs: list[int], theirs_logprobs: list, where: str) -> None:
    for pos, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a == b:
            continue
        top = theirs_logprobs[pos].top_logprobs
        gap = top[0][1] - top[1][1]
        assert gap < TIE_GAP and a in (top[0][0], top[1][0]), (
            f"{where}: token {pos} differs (triton {a}, torch {b}) with a top-2 logprob gap of {gap:.2e}"
        )
        return
    assert len(ours) == len(theirs), f"{where}: triton gave {len(ours)} tokens, torch {len(theirs)}"


# Qwen3 (per-head q/k norm, head_dim != hidden / heads) once; Llama through every path.
@pytest.mark.parametrize(("arch", "config"), [*(("llama", c) for c in CONFIGS), ("qwen3", "chunked-prefill")])
def test_triton_backend_matches_torch_backend(
    arch: str, config: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    if config == "split-k-decode":
        monkeypatch.setattr(paged_decode_module, "default_num_splits", lambda *args: 3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, logprobs=2)
    results = {}
    for backend in ("torch", "triton"):
        kernels.reset_launch_counts()
        llm = LLM(str(model_dir), device="cpu", dtype="float32", attention_backend=backend, **CONFIGS[config])
        first = _generate(llm, PROMPTS, params)
        second = _generate(llm, FOLLOW_UPS, params)
        assert llm.stats.prefix_hit_tokens > 0, "the second round should hit the prefix cache"
        if config == "chunked-prefill":
            assert llm.stats.num_partial_prefill_chunks > 0
        results[backend] = first + second
        launches = dict(kernels.launch_counts)
        if backend == "torch":
            assert launches == {}, f"the torch backend must not launch Triton kernels, got {launches}"
        else:
            for op in ("store_kv_cache", "extend_attention", "paged_decode_attention"):
                assert launches.get(op, 0) > 0, f"{op} never ran on the triton backend: {launches}"

    pairs = zip(results["triton"], results["torch"], strict=True)
    for i, ((ours, _), (theirs, theirs_logprobs)) in enumerate(pairs):
        _assert_same_tokens(ours, theirs, theirs_logprobs, f"{arch}/{config}/prompt {i}")


def test_backend_rejects_a_mismatched_cache(tiny_llama_dir: Path) -> None:
    from engine.attention import get_backend

    backend = get_backend("triton")(4, 2, 32, scale=32**-0.5)
    assert backend.name == "triton"
    with pytest.raises(ValueError, match="kv_cache must be"):
        backend.forward(
            torch.randn(1, 4, 32), torch.randn(1, 2, 32), torch.randn(1, 2, 32),
            torch.zeros(2, 4, 16, 4, 32), None,  # type: ignore[arg-type]
        )  # fmt: skip
    with pytest.raises(ValueError, match="decode_num_splits"):
        get_backend("triton")(4, 2, 32, scale=1.0, decode_num_splits=0)


def test_default_cuda_graph_batch_sizes() -> None:
    from engine.cuda_graphs import default_batch_sizes

    assert default_batch_sizes(1) == [1]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_cuda_graphs_refuse_what_cannot_be_captured() -> None:
    from engine.attention import get_backend
    from engine.cuda_graphs import DecodeCudaGraphs

    model = torch.nn.Identity()
    caches = [torch.zeros(2, 4, 16, 2, 32)]
    with pytest.raises(ValueError, match="need the triton attention backend"):
        DecodeCudaGraphs(model, caches, get_backend("torch")(4, 2, 32, scale=1.0), max_num_seqs=4,
                         max_model_len=64, block_size=16)  # fmt: skip
    with pytest.raises(ValueError, match="KV cache on a CUDA device"):
        DecodeCudaGraphs(model, caches, get_backend("triton")(4, 2, 32, scale=1.0), max_num_seqs=4,
                         max_model_len=64, block_size=16)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graph_decode_matches_eager(tiny_llama_dir: Path, dtype: str) -> None:
    """Replaying the captured decode graph gives the eager forward's hidden states, for a batch that is
    padded up to a captured size (3 -> 4) and after a larger batch left stale rows behind."""
    from engine.config import EngineConfig
    from engine.cuda_graphs import DecodeCudaGraphs
    from engine.model_runner import ModelRunner
    from engine.sequence import ScheduledBatch, ScheduledSeq, Sequence

    config = EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype=dtype, attention_backend="triton",
                          num_kv_blocks=64, enforce_eager=True)  # fmt: skip
    runner = ModelRunner(config)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for i, length in enumerate([5, 40, 17, 70, 3]):
        tokens = torch.randint(0, runner.vocab_size, (length,), generator=gen).tolist()
        seq = Sequence(request_id=str(i), token_ids=tokens, params=SamplingParams(max_tokens=4))
        seq.block_table = [10 * i + j for j in range(6)]  # room for prompt + a few decode tokens
        seqs.append(seq)
    runner.run(ScheduledBatch([ScheduledSeq(s, len(s.token_ids)) for s in seqs]))  # prefill eagerly
    for s in seqs:
        s.num_computed_tokens = len(s.token_ids)
        s.append_token(1)

    graphs = DecodeCudaGraphs(runner.model, runner.kv_caches, runner.attention_backend, max_num_seqs=8,
                              max_model_len=runner.max_model_len, block_size=runner.block_size)  # fmt: skip
    graphs.capture()
    for batch_seqs in (seqs, seqs[:3]):
        step = ScheduledBatch([ScheduledSeq(s, 1) for s in batch_seqs])
        input_ids, positions, meta, _ = runner.prepare(step)
        assert graphs.can_run(meta, input_ids.shape[0])
        replayed = graphs.run(input_ids, positions, meta).clone()
        with torch.inference_mode():
            eager = runner.model(input_ids, positions, runner.kv_caches, meta)
        torch.testing.assert_close(replayed, eager, atol=2e-2, rtol=2e-2)
