"""Greedy output of the engine equals ``transformers``' greedy ``generate``, token for token, on tiny
random-weight Llama / Qwen2 / Qwen3 checkpoints (float32, CPU) — with prefix caching on and off, with
chunked prefill forced by a small token budget, and with preemption forced by a small KV pool.

A divergence is accepted only where transformers' own top-2 logit gap at that position is below 1e-3
and our token is one of those two (a float near-tie); the outputs after it are then not compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MAX_NEW_TOKENS = 24
TIE_GAP = 1e-3
# Different lengths (one exactly two blocks, one with a shared prefix) so the batch mixes shapes.
PROMPTS = [
    "def fibonacci(n):\n    return",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import json\nimport os\n\nclass Config:\n    \"\"\"Settings loaded from the environment.\"\"\"\n",
    "Hello!",
    "The quick brown fox jumps over the lazy dog. Then",
]


def _hf_greedy(model_dir: Path, prompt_ids: list[list[int]], device: str = "cpu",
               dtype: torch.dtype = torch.float32) -> list[tuple[list[int], torch.Tensor]]:
    """transformers' greedy continuation of each prompt (one at a time: no padding) and its raw logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.eval()
    results = []
    with torch.no_grad():
        for ids in prompt_ids:
            input_ids = torch.tensor([ids], device=device)
            # An explicit mask: without one, transformers masks every prompt token equal to the pad id.
            out = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(ids):].tolist()
            logits = torch.stack([step[0] for step in out.logits]).float().cpu()
            results.append((tokens, logits))
    return results


def _assert_matches(ours: list[int], theirs: list[int], logits: torch.Tensor, where: str,
                    tie_gap: float = TIE_GAP) -> None:
    for pos, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a == b:
            continue
        top2 = torch.topk(logits[pos], 2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < tie_gap and a in top2.indices.tolist(), (
            f"{where}: token {pos} differs (ours {a}, transformers {b}) with a top-2 gap of {gap:.2e}"
        )
        return  # after an honest near-tie the continuations legitimately differ
    assert len(ours) == len(theirs), f"{where}: {len(ours)} tokens vs transformers' {len(theirs)}"


CONFIGS = {
    "prefix-cache-on": dict(enable_prefix_caching=True),
    "prefix-cache-off": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_kv_blocks=9, max_num_seqs=5),
}


def check_greedy_against_transformers(model_dir: Path, where: str) -> None:
    """The engine's greedy output under each of ``CONFIGS`` against transformers' ``generate``; with the
    prefix cache on, a second round reads every prompt's full blocks from the cache."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    reference: list[tuple[list[int], torch.Tensor]] | None = None
    for name, kwargs in CONFIGS.items():
        llm = LLM(str(model_dir), **kwargs)
        prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
        if reference is None:
            reference = _hf_greedy(model_dir, prompt_ids)
            assert len({tuple(t) for t, _ in reference}) == len(PROMPTS), "outputs should differ"
        for _ in range(2 if name == "prefix-cache-on" else 1):
            outputs = llm.generate(prompt_ids, params)
            for i, (out, (theirs, logits)) in enumerate(zip(outputs, reference, strict=True)):
                assert out.prompt_token_ids == prompt_ids[i]
                _assert_matches(out.token_ids, theirs, logits, f"{where}/{name}/prompt {i}")
                assert out.text == llm.tokenizer.decode(out.token_ids)
        stats = llm.stats
        if name == "chunked-prefill":
            assert stats.num_partial_prefill_chunks > 0
        if name == "preemption":
            assert stats.num_preemptions > 0
        if name == "prefix-cache-off":
            assert stats.prefix_hit_tokens == 0
        if name == "prefix-cache-on":
            assert stats.prefix_hit_tokens > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(arch: str, request: pytest.FixtureRequest) -> None:
    check_greedy_against_transformers(request.getfixturevalue(f"tiny_{arch}_dir"), arch)


# bfloat16 rounds each implementation's sums differently (about 3 significant digits), so a token may
# flip wherever transformers' own top-2 logits are this close.
BF16_TIE_GAP = 0.25


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_matches_transformers_on_gpu(arch: str, dtype: str, request: pytest.FixtureRequest) -> None:
    """The GPU path as deployed (triton backend, fused kernels, CUDA-graph decode, chunked prefill)
    against transformers on the same GPU in the same dtype."""
    check_greedy_on_gpu(request.getfixturevalue(f"tiny_{arch}_dir"), dtype, arch)


def check_greedy_on_gpu(model_dir: Path, dtype: str, where: str) -> None:
    """The engine on a GPU as deployed against transformers on the same GPU in the same dtype."""
    # A fixed small pool: sized from free memory it would take 90% of a GPU the other test workers share.
    llm = LLM(str(model_dir), device="cuda", dtype=dtype, max_num_batched_tokens=32, max_num_seqs=8,
              num_kv_blocks=128)
    assert llm.engine.runner.attention_backend.name == "triton"
    assert llm.engine.runner._graphs is not None, "CUDA graph capture failed"
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    reference = _hf_greedy(model_dir, prompt_ids, device="cuda", dtype=getattr(torch, dtype))
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
    gap = TIE_GAP if dtype == "float32" else BF16_TIE_GAP
    for i, (out, (theirs, logits)) in enumerate(zip(outputs, reference, strict=True)):
        _assert_matches(out.token_ids, theirs, logits, f"{where}/{dtype}/prompt {i}", tie_gap=gap)
    assert llm.stats.num_partial_prefill_chunks > 0
