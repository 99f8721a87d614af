"""The real engine's stats snapshot breaks its prefill backlog down by priority (what ``GET /load`` sends
and the gateway's overload shedding reads) and carries the scheduler's fairness-preemption counter."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prompt(start: int, length: int) -> list[int]:
    return [(start + 7 * i) % 2900 + 10 for i in range(length)]


def test_pending_prefill_by_priority_and_fairness_counter(tiny_llama_dir: Path) -> None:
    engine: LLMEngine = LLM(str(tiny_llama_dir), num_kv_blocks=128, max_num_seqs=16,
                            max_num_batched_tokens=64).engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("p0", _prompt(1, 40), params, priority=0)
    engine.add_request("p2a", _prompt(2, 100), params, priority=2)
    engine.add_request("p2b", _prompt(3, 30), params, priority=2)
    stats = engine.stats()
    assert stats.pending_prefill_tokens == 170
    assert stats.pending_prefill_tokens_by_priority == {0: 40, 2: 130}
    engine.step()  # 64 tokens: priority 0's whole prompt, then a 24-token chunk of the first priority-2 one
    stats = engine.stats()
    assert stats.pending_prefill_tokens_by_priority == {2: 130 - 24}
    assert sum(stats.pending_prefill_tokens_by_priority.values()) == stats.pending_prefill_tokens
    assert stats.num_fairness_preemptions == engine.scheduler.num_fairness_preemptions
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().pending_prefill_tokens_by_priority == {}
