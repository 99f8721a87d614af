"""LoRA adapters with speculative decoding and the overlapped loop: a step verifies an adapter request's
drafts through its adapter (every draft row is bound to its slot), so greedy outputs are identical with and
without drafts, with and without the overlapped loop; a prediction of the adapter's own output is accepted
whole, an edited one partly, prompt lookup drafts too, in one batch with a base-model request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.lora.registry import LoRARequest
from engine.sampling_params import SamplingParams
from tests.engine.test_lora_serving import ALL, strong_bundle

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
PROMPT = [(1 + 7 * i) % 2900 + 10 for i in range(20)]
REPETITIVE = [(3 + 7 * i) % 2900 + 10 for i in range(16)] * 3  # prompt lookup finds its continuation


def _run(engine: LLMEngine, requests: list[tuple[list[int], list[int] | None, LoRARequest | None]]) -> dict:
    for i, (prompt, prediction, lora) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, GREEDY, prediction=prediction, lora=lora)
    out: dict[str, Any] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            entry = out.setdefault(delta.request_id, {"tokens": []})
            for c in delta.completions:
                entry["tokens"].extend(c.token_ids)
            if delta.finished:
                entry["usage"] = delta.usage
    return out


def test_drafts_change_no_output_of_adapter_requests(tiny_llama_dir: Path, tmp_path: Path) -> None:
    adapter = LoRARequest("a", str(strong_bundle(tiny_llama_dir, tmp_path / "a", 1, ALL, 8)))
    with LLM(str(tiny_llama_dir), num_kv_blocks=64, max_loras=1, speculation="off") as plain:  # type: ignore[arg-type]
        tuned, base, looked_up = (o.outputs[0].token_ids for o in plain.generate(
            [PROMPT, PROMPT, REPETITIVE], GREEDY, lora_request=[adapter, None, adapter]))
    assert tuned != base  # the adapter changes the tokens: verifying through the base would show
    edited = list(tuned)
    for i in (8, 20):  # two wrong tokens: the drafts there fall, the prediction is found again after
        edited[i] = (edited[i] + 1) % 2000
    requests = [(PROMPT, tuned, adapter), (PROMPT, edited, adapter), (PROMPT, base, None),
                (REPETITIVE, None, adapter)]
    runs: dict[str, dict] = {}
    stats = {}
    for name, config in (("off", {"speculation": "off"}), ("sync", {"overlap": False}),
                         ("overlap", {"overlap": True})):
        with LLM(str(tiny_llama_dir), num_kv_blocks=64, max_loras=1, **config) as llm:  # type: ignore[arg-type]
            runs[name] = _run(llm.engine, requests)
            stats[name] = llm.stats
    for name in ("off", "sync", "overlap"):
        assert [runs[name][f"r{i}"]["tokens"] for i in range(4)] == [tuned, tuned, base, looked_up], name
    for name in ("sync", "overlap"):
        usage = {rid: runs[name][rid]["usage"] for rid in ("r0", "r1", "r2")}
        assert usage["r0"].accepted_prediction_tokens >= 24 and usage["r0"].rejected_prediction_tokens == 0
        assert usage["r1"].rejected_prediction_tokens > 0 and usage["r1"].accepted_prediction_tokens >= 8
        assert usage["r2"].accepted_prediction_tokens >= 24  # the same prediction, right for the base
        assert stats[name].speculation["drafted_tokens"] > 0
    assert runs["off"]["r0"]["usage"].accepted_prediction_tokens == 0
