"""The engine with ``attention_backend="triton"`` gives the same greedy tokens as the ``torch`` backend.

Tiny random-weight checkpoints, float32, on the GPU when there is one (compiled kernels, eager steps:
CUDA graphs have their own test below). Without a GPU the Triton kernels run in Triton's interpreter:
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

# Compiled kernels refuse CPU tensors and the interpreter is off on a CUDA host: run where they run.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
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
        llm = LLM(str(model_dir), device=DEVICE, dtype="float32", attention_backend=backend,
                  enforce_eager=True, **CONFIGS[config])
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


def _metadata(query_lens: list[int], seq_lens: list[int], tables: list[list[int]], block_size: int,
              device: str):
    from engine.attention import AttentionMetadata

    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    slots = []
    for q_len, seq_len, table in zip(query_lens, seq_lens, tables, strict=True):
        new_positions = range(seq_len - q_len, seq_len)
        slots += [table[p // block_size] * block_size + p % block_size for p in new_positions]
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(query_lens), 0, out=starts[1:])
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device), query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens, block_size=block_size,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("query_lens", "seq_lens"),
    [([37, 20, 1, 1], [37, 41, 50, 17]), ([1, 1, 1], [90, 1, 33])],
    ids=["mixed-prefill-chunk-decode", "decode-only"],
)
def test_backend_forward_matches_torch_backend(query_lens: list[int], seq_lens: list[int]) -> None:
    """One layer's forward through both backends from the same cache: same outputs, same cache after."""
    from engine.attention import get_backend

    gen = torch.Generator().manual_seed(1234)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 2, 64, 16, 24
    ids = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled physical blocks
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(ids[:need])
        ids = ids[need:]
    meta = _metadata(query_lens, seq_lens, tables, block_size, DEVICE)
    cache = torch.randn((2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen)  # "cached prefix"
    num_tokens = sum(query_lens)
    q = torch.randn((num_tokens, num_heads, head_dim), generator=gen)
    k = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    v = torch.randn((num_tokens, num_kv_heads, head_dim), generator=gen)
    cache, q, k, v = (t.to(DEVICE) for t in (cache, q, k, v))
    results = {}
    for name in ("torch", "triton"):
        backend = get_backend(name)(num_heads, num_kv_heads, head_dim, scale=head_dim**-0.5)
        layer_cache = cache.clone()
        results[name] = (backend.forward(q, k, v, layer_cache, meta), layer_cache)
    torch.testing.assert_close(results["triton"][0], results["torch"][0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(results["triton"][1], results["torch"][1], atol=0, rtol=0)


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graph_decode_matches_eager(tiny_llama_dir: Path, dtype: str) -> None:
    """On the GPU path (triton backend, fused kernels) the runner's CUDA-graph decode steps give the
    eager runner's logits: a batch padded up to a captured size (5 -> 8), then a smaller one (3 -> 4)
    that replays over the stale rows the first left behind."""
    from engine.config import EngineConfig
    from engine.model_runner import ModelRunner
    from engine.sequence import ScheduledBatch, ScheduledSeq, Sequence

    def make_runner(enforce_eager: bool) -> ModelRunner:
        return ModelRunner(EngineConfig(model=str(tiny_llama_dir), device="cuda", dtype=dtype, max_num_seqs=8,
                                        num_kv_blocks=64, enforce_eager=enforce_eager))  # fmt: skip

    eager_runner, graph_runner = make_runner(True), make_runner(False)
    assert eager_runner.attention_backend.name == graph_runner.attention_backend.name == "triton"
    # Capture failures fall back to eager steps with a warning; here they must not have happened.
    assert graph_runner._graphs is not None and eager_runner._graphs is None
    gen = torch.Generator().manual_seed(0)
    vocab = eager_runner.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (5, 40, 17, 70, 3)]

    def sequences() -> list[Sequence]:
        seqs = []
        for i, tokens in enumerate(prompts):
            seq = Sequence(request_id=str(i), token_ids=list(tokens), params=SamplingParams(max_tokens=4))
            seq.block_table = [60 - 10 * i - j for j in range(6)]  # shuffled ids, room for a few tokens
            seqs.append(seq)
        return seqs

    logits = {}
    for name, runner in (("eager", eager_runner), ("graphs", graph_runner)):
        seqs = sequences()
        steps = [runner.run(ScheduledBatch([ScheduledSeq(s, len(s.token_ids)) for s in seqs]))]
        for batch_seqs in (seqs, seqs[:3]):
            for s in batch_seqs:
                s.num_computed_tokens = len(s.token_ids)
                s.append_token(7)
            steps.append(runner.run(ScheduledBatch([ScheduledSeq(s, 1) for s in batch_seqs])))
        logits[name] = steps
    for eager, replayed in zip(logits["eager"], logits["graphs"], strict=True):
        torch.testing.assert_close(replayed, eager, atol=5e-2, rtol=5e-2)
