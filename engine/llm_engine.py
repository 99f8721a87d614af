"""The engine loop: requests in, token deltas out.

``LLMEngine`` composes the tokenizer, the ``ModelRunner`` (weights + paged KV cache), the
``BlockManager``, the ``Scheduler`` and the ``Sampler``. ``step()`` is schedule → run →
``update_after_step`` → sample → postprocess (append, detokenize, stop checks, finish).

Invariants:

- The engine is single-threaded: every method is called from one thread (``AsyncEngine`` runs it in a
  dedicated thread and funnels adds/aborts through it). ``validate_request`` is the exception: it only
  reads immutable state and may be called from any thread.
- A request is validated entirely in ``add_request`` (``RequestValidationError``, a ``ValueError``):
  once accepted, it can only end as ``stop``, ``length``, ``abort`` or ``error``. A rejected request
  changes nothing and affects no other request.
- ``max_model_len`` is the model's context, capped by what the KV pool can hold for one sequence (the
  block manager admits a sequence only when all its known tokens fit). A request with
  ``prompt + max_tokens > max_model_len`` is rejected (OpenAI's behaviour, not vLLM's clamp); without
  ``max_tokens`` it may generate up to the end of the context.
- Stop checks run after each appended token in this order: eos (unless ``ignore_eos``),
  ``stop_token_ids``, stop strings (the text is cut before the stop string, held back while a stop
  string may still be forming), grammar terminated, ``max_tokens``, ``max_model_len``.
  Stop tokens stay in ``token_ids`` and count as completion tokens; their text is never emitted.
- Usage counts the prompt once for ``n > 1``; ``cached_tokens`` is the first stream's
  ``num_cached_tokens`` (set when it first started, never changed by preemption).
- An embedding request (``pooling``, ``engine.pooling``) is never sampled: it finishes (``stop``, zero
  completion tokens) in the step its last prompt chunk runs, with ``RequestDelta.embedding``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.config import EngineConfig
from engine.grammar import GrammarBackend
from engine.kv.cache import KVCache
from engine.kv.pins import DEFAULT_POLICY, CachePolicy
from engine.model_runner import ModelRunner
from engine.outputs import CompletionDelta, EngineStats, RequestDelta, RequestValidationError, Timings, Usage
from engine.pooling import PoolingParams
from engine.sampler import Sampler, SampleResult
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, ScheduledBatch, Sequence, SequenceStatus
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer

logger = logging.getLogger(__name__)

_EWMA = 0.1


@dataclass(eq=False)
class _Completion:
    """Postprocessing state of one stream: detokenizer, stop-string matcher, what was emitted."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: list[str] = field(default_factory=list)
    new_logprobs: list | None = None
    reported_finish: bool = False
    embedding: list[float] | None = None


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    completions: list[_Completion]

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.runner = ModelRunner(config)
        self.kv = KVCache.create(config, self.runner.num_kv_blocks, self.runner.kv_transfer)
        self.kv_events = self.kv.events
        self.scheduler = Scheduler(config, self.kv)
        self.vocab_size: int = self.runner.vocab_size
        self.eos_token_ids: frozenset[int] = frozenset(self.runner.eos_token_ids)
        self.sampler = Sampler(self.vocab_size, self._grammar_backend(), seed=config.seed)
        kv_capacity = self.runner.num_kv_blocks * config.block_size
        self.max_model_len: int = min(config.max_model_len or self.runner.max_model_len, kv_capacity)
        if self.max_model_len < (config.max_model_len or self.runner.max_model_len):
            logger.warning(
                "max_model_len capped at %d tokens: the KV pool (%d blocks of %d) holds no more",
                self.max_model_len, self.runner.num_kv_blocks, config.block_size,
            )
        self._requests: dict[str, _Request] = {}
        self._seq_owner: dict[int, _Completion] = {}
        # Deltas produced outside step() (aborts), returned by the next step().
        self._pending: list[RequestDelta] = []
        self._stats = EngineStats(num_kv_blocks=self.runner.num_kv_blocks)

    def purge_cache(self, cache_salt: str | None) -> int:
        """Drop every cached block of ``cache_salt`` from the device, host and disk tiers (between steps);
        returns how many blocks went."""
        dropped = self.kv.purge(cache_salt)
        self.runner.transfer(self.kv.take_plan())
        return dropped

    def flush_kv(self) -> None:
        """Land every tier copy and finish every queued disk job (tests)."""
        self.runner.flush_transfers()

    def close(self) -> None:
        """Finish the disk tier's queued writes (a restart finds every block demoted so far)."""
        self.runner.close()

    def _grammar_backend(self) -> GrammarBackend | None:
        """Structured output needs the checkpoint's ``tokenizer.json`` and an EOS to end documents."""
        tokenizer_json = Path(self.config.model) / "tokenizer.json"
        if not tokenizer_json.is_file() or not self.eos_token_ids:
            logger.warning("structured output disabled: no tokenizer.json or no EOS token in %s",
                           self.config.model)
            return None
        return GrammarBackend.from_tokenizer_json(tokenizer_json, self.vocab_size, sorted(self.eos_token_ids))

    # ---- requests -------------------------------------------------------------------------------
    def validate_request(
        self, request_id: str, prompt_token_ids: SequenceLike[int], params: SamplingParams
    ) -> None:
        """Raise ``RequestValidationError`` if the engine cannot serve this request. Thread-safe."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestValidationError("request_id must be a non-empty string", "request_id")
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestValidationError("the prompt is empty: at least one token is required", "prompt")
        bad = next((t for t in prompt_token_ids if not (_is_int(t) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise RequestValidationError(
                f"prompt token id {bad!r} is not an integer in the vocabulary [0, {self.vocab_size})",
                "prompt",
            )
        if num_prompt >= self.max_model_len:
            raise RequestValidationError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num_prompt} tokens (at least one token must be left to generate)",
                "prompt", code="context_length_exceeded",
            )
        if num_prompt + params.max_tokens > self.max_model_len:
            raise RequestValidationError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{num_prompt} tokens and max_tokens asks for {params.max_tokens} more "
                f"({num_prompt + params.max_tokens} in total)",
                "max_tokens", code="context_length_exceeded",
            )
        bad = next((t for t in params.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestValidationError(
                f"stop token id {bad} is outside the vocabulary [0, {self.vocab_size})", "stop_token_ids"
            )
        if params.n > self.config.max_num_seqs:
            raise RequestValidationError(
                f"n={params.n} exceeds this engine's max_num_seqs ({self.config.max_num_seqs})", "n"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceLike[int],
        params: SamplingParams,
        tenant: str = "",
        cache_salt: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        pooling: PoolingParams | None = None,
        cache_policy: CachePolicy = DEFAULT_POLICY,
    ) -> None:
        """Queue a request (``params.n`` streams; with ``pooling``, one embedding and no tokens; its
        prompt-cache lifetimes in ``cache_policy``). Raises ``RequestValidationError``, changing nothing."""
        if request_id in self._requests:
            raise RequestValidationError(f"request_id {request_id!r} is already in flight", "request_id")
        self.validate_request(request_id, prompt_token_ids, params)
        if pooling is not None:
            if params.n != 1:
                raise RequestValidationError("an embedding request has exactly one completion (n = 1)", "n")
            if not pooling.uses_prefix_cache:
                # Every prompt token's hidden state is needed: a salt of its own, so nothing is a hit.
                cache_salt = f"{cache_salt or ''}:pooling:{request_id}"
        prompt = [int(t) for t in prompt_token_ids]
        try:
            self.sampler.prepare(params)
        except ValueError as e:
            raise RequestValidationError(str(e), "response_format") from e
        now = time.monotonic() if arrival_time is None else arrival_time
        completions = []
        for index in range(params.n):
            seq = Sequence(
                request_id=request_id,
                token_ids=list(prompt),
                params=params,
                priority=priority,
                tenant=tenant,
                cache_salt=cache_salt,
                arrival_time=now,
                index=index,
                pooling=pooling,
                cache_policy=cache_policy,
            )
            stop_matcher = StopStringMatcher(params.stop) if params.stop else None
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt, skip_special_tokens=params.skip_special_tokens
            )
            completions.append(_Completion(seq, detok, stop_matcher))
        request = _Request(request_id, prompt, params, now, completions)
        self._requests[request_id] = request
        for completion in completions:
            self._seq_owner[completion.seq.seq_id] = completion
            self.scheduler.add(completion.seq)
        self._stats.prompt_tokens += len(prompt)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Its final delta (``abort``) comes with the next
        ``step()``. Returns False if the request is unknown or already finished."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self.scheduler.abort(request_id)
        now = time.monotonic()
        for completion in request.completions:
            seq = completion.seq
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = FinishReason.ABORT
                seq.finished_time = now
        self._pending.append(self._finish_request(request))
        return True

    def abort_all(self) -> list[str]:
        """Abort every request and drop undelivered deltas (after a failed step). Returns their ids."""
        request_ids = list(self._requests)
        for request_id in request_ids:
            self.abort(request_id)
        self.discard_pending()
        return request_ids

    def discard_pending(self) -> None:
        """Drop the deltas queued for the next ``step()`` (aborts nobody will read)."""
        self._pending.clear()

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Run one scheduling step; return what every affected request gained."""
        outputs, self._pending = self._pending, []
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            self.runner.transfer(batch.transfers)
            if self.kv.reading():
                self.kv.wait_for_read(timeout_s=0.05)  # every waiting prompt waits for the disk
                return outputs
            if self.scheduler.has_unfinished():
                # Every accepted request fits the KV pool alone, so an empty step with work left is a bug.
                raise RuntimeError("the scheduler scheduled nothing although requests are waiting")
            return outputs
        now = time.monotonic()
        sampled: list[Sequence] = []
        pooled: list[Sequence] = []
        prefill_tokens = 0
        for scheduled in batch.seqs:
            seq = scheduled.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if scheduled.samples:
                (sampled if seq.pooling is None else pooled).append(seq)
            if scheduled.start < seq.num_prompt_tokens:
                prefill_tokens += scheduled.num_tokens
        logits = self.runner.run(batch)
        self.scheduler.update_after_step(batch)
        self.runner.transfer(batch.transfers_after)  # retained blocks, while the device blocks are intact
        touched: dict[str, _Request] = {}
        for seq in pooled:  # an embedding is done once its whole prompt has run
            completion = self._seq_owner[seq.seq_id]
            completion.embedding = self.runner.embedding(seq)
            seq.first_token_time = seq.finished_time = time.monotonic()
            self.scheduler.finish(seq, FinishReason.STOP)
            touched[seq.request_id] = self._requests[seq.request_id]
        if sampled:
            results = self.sampler.sample(logits, sampled)
            now = time.monotonic()
            for seq, result in zip(sampled, results, strict=True):
                completion = self._seq_owner[seq.seq_id]
                self._append(completion, result, now)
                touched[seq.request_id] = self._requests[seq.request_id]
        for request in touched.values():
            outputs.append(self._collect(request))
        self._account_step(batch, prefill_tokens, time.perf_counter() - started)
        return outputs

    def _append(self, completion: _Completion, result: SampleResult, now: float) -> None:
        seq = completion.seq
        token_id = int(result.token_id)
        seq.append_token(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        completion.new_token_ids.append(token_id)
        if seq.params.logprobs is not None and result.logprob is not None:
            if completion.new_logprobs is None:
                completion.new_logprobs = []
            completion.new_logprobs.append(result.logprob)
        self._stats.generation_tokens += 1
        reason = self._postprocess(completion, token_id, result)
        if reason is not None:
            seq.finished_time = now
            self.scheduler.finish(seq, reason)

    def _postprocess(
        self, completion: _Completion, token_id: int, result: SampleResult
    ) -> FinishReason | None:
        """Detokenize the new token, emit its text and decide whether the stream stops here."""
        seq, params = completion.seq, completion.seq.params
        if (token_id in self.eos_token_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            # The stop token's own text is never emitted; release what was held back before it.
            self._emit(completion, completion.detokenizer.flush(), final=True)
            return FinishReason.STOP
        if self._emit(completion, completion.detokenizer.add(token_id)):
            return FinishReason.STOP
        if result.terminated:
            reason = FinishReason.STOP
        elif seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.max_model_len:
            reason = FinishReason.LENGTH
        else:
            return None
        if self._emit(completion, completion.detokenizer.flush(), final=True):
            return FinishReason.STOP
        return reason

    @staticmethod
    def _emit(completion: _Completion, text: str, final: bool = False) -> bool:
        """Queue ``text`` for the next delta through the stop-string matcher; True if a stop string hit."""
        matcher = completion.stop_matcher
        if matcher is None:
            if text:
                completion.new_text.append(text)
            return False
        match = matcher.feed(text)
        completion.new_text.append(match.text)
        if match.stop is not None:
            return True
        if final:
            completion.new_text.append(matcher.flush())
        return False

    def _collect(self, request: _Request) -> RequestDelta:
        if request.finished:
            return self._finish_request(request)
        return RequestDelta(request.request_id, self._drain(request))

    def _drain(self, request: _Request) -> list[CompletionDelta]:
        deltas = []
        for c in request.completions:
            finish = None
            if c.seq.is_finished and not c.reported_finish:
                if c.seq.finish_reason is None:
                    raise RuntimeError(f"sequence {c.seq.seq_id} is finished without a finish reason")
                finish = c.seq.finish_reason.value
            if not c.new_token_ids and finish is None:
                continue
            deltas.append(CompletionDelta(c.seq.index, c.new_token_ids, "".join(c.new_text),
                                          c.new_logprobs, finish))
            c.new_token_ids, c.new_text, c.new_logprobs = [], [], None
            c.reported_finish = c.reported_finish or finish is not None
        return deltas

    def _finish_request(self, request: _Request) -> RequestDelta:
        completions = self._drain(request)
        del self._requests[request.request_id]
        seqs = [c.seq for c in request.completions]
        for seq in seqs:
            self._seq_owner.pop(seq.seq_id, None)
        first = seqs[0]
        usage = Usage(
            prompt_tokens=len(request.prompt_token_ids),
            cached_tokens=first.num_cached_tokens or 0,
            completion_tokens=sum(s.num_output_tokens for s in seqs),
            cache_write_tokens=sum(s.num_cache_write_tokens for s in seqs),
            cache_pinned_tokens=first.num_cache_pinned_tokens,
            cache_retained_tokens=first.num_cache_retained_tokens,
            cached_host_tokens=first.num_cached_host_tokens,
            cached_disk_tokens=first.num_cached_disk_tokens,
        )
        timings = self._timings(request, seqs)
        counts = self._stats.num_requests_finished
        for seq in seqs:
            name = (seq.finish_reason or FinishReason.ABORT).value
            counts[name] = counts.get(name, 0) + 1
        if timings.ttft > 0:
            self._stats.ttft_s = _ewma(self._stats.ttft_s, timings.ttft)
        reasons = [(s.finish_reason or FinishReason.ABORT).value for s in seqs]
        return RequestDelta(request.request_id, completions, True, reasons, usage, timings,
                            request.completions[0].embedding)

    @staticmethod
    def _timings(request: _Request, seqs: list[Sequence]) -> Timings:
        arrival = request.arrival_time
        end = max((s.finished_time for s in seqs if s.finished_time is not None), default=time.monotonic())
        scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
        first_tokens = [s.first_token_time for s in seqs if s.first_token_time is not None]
        queued = (min(scheduled) if scheduled else end) - arrival
        ttft = (min(first_tokens) - arrival) if first_tokens else 0.0
        longest = max(s.num_output_tokens for s in seqs)
        tpot = (end - min(first_tokens)) / (longest - 1) if first_tokens and longest > 1 else 0.0
        return Timings(queued=queued, ttft=ttft, tpot=tpot, e2e=end - arrival)

    # ---- stats ----------------------------------------------------------------------------------
    def _account_step(self, batch: ScheduledBatch, prefill_tokens: int, elapsed: float) -> None:
        stats = self._stats
        stats.num_steps += 1
        stats.computed_decode_tokens += batch.num_tokens - prefill_tokens
        stats.step_time_s = _ewma(stats.step_time_s, elapsed)
        if elapsed > 0:
            stats.tokens_per_s = _ewma(stats.tokens_per_s, batch.num_tokens / elapsed)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters (a new object; safe to hand to other threads)."""
        s = self._stats
        sched, bm = self.scheduler, self.kv.blocks
        pending_prefill = 0
        by_priority: dict[int, int] = {}
        for request in self._requests.values():
            for c in request.completions:
                seq = c.seq
                if not seq.is_finished and seq.num_computed_tokens < seq.num_prompt_tokens:
                    left = seq.num_prompt_tokens - seq.num_computed_tokens
                    pending_prefill += left
                    by_priority[seq.priority] = by_priority.get(seq.priority, 0) + left
        return EngineStats(
            num_waiting=sched.num_waiting,
            num_running=sched.num_running,
            pending_prefill_tokens=pending_prefill,
            pending_prefill_tokens_by_priority=by_priority,
            num_kv_blocks=bm.num_blocks,
            num_free_kv_blocks=bm.num_free_blocks,
            kv_usage=bm.usage,
            num_steps=s.num_steps,
            num_preemptions=sched.num_preemptions,
            num_fairness_preemptions=sched.num_fairness_preemptions,
            num_partial_prefill_chunks=sched.num_partial_prefill_chunks,
            computed_prefill_tokens=sched.computed_prefill_tokens,
            computed_decode_tokens=s.computed_decode_tokens,
            prefix_query_tokens=bm.prefix_queries_tokens,
            prefix_hit_tokens=bm.prefix_hit_tokens,
            prefix_hit_tokens_by_tier=dict(bm.hit_tokens_by_tier),
            **self.kv.tier_stats(),
            prompt_tokens=s.prompt_tokens,
            generation_tokens=s.generation_tokens,
            num_requests_finished=dict(s.num_requests_finished),
            step_time_s=s.step_time_s,
            tokens_per_s=s.tokens_per_s,
            ttft_s=s.ttft_s,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def _ewma(previous: float, value: float) -> float:
    return value if previous == 0.0 else previous + _EWMA * (value - previous)
