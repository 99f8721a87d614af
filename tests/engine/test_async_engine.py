"""The engine thread behind asyncio: concurrent streams, abort when the consumer goes away, validation
in the caller, and streams equal to the offline API's output."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine, EngineError
from engine.config import EngineConfig
from engine.outputs import RequestDelta, RequestValidationError
from engine.sampling_params import SamplingParams
from tests.polling import eventually, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def async_engine(tiny_qwen2_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=str(tiny_qwen2_dir), num_kv_blocks=64, max_num_seqs=8,
                                      max_num_batched_tokens=64))
    yield engine
    engine.shutdown()


async def _collect(engine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams
                   ) -> list[RequestDelta]:
    return [d async for d in engine.generate(rid, prompt, params)]


async def test_concurrent_streams_match_sequential_runs(async_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[(11 * i + 5 * j) % 900 + 3 for j in range(8 + 13 * i)] for i in range(4)]
    alone = [await _collect(async_engine, f"solo-{i}", p, params) for i, p in enumerate(prompts)]
    together = await asyncio.gather(*(_collect(async_engine, f"multi-{i}", p, params)
                                      for i, p in enumerate(prompts)))
    for a, b in zip(alone, together, strict=True):
        tokens_a = [t for d in a for c in d.completions for t in c.token_ids]
        tokens_b = [t for d in b for c in d.completions for t in c.token_ids]
        assert tokens_a == tokens_b and len(tokens_a) == 10
        assert b[-1].finished and b[-1].finish_reasons == ["length"]
        assert all(not d.finished for d in b[:-1])
        assert "".join(c.text for d in b for c in d.completions) == \
            async_engine.engine.tokenizer.decode(tokens_b)
        assert b[-1].usage is not None and b[-1].usage.completion_tokens == 10
        assert b[-1].timings is not None and b[-1].timings.e2e >= b[-1].timings.ttft > 0


async def test_consumer_leaving_aborts_and_frees_blocks(async_engine: AsyncEngine) -> None:
    total = async_engine.info()["num_kv_blocks"]
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    stream = await async_engine.add_request("leaver", list(range(5, 60)), params)
    got = 0
    async with stream:
        async for _ in stream:
            got += 1
            if got == 3:
                break  # leaving the `async with` closes the stream → abort before the next step
    # Another request is served after the abort; by the time it finishes the abort has been applied.
    rest = await _collect(async_engine, "after-leaver", [5, 6, 7], SamplingParams(max_tokens=2))
    assert rest[-1].finished
    stats = async_engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_kv_blocks == total
    assert stats.num_requests_finished.get("abort", 0) >= 1


async def test_validation_happens_in_the_caller(async_engine: AsyncEngine) -> None:
    with pytest.raises(RequestValidationError) as info:
        await async_engine.add_request("too-long", [1] * (async_engine.max_model_len + 1),
                                       SamplingParams(max_tokens=1))
    assert info.value.param == "prompt" and info.value.code == "context_length_exceeded"
    running = await async_engine.add_request("dup", [4, 5, 6], SamplingParams(max_tokens=50,
                                                                            ignore_eos=True))
    with pytest.raises(RequestValidationError, match="already in flight"):
        await async_engine.add_request("dup", [4, 5, 6], SamplingParams(max_tokens=1))
    deltas = [d async for d in running]
    assert deltas[-1].finish_reasons == ["length"]


async def test_a_failed_step_fails_in_flight_requests_and_the_loop_goes_on(
    async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = async_engine.engine.runner
    original = runner._forward  # the device's side of a step: the failure surfaces when its tokens are read
    calls = 0

    def fails_once(*args):
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("device lost")
        return original(*args)

    monkeypatch.setattr(runner, "_forward", fails_once)
    with pytest.raises(EngineError):
        await _collect(async_engine, "doomed", [5, 6, 7], SamplingParams(max_tokens=5))
    survivor = await _collect(async_engine, "survivor", [5, 6, 7], SamplingParams(max_tokens=2,
                                                                                  ignore_eos=True))
    assert survivor[-1].finish_reasons == ["length"]
    stats = async_engine.stats()
    assert stats.num_running == 0 and stats.num_free_kv_blocks == async_engine.info()["num_kv_blocks"]


async def test_explicit_abort_ends_the_stream_with_abort(async_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    stream = await async_engine.add_request("aborted", list(range(5, 30)), params)
    first = await stream.__anext__()
    assert not first.finished
    assert async_engine.abort("aborted")
    rest = [d async for d in stream]
    final = rest[-1]
    assert final.finished and final.finish_reasons == ["abort"]
    assert final.usage is not None and 1 <= final.usage.completion_tokens < 500
    assert not async_engine.abort("aborted")


async def test_a_streams_first_delta_is_handed_over_before_running_streams(async_engine: AsyncEngine) -> None:
    """Within one step's deltas, streams that get their first delta are woken (and so written) first, in
    step order, then the streams that were already running, in step order."""
    from engine.async_engine import RequestStream

    order: list[str] = []

    class Recording(RequestStream):
        def put_nowait(self, item: RequestDelta | BaseException) -> None:
            order.append(self.request_id)
            super().put_nowait(item)

    streams = {rid: Recording(rid, lambda _: None) for rid in ("run-1", "run-2", "new-1", "run-3", "new-2")}
    for rid in ("run-1", "run-2", "run-3"):
        streams[rid].delivered = True
    with async_engine._cond:
        async_engine._streams.update(streams)
    try:
        async_engine._deliver([RequestDelta(rid, []) for rid in streams])
        await eventually(lambda: len(order) >= len(streams), "the step's deltas to be handed over")
        assert order == ["new-1", "new-2", "run-1", "run-2", "run-3"]
        assert all(s.delivered for s in streams.values())
        order.clear()
        async_engine._deliver([RequestDelta(rid, []) for rid in streams])
        await eventually(lambda: len(order) >= len(streams), "the step's deltas to be handed over")
        assert order == list(streams)
    finally:
        with async_engine._cond:
            for rid in streams:
                async_engine._streams.pop(rid, None)


def test_the_engine_loop_binds_the_runners_device_to_its_own_thread(tiny_qwen2_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA's current device is per thread: the loop thread that steps the engine (built on the caller's
    thread) makes the runner's GPU its own before its first step, or its launches and events would go to
    GPU 0 with another GPU's memory."""
    import threading

    from engine.model_runner import ModelRunner

    bound: list[str] = []
    monkeypatch.setattr(ModelRunner, "bind_thread",
                        lambda self: bound.append(threading.current_thread().name))  # fmt: skip
    engine = AsyncEngine(EngineConfig(model=str(tiny_qwen2_dir), num_kv_blocks=16, max_num_seqs=2))
    try:
        wait_until(lambda: bound, "the loop thread started")
        assert bound == ["engine-loop"]
    finally:
        engine.shutdown()


def test_binding_a_thread_sets_the_cuda_device_and_leaves_the_cpu_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from engine.model_runner import ModelRunner

    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    runner = ModelRunner.__new__(ModelRunner)  # only ``device`` is read
    runner.device = torch.device("cpu")
    runner.bind_thread()
    runner.device = torch.device("cuda", 1)
    runner.bind_thread()
    assert calls == [torch.device("cuda", 1)]
