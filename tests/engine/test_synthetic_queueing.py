"""The synthetic engine's opt-in prefill queue (``prefill_tokens_per_s``) and what a replica reports about
its backlog: ``GET /load`` breaks ``pending_prefill_tokens`` down by engine priority, ``GET /metrics``
has that gauge and the fairness-preemption counter. No model, no torch.

The tests finish the prefill chunks themselves (``ChunkPacing``): they prove which prompt each chunk goes
to, what the engine reports between chunks and whose first token comes when, never how long anything took.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import synthetic
from engine.metrics import EngineMetrics
from engine.outputs import EngineStats, RequestDelta
from engine.protocol import LoadReport
from engine.sampling_params import SamplingParams
from engine.server import build_engine, create_app
from engine.synthetic import SyntheticEngine
from tests.polling import eventually

RATE = 2_000.0  # prompt tokens per second
CHUNK = 100     # one chunk: 50 ms at the rate
PREFILL_TASK = "synthetic-prefill"


class ChunkPacing:
    """Stands in for ``asyncio`` inside ``engine.synthetic``. The prefill loop's pause for a chunk records
    the seconds it asks for (the chunk's tokens at the rate) and lasts until the test finishes the chunk
    (``finish_chunks``); everything else (the token timer, events, tasks) is the real ``asyncio``."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self.in_chunk = False
        self._finish = asyncio.Semaphore(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float, result: Any = None) -> Any:
        task = asyncio.current_task()
        if task is None or task.get_name() != PREFILL_TASK:
            return await asyncio.sleep(delay, result)  # not a wait: the synthetic engine's own token pacing
        self.pauses.append(delay)
        self.in_chunk = True
        try:
            await self._finish.acquire()
        finally:
            self.in_chunk = False
        return result

    async def finish_chunks(self, engine: SyntheticEngine, count: int) -> None:
        """Let the prefill loop finish ``count`` chunks, one at a time; returns once the engine accounted
        for the last one (by then it is in its next chunk, or waits for work)."""
        for _ in range(count):
            await eventually(lambda: self.in_chunk, "the prefill loop to be in a chunk")
            steps = engine.stats().num_steps
            self._finish.release()
            await eventually(lambda steps=steps: engine.stats().num_steps > steps,
                             "the chunk to be accounted for")


@pytest.fixture
def pacing(monkeypatch: pytest.MonkeyPatch) -> ChunkPacing:
    stand_in = ChunkPacing()
    monkeypatch.setattr(synthetic, "asyncio", stand_in)
    return stand_in


def _engine(**kwargs: float) -> SyntheticEngine:
    return SyntheticEngine(token_interval_s=0.001, ttft_s=0.0, prefill_tokens_per_s=RATE,
                           prefill_chunk_tokens=CHUNK, cache_blocks=0, **kwargs)


def _has_delta(stream) -> bool:
    return not stream.queue.empty()


async def _final(stream, what: str) -> RequestDelta:
    """The stream's final delta (``what`` names the request for a timeout)."""
    await eventually(lambda: _has_delta(stream), f"{what}'s first delta")
    deltas = [delta async for delta in stream]
    assert deltas and deltas[-1].finished
    return deltas[-1]


async def test_backlog_is_reported_by_priority_and_prefilled_best_first_chunk_by_chunk(
        pacing: ChunkPacing) -> None:
    engine = _engine()
    params = SamplingParams(max_tokens=1)
    streams = {f"flex-{i}": await engine.add_request(f"flex-{i}", list(range(1, 401)), params, priority=2)
               for i in range(3)}
    streams["default"] = await engine.add_request("default", list(range(1, 201)), params, priority=1)
    stats = engine.stats()
    assert stats.pending_prefill_tokens == 1_400
    assert stats.pending_prefill_tokens_by_priority == {2: 1_200, 1: 200}
    assert stats.num_waiting == 4
    # The default request goes first, ahead of the earlier flex arrivals, then flex in arrival order, each
    # prompt in chunks of CHUNK tokens. Once a prompt's last chunk is done its first token comes without
    # another chunk, and no prompt behind it has one yet.
    served: list[str] = []
    for rid, chunks, backlog in (("default", 2, {2: 1_200}), ("flex-0", 4, {2: 800}),
                                 ("flex-1", 4, {2: 400}), ("flex-2", 4, {})):
        assert not _has_delta(streams[rid])
        await pacing.finish_chunks(engine, chunks)
        assert engine.stats().pending_prefill_tokens_by_priority == backlog
        await eventually(lambda rid=rid: _has_delta(streams[rid]), f"{rid}'s first token")
        served.append(rid)
        assert {r for r, stream in streams.items() if _has_delta(stream)} == set(served)
    for rid, stream in streams.items():
        final = await _final(stream, rid)
        assert final.finish_reasons == ["length"] and final.usage.completion_tokens == 1
    stats = engine.stats()
    assert stats.pending_prefill_tokens == 0 and stats.pending_prefill_tokens_by_priority == {}
    assert stats.computed_prefill_tokens == 1_400 and stats.num_steps == 14
    # Paced at the rate: every chunk asked for its tokens' time at RATE.
    assert pacing.pauses == [CHUNK / RATE] * 14
    assert stats.tokens_per_s == RATE and stats.step_time_s == pytest.approx(CHUNK / RATE)
    engine.shutdown()


async def test_a_better_priority_waits_at_most_one_chunk(pacing: ChunkPacing) -> None:
    engine = _engine()
    params = SamplingParams(max_tokens=1)
    backlog = [await engine.add_request(f"b{i}", list(range(1, 1_001)), params, priority=2) for i in range(4)]
    await pacing.finish_chunks(engine, 3)  # mid-backlog: b0 had 3 of its 10 chunks and is in its 4th
    urgent = await engine.add_request("urgent", [1, 2, 3], params, priority=0)
    assert engine.stats().pending_prefill_tokens_by_priority == {2: 3_700, 0: 3}
    # The chunk in progress ends; the very next chunk is the urgent prompt's (its 3 tokens), ahead of b0's.
    await pacing.finish_chunks(engine, 1)
    assert engine.stats().pending_prefill_tokens_by_priority == {2: 3_600, 0: 3}
    assert pacing.in_chunk and pacing.pauses[-1] == 3 / RATE
    await pacing.finish_chunks(engine, 1)
    final = await _final(urgent, "urgent")  # its first token: no other chunk ran
    assert final.usage.prompt_tokens == 3 and final.finish_reasons == ["length"]
    assert engine.stats().num_steps == 5
    assert engine.stats().pending_prefill_tokens_by_priority == {2: 3_600}
    for i, _ in enumerate(backlog):
        engine.abort(f"b{i}")
    for i, stream in enumerate(backlog):
        assert (await _final(stream, f"b{i}")).finish_reasons == ["abort"]
    assert engine.stats().pending_prefill_tokens == 0  # aborted prompts leave the backlog
    assert engine.stats().pending_prefill_tokens_by_priority == {}
    engine.shutdown()


async def test_without_a_rate_nothing_queues() -> None:
    engine = SyntheticEngine(token_interval_s=0.001, ttft_s=0.0)
    stream = await engine.add_request("r", list(range(1, 1_001)), SamplingParams(max_tokens=2), priority=2)
    assert engine.stats().pending_prefill_tokens == 0 and engine.stats().tokens_per_s == 0.0
    final = await _final(stream, "r")
    assert final.usage.completion_tokens == 2
    assert engine.stats().num_steps == 0  # no prefill chunk ran
    engine.shutdown()


def test_engine_kwargs_pass_the_queue_settings() -> None:
    engine = build_engine("synthetic", extra={"prefill_tokens_per_s": 123.0, "prefill_chunk_tokens": 7})
    assert isinstance(engine, SyntheticEngine)
    assert (engine.prefill_tokens_per_s, engine.prefill_chunk_tokens) == (123.0, 7)
    with pytest.raises(ValueError):
        SyntheticEngine(prefill_chunk_tokens=0)


async def test_load_and_metrics_report_the_backlog_by_priority(pacing: ChunkPacing) -> None:
    engine = _engine()  # no chunk finishes while the test reads the backlog
    app = create_app(engine)
    params = SamplingParams(max_tokens=1)
    streams = [await engine.add_request(f"r{i}", list(range(1, 1_001)), params, priority=p)
               for i, p in enumerate((0, 2, 2))]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://engine") as client:
        body = (await client.get("/load")).json()
        assert body["pending_prefill_tokens_by_priority"] == {"0": 1_000, "2": 2_000}
        load = LoadReport(**body)
        assert load.pending_prefill_tokens_by_priority == {0: 1_000, 2: 2_000}
        assert load.pending_prefill_tokens == 3_000
        text = (await client.get("/metrics")).text
    samples = {(s.name, s.labels.get("priority")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("tollgate_engine_pending_prefill_tokens_by_priority", "0")] == 1_000
    assert samples[("tollgate_engine_pending_prefill_tokens_by_priority", "2")] == 2_000
    assert samples[("tollgate_engine_fairness_preemptions_total", None)] == 0
    for i, _ in enumerate(streams):
        engine.abort(f"r{i}")
    engine.shutdown()


def test_load_report_without_a_breakdown_still_parses() -> None:
    """An older replica's /load (no breakdown): an empty map, so shedding stays conservative."""
    load = LoadReport(model="m", pool="p", waiting=0, running=0, pending_prefill_tokens=5, kv_usage=0.0,
                      num_kv_blocks=1, free_kv_blocks=1, prefix_hit_rate=0.0, num_preemptions=0,
                      tokens_per_s=0.0, step_time_s=0.0, ttft_s=0.0)
    assert load.pending_prefill_tokens_by_priority == {}


def test_fairness_preemptions_are_exported() -> None:
    stats = EngineStats(num_preemptions=5, num_fairness_preemptions=3)
    text = EngineMetrics(lambda: stats, "m", "interactive").render().decode()
    assert 'tollgate_engine_fairness_preemptions_total{model="m",pool="interactive"} 3.0' in text
    assert 'tollgate_engine_preemptions_total{model="m",pool="interactive"} 5.0' in text


async def test_synthetic_embedding_is_deterministic_and_tokenless() -> None:
    from engine.pooling import PoolingParams
    from engine.synthetic import EMBEDDING_DIMENSIONS, SyntheticEngine

    engine = SyntheticEngine(token_interval_s=0.0, ttft_s=0.0)
    finals = []
    for request_id in ("e1", "e2"):
        stream = await engine.add_request(request_id, [5, 6, 7, 8], SamplingParams(max_tokens=1),
                                          pooling=PoolingParams("last"))
        finals += [delta async for delta in stream if delta.finished]
    assert [f.finish_reasons for f in finals] == [["stop"], ["stop"]]
    assert all(f.usage.completion_tokens == 0 and not f.completions for f in finals)
    assert finals[0].embedding == finals[1].embedding and len(finals[0].embedding) == EMBEDDING_DIMENSIONS
    assert abs(sum(v * v for v in finals[0].embedding) - 1.0) < 1e-9
