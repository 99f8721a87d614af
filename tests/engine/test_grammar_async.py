"""Grammar compilation off the engine thread: ``AsyncEngine.add_request`` compiles a response format on a
``grammar-compile`` thread and hands the request to the engine only once it is compiled; other streams
keep stepping meanwhile, an abort while compiling never reaches the engine, a compile failure is that
request's own ``response_format`` error, and concurrent requests with one schema share one compile."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.async_engine import AsyncEngine, EngineError, RequestStream
from engine.config import EngineConfig
from engine.grammar import GrammarBackend
from engine.outputs import RequestDelta, RequestValidationError
from engine.sampling_params import SamplingParams
from engine.server import create_app
from tests.polling import eventually, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One order over what the test's threads record (compiles, engine steps, deltas, engine adds): where an
# event lies relative to another is decided by these numbers, never by reading a clock.
_EVENTS = itertools.count()


def _mark() -> int:
    return next(_EVENTS)  # atomic under the GIL, from any thread


def slow_schema(tag: str, n: int = 50) -> dict[str, Any]:
    """An object of ``n`` required properties mixing bounded integers, patterned and length-bounded
    strings and bounded arrays: with the tiny checkpoint's 3k vocabulary xgrammar takes a while to
    compile it; length-bounded string rules are what makes it slow. ``tag`` renames the properties so
    that every test compiles its own schema (no cache hit)."""
    kinds = [
        lambda i: {"type": "integer", "minimum": -i, "maximum": 1000 + i},
        lambda i: {"type": "string", "pattern": f"[a-z]{{2,{3 + i % 5}}}"},
        lambda i: {"type": "array", "items": {"type": "number"}, "maxItems": 3 + i % 4},
        lambda i: {"type": "string", "maxLength": 3 + i},
    ]
    props = {f"{tag}_{i}": kinds[i % 4](i) for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


@pytest.fixture(scope="module")
def async_engine(tiny_qwen2_dir: Path) -> Iterator[AsyncEngine]:
    engine = AsyncEngine(EngineConfig(model=str(tiny_qwen2_dir), num_kv_blocks=128, max_num_seqs=8,
                                      max_num_batched_tokens=64), grammar_compile_threads=2)
    yield engine
    engine.shutdown()


def _backend(engine: AsyncEngine) -> GrammarBackend:
    backend = engine.engine.sampler.grammar
    assert backend is not None
    return backend


class _Compiler:
    """Wraps the backend's xgrammar compiler: records on which thread each compile ran and where it began
    and ended among the other events (``_mark``; also the instants ``began_at`` / ``ended_at``, on the
    engine's clock, for the request's timings). It can hold compiles of schemas whose first property
    starts with ``gated`` until ``release`` is set, and runs ``during(first property, start event)``, if
    set, inside each compile before xgrammar's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[dict[str, Any]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.fail_tags: set[str] = set()
        self.during: Callable[[str, int], None] | None = None

    def _record(self, what: str, fn, *args: Any, **kwargs: Any) -> Any:
        call: dict[str, Any] = {"what": what, "thread": threading.current_thread().name}
        call["began_at"] = time.monotonic()
        call["start"] = _mark()
        self.calls.append(call)
        first = next(iter(json.loads(what).get("properties", {})), "") if what.startswith("{") else ""
        try:
            if first.startswith("gated"):
                self.started.release()
                assert self.release.wait(60), "the test never released a gated compile"
            if first.split("_")[0] in self.fail_tags:
                raise RuntimeError("injected compile failure")
            if self.during is not None:
                self.during(first, call["start"])
            return fn(*args, **kwargs)
        finally:
            call["end"] = _mark()
            call["ended_at"] = time.monotonic()

    def compile_json_schema(self, schema: str, *args: Any, **kwargs: Any) -> Any:
        return self._record(schema, self.inner.compile_json_schema, schema, *args, **kwargs)

    def compile_regex(self, regex: str) -> Any:
        return self._record("regex:" + regex, self.inner.compile_regex, regex)


