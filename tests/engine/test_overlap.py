"""The overlapped step loop (``engine.llm_engine``): the same outputs as the synchronous loop, and what
the one step of lag costs is never seen.

Every workload runs twice on the same tiny checkpoint, ``overlap=False`` then ``overlap=True`` (the CPU
device thread), and the outputs must be identical: greedy and seeded sampling, with stop strings,
``n > 1``, logprobs, penalties, JSON-schema and tool-call grammars, preemption and resumption, prefix hits
from the device, host and disk tiers, embeddings in the same batch, and aborts. Then the extra token:
a stream that stops was already scheduled once more, and what that step computed for it is never
emitted, billed or cached. And the overlap itself, shown without a clock: on a device held in the
middle of a step, the host has already scheduled and submitted the next one.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.device import ThreadExecutor
from engine.kv.block_hash import prefix_block_hashes
from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta
from engine.pooling import PoolingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOL_CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"},
                   "arguments": {"type": "object",
                                 "properties": {"city": {"type": "string", "maxLength": 12},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                                 "required": ["city", "days"]}},
    "required": ["name", "arguments"],
}


def _prompt(start: int, length: int) -> list[int]:
    return [(start + 7 * i) % 2900 + 10 for i in range(length)]


def _summary(out: Any) -> list[tuple]:
    """What a client sees of a request: per stream its tokens, text, finish and logprobs; the usage."""
    usage = out.usage
    streams = [(c.token_ids, c.text, c.finish_reason,
                [(lp.token_id, round(lp.logprob, 4), [t for t, _ in lp.top_logprobs])
                 for lp in c.logprobs or []])
               for c in out.outputs]
    return [streams, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens]


def _both(model_dir: Path, run: Any, **config: Any) -> tuple[Any, Any]:
    """``run(llm)`` with the overlap off, then on (speculation off: a step that verifies drafts is
    processed at once; tests/engine/test_speculative.py covers the two together)."""
    results = []
    for overlap in (False, True):
        with LLM(str(model_dir), overlap=overlap, speculation="off", **config) as llm:
            assert isinstance(llm.engine.runner.executor, ThreadExecutor) is overlap
            results.append(run(llm))
    return results[0], results[1]


def test_sampling_stops_n_logprobs_penalties_and_preemption_are_identical(tiny_llama_dir: Path) -> None:
    prompts = [_prompt(i * 37, 9 + 11 * i) for i in range(10)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=33, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=60, stop=[" the", "e"]),
        SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, top_k=20, min_p=0.05, logprobs=2, max_tokens=30),
        SamplingParams(temperature=0.8, seed=8, presence_penalty=1.5, frequency_penalty=0.5,
                       repetition_penalty=1.3, max_tokens=45, ignore_eos=True),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, max_tokens=38, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=1),
        SamplingParams(temperature=1.2, seed=99, n=2, stop_token_ids=[17, 23], max_tokens=50),
    ]

    def run(llm: LLM) -> tuple[list, int]:
        outs = llm.generate(prompts, params)
        return [_summary(o) for o in outs], llm.stats.num_preemptions

    # 40 blocks of 16 for 15 streams that grow to ~100 tokens each: preempted and resumed, often.
    (sync, sync_preempted), (overlapped, preempted) = _both(
        tiny_llama_dir, run, num_kv_blocks=40, max_num_seqs=12, max_num_batched_tokens=96)
    assert overlapped == sync
    assert sync_preempted > 0 and preempted > 0


def test_grammars_are_identical_with_constrained_and_free_rows_mixed(tiny_qwen3_dir: Path) -> None:
    prompts = [_prompt(i * 11, 12 + i) for i in range(6)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, json_schema=TOOL_CALL),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=4, max_tokens=48, json_object=True),
        SamplingParams(temperature=0.8, seed=2, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=48, json_schema=TOOL_CALL, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=24, regex="[a-z]{3,9}( [a-z]{2,6}){2}"),
    ]

    def run(llm: LLM) -> list:
        return [_summary(o) for o in llm.generate(prompts, params)]

    sync, overlapped = _both(tiny_qwen3_dir, run, max_num_seqs=8)
    assert overlapped == sync
    assert sync[0][0][0][2] == "stop"  # the tool call's document completed


def test_prefix_hits_from_the_device_host_and_disk_tiers_are_identical(tiny_llama_dir: Path,
                                                                        tmp_path: Path) -> None:
    prompts = [[(31 * i + 7 * j) % 250 + 3 for j in range(50)] for i in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(llm: LLM) -> tuple[list, dict]:
        # Each prompt twice (the second round from the host tier or disk), the last once more (device).
        outs = [_summary(llm.generate([p], greedy)[0]) for p in prompts + prompts + prompts[-1:]]
        return outs, llm.stats.prefix_hit_tokens_by_tier

    def tiers(name: str) -> dict:
        return {"num_kv_blocks": 8, "max_num_seqs": 2, "num_host_kv_blocks": 6, "num_disk_kv_blocks": 64,
                "kv_disk_dir": str(tmp_path / name)}

    with LLM(str(tiny_llama_dir), overlap=False, speculation="off", **tiers("sync")) as llm:
        sync, sync_hits = run(llm)
    with LLM(str(tiny_llama_dir), overlap=True, speculation="off", **tiers("overlap")) as llm:
        overlapped, hits = run(llm)
    assert overlapped == sync and hits == sync_hits
    assert all(hits[tier] > 0 for tier in ("device", "host", "disk")), hits


def test_embeddings_in_the_same_batch_are_identical(tiny_qwen3_dir: Path) -> None:
    def run(llm: LLM) -> tuple[dict, dict]:
        engine = llm.engine
        for i in range(4):
            greedy = SamplingParams(temperature=0.0, max_tokens=9)
            engine.add_request(f"gen-{i}", _prompt(i, 20 + 5 * i), greedy)
            engine.add_request(f"emb-{i}", _prompt(50 + i, 30 + 9 * i), SamplingParams(max_tokens=1),
                               pooling=PoolingParams("mean" if i % 2 else "last"))
        tokens: dict[str, list[int]] = {}
        embeddings = {}
        while engine.has_unfinished():
            for delta in engine.step():
                for c in delta.completions:
                    tokens.setdefault(delta.request_id, []).extend(c.token_ids)
                if delta.finished and delta.embedding is not None:
                    embeddings[delta.request_id] = [round(x, 5) for x in delta.embedding]
        return tokens, embeddings

    (sync_tokens, sync_vectors), (tokens, vectors) = _both(tiny_qwen3_dir, run, max_num_batched_tokens=64)
    assert tokens == sync_tokens and vectors == sync_vectors and len(vectors) == 4


def _run_with_abort(engine: LLMEngine,
                    abort_after: int) -> tuple[dict[str, list[int]], dict[str, RequestDelta]]:
    greedy = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", _prompt(i * 13, 15), greedy)
    tokens: dict[str, list[int]] = {}
    finals: dict[str, RequestDelta] = {}
    steps = 0
    while engine.has_unfinished():
        for delta in engine.step():
            for c in delta.completions:
                tokens.setdefault(delta.request_id, []).extend(c.token_ids)
            if delta.finished:
                finals[delta.request_id] = delta
        steps += 1
        if steps == abort_after:
            assert engine.abort("r2")
    return tokens, finals


def test_an_abort_in_flight_changes_nothing_else_and_bills_what_was_sent(tiny_llama_dir: Path) -> None:
    (sync_tokens, sync_finals), (tokens, finals) = _both(
        tiny_llama_dir, lambda llm: _run_with_abort(llm.engine, abort_after=6))
    for rid in ("r0", "r1", "r3"):
        assert tokens[rid] == sync_tokens[rid] and len(tokens[rid]) == 30
    # The aborted stream got a prefix of its output (one step less when the loop overlaps) and is billed
    # exactly what it was sent.
    assert finals["r2"].finish_reasons == sync_finals["r2"].finish_reasons == ["abort"]
    assert tokens["r2"] == sync_tokens["r2"][: len(tokens["r2"])]
    for run_tokens, run_finals in ((sync_tokens, sync_finals), (tokens, finals)):
        assert run_finals["r2"].usage.completion_tokens == len(run_tokens["r2"]) > 0


def test_the_extra_token_of_a_stopped_stream_is_never_emitted_billed_or_cached(tiny_llama_dir: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    reference = LLM(str(tiny_llama_dir), overlap=False)
    # 12 prompt tokens and 3 generated, the third a stop token: the extra token would sit at position 15,
    # completing block 0.
    prompt, expected = next((p, out) for p in (_prompt(start, 12) for start in range(40))
                            if (out := reference.generate([p], greedy)[0].token_ids)[2] not in out[:2])
    with LLM(str(tiny_llama_dir), overlap=True, speculation="off", num_host_kv_blocks=16) as llm:
        engine = llm.engine
        sampled_rows: list[int] = []
        forward = engine.runner.forward

        def spy(batch):  # how often the request is scheduled to produce a token
            sampled_rows.append(sum(1 for item in batch.seqs if item.samples))
            return forward(batch)

        engine.runner.forward = spy  # type: ignore[method-assign]
        stop = SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[expected[2]], ignore_eos=True)
        out = llm.generate([prompt], stop)[0]
        assert sum(sampled_rows) == 4  # three tokens, and the one computed after the stop it had not seen
        assert out.token_ids == expected[:3] and out.finish_reason == "stop"
        assert out.usage is not None and out.usage.completion_tokens == 3
        with_extra = prefix_block_hashes(prompt + out.token_ids + [expected[3]], 16)
        assert len(with_extra) == 1
        seen = set(engine.kv_events.holdings())
        events = engine.kv_events.since(0, engine.kv_events.epoch)
        seen |= {digest for _, _, _, digest in events.events} | set(events.snapshot or {})
        assert with_extra[0] not in seen  # never registered, never offloaded, never written
        # A stream whose pending token is its last (max_tokens) is not scheduled again: no extra token.
        sampled_rows.clear()
        length = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        assert llm.generate([prompt], length)[0].token_ids == expected[:3]
        assert sum(sampled_rows) == 3


class _HeldDevice(ThreadExecutor):
    """A device thread that stops inside the second forward pass until the test lets it go on."""

    def __init__(self) -> None:
        self.forwards = 0
        self.inside = threading.Event()
        self.release = threading.Event()
        self.submitted_steps = 0
        super().__init__()

    def submit(self, fn, *args, step=False):  # type: ignore[no-untyped-def]
        if step:
            self.submitted_steps += 1
            return super().submit(self._held(fn), *args, step=step)
        return super().submit(fn, *args, step=step)

    def _held(self, fn):  # type: ignore[no-untyped-def]
        def run(*args):  # type: ignore[no-untyped-def]
            self.forwards += 1
            if self.forwards == 2:
                self.inside.set()
                assert self.release.wait(timeout=60)
            return fn(*args)
        return run


def test_the_host_prepares_the_next_step_while_the_device_runs_one(tiny_llama_dir: Path) -> None:
    engine = LLM(str(tiny_llama_dir), overlap=True, speculation="off").engine
    device = _HeldDevice()
    engine.runner.executor.close()
    engine.runner.executor = device
    for i in range(3):
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        engine.add_request(f"r{i}", _prompt(i, 20), greedy)
    engine.step()  # step 1 (the prefills): submitted; nothing to process yet
    engine.step()  # step 2 submitted; step 1's tokens processed
    assert device.inside.wait(timeout=60)  # the device is now inside step 2's forward pass
    stepping = threading.Thread(target=engine.step)
    stepping.start()  # step 3: scheduled, built and submitted, then it waits for step 2's tokens
    pause = threading.Event()
    for _ in range(6000):  # at most a minute
        if device.submitted_steps == 3 or pause.wait(0.01):
            break
    assert device.submitted_steps == 3 and device.forwards == 2  # step 3 was submitted behind step 2
    assert stepping.is_alive()  # ... and the host is waiting for step 2, not step 3
    device.release.set()
    stepping.join(timeout=60)
    while engine.has_unfinished():
        engine.step()
    engine.close()


# Exact equality across two runs whose batches differ (another graph size, split count or GEMM shape
# rounds each row differently) holds in float32 only: in half precision the random tiny model's near-tied
# logits flip (test_llm_greedy.py compares bf16 with a tie gap instead). The half-precision kernels and the
# GPU path in bf16 are covered there and in tests/kernels.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32"])
def test_the_overlapped_loop_on_the_gpu_changes_no_output(tiny_llama_dir: Path, dtype: str) -> None:
    """CUDA graphs, the triton kernels, sampled ids fed to the next step on the device, one copy of them
    to the host per step: the same tokens as the synchronous loop."""
    prompts = [_prompt(i * 37, 9 + 11 * i) for i in range(8)]
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=60, stop=[" the", "e"]),
              SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=25, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, top_k=20, min_p=0.05, logprobs=2, max_tokens=30),
              SamplingParams(temperature=0.8, seed=8, presence_penalty=1.5, repetition_penalty=1.3,
                             max_tokens=45, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1),
              SamplingParams(temperature=1.2, seed=99, n=2, stop_token_ids=[17, 23], max_tokens=50)]

    def run(overlap: bool) -> list:
        with LLM(str(tiny_llama_dir), device="cuda", dtype=dtype, overlap=overlap, speculation="off",
                 num_kv_blocks=40, max_num_seqs=12, max_num_batched_tokens=96) as llm:
            return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs]
                    for o in llm.generate(prompts, params)]

    assert run(True) == run(False)
