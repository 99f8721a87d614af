"""Drives ``LLMEngine.step()`` in a dedicated thread and hands each request's deltas to asyncio.

Invariants:

- Only the engine thread touches the ``LLMEngine`` (it is single-threaded). Callers enqueue adds and
  aborts under a condition variable; the thread applies them between steps, so an abort takes effect
  before the next step (the request's blocks are freed then).
- Validation happens in the caller (``add_request`` raises ``RequestValidationError`` before anything
  is queued), so a server can answer 400 before streaming. Two requests with the same id cannot be in
  flight at once.
- Grammar compilation never runs on the engine thread. ``add_request`` of a request with a response
  format starts its compile on a small pool of ``grammar-compile`` threads (``GrammarBackend`` shares one
  compile between requests with the same constraint; xgrammar releases the GIL while compiling) and
  awaits it; only then is the request queued for the engine, with its grammar pinned in the backend's
  cache until its final delta, so the engine's own look-ups always hit. A compile failure makes
  ``add_request`` raise ``RequestValidationError`` (param ``response_format``) for that request only. An
  abort while compiling (``abort`` or the caller cancelling ``add_request``) never reaches the engine: the
  stream gets a final ``abort`` delta and the compile is cancelled if it has not started and nobody else
  waits for it (a started one finishes into the cache).
- Timings count from ``add_request`` (compile included), not from when the engine thread picked it up.
- Each request has its own unbounded ``asyncio.Queue``: a slow consumer never stalls the engine or
  other requests (no back-pressure), and a consumer that goes away (the ``RequestStream`` is closed or
  cancelled before its final delta) aborts its request.
- The thread sleeps on the condition while there is no work; it wakes on an add, an abort or shutdown.
- If a step raises, every in-flight request ends with an ``EngineError`` (the stream raises it) and
  the loop keeps serving new requests.
- ``stats()`` returns the snapshot the thread took after its last step: readers never touch live state.
- Disaggregated serving (``engine.kv.connector``): a delivered lease or a finished pull wakes the thread;
  while leases are held it wakes at the next expiry even when idle, so stranded blocks are freed on time.

This module imports no torch itself (``LLMEngine`` is imported when an ``AsyncEngine`` is built), so the
synthetic engine can share ``RequestStream``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.kv.connector import RemoteKV
from engine.kv.pins import DEFAULT_POLICY, CachePolicy
from engine.lora.adapter import LoRAAdapter
from engine.lora.registry import LoRARequest, by_id
from engine.metrics import EngineMetrics
from engine.outputs import EngineStats, RequestDelta, RequestValidationError, Timings, Usage
from engine.pooling import PoolingParams, checkpoint_pooling
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.grammar import GrammarBackend
    from engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault): an ``error`` record."""