@pytest.fixture
def compiler(async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Compiler]:
    backend = _backend(async_engine)
    recorder = _Compiler(backend._compiler)
    monkeypatch.setattr(backend, "_compiler", recorder)
    yield recorder
    recorder.release.set()
    wait_until(lambda: backend.num_compiling == 0, "the background compiles to finish")


@pytest.fixture
def steps(async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every engine step as (thread name, start event, end event)."""
    engine = async_engine.engine
    original = engine.step
    recorded: list[tuple[str, int, int]] = []

    def step() -> list[RequestDelta]:
        start = _mark()
        try:
            return original()
        finally:
            recorded.append((threading.current_thread().name, start, _mark()))

    monkeypatch.setattr(engine, "step", step)
    return recorded


class _Adds(list):
    """The request ids the engine thread handed to ``LLMEngine.add_request``, the event of each hand-over
    and the arrival time it passed (where the request's timings count from)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: dict[str, int] = {}
        self.arrivals: dict[str, float] = {}


@pytest.fixture
def engine_adds(async_engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> _Adds:
    engine = async_engine.engine
    original = engine.add_request
    added = _Adds()

    def add_request(request_id: str, *args: Any, **kwargs: Any) -> None:
        added.append(request_id)
        added.events[request_id] = _mark()
        added.arrivals[request_id] = kwargs["arrival_time"]
        original(request_id, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", add_request)
    return added


async def _consume(stream: RequestStream, arrivals: list[int]) -> list[RequestDelta]:
    """The stream's deltas; ``arrivals`` gets the event of each one's arrival."""
    deltas = []
    async with stream:
        async for delta in stream:
            arrivals.append(_mark())
            deltas.append(delta)
    return deltas


def _long(max_tokens: int = 2000) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _assert_idle(engine: AsyncEngine) -> None:
    """Nothing of any request is left: engine, async engine, backend pins and compiles."""
    assert engine.engine.num_requests == 0
    assert not engine._streams and not engine._compiling and not engine._pins
    backend = _backend(engine)
    assert not backend._pinned and backend.num_compiling == 0


async def test_a_slow_compile_runs_off_the_engine_thread_while_another_stream_steps(
    async_engine: AsyncEngine, compiler: _Compiler, steps: list, engine_adds: _Adds
) -> None:
    arrivals: list[int] = []
    streaming = await async_engine.add_request("streaming", list(range(5, 40)), _long())
    consumer = asyncio.create_task(_consume(streaming, arrivals))
    await eventually(lambda: len(arrivals) >= 2, "the first stream's first tokens")

    def hold_the_slow_compile(first: str, began: int) -> None:
        # The compile does not end before whole engine steps ran and the other stream got deltas since it
        # began: if the step loop waited for the compile (or ran it), this would never happen.
        if first.startswith("slow"):
            wait_until(lambda: len([s for s in steps if s[1] > began]) >= 3
                       and len([t for t in arrivals if t > began]) >= 3,
                       "engine steps and the other stream's deltas while the schema compiles")

    compiler.during = hold_the_slow_compile
    constrained = SamplingParams(json_schema=slow_schema("slow"), temperature=0.0, max_tokens=6)
    stream = await async_engine.add_request("constrained", [5, 6, 7], constrained)
    # add_request returned: the grammar is compiled and the request is queued for the engine.
    (call,) = [c for c in compiler.calls if c["what"].startswith("{")]
    assert call["thread"].startswith("grammar-compile"), call["thread"]
    start, end = call["start"], call["end"]
    during = [s for s in steps if start < s[1] and s[2] < end]
    deltas_during = [t for t in arrivals if start < t < end]
    # The step loop kept going while the schema compiled: whole steps ran inside the compile's window
    # and the other stream received deltas in it (an ordering of events).
    assert len(during) >= 3 and len(deltas_during) >= 3
    assert all(name == "engine-loop" for name, _, _ in steps)
    # The request reached the engine only after its compile ended, and was served.
    deltas = [d async for d in stream]
    assert engine_adds.events["constrained"] > end
    assert deltas[-1].finished and deltas[-1].finish_reasons in (["length"], ["stop"])
    assert sum(len(c.token_ids) for d in deltas for c in d.completions) >= 1
    # Its timings count from add_request, the compile included: the arrival time the engine got was
    # taken before the compile began, and it was first scheduled (arrival + queued) after the compile
    # ended (instants on the engine's clock, in order; no duration is bounded).
    timings, arrival = deltas[-1].timings, engine_adds.arrivals["constrained"]
    assert timings is not None and arrival <= call["began_at"]
    assert arrival + timings.queued >= call["ended_at"]
    # No compile ever ran on the engine thread (its look-ups hit the pinned grammar).
    assert all(c["thread"].startswith("grammar-compile") for c in compiler.calls)
    assert async_engine.abort("streaming")
    result = await consumer
    assert result[-1].finish_reasons == ["abort"]
    await eventually(lambda: async_engine.engine.num_requests == 0, "the abort to be applied")
    _assert_idle(async_engine)


async def test_concurrent_requests_with_one_schema_share_one_compile(
    async_engine: AsyncEngine, compiler: _Compiler
) -> None:
    # The same schema with its keys in another order: canonically the same constraint.
    schema = slow_schema("shared", n=20)
    reordered = {"required": schema["required"], "properties": schema["properties"], "type": "object"}
    params = [SamplingParams(json_schema=s, temperature=0.0, max_tokens=4) for s in (schema, reordered)]
    streams = await asyncio.gather(*(async_engine.add_request(f"twin-{i}", [5, 6, 7 + i], p)
                                     for i, p in enumerate(params)))
    assert len([c for c in compiler.calls if "shared_0" in c["what"]]) == 1
    for stream in streams:
        deltas = [d async for d in stream]
        assert deltas[-1].finished
    # A third request with it is a cache hit: no compile at all.
    again = await async_engine.add_request("twin-again", [5], params[0])
    assert [d async for d in again][-1].finished
    assert len([c for c in compiler.calls if "shared_0" in c["what"]]) == 1
    _assert_idle(async_engine)


async def test_abort_while_compiling_never_reaches_the_engine(
    async_engine: AsyncEngine, compiler: _Compiler, engine_adds: _Adds
) -> None:
    params = SamplingParams(json_schema=slow_schema("gatedA", n=8), max_tokens=4)
    task = asyncio.create_task(async_engine.add_request("doomed", [5, 6, 7], params))
    assert await asyncio.to_thread(compiler.started.acquire, True, 30)  # the compile is running
    assert "doomed" in async_engine._compiling
    assert async_engine.abort("doomed")
    stream = await task  # add_request returns the stream, which ends with the abort
    deltas = [d async for d in stream]
    assert len(deltas) == 1 and deltas[0].finished and deltas[0].finish_reasons == ["abort"]
    assert deltas[0].usage is not None and deltas[0].usage.completion_tokens == 0
    assert deltas[0].usage.prompt_tokens == 3
    assert not async_engine.abort("doomed")
    # The id is free again at once; the running compile finishes (into the cache) after the release.
    other = await async_engine.add_request("doomed", [5, 6], SamplingParams(max_tokens=2))
    compiler.release.set()
    await eventually(lambda: _backend(async_engine).num_compiling == 0, "the compile to finish")
    assert [d async for d in other][-1].finished
    # One more engine round trip after the compile ended: the aborted request was never added.
    follow = await async_engine.add_request("follow", [5], SamplingParams(max_tokens=1))
    assert [d async for d in follow][-1].finished
    assert engine_adds.count("doomed") == 1  # only the plain request that reused the id
    assert _backend(async_engine).cached(GrammarBackend.key(params)) is not None
    _assert_idle(async_engine)


async def test_cancelling_add_request_while_compiling_cancels_a_queued_compile(
    async_engine: AsyncEngine, compiler: _Compiler, engine_adds: _Adds
) -> None:
    # Two gated compiles occupy both compile threads; a third schema waits in the pool's queue.
    blockers = [asyncio.create_task(async_engine.add_request(
        f"blocker-{i}", [5, 6], SamplingParams(json_schema=slow_schema(f"gatedB{i}", n=4), max_tokens=2)))
        for i in range(2)]
    for _ in blockers:
        assert await asyncio.to_thread(compiler.started.acquire, True, 30)
    queued = SamplingParams(json_schema=slow_schema("queued", n=4), max_tokens=2)
    task = asyncio.create_task(async_engine.add_request("queued", [5, 6], queued))
    await eventually(lambda: "queued" in async_engine._compiling, "the third request to be compiling")
    task.cancel()  # the caller goes away (a server's handler cancelled)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert "queued" not in async_engine._compiling and "queued" not in async_engine._streams
    compiler.release.set()
    for blocker in blockers:
        assert [d async for d in await blocker][-1].finished
    await eventually(lambda: _backend(async_engine).num_compiling == 0, "the compiles to finish")
    # Withdrawn before it started: never compiled, never cached, never added.
    assert not [c for c in compiler.calls if "queued_0" in c["what"]]
    assert _backend(async_engine).cached(GrammarBackend.key(queued)) is None
    assert "queued" not in engine_adds
    _assert_idle(async_engine)


async def test_a_compile_failure_is_that_requests_error_only(
    async_engine: AsyncEngine, compiler: _Compiler
) -> None:
    arrivals: list[int] = []
    streaming = await async_engine.add_request("bystander", list(range(5, 30)), _long(40))
    consumer = asyncio.create_task(_consume(streaming, arrivals))
    compiler.fail_tags.add("broken")
    bad = SamplingParams(json_schema=slow_schema("broken", n=3), max_tokens=4)
    with pytest.raises(RequestValidationError) as info:
        await async_engine.add_request("bad", [5, 6, 7], bad)
    assert info.value.param == "response_format"
    assert "cannot compile the response format" in info.value.message
    assert "injected compile failure" in info.value.message
    # The failure is not cached: the next request with the schema compiles again (and fails again).
    with pytest.raises(RequestValidationError):
        await async_engine.add_request("bad", [5, 6, 7], bad)
    assert len([c for c in compiler.calls if "broken_0" in c["what"]]) == 2
    # A schema xgrammar itself rejects, slipped past SamplingParams' check.
    invalid = SamplingParams(json_schema={"type": "object"}, max_tokens=4)
    invalid.json_schema = {"type": "no-such-type"}
    with pytest.raises(RequestValidationError, match="cannot compile the response format") as info:
        await async_engine.add_request("invalid", [5, 6, 7], invalid)
    assert info.value.param == "response_format"
    # The bystander streamed on untouched.
    deltas = await consumer
    assert deltas[-1].finish_reasons == ["length"]
    assert sum(len(c.token_ids) for d in deltas for c in d.completions) == 40
    _assert_idle(async_engine)


async def test_the_server_answers_400_for_a_schema_that_does_not_compile(
    async_engine: AsyncEngine, compiler: _Compiler
) -> None:
    compiler.fail_tags.add("served")
    transport = httpx.ASGITransport(app=create_app(async_engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        body = {"request_id": "http-bad", "prompt_token_ids": [5, 6, 7], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": slow_schema("served", n=3)}}
        response = await client.post("/generate", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "response_format" and "cannot compile the response format" in error["message"]
    _assert_idle(async_engine)


async def test_shutdown_while_compiling_fails_the_waiting_request(tiny_qwen2_dir: Path) -> None:
    engine = AsyncEngine(EngineConfig(model=str(tiny_qwen2_dir), num_kv_blocks=32, max_num_seqs=2))
    backend = _backend(engine)
    recorder = _Compiler(backend._compiler)
    backend._compiler = recorder
    try:
        params = SamplingParams(json_schema=slow_schema("gatedS", n=4), max_tokens=2)
        task = asyncio.create_task(engine.add_request("late", [5, 6], params))
        assert await asyncio.to_thread(recorder.started.acquire, True, 30)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineError, match="shutting down"):
            await task
        assert not engine._compiling and not engine._streams and not engine._pins
    finally:
        recorder.release.set()
        engine.shutdown()
    wait_until(lambda: backend.num_compiling == 0, "the compile to finish")


# ---- GrammarBackend's compile side on its own ---------------------------------------------------------
class _ManualExecutor(Executor):
    """Runs submitted jobs only when the test says so."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Any, tuple[Any, ...]]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[override]
        self.jobs.append((fn, args))
        return Future()

    def run_all(self) -> None:
        jobs, self.jobs = self.jobs, []
        for fn, args in jobs:
            fn(*args)


@pytest.fixture
def backend(tiny_qwen2_dir: Path) -> GrammarBackend:
    config = json.loads((tiny_qwen2_dir / "config.json").read_text())
    eos = config["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    tokenizer_json = tiny_qwen2_dir / "tokenizer.json"
    return GrammarBackend.from_tokenizer_json(tokenizer_json, config["vocab_size"], eos_ids)


def _params(tag: str) -> SamplingParams:
    return SamplingParams(json_schema={"type": "object", "properties": {tag: {"type": "integer"}}})


def test_compile_async_shares_one_compile_and_cancels_when_every_waiter_withdraws(
    backend: GrammarBackend
) -> None:
    executor = _ManualExecutor()
    key, first = backend.compile_async(_params("a"), executor)
    key2, second = backend.compile_async(_params("a"), executor)
    assert key == key2 and first is second and len(executor.jobs) == 1 and backend.num_compiling == 1
    backend.withdraw(key, first)
    assert not first.cancelled()  # the other waiter still wants it
    backend.withdraw(key, first)
    assert first.cancelled() and backend.num_compiling == 0
    executor.run_all()  # the queued job sees the cancellation and compiles nothing
    assert backend.cached(key) is None
    # A new request starts a new compile; a synchronous compile of the same key waits for it.
    key, future = backend.compile_async(_params("a"), executor)
    results: list[Any] = []
    waiter = threading.Thread(target=lambda: results.append(backend.compile(_params("a"))))
    waiter.start()
    wait_until(lambda: backend._inflight[key].waiters == 2, "the synchronous caller to wait")
    backend.withdraw(key, future)  # the async waiter leaves; the synchronous one keeps it alive
    assert not future.cancelled()
    executor.run_all()
    waiter.join(30)
    assert results == [future.result()] and backend.cached(key) is future.result()
    # A cache hit is a done future and needs no executor.
    _, hit = backend.compile_async(_params("a"), executor)
    assert hit.done() and hit.result() is future.result() and not executor.jobs


def test_a_failed_compile_is_not_cached(backend: GrammarBackend) -> None:
    params = _params("x")
    params.json_schema = {"type": "no-such-type"}
    executor = _ManualExecutor()
    key, future = backend.compile_async(params, executor)
    executor.run_all()
    with pytest.raises(ValueError, match="cannot compile the response format"):
        future.result()
    assert key is not None and backend.cached(key) is None and backend.num_compiling == 0
    with pytest.raises(ValueError, match="cannot compile the response format"):
        backend.compile(params)


def test_pinned_grammars_survive_lru_eviction(backend: GrammarBackend) -> None:
    small = GrammarBackend(backend.tokenizer_info, max_cached_grammars=1)
    a, b = _params("a"), _params("b")
    key_a, key_b = GrammarBackend.key(a), GrammarBackend.key(b)
    assert key_a is not None and key_b is not None
    compiled_a = small.compile(a)
    assert compiled_a is not None
    small.pin(key_a, compiled_a)
    small.pin(key_a, compiled_a)
    small.compile(b)  # evicts a from the LRU
    assert key_a not in small._cache and small.cached(key_a) is compiled_a
    assert small.compile(a) is compiled_a  # a hit: no recompile
    small.unpin(key_a)
    assert small.cached(key_a) is compiled_a
    small.unpin(key_a)
    assert small.cached(key_a) is None and small.cached(key_b) is not None
