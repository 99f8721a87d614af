"""Output processing: each stream's new tokens become text deltas, stop decisions and, at the end, the
request's final record (usage and timings).

``OutputProcessor`` holds the requests in flight, with per stream an incremental detokenizer and a
stop-string matcher. The engine hands it every token it learns (``token``), in order, after the
step that sampled it ran; in the overlapped loop that is while the next step computes, so none of this
is on the device's critical path. Invariants:

- Stop checks run after each appended token in this order: eos (unless ``ignore_eos``),
  ``stop_token_ids``, stop strings (the text is cut before the stop string, held back while a stop
  string may still be forming), grammar terminated, ``max_tokens``, ``max_model_len``.
  Stop tokens stay in ``token_ids`` and count as completion tokens; their text is never emitted.
- A token that arrives for a stream already finished (the one extra token the overlapped loop computed
  after the stop it had not seen yet, or after an abort) is never appended: not emitted, not counted,
  not billed (the engine drops it before it gets here).
- Usage counts the prompt once for ``n > 1``; ``cached_tokens`` is the first stream's
  ``num_cached_tokens`` (set when it first started, never changed by preemption).
- Each request's delta of a step carries what its streams gained since the last one; the finished
  delta carries usage, timings, finish reasons and (an embedding request) the vector.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import CompletionDelta, EngineStats, RequestDelta, Timings
from engine.sampler import Logprob
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, SequenceStatus
from engine.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from engine.usage import TokenKind, Usage

_EWMA = 0.1


@dataclass(eq=False, slots=True)
class Completion:
    """Postprocessing state of one stream: detokenizer, stop-string matcher, what was emitted."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher | None
    request: Request | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: list[str] = field(default_factory=list)
    new_logprobs: list | None = None
    reported_finish: bool = False
    embedding: list[float] | None = None
    new_prompt_logprobs: list[Any] | None = None


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    completions: list[Completion]

    @property
    def finished(self) -> bool:
        for c in self.completions:
            if c.seq.status is not SequenceStatus.FINISHED:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: frozenset[int], max_model_len: int,
                 stats: EngineStats) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.stats = stats
        self.requests: dict[str, Request] = {}
        self._completion_of: dict[int, Completion] = {}  # by seq_id
        self._touched: dict[str, Request] = {}  # requests with something for their next delta

    def add(self, request_id: str, prompt: list[int], params: SamplingParams, seqs: list[Sequence],
            arrival_time: float) -> None:
        completions = []
        for seq in seqs:
            matcher = StopStringMatcher(params.stop) if params.stop else None
            detok = IncrementalDetokenizer(self.tokenizer, prompt,
                                           skip_special_tokens=params.skip_special_tokens)
            completion = Completion(seq, detok, matcher)
            completions.append(completion)
            self._completion_of[seq.seq_id] = completion
        request = Request(request_id, prompt, params, arrival_time, completions)
        for completion in completions:
            completion.request = request
        self.requests[request_id] = request

    def request_of(self, seq: Sequence) -> Request:
        return self.requests[seq.request_id]

    # ---- tokens -----------------------------------------------------------------------------------
    def token(self, seq: Sequence, token_id: int, logprob: Logprob | None, terminated: bool,
              now: float) -> FinishReason | None:
        """The stream's newest token (already in ``seq.token_ids``): detokenize it, queue its text and
        logprob for the next delta, and decide whether the stream stops here (``terminated``: its grammar
        is complete). Called once per token of every stream: kept flat."""
        completion = self._completion_of[seq.seq_id]
        self._touched[seq.request_id] = completion.request  # type: ignore[assignment]
        if seq.first_token_time is None:
            seq.first_token_time = now
        completion.new_token_ids.append(token_id)
        params = seq.params
        if logprob is not None and params.logprobs is not None:
            if completion.new_logprobs is None:
                completion.new_logprobs = []
            completion.new_logprobs.append(logprob)
        self.stats.generation_tokens += 1
        if (token_id in self.eos_token_ids and not params.ignore_eos) or (
            params.stop_token_ids and token_id in params.stop_token_ids
        ):
            # The stop token's own text is never emitted; release what was held back before it.
            self._emit(completion, completion.detokenizer.flush(), final=True)
            return FinishReason.STOP
        text = completion.detokenizer.add(token_id)
        if completion.stop_matcher is None:
            if text:
                completion.new_text.append(text)
        elif self._emit(completion, text):
            return FinishReason.STOP
        num_tokens = len(seq.token_ids)
        if terminated:
            reason = FinishReason.STOP
        elif num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        else:
            return None
        if self._emit(completion, completion.detokenizer.flush(), final=True):
            return FinishReason.STOP
        return reason

    def prompt_logprobs(self, seq: Sequence, records: list[Any]) -> None:
        """The stream's prompt, scored: sent with its next delta."""
        completion = self._completion_of[seq.seq_id]
        completion.new_prompt_logprobs = records
        self._touched[seq.request_id] = completion.request  # type: ignore[assignment]

    def embedding(self, seq: Sequence, vector: list[float]) -> None:
        completion = self._completion_of[seq.seq_id]
        completion.embedding = vector
        self._touched[seq.request_id] = completion.request  # type: ignore[assignment]

    @staticmethod
    def _emit(completion: Completion, text: str, final: bool = False) -> bool:
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

    # ---- deltas -----------------------------------------------------------------------------------
    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> RequestDelta | None:
        """End a request now (its streams already freed by the scheduler): its final delta, ``reason``
        (``abort``) for every stream that had not finished. None if it is not in flight."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        now = time.monotonic()
        for completion in request.completions:
            seq = completion.seq
            if not seq.is_finished:
                seq.status = SequenceStatus.FINISHED
                seq.finish_reason = reason
                seq.finished_time = now
        return self.finish(request)

    def deltas(self) -> list[RequestDelta]:
        """The delta of every request that gained something since the last call."""
        touched, self._touched = self._touched, {}
        return [self.collect(request) for request in touched.values()]

    def collect(self, request: Request) -> RequestDelta:
        """What the request's streams gained since its last delta (its final delta once all finished)."""
        completions = request.completions
        if len(completions) == 1:  # most requests: n = 1
            c = completions[0]
            if c.seq.status is SequenceStatus.FINISHED:
                return self.finish(request)
            delta = CompletionDelta(c.seq.index, c.new_token_ids, "".join(c.new_text), c.new_logprobs, None,
                                    c.new_prompt_logprobs)
            c.new_token_ids, c.new_text, c.new_logprobs, c.new_prompt_logprobs = [], [], None, None
            keep = delta.token_ids or delta.prompt_logprobs is not None
            return RequestDelta(request.request_id, [delta] if keep else [])
        if request.finished:
            return self.finish(request)
        return RequestDelta(request.request_id, self._drain(request))

    def _drain(self, request: Request) -> list[CompletionDelta]:
        deltas = []
        for c in request.completions:
            finish = None
            if c.seq.is_finished and not c.reported_finish:
                if c.seq.finish_reason is None:
                    raise RuntimeError(f"sequence {c.seq.seq_id} is finished without a finish reason")
                finish = c.seq.finish_reason.value
            if not c.new_token_ids and finish is None and c.new_prompt_logprobs is None:
                continue
            deltas.append(CompletionDelta(c.seq.index, c.new_token_ids, "".join(c.new_text),
                                          c.new_logprobs, finish, c.new_prompt_logprobs))
            c.new_token_ids, c.new_text, c.new_logprobs, c.new_prompt_logprobs = [], [], None, None
            c.reported_finish = c.reported_finish or finish is not None
        return deltas

    def finish(self, request: Request) -> RequestDelta:
        """The final delta of a finished request (usage, timings, reasons); forgets the request."""
        completions = self._drain(request)
        del self.requests[request.request_id]
        self._touched.pop(request.request_id, None)
        seqs = [c.seq for c in request.completions]
        for seq in seqs:
            self._completion_of.pop(seq.seq_id, None)
        first = seqs[0]
        usage = Usage({
            TokenKind.INPUT: len(request.prompt_token_ids),
            TokenKind.CACHED_INPUT: first.num_cached_tokens or 0,
            TokenKind.OUTPUT: sum(s.num_output_tokens for s in seqs),
            TokenKind.CACHE_WRITE: sum(s.num_cache_write_tokens for s in seqs),
            TokenKind.CACHE_PINNED: first.num_cache_pinned_tokens,
            TokenKind.CACHE_RETAINED: first.num_cache_retained_tokens,
            TokenKind.CACHED_HOST: first.num_cached_host_tokens,
            TokenKind.CACHED_DISK: first.num_cached_disk_tokens,
            TokenKind.ACCEPTED_PREDICTION: sum(s.num_accepted_prediction_tokens for s in seqs),
            TokenKind.REJECTED_PREDICTION: sum(s.num_rejected_prediction_tokens for s in seqs),
        })
        timings = _timings(request, seqs)
        counts = self.stats.num_requests_finished
        for seq in seqs:
            name = (seq.finish_reason or FinishReason.ABORT).value
            counts[name] = counts.get(name, 0) + 1
        if timings.ttft > 0:
            self.stats.ttft_s = ewma(self.stats.ttft_s, timings.ttft)
        reasons = [(s.finish_reason or FinishReason.ABORT).value for s in seqs]
        kv_pull = None
        if first.kv_pull:
            kv_pull = {"pulled_tokens": max(s.num_cached_remote_tokens for s in seqs),
                       "error": next((s.kv_pull_error for s in seqs if s.kv_pull_error), None)}
        return RequestDelta(request.request_id, completions, True, reasons, usage, timings,
                            request.completions[0].embedding, first.kv_lease, kv_pull)


def _timings(request: Request, seqs: list[Sequence]) -> Timings:
    arrival = request.arrival_time
    end = max((s.finished_time for s in seqs if s.finished_time is not None), default=time.monotonic())
    scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
    first_tokens = [s.first_token_time for s in seqs if s.first_token_time is not None]
    queued = (min(scheduled) if scheduled else end) - arrival
    ttft = (min(first_tokens) - arrival) if first_tokens else 0.0
    longest = max(s.num_output_tokens for s in seqs)
    tpot = (end - min(first_tokens)) / (longest - 1) if first_tokens and longest > 1 else 0.0
    return Timings(queued=queued, ttft=ttft, tpot=tpot, e2e=end - arrival)


def ewma(previous: float, value: float) -> float:
    """An exponentially weighted moving average's next value (the first value taken as is)."""
    return value if previous == 0.0 else previous + _EWMA * (value - previous)
