"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``): every prompt token's logprob given the
tokens before it, equal to transformers' on the same checkpoint, computed chunk by chunk during prefill,
never read from the prefix cache, the same under tensor parallelism; bad values refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

PROMPT = list(range(30, 71))  # 41 tokens: three chunks of 16
SMALL = {"num_kv_blocks": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16}


def _reference(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(records: list, prompt: list[int], reference: torch.Tensor, k: int) -> None:
    assert records[0] is None and len(records) == len(prompt)
    for i in range(1, len(prompt)):
        record, row = records[i], reference[i - 1]
        assert record.token_id == prompt[i]
        assert record.logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
        value = row[prompt[i]]  # the rank, up to ties within float error between two computations
        assert 1 + int((row > value + 1e-5).sum()) <= record.rank <= 1 + int((row > value - 1e-5).sum())
        assert [t for t, _ in record.top_logprobs] == row.topk(k).indices.tolist()


def test_prompt_logprobs_equal_transformers_chunk_by_chunk_and_skip_the_cache(tiny_llama_dir: Path) -> None:
    reference = _reference(tiny_llama_dir, PROMPT)
    with LLM(str(tiny_llama_dir), **SMALL) as llm:  # type: ignore[arg-type]
        plain = llm.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0))[0]
        assert plain.prompt_logprobs is None
        scored, beside = llm.generate(
            [PROMPT, PROMPT[:20]], [SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2),
                                    SamplingParams(max_tokens=4, temperature=0)])
        _check(scored.prompt_logprobs, PROMPT, reference, 3)
        assert scored.usage.cached_tokens == 0  # its blocks were cached: every position computed again
        assert scored.outputs[0].token_ids == plain.outputs[0].token_ids  # generation unchanged
        assert beside.usage.cached_tokens > 0 and beside.prompt_logprobs is None
        only = llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert all(r.top_logprobs == [] for r in only.prompt_logprobs[1:])
        assert [r.logprob for r in only.prompt_logprobs[1:]] == [
            r.logprob for r in scored.prompt_logprobs[1:]]


def test_prompt_logprobs_under_tensor_parallelism(tiny_llama_dir: Path) -> None:
    reference = _reference(tiny_llama_dir, PROMPT)
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **SMALL) as llm:  # type: ignore[arg-type]
        out = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))[0]
    _check(out.prompt_logprobs, PROMPT, reference, 2)


@pytest.mark.parametrize("value", [-1, 21, 1.5, "2"])
def test_a_bad_prompt_logprobs_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