class RequestStream:
    """Async iterator over one request's ``RequestDelta``s; ends after the finished delta.

    ``close()`` (also ``async with stream:`` on exit, and cancellation of a task waiting in
    ``__anext__``) before the finished delta calls ``on_close`` once, which aborts the request.
    Leaving an ``async for`` with ``break`` does not close a plain iterator: use ``async with``.
    """

    def __init__(self, request_id: str, on_close: Callable[[str], Any]) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False
        # Set by the engine thread once a delta was handed over (``_deliver`` puts first deltas first).
        self.delivered = False
        # The request's end as the engine delivered it, whether or not anybody reads the stream any more:
        # ``final`` is its finished delta (None after an engine failure), ``ended`` is set with it, and
        # ``on_end`` (set by whoever tracks requests, e.g. the server's ``RecentRequests``) is called once.
        self.final: RequestDelta | None = None
        self.ended = asyncio.Event()
        self.on_end: Callable[[RequestStream], Any] | None = None
        self._on_close = on_close

    def put_nowait(self, item: RequestDelta | BaseException) -> None:
        """Deliver from the stream's own event loop."""
        if not self.ended.is_set() and (isinstance(item, BaseException) or item.finished):
            self.final = None if isinstance(item, BaseException) else item
            self.ended.set()
            if self.on_end is not None:
                self.on_end(self)
        self.queue.put_nowait(item)

    def put_threadsafe(self, item: RequestDelta | BaseException) -> None:
        """Deliver from another thread (a closed event loop means nobody listens: dropped)."""
        try:
            self.loop.call_soon_threadsafe(self.put_nowait, item)
        except RuntimeError:
            logger.debug("dropping an item for request %s: its event loop is closed", self.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestDelta:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except asyncio.CancelledError:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Stop listening; aborts the request unless it already finished."""
        if not self.finished:
            self.finished = True
            self._on_close(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    cache_salt: str | None
    priority: int
    stream: RequestStream
    arrival_time: float
    pooling: PoolingParams | None = None
    cache_policy: CachePolicy = DEFAULT_POLICY
    prediction: list[int] | None = None
    lora: LoRARequest | None = None
    kv_source: RemoteKV | None = None


@dataclass(eq=False, slots=True)
class _Compiling:
    """A request waiting for its grammar: not yet known to the engine."""

    add: _Add
    key: str
    future: Future  # the backend's compile (shared by requests with the same constraint)
    waiter: asyncio.Future[None]  # add_request awaits it: compiled, failed (its exception) or aborted


class AsyncEngine:
    """An ``LLMEngine`` behind a thread, for the internal server."""

    def __init__(self, config: EngineConfig, model_name: str | None = None, pool: str = "interactive",
                 engine: LLMEngine | None = None, grammar_compile_threads: int = 2) -> None:
        if engine is None:
            from engine.llm_engine import LLMEngine

            engine = LLMEngine(config)
        self.engine = engine
        self.kv_events = engine.kv_events  # read by the server's /kv/events (thread-safe)
        self.config = config
        self.model_name = model_name or config.model
        self.pool = pool
        # The checkpoint's embedding pooling (``engine.pooling``): what a request leaves out takes.
        self.pooling = checkpoint_pooling(config.model)
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self._cond = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._purges: list[tuple[str | None, concurrent.futures.Future[int]]] = []
        self._streams: dict[str, RequestStream] = {}
        self._stopping = False
        if grammar_compile_threads < 1:
            raise ValueError(f"grammar_compile_threads must be >= 1, got {grammar_compile_threads}")
        sampler = getattr(engine, "sampler", None)
        self._grammar: GrammarBackend | None = getattr(sampler, "grammar", None)
        self._compile_pool = ThreadPoolExecutor(grammar_compile_threads, thread_name_prefix="grammar-compile")
        self._compiling: dict[str, _Compiling] = {}
        # request id -> grammar key pinned for it (until its final delta or failure).
        self._pins: dict[str, str] = {}
        self._stats = engine.stats()
        self.metrics = EngineMetrics(self.stats, self.model_name, pool)
        # Liveness (``stalled``): when the loop last finished a step or went idle, and how many steps in a
        # row have failed (a poisoned device fails every one).
        self._last_progress = time.monotonic()
        self._step_started: float | None = None  # while a step runs: when it began
        self._failed_steps = 0
        connector = getattr(engine, "connector", None)
        if connector is not None:
            connector.add_listener(self._wake)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ---- public, any thread / the event loop ---------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats

    def render_metrics(self) -> bytes:
        return self.metrics.render()

    def check_adapter(self, lora: str) -> LoRAAdapter:
        """The adapter ``lora`` of the replica's store, read and checked against the served model as a
        request for it would be (and then held read); ``RequestValidationError`` (param ``lora``) if it
        cannot be served here. Reads files: call it off the event loop."""
        return self.engine.adapters.get(by_id(lora, self.config.lora_dir))

    def resident_adapters(self) -> list[str]:
        """The ids of the adapters held read (``LoadReport.adapters``)."""
        return self.engine.adapters.resident()

    def stalled(self, stall_s: float, max_failed_steps: int = 3) -> str | None:
        """Why this replica should be restarted, or None: its loop thread is gone, it has had work for
        ``stall_s`` seconds without finishing a step (a hung kernel, a collective waiting on a dead
        tensor-parallel rank), or its last ``max_failed_steps`` steps all failed (a device error)."""
        if self._stopping:
            return None
        if not self._thread.is_alive():
            return "the engine loop thread has exited"
        if self._failed_steps >= max_failed_steps:
            return f"the last {self._failed_steps} engine steps failed"
        started = self._step_started
        if started is not None and time.monotonic() - started > stall_s:
            return f"no engine step has finished for {time.monotonic() - started:.0f} s: one is stuck"
        with self._cond:
            busy = bool(self._adds or self._aborts or self._purges)
        busy = busy or self._stats.num_running > 0 or self._stats.num_waiting > 0
        idle_for = time.monotonic() - self._last_progress
        if busy and idle_for > stall_s:
            return f"no engine step has finished for {idle_for:.0f} s with requests queued"
        return None

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model": self.model_name,
            "pool": self.pool,
            "max_model_len": e.max_model_len,
            "vocab_size": e.vocab_size,
            "block_size": self.config.block_size,
            "eos_token_ids": sorted(e.eos_token_ids),
            "num_kv_blocks": e.kv.blocks.num_blocks,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "embedding_dimensions": e.runner.args.hidden_size,
            "pooling": self.pooling.mode,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "role": self.config.role,
        }

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        tenant: str = "",
        cache_salt: str | None = None,
        priority: int = 0,
        pooling: PoolingParams | None = None,
        cache_policy: CachePolicy = DEFAULT_POLICY,
        prediction: list[int] | None = None,
        lora: str | None = None,
        kv_source: RemoteKV | None = None,
    ) -> RequestStream:
        """Validate and queue a request; iterate the returned stream for its deltas (with ``pooling``:
        one final delta carrying the embedding; ``lora``: the id of the adapter its tokens run through,
        in the replica's adapter store).

        A request with a response format returns once its grammar is compiled (off the engine thread);
        ``RequestValidationError`` (param ``response_format``) if it cannot be compiled; param ``lora`` if
        its adapter cannot be served here.
        """
        received = time.monotonic()
        prompt = list(prompt_token_ids)
        self.engine.validate_request(request_id, prompt, params)
        prediction = self.engine.validate_prediction(prediction)
        self.engine.validate_kv_source(kv_source)
        adapter = None
        if lora is not None:
            adapter = by_id(lora, self.config.lora_dir)
            # Read and checked now: a 400 before anything is queued. Off the event loop (a cold bundle
            # is read from disk), so other requests' streams keep flowing meanwhile.
            await asyncio.to_thread(self.engine.adapters.get, adapter)
        grammar = self._grammar if params.structured else None
        if params.structured and grammar is None:
            raise RequestValidationError(
                "structured output (response_format) is not available for this model", "response_format"
            )
        stream = RequestStream(request_id, self.abort)
        add = _Add(request_id, prompt, params, tenant, cache_salt, priority, stream, received, pooling,
                   cache_policy, prediction, adapter, kv_source)
        with self._cond:
            if self._stopping:
                raise EngineError("the engine is shutting down")
            if request_id in self._streams:
                raise RequestValidationError(f"request_id {request_id!r} is already in flight", "request_id")
            if grammar is None:
                self._streams[request_id] = stream
                self._enqueue(add)
                return stream
            key, future = grammar.compile_async(params, self._compile_pool)
            if key is None:  # structured implies a key; defensive
                raise RequestValidationError("the response format has no grammar", "response_format")
            self._streams[request_id] = stream
            if future.done():  # a cached grammar: queue it now
                self._enqueue(add, key, future.result())
                return stream
            compiling = _Compiling(add, key, future, stream.loop.create_future())
            self._compiling[request_id] = compiling
        future.add_done_callback(lambda _: self._compiled(compiling))
        try:
            await compiling.waiter
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away while its grammar compiled
            raise
        return stream

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                       tenant: str = "", cache_salt: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestDelta]:
        stream = await self.add_request(request_id, prompt_token_ids, params, tenant, cache_salt, priority)
        async with stream:
            async for delta in stream:
                yield delta

    def purge_cache(self, cache_salt: str | None) -> concurrent.futures.Future[int]:
        """Drop one tenant's cached blocks from every tier before the next step (its blocks dropped)."""
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        with self._cond:
            if self._stopping:
                raise EngineError("the engine is shutting down")
            self._purges.append((cache_salt, done))
            self._cond.notify()
        return done

    def abort(self, request_id: str) -> bool:
        """Abort a request before the next step; returns False if it is not in flight.

        A request still compiling its grammar ends at once (final ``abort`` delta) and never reaches the
        engine."""
        with self._cond:
            stream = self._streams.get(request_id)
            if stream is None:
                return False
            compiling = self._compiling.pop(request_id, None)
            if compiling is None:
                self._aborts.append(request_id)
                self._cond.notify()
                return True
            del self._streams[request_id]
        self._drop_compile(compiling)
        add = compiling.add
        e2e = time.monotonic() - add.arrival_time
        timings = Timings(queued=e2e, ttft=0.0, tpot=0.0, e2e=e2e)
        stream.put_threadsafe(RequestDelta(
            request_id, [], True, ["abort"] * add.params.n,
            Usage.of(prompt_tokens=len(add.prompt_token_ids)), timings,
        ))
        self.metrics.observe_finished(timings, 0)
        _resolve_threadsafe(compiling.waiter, None)
        return True

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            compiling = list(self._compiling.values())
            self._compiling.clear()
            self._cond.notify()
        error = EngineError("the engine is shutting down")
        for c in compiling:
            self._drop_compile(c)
            _resolve_threadsafe(c.waiter, error)
        self._thread.join()
        self._compile_pool.shutdown(wait=False)
        self.engine.close()

    # ---- grammar compilation (the compile threads) ------------------------------------------------
    def _compiled(self, compiling: _Compiling) -> None:
        """The request's compile finished (in a compile thread): queue it for the engine or fail it."""
        future = compiling.future
        if future.cancelled():
            return  # every waiter withdrew, this request too: it is gone already
        request_id = compiling.add.request_id
        error: BaseException | None = None
        with self._cond:
            if self._compiling.get(request_id) is not compiling:
                return  # aborted or shut down meanwhile: it was withdrawn and is nobody's business now
            del self._compiling[request_id]
            exc = future.exception()
            if exc is None and self._grammar is not None:
                self._enqueue(compiling.add, compiling.key, future.result())
            else:
                self._streams.pop(request_id, None)
                error = (RequestValidationError(str(exc), "response_format") if isinstance(exc, ValueError)
                         else EngineError(f"the grammar compile failed: {exc}"))
        if not _resolve_threadsafe(compiling.waiter, error) and error is None:
            self.abort(request_id)  # its event loop is closed: nobody will read the stream

    def _enqueue(self, add: _Add, key: str | None = None, compiled: Any = None) -> None:
        """Under ``_cond``: hand the request to the engine thread; a compiled grammar (``key``) stays
        pinned in the backend's cache until the request ends."""
        if key is not None:
            assert self._grammar is not None
            self._grammar.pin(key, compiled)
            self._pins[add.request_id] = key
        self._adds.append(add)
        self._cond.notify()

    def _drop_compile(self, compiling: _Compiling) -> None:
        if self._grammar is not None:
            self._grammar.withdraw(compiling.key, compiling.future)

    def _unpin(self, request_id: str) -> None:
        """Under ``_cond``: the request is over, release its grammar's pin."""
        key = self._pins.pop(request_id, None)
        if key is not None and self._grammar is not None:
            self._grammar.unpin(key)

    # ---- the engine thread ----------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        engine.runner.bind_thread()  # built on the caller's thread: its GPU is not this thread's default
        while True:
            with self._cond:
                while not (self._adds or self._aborts or self._purges or self._stopping
                           or engine.has_unfinished()):
                    self._last_progress = time.monotonic()  # idle is not stalled
                    next_expiry = engine.housekeeping()  # leases delivered or expired
                    self._stats = engine.stats()
                    self._cond.wait(None if next_expiry is None else next_expiry + 0.01)
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                purges, self._purges = self._purges, []
            for salt, done in purges:
                try:
                    done.set_result(engine.purge_cache(salt))
                except Exception as exc:
                    done.set_exception(exc)
            for add in adds:
                try:
                    engine.add_request(add.request_id, add.prompt_token_ids, add.params, tenant=add.tenant,
                                       cache_salt=add.cache_salt, priority=add.priority,
                                       arrival_time=add.arrival_time, pooling=add.pooling,
                                       cache_policy=add.cache_policy, prediction=add.prediction,
                                       lora=add.lora, kv_source=add.kv_source)
                except Exception as exc:  # validated already; a late failure ends that request only
                    self._fail(add.request_id, exc)
            try:
                for request_id in aborts:
                    engine.abort(request_id)
                self._step_started = time.monotonic()
                deltas = engine.step()
                self._step_started = None
                self._stats = engine.stats()
                self._last_progress = time.monotonic()
                self._failed_steps = 0
                self._deliver(deltas)
            except Exception:
                self._step_started = None
                self._failed_steps += 1
                logger.exception("engine step failed; failing every in-flight request")
                self._fail_all()
        self._fail_all_streams(EngineError("the engine shut down"))

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        """Hand a step's deltas to their streams: one wake-up per event loop, not one per request.

        A stream's first delta goes ahead of the others of its step: the event loop wakes the readers
        (and so writes their NDJSON lines) in this order, and the gateway reads the connections in the
        order they became readable, so a new request's first token is not written after every running
        stream's next one (with 16 streams that was up to ~2 ms of other streams' writes and frames)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestDelta]]] = {}
        firsts: dict[asyncio.AbstractEventLoop, int] = {}
        with self._cond:
            for delta in deltas:
                stream = self._streams.get(delta.request_id)
                if delta.finished:
                    self._streams.pop(delta.request_id, None)
                    self._unpin(delta.request_id)
                    if delta.timings is not None and delta.usage is not None:
                        self.metrics.observe_finished(delta.timings, delta.usage.completion_tokens)
                if stream is not None:
                    batch = batches.setdefault(stream.loop, [])
                    if stream.delivered:
                        batch.append((stream, delta))
                    else:
                        stream.delivered = True
                        at = firsts.get(stream.loop, 0)
                        batch.insert(at, (stream, delta))
                        firsts[stream.loop] = at + 1
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                logger.debug("dropping %d deltas for a closed event loop", len(items))

    def _fail(self, request_id: str, exc: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
            self._unpin(request_id)
        if stream is not None:
            error = exc if isinstance(exc, RequestValidationError) else EngineError(str(exc))
            stream.put_threadsafe(error)

    def _fail_all(self) -> None:
        try:
            self.engine.abort_all()
            self._stats = self.engine.stats()
        except Exception:
            logger.exception("could not abort the in-flight requests after a failed step")
        self._fail_all_streams(EngineError("the engine failed while running this request"))

    def _fail_all_streams(self, error: EngineError) -> None:
        """Fail every request the engine has (those still compiling are not the engine's yet)."""
        with self._cond:
            streams = {rid: s for rid, s in self._streams.items() if rid not in self._compiling}
            for request_id in streams:
                del self._streams[request_id]
                self._unpin(request_id)
        for stream in streams.values():
            stream.put_threadsafe(error)


def _resolve_threadsafe(waiter: asyncio.Future[None], error: BaseException | None) -> bool:
    """Complete ``add_request``'s wait from any thread; False if its event loop is closed."""

    def resolve() -> None:
        if waiter.done():
            return
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)

    try:
        waiter.get_loop().call_soon_threadsafe(resolve)
    except RuntimeError:
        return False
    return True


def _put_all(items: list[tuple[RequestStream, RequestDelta]]) -> None:
    for stream, delta in items:
        stream.put_nowait(delta)
