"""The persistent batch: per-slot state of the running sequences, and one step's inputs gathered from it.

Each sequence the model runner sees takes a *slot* (``max_num_seqs`` of them) and keeps it while it
runs. A slot's row holds what does not change from token to token, in preallocated numpy arrays:

- its block table, copied when the sequence takes the slot and then only *grown*: the block manager
  appends blocks to ``seq.block_table`` in place, and the row copies the new entries (a table replaced
  after a preemption is copied again);
- its sampling parameters as numbers (``engine.sampler.param_row``), written once.

``build(batch)`` turns a ``ScheduledBatch`` into ``StepInputs``: per sequence it reads a few integers
(its slot, chunk start and length, the input ids of a prefill chunk or the one known id of a decode),
and everything else (positions, slot mapping, context lengths, query offsets, block tables, the
sampled rows' parameters) comes from vectorised numpy over the slots, not from Python lists per token.

A decode whose input token is still *pending* (sampled by the previous step, not known on the host:
the overlapped loop) gets a placeholder id, and ``pending_rows`` / ``pending_sources`` say which row of
the previous step's sampled ids to put there, on the device, before the forward pass.

A sequence with ``k`` draft tokens (speculative decoding: ``engine.speculative``) brings its last known
token and the drafts, and gets ``k + 1`` logits rows: one per position that yields a token, each sampled
like an ordinary decode at that position (``drafts`` says which rows verify which drafts).

Slots are never released explicitly: a slot whose sequence finished or went back to waiting
(preempted) is reclaimed when a new sequence needs one and none is free. A sequence that kept its slot
while waiting finds it again, its block table copied anew; one that lost it gets a new slot. A
penalised sequence's token counts (kept on the device per slot) are rebuilt from its known tokens with
the first row it samples in a new slot (``SamplingInputs.init``), whatever ran there before.

Invariants checked here (``ValueError``, before anything touches the device): a chunk is at least one
token and lies within the sequence's tokens and ``max_model_len``; the block table covers it; every block
id is in ``[0, num_kv_blocks)``.

Pure numpy (the runner turns the arrays into tensors).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.sampler import PARAM_COLUMNS, Sampler, SamplingInputs, param_row, penalised
from engine.sequence import ScheduledBatch, ScheduledSeq, Sequence, SequenceStatus


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs (host arrays) and what the runner must know of its sequences."""

    input_ids: np.ndarray  # [T] int64 (0 where pending)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32
    block_tables: np.ndarray  # [B, max_blocks] int32, padded with 0
    logits_indices: np.ndarray  # [N] int64: the token row of each sampled sequence
    pending_rows: np.ndarray  # [P] int64: token rows whose id is the previous step's sample ...
    pending_sources: np.ndarray  # [P] int64: ... at these rows of its sampled ids
    query_lens: list[int]
    context_lens: list[int]
    sampled: list[Sequence]  # one per logits row, in batch order (a sequence with k drafts: k + 1 rows)
    sampling: SamplingInputs | None
    drafts: dict[int, list[int]] = field(default_factory=dict)  # first row of a group -> its drafts
    pooled: list[tuple[ScheduledSeq, int, int]] = field(default_factory=list)  # (chunk, first row, rows)
    # Prompt log-probabilities: (chunk, first logits row after the sampled ones, rows); row ``j`` of a chunk
    # holds position ``chunk.start + j``'s logits, scored against ``prompt_targets`` (the next prompt token).
    prompt_rows: list[tuple[ScheduledSeq, int, int]] = field(default_factory=list)
    prompt_targets: np.ndarray | None = None
    # LoRA: (the adapter, first token row, rows) of each chunk whose sequence uses one (``seq.lora``).
    lora_rows: list[tuple[Any, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, num_kv_blocks: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        max_blocks = -(-max_model_len // block_size)
        self.block_table = np.zeros((max_num_seqs, max_blocks), dtype=np.int32)
        self.params = np.zeros((max_num_seqs, len(PARAM_COLUMNS)), dtype=np.float64)
        self.seeded = np.zeros(max_num_seqs, dtype=bool)
        self.penalised = np.zeros(max_num_seqs, dtype=bool)
        self.structured = np.zeros(max_num_seqs, dtype=bool)
        self._slot_of: dict[int, int] = {}
        self._seq_in: list[Sequence | None] = [None] * max_num_seqs
        self._table_in: list[list[int] | None] = [None] * max_num_seqs  # the list object copied
        self._table_len = [0] * max_num_seqs  # entries of it copied
        self._free = list(range(max_num_seqs - 1, -1, -1))
        # Penalised slots whose token counts on the device are another sequence's (or none yet): reset from
        # the sequence's known tokens with its first sampled row.
        self._counts_stale: set[int] = set()

    # ---- slots ------------------------------------------------------------------------------------
    def _refuse(self, seq: Sequence, start: int, end: int, num_draft: int = 0) -> None:
        """Raise the ``ValueError`` of a chunk that cannot run."""
        if num_draft and (seq.num_pending_tokens or end - num_draft != len(seq.token_ids)
                          or len(seq.draft_token_ids) < num_draft):
            raise ValueError(f"sequence {seq.request_id}: {num_draft} drafts need a decode of its last known "
                             f"token ({len(seq.draft_token_ids)} drafts, {seq.num_pending_tokens} pending)")
        end -= num_draft
        if end - start < 1 or end > len(seq.token_ids) + seq.num_pending_tokens:
            raise ValueError(f"sequence {seq.request_id}: chunk [{start}, {end}) is outside its "
                             f"{len(seq.token_ids) + seq.num_pending_tokens} tokens")
        if end > self.max_model_len:
            raise ValueError(f"sequence {seq.request_id}: {end} tokens exceed max_model_len "
                             f"{self.max_model_len}")
        raise ValueError(f"sequence {seq.request_id}: {end} tokens need {-(-end // self.block_size)} blocks, "
                         f"its block table has {len(seq.block_table)}")

    def _slot(self, seq: Sequence, busy: list[int]) -> int:
        """A slot for a sequence that has none (``busy``: the slots of the batch being built)."""
        if not self._free:
            self._reclaim(set(busy))
        if not self._free:
            raise RuntimeError(f"no slot left for sequence {seq.seq_id}: more than "
                               f"{self.max_num_seqs} sequences running")
        slot = self._free.pop()
        self._slot_of[seq.seq_id] = slot
        self._seq_in[slot] = seq
        self._table_in[slot] = None
        params = seq.params
        self.params[slot] = param_row(params)
        self.seeded[slot] = params.seed is not None and not params.greedy
        self.penalised[slot] = penalised(params) and seq.pooling is None
        self.structured[slot] = params.structured
        if self.penalised[slot]:
            self._counts_stale.add(slot)
        return slot

    def _reclaim(self, busy: set[int]) -> None:
        """Free the slots of sequences that finished or went back to waiting (but those of ``busy``, the
        slots of the batch being built)."""
        for slot, seq in enumerate(self._seq_in):
            if seq is not None and seq.status is not SequenceStatus.RUNNING and slot not in busy:
                del self._slot_of[seq.seq_id]
                self._seq_in[slot] = None
                self._table_in[slot] = None
                self._free.append(slot)

    def _sync_table(self, slot: int, table: list[int]) -> None:
        if self._table_in[slot] is not table:
            self._table_in[slot] = table
            self._table_len[slot] = 0
        done = self._table_len[slot]
        if len(table) > done:
            if len(table) > self.block_table.shape[1]:
                raise ValueError(f"a block table of {len(table)} blocks exceeds max_model_len")
            self.block_table[slot, done:len(table)] = table[done:]
            self._table_len[slot] = len(table)

    # ---- one step ---------------------------------------------------------------------------------
    def build(self, batch: ScheduledBatch, previous: dict[int, int] | None = None) -> StepInputs:
        """The inputs of ``batch``; ``previous`` maps the sequences sampled by the previous step to their
        row of its sampled ids (for pending input tokens)."""
        if not batch.seqs:
            raise ValueError("cannot run an empty batch")
        num = len(batch.seqs)
        slot_list: list[int] = []
        start_list: list[int] = []
        len_list: list[int] = []
        ids: list[int] = []
        pending_rows: list[int] = []
        pending_sources: list[int] = []
        logits_indices: list[int] = []
        sampled: list[Sequence] = []
        sampled_at: list[int] = []  # their batch indices
        offsets: list[int] = []  # a row's position past the sequence's tokens (drafts: 0 .. k)
        drafts: dict[int, list[int]] = {}  # first sampled row -> the drafts its rows verify
        pooled: list[tuple[ScheduledSeq, int, int]] = []
        prompt_rows: list[tuple[ScheduledSeq, int, int]] = []
        prompt_indices: list[int] = []
        prompt_targets: list[int] = []
        lora_rows: list[tuple[Any, int, int]] = []
        init: list[tuple[int, list[int], list[int]]] = []
        slot_of, table_in, table_len = self._slot_of, self._table_in, self._table_len
        bs, max_len = self.block_size, self.max_model_len
        row = 0
        for b, item in enumerate(batch.seqs):
            seq, start, n, k = item.seq, item.start, item.num_tokens, item.num_draft
            end = start + n
            token_ids, table = seq.token_ids, seq.block_table
            known = len(token_ids)
            if (n < 1 or end - k > known + seq.num_pending_tokens or end > max_len or len(table) * bs < end
                    or (k and (seq.num_pending_tokens or end - k != known or len(seq.draft_token_ids) < k))):
                self._refuse(seq, start, end, k)
            slot = slot_of.get(seq.seq_id)
            if slot is None:
                slot = self._slot(seq, slot_list)
            if table_in[slot] is not table or table_len[slot] != len(table):
                self._sync_table(slot, table)
            slot_list.append(slot)
            start_list.append(start)
            len_list.append(n)
            if k:  # the last known token, then the drafts to verify
                ids.extend(token_ids[start:known])
                ids.extend(seq.draft_token_ids[:k])
            elif end <= known:
                if n == 1:
                    ids.append(token_ids[start])
                else:
                    ids.extend(token_ids[start:end])
            else:  # the last token is pending: the previous step sampled it on the device
                source = None if previous is None else previous.get(seq.seq_id)
                if source is None or end != known + 1:
                    raise RuntimeError(f"sequence {seq.seq_id}: token {known} is pending but the previous "
                                       "step did not sample it")
                ids.extend(token_ids[start:known])
                ids.append(0)
                pending_rows.append(row + n - 1)
                pending_sources.append(source)
            row += n
            if seq.lora is not None:
                lora_rows.append((seq.lora, row - n, n))
            if item.samples and seq.pooling is None:
                if k:
                    drafts[len(sampled)] = seq.draft_token_ids[:k]
                for j in range(k + 1):  # one row per position that yields a token
                    logits_indices.append(row - 1 - k + j)
                    sampled.append(seq)
                    sampled_at.append(b)
                    offsets.append(j)
            elif seq.pooling is not None:
                pooled.append((item, row - n, n))
            if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_done:
                scored = min(end, seq.num_prompt_tokens - 1) - start  # positions whose next token is prompt
                if scored > 0:
                    prompt_rows.append((item, len(prompt_indices), scored))
                    prompt_indices.extend(range(row - n, row - n + scored))
                    prompt_targets.extend(token_ids[start + 1:start + 1 + scored])

        slots = np.array(slot_list, dtype=np.int64)
        starts = np.array(start_list, dtype=np.int64)
        lens = np.array(len_list, dtype=np.int64)
        seq_lens = starts + lens
        positions = np.arange(row, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens - starts, lens)
        width = -(-int(seq_lens.max()) // self.block_size)
        tables = self.block_table[slots, :width]
        lo, hi = int(tables.min()), int(tables.max())
        if lo < 0 or hi >= self.num_kv_blocks:
            raise ValueError(f"block ids must be in [0, {self.num_kv_blocks}), got {lo if lo < 0 else hi}")
        token_seq = np.repeat(np.arange(num), lens)
        slot_mapping = tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
        query_start_loc = np.zeros(num + 1, dtype=np.int32)
        np.cumsum(lens, out=query_start_loc[1:])
        sampling = None
        if sampled:
            rows = slots[np.asarray(sampled_at, dtype=np.int64)]
            if self._counts_stale:
                for i in np.flatnonzero(self.penalised[rows]).tolist():
                    slot = int(rows[i])
                    if slot in self._counts_stale:
                        self._counts_stale.discard(slot)
                        seq = sampled[i]
                        init.append((slot, seq.output_token_ids, list(seq.token_ids)))
            sampling = SamplingInputs(sampled, self.params[rows], rows,
                                      self._noise_seeds(sampled, rows, offsets), init,
                                      np.flatnonzero(self.structured[rows]).tolist(), drafts=drafts)
        return StepInputs(
            input_ids=np.asarray(ids, dtype=np.int64),
            positions=positions,
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens.astype(np.int32),
            block_tables=tables,
            logits_indices=np.asarray(logits_indices + prompt_indices, dtype=np.int64),
            pending_rows=np.asarray(pending_rows, dtype=np.int64),
            pending_sources=np.asarray(pending_sources, dtype=np.int64),
            query_lens=lens.tolist(),
            context_lens=seq_lens.tolist(),
            sampled=sampled,
            sampling=sampling,
            pooled=pooled,
            drafts=drafts,
            prompt_rows=prompt_rows,
            lora_rows=lora_rows,
            prompt_targets=np.asarray(prompt_targets, dtype=np.int64) if prompt_rows else None,
        )

    def _noise_seeds(self, sampled: list[Sequence], slots: np.ndarray,
                     offsets: list[int]) -> list[int | None]:
        keys: list[int | None] = [None] * len(sampled)
        for i in np.flatnonzero(self.seeded[slots]).tolist():
            seq = sampled[i]
            keys[i] = Sampler.noise_seed(seq, seq.num_tokens + offsets[i])
        return keys
