"""Embeddings from the engine (``engine.pooling``): the pooled final hidden states equal ``transformers``'
``last_hidden_state`` pooled the same way (last token, mean, first), whatever the chunking; they run in
the same batches as generation without changing it; last-token pooling uses the prefix cache, the
others never do; the checkpoint's sentence-transformers pooling config is honoured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.pooling import PoolingParams, checkpoint_pooling

TEXTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Embeddings are vectors.", "a"]


def _reference(model_dir: Path, token_lists: list[list[int]], pooling: PoolingParams) -> list[torch.Tensor]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for tokens in token_lists:
            hidden = model(torch.tensor([tokens])).last_hidden_state[0]  # [T, hidden], after the final norm
            vector = {"last": hidden[-1], "mean": hidden.mean(0), "first": hidden[0]}[pooling.mode]
            out.append(torch.nn.functional.normalize(vector, dim=0) if pooling.normalize else vector)
    return out


@pytest.mark.parametrize("pooling", [PoolingParams("last"), PoolingParams("mean"),
                                     PoolingParams("first", normalize=False)])
@pytest.mark.parametrize("chunk", [2048, 16])  # whole prompts, and prefills in 16-token chunks
def test_pooled_hidden_states_match_transformers(tiny_llama_dir: Path, pooling: PoolingParams,
                                                 chunk: int) -> None:
    llm = LLM(str(tiny_llama_dir), max_num_batched_tokens=chunk, num_kv_blocks=64)
    tokens = [llm.tokenizer.encode(t) for t in TEXTS]
    ours = llm.embed(tokens, pooling=pooling)
    for vector, expected in zip(ours, _reference(tiny_llama_dir, tokens, pooling), strict=True):
        assert len(vector) == expected.numel()
        torch.testing.assert_close(torch.tensor(vector), expected, atol=2e-5, rtol=1e-4)
    if pooling.normalize:
        assert all(abs(float(torch.tensor(v).norm()) - 1.0) < 1e-5 for v in ours)
    if chunk == 16:
        assert llm.stats.num_partial_prefill_chunks > 0


def test_embeddings_batch_with_generation_without_changing_it(tiny_qwen3_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    alone = LLM(str(tiny_qwen3_dir)).generate(TEXTS, params)
    llm = LLM(str(tiny_qwen3_dir))
    for i, text in enumerate(TEXTS):
        llm.engine.add_request(f"gen-{i}", llm.tokenizer.encode(text), params)
        llm.engine.add_request(f"emb-{i}", llm.tokenizer.encode(text), SamplingParams(max_tokens=1),
                               pooling=PoolingParams("mean"))
    tokens: dict[str, list[int]] = {}
    finals = {}
    while llm.engine.has_unfinished():
        for delta in llm.engine.step():
            for completion in delta.completions:
                tokens.setdefault(delta.request_id, []).extend(completion.token_ids)
            if delta.finished:
                finals[delta.request_id] = delta
    assert [tokens[f"gen-{i}"] for i in range(len(TEXTS))] == [o.token_ids for o in alone]
    expected = LLM(str(tiny_qwen3_dir)).embed(TEXTS, pooling=PoolingParams("mean"))
    for i in range(len(TEXTS)):
        emb = finals[f"emb-{i}"]
        assert tokens.get(f"emb-{i}", []) == []  # no tokens, only the vector
        assert emb.finish_reasons == ["stop"] and emb.usage.completion_tokens == 0
        torch.testing.assert_close(torch.tensor(emb.embedding), torch.tensor(expected[i]))
        assert finals[f"gen-{i}"].embedding is None


def test_last_token_pooling_uses_the_prefix_cache_and_mean_never_does(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir))
    tokens = llm.tokenizer.encode(TEXTS[0])
    first = llm.generate([tokens], SamplingParams(max_tokens=1), pooling=PoolingParams("last"))[0]
    again = llm.generate([tokens], SamplingParams(max_tokens=1), pooling=PoolingParams("last"))[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    torch.testing.assert_close(torch.tensor(again.embedding), torch.tensor(first.embedding))
    means = [llm.generate([tokens], SamplingParams(max_tokens=1), pooling=PoolingParams("mean"))[0]
             for _ in range(2)]
    assert [m.num_cached_tokens for m in means] == [0, 0]
    torch.testing.assert_close(torch.tensor(means[1].embedding), torch.tensor(means[0].embedding))


def test_checkpoint_pooling_config(tmp_path: Path) -> None:
    assert checkpoint_pooling(tmp_path) == PoolingParams("last", normalize=True)  # a generative checkpoint
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    assert checkpoint_pooling(tmp_path) == PoolingParams("mean", normalize=False)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    assert checkpoint_pooling(tmp_path) == PoolingParams("mean", normalize=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": True}))
    with pytest.raises(ValueError, match="exactly one"):
        checkpoint_pooling(tmp_path)
    with pytest.raises(ValueError, match="pooling mode"):
        PoolingParams("max")
