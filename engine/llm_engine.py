"""The engine loop: requests in, token deltas out.

``LLMEngine`` composes the tokenizer, the ``Scheduler`` (which owns the ``KVCache``), the ``ModelRunner``
(weights, KV pool, device work), the ``Sampler`` and the ``OutputProcessor``. ``step()`` reads schedule →
run → postprocess:

1. ``scheduler.schedule()``: the batch of step N+1 (with the tier copies it needs);
2. ``runner.forward(batch)`` and ``runner.sample(...)``: its inputs built on the host and its device work
   submitted; ``scheduler.update_after_step`` advances the sequences (each that samples gets a *pending*
   token: its id stays on the device, where step N+2's forward pass reads it);
3. the tokens of step N, sampled on the device while the host did 1 and 2, are learned (one copy) and
   postprocessed: appended, detokenized, stop-checked, streamed, finished.

This is the overlapped loop (``config.overlap``, default): the host schedules, prepares and
postprocesses while the device computes, and a step costs about max(host, device) instead of their
sum. With ``overlap=False`` step 3 processes the step just launched (the synchronous loop). Greedy and
seeded sampling give identical outputs either way (unseeded draws share the engine's generator, so they
depend on what else is in each step's batch, as they always did):

- A stream that stops at step N on something only its token shows (eos, a stop token or string, its
  grammar, an abort) was already scheduled for step N+1: that step computes one extra token for it, which
  is dropped when it comes back (never appended, emitted, billed, hashed into the prefix cache or written
  to a tier), and its blocks are freed at the stop (the device runs N+1 before any later step reuses
  them). One whose pending token is its ``max_tokens``-th is not scheduled again.
- Structured output needs the previous token on the host: a grammar matcher must accept it before the
  next token's mask is computed. A step with a constrained row whose previous token is still pending
  first processes the previous step (after submitting its own forward pass, which therefore still
  overlaps), then fills the masks and submits its sampling. Only such steps wait; the others do not. A
  step that carries drafts processed the previous step before drafting (drafts continue known tokens),
  so a constrained sequence's matcher can walk its drafts when the masks are filled.
- Penalties count tokens on the device (``engine.sampler``), seeded noise depends on the position only,
  and nothing else in sampling reads a token on the host.

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
- Stop checks and usage: ``engine.output_processor``.
- An embedding request (``pooling``, ``engine.pooling``) is never sampled: it finishes (``stop``, zero
  completion tokens) with the step its last prompt chunk runs in, with ``RequestDelta.embedding``.
- Disaggregated serving (``config.role``, ``engine.kv.connector``): a ``prefill`` replica serves each
  request as one completion of one token (``n = 1``, ``max_tokens = 1``) and leases its prompt's blocks
  (the final delta's ``kv_transfer``); a ``decode`` replica takes requests naming such a lease
  (``kv_source``), admits them once their blocks arrived, and steps the others meanwhile; an empty step
  with pulls under way waits for one. ``housekeeping`` ends delivered and expired leases between steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence as SequenceLike
from functools import partial
from pathlib import Path

import numpy as np

from engine.config import EngineConfig
from engine.grammar import GrammarBackend
from engine.kv.block_hash import adapter_cache_salt
from engine.kv.cache import KVCache
from engine.kv.connector import KVConnector, RemoteKV
from engine.kv.events import KVEventLog
from engine.kv.pins import DEFAULT_POLICY, CachePolicy
from engine.lora.registry import HostAdapters, LoRARequest
from engine.model_runner import ModelRunner, Step
from engine.output_processor import OutputProcessor, ewma
from engine.outputs import EngineStats, RequestDelta, RequestValidationError
from engine.pooling import PoolingParams
from engine.sampler import HostSampled, Logprob, Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import FinishReason, ScheduledBatch, Sequence, SequenceStatus
from engine.speculative import PredictionProposer, SpeculationPolicy, accepted_prefix, speculates
from engine.step_profile import StepProfile
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = Tokenizer.from_pretrained(config.model)
        self.runner = ModelRunner(config)
        self.kv_events = KVEventLog()  # what every tier of the prefix cache holds, in order
        self.kv = KVCache.create(config, self.runner.num_kv_blocks, self.runner.kv_transfer, self.kv_events)
        self.scheduler = Scheduler(config, self.kv)
        self.connector: KVConnector | None = None
        if config.role != "both":
            worker = self.runner.kv_remote
            assert worker is not None
            self.connector = KVConnector(
                config.role, self.kv.blocks, worker, lease_s=config.kv_lease_s,
                failure=config.kv_transfer_failure, timeout_s=config.kv_transfer_timeout_s,
                host=config.kv_transfer_host, port=config.kv_transfer_port,
                advertise_host=config.kv_transfer_advertise_host,
                chunk_blocks=config.kv_transfer_chunk_blocks)
            self.kv.attach(self.connector)
        self.adapters = HostAdapters(self.runner.args, slots=config.max_loras, max_rank=config.max_lora_rank,
                                     capacity=config.max_cpu_loras)
        self.vocab_size: int = self.runner.vocab_size
        self.eos_token_ids: frozenset[int] = frozenset(self.runner.eos_token_ids)
        self.sampler = Sampler(self.vocab_size, self._grammar_backend(), seed=config.seed,
                               num_slots=config.max_num_seqs)
        kv_capacity = self.runner.num_kv_blocks * config.block_size
        self.max_model_len: int = min(config.max_model_len or self.runner.max_model_len, kv_capacity)
        if self.max_model_len < (config.max_model_len or self.runner.max_model_len):
            logger.warning(
                "max_model_len capped at %d tokens: the KV pool (%d blocks of %d) holds no more",
                self.max_model_len, self.runner.num_kv_blocks, config.block_size,
            )
        self._stats = EngineStats(num_kv_blocks=self.runner.num_kv_blocks)
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len, self._stats)
        # Deltas produced outside step() (aborts), returned by the next step().
        self._pending: list[RequestDelta] = []
        # The step launched last whose tokens are not processed yet (the overlapped loop).
        self._in_flight: Step | None = None
        self.profile = StepProfile()
        self.speculation = SpeculationPolicy.from_config(config)

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
        """Finish the disk tier's queued writes (a restart finds every block demoted so far); stop serving
        and pulling KV blocks."""
        if self.connector is not None:
            self.connector.close()
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
        prediction: SequenceLike[int] | None = None,
        lora: LoRARequest | None = None,
        kv_source: RemoteKV | None = None,
    ) -> None:
        """Queue a request (``params.n`` streams; with ``pooling``, one embedding and no tokens; its
        prompt-cache lifetimes in ``cache_policy``; ``prediction``: the output it is expected to be,
        mostly, as token ids: drafts for speculative decoding; ``lora``: the adapter its tokens run
        through; ``kv_source``: on a decode replica, the prefill replica's lease on its prompt's blocks).
        Raises ``RequestValidationError``, changing nothing."""
        if request_id in self.outputs.requests:
            raise RequestValidationError(f"request_id {request_id!r} is already in flight", "request_id")
        self.validate_kv_source(kv_source)
        if self.config.role == "prefill" and pooling is None:
            params = dataclasses.replace(params, n=1, max_tokens=1)  # the first token; decode does the rest
        self.validate_request(request_id, prompt_token_ids, params)
        predicted = self.validate_prediction(prediction)
        adapter = self.adapters.get(lora) if lora is not None else None
        if adapter is not None:
            # The prefix cache never shares blocks across adapters: their K/V differ. Keyed by the
            # adapter's contents, so a bundle replaced under the same name never meets the old blocks.
            cache_salt = adapter_cache_salt(cache_salt, adapter.digest)
        if pooling is not None:
            if params.n != 1:
                raise RequestValidationError("an embedding request has exactly one completion (n = 1)", "n")
            if not pooling.uses_prefix_cache:
                # Every prompt token's hidden state is needed: nothing is looked up in the prefix cache,
                # nothing registered (a preempted one then recomputes from its first token).
                cache_policy = CachePolicy(prefix_tokens=0)
        prompt = [int(t) for t in prompt_token_ids]
        try:
            self.sampler.prepare(params)
        except ValueError as e:
            raise RequestValidationError(str(e), "response_format") from e
        now = time.monotonic() if arrival_time is None else arrival_time
        seqs = [
            Sequence(request_id=request_id, token_ids=list(prompt), params=params, priority=priority,
                     tenant=tenant, cache_salt=cache_salt, arrival_time=now, index=index, pooling=pooling,
                     cache_policy=cache_policy, lora=adapter)
            for index in range(params.n)
        ]
        if self.speculation is not None and pooling is None and speculates(params):
            tokenizer = self.tokenizer
            token_bytes = None if tokenizer is None else tokenizer.token_bytes
            encode = None if tokenizer is None else partial(tokenizer.encode, add_special_tokens=False)
            for seq in seqs:
                seq.speculation = self.speculation.state(predicted, token_bytes=token_bytes, encode=encode)
        self.outputs.add(request_id, prompt, params, seqs, now)
        for seq in seqs:
            self.scheduler.add(seq)
        self._stats.prompt_tokens += len(prompt)
        if lora is not None:
            self.adapters.count_request(lora.name)
        if kv_source is not None and self.connector is not None:
            for seq in seqs:
                seq.kv_pull = True
            if pooling is None and params.prompt_logprobs is None:  # (scoring reads no cached block)
                self.connector.start_pull(seqs[0], kv_source)

    def validate_kv_source(self, kv_source: RemoteKV | None) -> None:
        """``RequestValidationError`` (param ``kv_transfer``) if this replica does not pull. Thread-safe."""
        if kv_source is not None and self.config.role != "decode":
            raise RequestValidationError(
                f"this replica's role is {self.config.role}: only a decode replica pulls KV blocks",
                "kv_transfer")

    def validate_prediction(self, prediction: SequenceLike[int] | None) -> list[int] | None:
        """The prediction as token ids; ``RequestValidationError`` (param ``prediction``) if it cannot be
        one. Thread-safe."""
        if prediction is None:
            return None
        tokens = list(prediction)
        bad = next((t for t in tokens if not (_is_int(t) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise RequestValidationError(
                f"prediction token id {bad!r} is not an integer in the vocabulary [0, {self.vocab_size})",
                "prediction")
        if len(tokens) > self.max_model_len:
            raise RequestValidationError(
                f"the prediction has {len(tokens)} tokens, more than this model's context "
                f"({self.max_model_len})", "prediction")
        return [int(t) for t in tokens]

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. Its final delta (``abort``) comes with the next
        ``step()``. Returns False if the request is unknown or already finished."""
        if request_id not in self.outputs.requests:
            return False
        self.scheduler.abort(request_id)
        delta = self.outputs.abort(request_id)
        if delta is not None:
            self._pending.append(delta)
        return True

    def abort_all(self) -> list[str]:
        """Abort every request and drop undelivered deltas and the step in flight (after a failed
        step). Returns their ids."""
        request_ids = list(self.outputs.requests)
        for request_id in request_ids:
            self.abort(request_id)
        self._in_flight = None
        self.discard_pending()
        return request_ids

    def discard_pending(self) -> None:
        """Drop the deltas queued for the next ``step()`` (aborts nobody will read)."""
        self._pending.clear()

    def has_unfinished(self) -> bool:
        return bool(self.outputs.requests) or bool(self._pending) or self._in_flight is not None

    @property
    def num_requests(self) -> int:
        return len(self.outputs.requests)

    # ---- the loop -------------------------------------------------------------------------------
    def step(self) -> list[RequestDelta]:
        """Schedule and launch one step; return what every request gained from the step before it (the
        overlapped loop) or from this one (``overlap=False``), and the aborts since the last call."""
        outputs, self._pending = self._pending, []
        profile = self.profile
        drafting = self._propose(outputs) if self.speculation is not None else []  # (profiled inside)
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        scheduled = time.perf_counter()
        profile.schedule_s += scheduled - started
        failed = self.connector.take_failures() if self.connector is not None else []
        if failed:
            for request_id, error in failed:  # pulls that failed, in ``fail`` mode
                self.scheduler.abort(request_id, FinishReason.ERROR)
                delta = self.outputs.abort(request_id, FinishReason.ERROR)
                if delta is not None:
                    logger.info("request %s failed: its KV pull failed (%s)", request_id, error)
                    outputs.append(delta)
        if not batch:
            for seq in drafting:
                seq.draft_token_ids = []
            self.runner.transfer(batch.transfers)
            self.runner.load_pulled(batch.kv_loads)
            if self._in_flight is not None:
                outputs.extend(self._process(self._take_in_flight()))
            elif self.kv.reading():
                self.kv.wait_for_read(timeout_s=0.05)  # every waiting prompt waits for the disk
            elif self.connector is not None and self.connector.pulling():
                self.connector.wait(timeout_s=0.05)  # every waiting prompt waits for its pull
            elif failed:
                pass  # requests ended before anything was scheduled (their pulls failed)
            elif self.scheduler.has_unfinished():
                # Every accepted request fits the KV pool alone, so an empty step with work left is a bug.
                raise RuntimeError("the scheduler scheduled nothing although requests are waiting")
            return outputs
        now = time.monotonic()
        prefill_tokens = 0
        verifying = False
        for item in batch.seqs:
            seq = item.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if item.start < seq.num_prompt_tokens:
                prefill_tokens += item.num_tokens
            verifying = verifying or item.num_draft > 0
        try:
            forward = self.runner.forward(batch)
        finally:
            for seq in drafting:  # drafts are drawn anew each step
                seq.draft_token_ids = []
        self.scheduler.update_after_step(batch)
        self.runner.transfer(batch.transfers_after)  # retained blocks, once the forward pass wrote them
        sampling = forward.inputs.sampling
        prepared = time.perf_counter()
        profile.prepare_s += prepared - scheduled
        if sampling is not None and sampling.structured:
            if self._in_flight is not None and any(sampling.seqs[i].num_pending_tokens > 1
                                                    for i in sampling.structured):
                outputs.extend(self._process(self._take_in_flight()))  # their matchers need its tokens
            self.sampler.fill_grammar(sampling)
        launched = self.runner.sample(forward, self.sampler)
        sampled = time.perf_counter()
        profile.sample_s += sampled - prepared
        previous, self._in_flight = self._in_flight, launched
        if previous is not None:
            outputs.extend(self._process(previous))
        if not self.config.overlap or verifying:
            # (A step that verifies drafts yields an unknown number of tokens: the next step needs them.)
            outputs.extend(self._process(self._take_in_flight()))
        self._account_step(batch, prefill_tokens, time.perf_counter() - started)
        return outputs

    def housekeeping(self) -> float | None:
        """Between steps of an idle engine: end delivered and expired leases, take in finished pulls.
        Returns the seconds until the next lease expires (None: no lease)."""
        if self.connector is None:
            return None
        self.connector.begin_step()
        return self.connector.next_expiry_s()

    # ---- speculative decoding -------------------------------------------------------------------
    def _propose(self, outputs: list[RequestDelta]) -> list[Sequence]:
        """Give the decoding sequences that speculate this step their drafts (``engine.speculative``).
        Drafts continue the known tokens: a step in flight is processed first."""
        policy = self.speculation
        assert policy is not None
        running = self.scheduler.running
        if not policy.active(len(running)):
            return []
        planned = [(seq, k) for seq in running if seq.speculation is not None
                   and seq.num_computed_tokens + seq.num_pending_tokens >= seq.num_prompt_tokens
                   and (k := policy.draft_length(seq.speculation)) > 0]
        if not planned:
            return []
        if self._in_flight is not None:  # drafts continue known tokens: this step gives up the overlap
            counters = self._stats.speculation
            counters["waits"] = counters.get("waits", 0) + 1
            outputs.extend(self._process(self._take_in_flight()))
        drafting = []
        for seq, k in planned:
            known = len(seq.token_ids)
            if seq.is_finished or seq.num_pending_tokens or seq.num_computed_tokens != known - 1:
                continue  # not a plain decode this step (finished, preempted, prefilling)
            room = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len) - known - 1
            k = min(k, room)  # the drafts and the token after them fit max_tokens and the context
            drafts = seq.speculation.proposer.propose(seq.token_ids, k) if k > 0 else []
            if drafts:
                seq.draft_token_ids = drafts
                drafting.append(seq)
        return drafting

    def _verify(self, step: Step, host: HostSampled, now: float) -> None:
        """Tokens of a step with drafts: per sequence, its drafts up to the first that differs from the
        token drawn at its position, then that drawn token; each through the usual stop checks. A
        constrained sequence's matcher accepts exactly those tokens, in order (the rows past them were
        masked from states it never reaches: ``GrammarBackend.fill_bitmask``)."""
        inputs, scheduler, outputs, sampler = step.inputs, self.scheduler, self.outputs, self.sampler
        assert inputs.sampling is not None
        seqs, ids, groups = inputs.sampled, host.token_ids, inputs.drafts
        logprobs, _ = sampler.extras(host, seqs, [])
        counters = self._stats.speculation
        row = 0
        while row < len(seqs):
            seq = seqs[row]
            drafts = groups.get(row, [])
            rows = len(drafts) + 1
            if seq.is_finished:
                row += rows
                continue
            accepted = accepted_prefix(drafts, ids[row:row + rows])
            structured = seq.params.structured
            emitted = 0
            for j in range(accepted + 1):
                token_id = ids[row + j]
                if j < accepted:
                    scheduler.draft_accepted(seq, token_id)
                else:
                    scheduler.token_known(seq, token_id)
                emitted += 1
                complete = structured and sampler.accept(seq, token_id)
                reason = outputs.token(seq, token_id, logprobs.get(row + j), complete, now)
                if reason is not None:
                    seq.finished_time = now
                    scheduler.finish(seq, reason)
                    break
            else:
                scheduler.drafts_verified(seq)
            speculation = seq.speculation
            if drafts and speculation is not None:
                speculation.record(len(drafts), accepted)
                counters["drafted_tokens"] = counters.get("drafted_tokens", 0) + len(drafts)
                counters["accepted_tokens"] = counters.get("accepted_tokens", 0) + accepted
            if speculation is not None and speculation.from_prediction:
                proposer = speculation.proposer
                assert isinstance(proposer, PredictionProposer)
                if drafts:  # by prediction position: each counted once, as accepted or as rejected
                    proposer.verified(len(drafts), min(accepted, emitted))
                    seq.num_accepted_prediction_tokens = proposer.num_accepted
                    seq.num_rejected_prediction_tokens = proposer.num_rejected
                proposer.observe(seq.output_token_ids, emitted)
            row += rows

    def _take_in_flight(self) -> Step:
        step, self._in_flight = self._in_flight, None
        assert step is not None
        return step

    def _process(self, step: Step) -> list[RequestDelta]:
        """A launched step's results, once on the host: tokens appended and postprocessed, embeddings
        delivered, streams finished; the deltas of the requests they touched. The tokens of streams that
        finished meanwhile are the extra ones, dropped."""
        profile = self.profile
        started = time.perf_counter()
        host, embeddings = step.result()
        now = time.monotonic()
        waited = time.perf_counter()
        profile.wait_s += waited - started
        scheduler, outputs = self.scheduler, self.outputs
        if step.inputs.prompt_rows:
            self._prompt_logprobs(step)
        for chunk, _, _ in step.inputs.pooled:
            seq = chunk.seq
            if chunk.samples and not seq.is_finished:
                outputs.embedding(seq, embeddings[seq.seq_id])
                seq.first_token_time = seq.finished_time = now
                scheduler.finish(seq, FinishReason.STOP)
        sampling = step.inputs.sampling
        if host is not None and sampling is not None and step.inputs.drafts:
            self._verify(step, host, now)
        elif host is not None and sampling is not None:
            seqs = step.inputs.sampled
            logprobs, terminated = self.sampler.extras(host, seqs, sampling.structured)
            token_known, token, finished = scheduler.token_known, outputs.token, SequenceStatus.FINISHED
            for i, (seq, token_id) in enumerate(zip(seqs, host.token_ids, strict=True)):
                if seq.status is finished:
                    continue  # the extra token of a stream that stopped (or was aborted) meanwhile
                token_known(seq, token_id)
                reason = token(seq, token_id, logprobs.get(i) if logprobs else None, i in terminated, now)
                if reason is not None:
                    seq.finished_time = now
                    scheduler.finish(seq, reason)
                elif seq.num_computed_tokens >= len(seq.token_ids):
                    scheduler.commit(seq)  # the block this token completes is computed already
                speculation = seq.speculation
                if speculation is not None and speculation.from_prediction:
                    speculation.proposer.observe(seq.output_token_ids, 1)
        deltas = outputs.deltas()
        profile.postprocess_s += time.perf_counter() - waited
        return deltas

    def _prompt_logprobs(self, step: Step) -> None:
        """Fold a step's prompt scores into their sequences (a chunk from position 0 starts afresh: a
        preempted sequence's recompute); a sequence whose whole prompt is scored hands it to its stream."""
        scores = step.prompt_scores()
        assert scores is not None
        chosen, ranks, values, ids = scores
        targets = step.inputs.prompt_targets
        assert targets is not None
        for chunk, first, rows in step.inputs.prompt_rows:
            seq = chunk.seq
            if seq.prompt_logprobs_done or seq.is_finished:
                continue
            if chunk.start == 0 or seq.prompt_logprobs is None:
                seq.prompt_logprobs = []
            k = seq.params.prompt_logprobs or 0
            for r in range(first, first + rows):
                top = ([] if values is None or ids is None
                       else list(zip(ids[r][:k], values[r][:k], strict=True)))
                seq.prompt_logprobs.append(Logprob(int(targets[r]), chosen[r], top, ranks[r]))
            if len(seq.prompt_logprobs) >= seq.num_prompt_tokens - 1:
                self.outputs.prompt_logprobs(seq, [None, *seq.prompt_logprobs])
                seq.prompt_logprobs, seq.prompt_logprobs_done = None, True

    # ---- stats ----------------------------------------------------------------------------------
    def _account_step(self, batch: ScheduledBatch, prefill_tokens: int, elapsed: float) -> None:
        stats = self._stats
        stats.num_steps += 1
        stats.computed_decode_tokens += batch.num_tokens - prefill_tokens
        stats.step_time_s = ewma(stats.step_time_s, elapsed)
        self.profile.num_steps += 1
        if elapsed > 0:
            stats.tokens_per_s = ewma(stats.tokens_per_s, batch.num_tokens / elapsed)

    def stats(self) -> EngineStats:
        """A snapshot of the engine's gauges and counters (a new object; safe to hand to other threads)."""
        s = self._stats
        sched, bm = self.scheduler, self.kv.blocks
        pending_prefill = 0
        by_priority: dict[int, int] = {}
        for request in self.outputs.requests.values():
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
            speculation=dict(s.speculation),
            kv_transfer=self.connector.stats() if self.connector is not None else {},
            lora=self.adapters.stats(self.runner.lora) if self.config.max_loras else None,
            step_time_s=s.step_time_s,
            tokens_per_s=s.tokens_per_s,
            ttft_s=s.ttft_s,
        )


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
