"""The persistent batch (``engine.input_batch``), pure numpy: a step's inputs gathered from per-slot rows,
block tables grown in place, pending decode inputs, slots reclaimed, and malformed batches refused."""

from __future__ import annotations

import numpy as np
import pytest

from engine.input_batch import InputBatch
from engine.sampler import PARAM_COLUMNS
from engine.sampling_params import SamplingParams
from engine.sequence import ScheduledBatch, ScheduledSeq, Sequence, SequenceStatus

BS = 4


def running(tokens: list[int], blocks: list[int], computed: int = 0, **params: object) -> Sequence:
    seq = Sequence("r", list(tokens), SamplingParams(**params))  # type: ignore[arg-type]
    seq.block_table = list(blocks)
    seq.num_computed_tokens = computed
    seq.status = SequenceStatus.RUNNING
    return seq


def batch(*chunks: tuple[Sequence, int]) -> ScheduledBatch:
    return ScheduledBatch([ScheduledSeq(seq, n) for seq, n in chunks])


def test_a_prefill_chunk_and_decodes_gather_positions_slots_and_tables() -> None:
    inputs = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS, num_kv_blocks=32)
    prefill = running(list(range(10, 20)), [7, 3, 9], computed=4)  # tokens 4..9 this step
    decode = running([5, 6, 7, 8, 9], [2, 11], computed=4, temperature=0.5, top_k=7)
    step = inputs.build(batch((prefill, 6), (decode, 1)))
    assert step.input_ids.tolist() == list(range(14, 20)) + [9]
    assert step.positions.tolist() == [4, 5, 6, 7, 8, 9, 4]
    # slot = block_table[p // 4] * 4 + p % 4
    assert step.slot_mapping.tolist() == [12, 13, 14, 15, 36, 37, 44]
    assert step.query_start_loc.tolist() == [0, 6, 7] and step.seq_lens.tolist() == [10, 5]
    assert step.block_tables.tolist() == [[7, 3, 9], [2, 11, 0]]
    assert step.logits_indices.tolist() == [5, 6] and step.sampled == [prefill, decode]
    assert step.sampling is not None
    params = dict(zip(PARAM_COLUMNS, step.sampling.params[1], strict=True))
    assert params["temperature"] == 0.5 and params["top_k"] == 7 and params["logprobs"] == -1
    assert step.pending_rows.size == 0


def test_block_tables_grow_in_place_and_a_replaced_table_is_copied_again() -> None:
    inputs = InputBatch(max_num_seqs=2, max_model_len=64, block_size=BS, num_kv_blocks=32)
    seq = running([1, 2, 3, 4], [5], computed=3)
    inputs.build(batch((seq, 1)))
    seq.token_ids.append(9)
    seq.num_computed_tokens = 4
    seq.block_table.append(6)  # the block manager grows the same list
    assert inputs.build(batch((seq, 1))).block_tables.tolist() == [[5, 6]]
    seq.block_table = [8, 10]  # a preemption and a new admission give a new list
    seq.num_computed_tokens = 4
    assert inputs.build(batch((seq, 1))).block_tables.tolist() == [[8, 10]]


def test_a_pending_decode_input_points_at_the_previous_steps_sampled_row() -> None:
    inputs = InputBatch(max_num_seqs=4, max_model_len=64, block_size=BS, num_kv_blocks=32)
    a = running([1, 2, 3], [0], computed=3)
    b = running([4, 5, 6], [1], computed=3)
    a.num_pending_tokens = b.num_pending_tokens = 1  # sampled last step, not known yet
    step = inputs.build(batch((b, 1), (a, 1)), previous={a.seq_id: 0, b.seq_id: 1})
    assert step.input_ids.tolist() == [0, 0]
    assert step.pending_rows.tolist() == [0, 1] and step.pending_sources.tolist() == [1, 0]
    with pytest.raises(RuntimeError, match="pending"):
        inputs.build(batch((a, 1)), previous={})


def test_slots_of_finished_and_waiting_sequences_are_reclaimed() -> None:
    inputs = InputBatch(max_num_seqs=2, max_model_len=64, block_size=BS, num_kv_blocks=32)
    first = running([1, 2], [0], computed=1, presence_penalty=1.0)
    second = running([3, 4], [1], computed=1)
    step = inputs.build(batch((first, 1), (second, 1)))
    assert step.sampling is not None and [slot for slot, _, _ in step.sampling.init] == [0]
    again = inputs.build(batch((first, 1)))
    assert again.sampling is not None and again.sampling.init == []  # its counts are on the device
    first.status = SequenceStatus.FINISHED
    third = running([5, 6], [2], computed=1, temperature=0.3)
    step = inputs.build(batch((second, 1), (third, 1)))
    assert step.sampling is not None and step.sampling.slots.tolist() == [1, 0]  # first's slot, reused
    assert step.sampling.params[1][PARAM_COLUMNS.index("temperature")] == pytest.approx(0.3)
    fourth = running([7, 8], [3], computed=1)
    with pytest.raises(RuntimeError, match="no slot left"):
        inputs.build(batch((second, 1), (third, 1), (fourth, 1)))


@pytest.mark.parametrize(("tokens", "blocks", "computed", "n", "match"), [
    ([1, 2, 3], [0], 2, 2, "outside its 3 tokens"),
    ([1, 2, 3], [0], 0, 0, "outside"),
    (list(range(9)), [0, 1], 0, 9, "need 3 blocks"),
    ([1, 2, 3], [40], 0, 3, r"block ids must be in \[0, 32\)"),
    (list(range(70)), list(range(18)), 0, 70, "exceed max_model_len 64"),
])  # fmt: skip
def test_a_malformed_batch_is_refused(tokens: list[int], blocks: list[int], computed: int, n: int,
                                      match: str) -> None:
    inputs = InputBatch(max_num_seqs=2, max_model_len=64, block_size=BS, num_kv_blocks=32)
    with pytest.raises(ValueError, match=match):
        inputs.build(batch((running(tokens, blocks, computed), n)))
    assert not np.any(inputs.block_table[1])  # nothing half-built for a second slot


def test_a_penalised_sequence_resets_its_slots_counts_with_its_first_sampled_row() -> None:
    """Whatever ran in the slot before, and even when its first steps there are prefill chunks."""
    inputs = InputBatch(max_num_seqs=1, max_model_len=64, block_size=BS, num_kv_blocks=32)
    first = running([1, 2, 3], [0], computed=2, frequency_penalty=1.0)
    assert inputs.build(batch((first, 1))).sampling.init == [(0, [], [1, 2, 3])]  # type: ignore[union-attr]
    first.status = SequenceStatus.FINISHED
    second = running(list(range(10)), [1, 2, 3], computed=0, presence_penalty=0.5)
    assert inputs.build(batch((second, 4))).sampling is None  # a prefill chunk: nothing sampled yet
    second.num_computed_tokens = 4
    step = inputs.build(batch((second, 6)))
    assert step.sampling is not None and step.sampling.init == [(0, [], list(range(10)))]
    second.num_computed_tokens, second.token_ids = 10, list(range(11))
    assert inputs.build(batch((second, 1))).sampling.init == []  # type: ignore[union-attr]
