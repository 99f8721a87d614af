"""Per-request state shared by the scheduler, block manager, runner and sampler.

A ``Sequence`` is one generation stream (a request with ``n > 1`` owns ``n`` sequences that share the
prompt's blocks). Invariants:

- ``token_ids`` is the prompt followed by every generated token the host knows; ``num_prompt_tokens``
  never changes. ``num_pending_tokens`` more were sampled on the device and are not known yet
  (placeholders after ``token_ids``: the overlapped step loop learns a step's tokens one step later);
  ``num_tokens`` counts both. A pending token is known before anything reads its id on the host:
  stop checks, streaming, billing, block hashes.
- ``num_computed_tokens`` tokens have their K/V in the cache (blocks in ``block_table``), or will have
  once the steps launched so far have run (the device runs them in order); it only grows, except on
  preemption by recompute, which resets it (and ``block_table``) to zero.
- ``num_cached_tokens`` is the prompt tokens served from the prefix cache the first time the sequence
  started; set once, never changed by a preemption (recompute is the platform's cost, never billed).
- The scheduler hands the runner a ``ScheduledBatch``: for each sequence, how many of its tokens after
  ``num_computed_tokens`` to compute this step. A sequence whose chunk reaches ``num_tokens``
  produces logits for its last token and is sampled; a partial prefill chunk is not. An embedding
  sequence (``pooling``) produces no logits: its chunk's hidden states are pooled instead.

This module imports no torch.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.kv.pins import DEFAULT_POLICY, CachePolicy

if TYPE_CHECKING:
    from engine.pooling import PoolingParams
    from engine.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    tenant: str = ""
    cache_salt: str | None = None
    arrival_time: float = 0.0
    # Index of this stream inside its request (0..n-1).
    index: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    # Tokens sampled on the device whose ids the host does not know yet (they follow ``token_ids``).
    num_pending_tokens: int = 0
    num_cached_tokens: int | None = None
    # Of those, the ones loaded from the host tier and read from disk (the rest were on the device).
    num_cached_host_tokens: int = 0
    num_cached_disk_tokens: int = 0
    # Disaggregated serving (``engine.kv.connector``). Decode: whether the request pulls its prompt's
    # blocks from a prefill replica, the prompt tokens those pulled blocks served, and why a pull failed.
    # Prefill: where the lease on its prompt's blocks is (the final record's ``kv_transfer``).
    kv_pull: bool = False
    num_cached_remote_tokens: int = 0
    kv_pull_error: str | None = None
    kv_lease: dict[str, Any] | None = None
    # Prompt tokens this sequence newly wrote into the prefix cache (the full prompt blocks it registered
    # on its first admission; recompute after a preemption is not counted).
    num_cache_write_tokens: int = 0
    # Its prompt-cache lifetimes (``engine.kv.pins``) and what they applied: prompt tokens pinned in the
    # host tier for the ttl, and retained on disk.
    cache_policy: CachePolicy = DEFAULT_POLICY
    cache_lifetimes_applied: bool = False
    num_cache_pinned_tokens: int = 0
    num_cache_retained_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # Per-token logprob records produced by the sampler (engine-defined objects).
    logprobs: list[Any] = field(default_factory=list)
    # Sampler-owned state (e.g. a grammar matcher); opaque to everyone else.
    sampler_state: Any = None
    # Speculative decoding (``engine.speculative``): its proposer and acceptance (None: never drafts),
    # the draft tokens of the step being scheduled, and the prediction tokens drafted so far that made
    # it into the output (accepted) or did not (rejected: computed and thrown away).
    speculation: Any = None
    draft_token_ids: list[int] = field(default_factory=list)
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    # An embedding request (``engine.pooling``): prefilled, never sampled. ``pooled`` is the runner's
    # running state of it (a device tensor); cleared on preemption.
    pooling: PoolingParams | None = None
    pooled: Any = None
    # ``params.prompt_logprobs``: the records of the prompt positions computed so far (position ``p``'s
    # logits scoring token ``p + 1``), until all ``num_prompt_tokens - 1`` are in and delivered (``None``).
    prompt_logprobs: list[Any] | None = None
    prompt_logprobs_done: bool = False
    # The LoRA adapter its tokens run through (``engine.lora.adapter.LoRAAdapter``); None: the base model.
    lora: Any = None
    # Timing marks (monotonic seconds), filled by the engine.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens known on the host (pending ones are not counted until they are)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those still pending on the device."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's chunk of a step: tokens ``start .. start + num_tokens`` are computed, ``start`` being
    its ``num_computed_tokens`` when the step was scheduled (with ``num_draft`` draft tokens, the last
    known token and the drafts). ``samples``: the chunk reaches the end of its tokens (pending ones
    included), so the step yields a new token (with drafts, 1 to ``num_draft + 1`` of them)."""

    seq: Sequence
    num_tokens: int
    # Of ``num_tokens``, the last ``num_draft`` are draft tokens (``seq.draft_token_ids``), verified here.
    num_draft: int = 0
    start: int = field(init=False)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        seq = self.seq
        self.start = start = seq.num_computed_tokens
        self.samples = start + self.num_tokens - self.num_draft == len(seq.token_ids) + seq.num_pending_tokens

    def add_drafts(self, num_draft: int) -> None:
        """Verify the first ``num_draft`` of the sequence's draft tokens in this (decode) chunk."""
        self.num_tokens += num_draft
        self.num_draft += num_draft

    def extend(self, extra: int) -> None:
        """Compute ``extra`` more tokens of the sequence in this chunk."""
        self.num_tokens += extra
        self.samples = self.start + self.num_tokens - self.num_draft == self.seq.num_tokens


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    # Sequences preempted (by recompute) while building this step, for counters and logs.
    preempted: list[Sequence] = field(default_factory=list)
    # Copies between KV tiers (``engine.kv.tiers.TransferPlan``) the runner makes before the forward pass,
    # and those that committing the step asked for (retained blocks), made after it. None: nothing.
    transfers: Any = None
    transfers_after: Any = None
    # Blocks pulled from a prefill replica, copied into these device blocks before the forward pass:
    # (device block, payload) (``engine.kv.connector``).
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)
