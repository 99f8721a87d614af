"""LoRA adapters with speculative decoding and the overlapped loop: a step verifies an adapter request's
drafts through its adapter (every draft row is bound to its slot), so greedy outputs are identical with and
without drafts, with and without the overlapped loop; a prediction of the adapter's own output is accepted
whole, an edited one partly, prompt lookup drafts too, in one batch with a base-model request."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.device import ThreadExecutor, Work
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


class _LateDevice(ThreadExecutor):
    """A device thread that starts each forward pass only once the host has submitted the next one (or
    after 0.2 s, when no next one comes): everything the host does for step N+1, its adapter slots
    included, happens before step N computes anything."""

    def __init__(self) -> None:
        super().__init__()
        self._submitted = 0
        self._changed = threading.Condition()

    def submit(self, fn: Callable[..., Any], *args: Any, step: bool = False) -> Work[Any]:
        if not step:
            return super().submit(fn, *args, step=step)
        with self._changed:
            self._submitted += 1
            number = self._submitted
            self._changed.notify_all()

        def late(*inner: Any) -> Any:
            with self._changed:
                self._changed.wait_for(lambda: self._submitted > number, timeout=0.2)
            return fn(*inner)

        return super().submit(late, *args, step=step)


def test_the_overlapped_loop_swaps_slots_under_a_step_in_flight(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """One device slot, two adapters and the base model, on a device that starts each step only once the
    host has planned the next (slots included): the adapters take turns in the slot and the tokens equal
    the synchronous loop's. (The copy into a slot is device work, after every step submitted before it.)"""
    adapters = [LoRARequest(f"a{i}", str(strong_bundle(tiny_llama_dir, tmp_path / f"a{i}", i + 1, ALL, 4)))
                for i in range(2)]
    prompts = [[(5 * i + 3 * j) % 250 + 3 for j in range(12 + i)] for i in range(6)]
    loras = [adapters[0], adapters[1], None, adapters[1], adapters[0], None]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for overlap in (False, True):
        with LLM(str(tiny_llama_dir), num_kv_blocks=64, max_loras=1, speculation="off",  # type: ignore[arg-type]
                 overlap=overlap) as llm:
            if overlap:
                llm.engine.runner.executor.close()
                llm.engine.runner.executor = _LateDevice()
            outputs = llm.generate(prompts, params, lora_request=loras)
            runs[overlap] = [o.outputs[0].token_ids for o in outputs]
            lora = llm.engine.runner.lora
            assert lora is not None and lora.evictions >= 1
    assert runs[True] == runs[False]
    assert runs[False][0] != runs[False][1]
