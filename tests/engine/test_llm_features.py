"""The offline API and the engine loop: prefix-cache accounting, seeded sampling, stop strings, n > 1,
structured output, aborts and bad input — on a tiny random-weight Llama."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine, RequestValidationError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=256)


def _prompt(start: int, length: int) -> list[int]:
    return [(start + 7 * i) % 2900 + 10 for i in range(length)]


def test_identical_request_hits_the_prefix_cache(llm: LLM) -> None:
    prompt = _prompt(1, 53)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params, cache_salt="tenant-a")[0]
    before = llm.stats
    second = llm.generate([prompt], params, cache_salt="tenant-a")[0]
    after = llm.stats
    expected_cached = (len(prompt) - 1) // 16 * 16
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == expected_cached == 48
    assert second.usage is not None and second.usage.cached_tokens == expected_cached
    assert after.computed_prefill_tokens - before.computed_prefill_tokens == len(prompt) - expected_cached
    assert after.prefix_hit_tokens - before.prefix_hit_tokens == expected_cached
    assert second.token_ids == first.token_ids
    # Another tenant's salt never shares blocks.
    other = llm.generate([prompt], params, cache_salt="tenant-b")[0]
    assert other.num_cached_tokens == 0 and other.token_ids == first.token_ids


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    prompt = _prompt(3, 20)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].token_ids
    busy = [_prompt(100 + i, 10 + 9 * i) for i in range(6)]
    noise = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    outs = llm.generate(busy[:3] + [prompt] + busy[3:], [noise] * 3 + [seeded] + [noise] * 3)
    assert outs[3].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert llm.generate([prompt], other_seed)[0].token_ids != alone


def test_stop_string_across_tokens_cuts_the_text(llm: LLM) -> None:
    prompt = _prompt(5, 12)
    base = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = base.text
    # A stop string that starts inside one token's text and ends inside a later one.
    offsets, pos = [], 0
    for t in base.token_ids:
        pos += len(llm.tokenizer.decode([t]))
        offsets.append(pos)
    start = next(o for o in offsets[3:] if len(text) - o > 6) - 1
    stop = text[start : start + 4]
    assert stop.strip(), "need a visible stop string"
    cut = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert cut.token_ids == base.token_ids[: len(cut.token_ids)]


def test_n_completions_count_the_prompt_once(llm: LLM) -> None:
    prompt = _prompt(9, 40)
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6,
                                                ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert out.usage is not None
    assert out.usage.prompt_tokens == 40 and out.usage.completion_tokens == 18
    assert out.token_ids == out.outputs[0].token_ids


def test_max_tokens_and_logprobs(llm: LLM) -> None:
    out = llm.generate([_prompt(11, 9)], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                                        logprobs=3))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token, record in zip(out.token_ids, out.logprobs, strict=True):
        assert record.token_id == token and record.logprob <= 0.0
        assert len(record.top_logprobs) == 3
        # Greedy: the sampled token is the most likely one.
        assert record.top_logprobs[0][0] == token


BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}


def test_json_schema_output_parses_and_validates(llm: LLM) -> None:
    prompts = [_prompt(20 + i, 15 + 4 * i) for i in range(3)]
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=200, json_schema=BOUNDED_SCHEMA)
    for out in llm.generate(prompts, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), BOUNDED_SCHEMA)
    obj = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=200, json_object=True))[0]
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)


def test_abort_mid_generation_frees_blocks(llm: LLM) -> None:
    engine: LLMEngine = llm.engine
    total = engine.kv.blocks.num_free_blocks
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    engine.add_request("to-abort", _prompt(30, 70), params)
    engine.add_request("keeps-going", _prompt(31, 20), SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.kv.blocks.num_free_blocks < total
    assert engine.abort("to-abort")
    finals = {d.request_id: d for _ in range(10) for d in engine.step() if d.finished}
    while engine.has_unfinished():
        finals.update({d.request_id: d for d in engine.step() if d.finished})
    assert finals["to-abort"].finish_reasons == ["abort"]
    assert finals["keeps-going"].finish_reasons == ["length"]
    assert engine.kv.blocks.num_free_blocks == total
    assert engine.kv.blocks.usage == 0.0
    assert not engine.abort("to-abort")


def test_bad_requests_fail_alone(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("good", _prompt(40, 10), SamplingParams(max_tokens=3, ignore_eos=True))
    bad = [
        ([], SamplingParams(), "prompt"),
        ([engine.vocab_size], SamplingParams(), "prompt"),
        ([-1, 5], SamplingParams(), "prompt"),
        (_prompt(1, engine.max_model_len), SamplingParams(max_tokens=1), "prompt"),
        ([1.5, 2], SamplingParams(), "prompt"),
        (_prompt(1, 10), SamplingParams(max_tokens=engine.max_model_len), "max_tokens"),
        (_prompt(1, 10), SamplingParams(stop_token_ids=[engine.vocab_size + 5]), "stop_token_ids"),
        (_prompt(1, 10), SamplingParams(), "request_id"),  # duplicate id
    ]
    for i, (prompt, params, param) in enumerate(bad):
        rid = "good" if param == "request_id" else f"bad-{i}"
        with pytest.raises(RequestValidationError) as info:
            engine.add_request(rid, prompt, params)
        assert info.value.param == param and str(info.value)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(RequestValidationError, match="prompt 1"):
        llm.generate([_prompt(1, 5), _prompt(1, engine.max_model_len + 3)])
    finished = []
    while engine.has_unfinished():
        finished += [d for d in engine.step() if d.finished]
    assert [d.request_id for d in finished] == ["good"]
    assert finished[0].usage is not None and finished[0].usage.completion_tokens == 3
