"""The synthetic engine's opt-in prefill queue (``prefill_tokens_per_s``) and what a replica reports about
its backlog: ``GET /load`` breaks ``pending_prefill_tokens`` down by engine priority, ``GET /metrics``
has that gauge and the fairness-preemption counter. No model, no torch."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import EngineMetrics
from engine.outputs import EngineStats
from engine.protocol import LoadReport
from engine.sampling_params import SamplingParams
from engine.server import build_engine, create_app
from engine.synthetic import SyntheticEngine

RATE = 2_000.0  # prompt tokens per second
CHUNK = 100     # one chunk: 50 ms


def _engine(**kwargs: float) -> SyntheticEngine:
    return SyntheticEngine(token_interval_s=0.001, ttft_s=0.0, prefill_tokens_per_s=RATE,
                           prefill_chunk_tokens=CHUNK, cache_blocks=0, **kwargs)


async def _drain(stream) -> tuple[float, object]:
    """(seconds until the first token, the final delta)."""
    started = time.monotonic()
    first = None
    async for delta in stream:
        if first is None and any(c.token_ids for c in delta.completions):
            first = time.monotonic() - started
        if delta.finished:
            return (first if first is not None else time.monotonic() - started), delta
    raise AssertionError("the stream ended without a final delta")


async def test_backlog_is_reported_by_priority_and_drains_at_the_rate() -> None:
    engine = _engine()
    params = SamplingParams(max_tokens=1)
    flex = [await engine.add_request(f"flex-{i}", list(range(1, 401)), params, priority=2) for i in range(3)]
    default = await engine.add_request("default", list(range(1, 201)), params, priority=1)
    stats = engine.stats()
    assert stats.pending_prefill_tokens == 1_400
    assert stats.pending_prefill_tokens_by_priority == {2: 1_200, 1: 200}
    assert stats.num_waiting == 4
    await asyncio.sleep(0.01)
    # The earlier flex arrival took the first chunk; the default request goes next, ahead of flex.
    (default_ttft, _), *flex_done = await asyncio.gather(_drain(default), *(_drain(s) for s in flex))
    assert default_ttft < 0.5 * max(t for t, _ in flex_done)
    stats = engine.stats()
    assert stats.pending_prefill_tokens == 0 and stats.pending_prefill_tokens_by_priority == {}
    assert stats.computed_prefill_tokens == 1_400 and stats.tokens_per_s == RATE
    assert stats.step_time_s == pytest.approx(CHUNK / RATE)
    engine.shutdown()


async def test_a_better_priority_waits_at_most_one_chunk() -> None:
    engine = _engine()
    params = SamplingParams(max_tokens=1)
    backlog = [await engine.add_request(f"b{i}", list(range(1, 1_001)), params, priority=2) for i in range(4)]
    await asyncio.sleep(0.12)  # mid-backlog: 4,000 tokens = 2 s at the rate
    ttft, final = await _drain(await engine.add_request("urgent", [1, 2, 3], params, priority=0))
    assert ttft < 2 * CHUNK / RATE + 0.1, ttft
    assert final.usage.prompt_tokens == 3
    assert engine.stats().pending_prefill_tokens_by_priority.get(2, 0) > 2_000
    for i, _ in enumerate(backlog):
        engine.abort(f"b{i}")
    await asyncio.sleep(0.1)
    assert engine.stats().pending_prefill_tokens == 0  # aborted prompts leave the backlog
    engine.shutdown()


async def test_without_a_rate_nothing_queues() -> None:
    engine = SyntheticEngine(token_interval_s=0.001, ttft_s=0.0)
    stream = await engine.add_request("r", list(range(1, 1_001)), SamplingParams(max_tokens=2), priority=2)
    assert engine.stats().pending_prefill_tokens == 0 and engine.stats().tokens_per_s == 0.0
    _, final = await _drain(stream)
    assert final.usage.completion_tokens == 2
    engine.shutdown()


def test_engine_kwargs_pass_the_queue_settings() -> None:
    engine = build_engine("synthetic", extra={"prefill_tokens_per_s": 123.0, "prefill_chunk_tokens": 7})
    assert isinstance(engine, SyntheticEngine)
    assert (engine.prefill_tokens_per_s, engine.prefill_chunk_tokens) == (123.0, 7)
    with pytest.raises(ValueError):
        SyntheticEngine(prefill_chunk_tokens=0)


async def test_load_and_metrics_report_the_backlog_by_priority() -> None:
    engine = _engine()
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
