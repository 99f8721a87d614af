"""The one usage value (``engine.usage``): kinds, bounds, addition, the billed tokens and the wire form."""

from __future__ import annotations

import pytest

from engine.usage import COST_FIELDS, FIELDS, KINDS, PRICED_KINDS, SURCHARGE_KINDS, TokenKind, Usage, total


def test_every_kind_has_one_field_and_bounds_come_first() -> None:
    assert list(KINDS) == list(TokenKind) and len(set(FIELDS)) == len(FIELDS)
    order = list(KINDS)
    for kind, spec in KINDS.items():
        if spec.within is not None:
            assert order.index(spec.within) < order.index(kind)
    assert [k.value for k in PRICED_KINDS] == ["input", "cached_input", "output", "cache_write",
                                               "cache_pinned", "cache_retained"]
    assert COST_FIELDS[1] == "cached_input_cost_pico_usd" and set(SURCHARGE_KINDS) < set(PRICED_KINDS)


def test_zero_counts_are_not_stored_and_addition_is_kind_by_kind() -> None:
    a = Usage.of(prompt_tokens=10, cached_tokens=4, completion_tokens=0)
    b = Usage.of(prompt_tokens=5, completion_tokens=3, accepted_prediction_tokens=2)
    assert a.counts == {TokenKind.INPUT: 10, TokenKind.CACHED_INPUT: 4} and not Usage()
    assert (a + b).fields() == {**dict.fromkeys(FIELDS, 0), "prompt_tokens": 15, "cached_tokens": 4,
                                "completion_tokens": 3, "accepted_prediction_tokens": 2}
    assert total([a, b, Usage()]) == a + b and (a + b).total_tokens == 18
    assert a.cache_write_tokens == 0 and b.accepted_prediction_tokens == 2
    with pytest.raises(AttributeError):
        _ = a.reasoning_tokens


@pytest.mark.parametrize("value", [-1, 1.0, True, "3"])
def test_counts_are_non_negative_integers(value: object) -> None:
    with pytest.raises(ValueError, match="cached_tokens must be a non-negative integer"):
        Usage.of(prompt_tokens=10, cached_tokens=value)  # type: ignore[arg-type]


def test_bounds_parts_together_and_surcharges_alone() -> None:
    assert Usage.of(prompt_tokens=10, cached_tokens=10, cache_write_tokens=10, cache_pinned_tokens=10).check()
    for counts, message in (
            ({"prompt_tokens": 10, "cached_tokens": 11}, "cached_tokens exceeds prompt_tokens"),
            ({"prompt_tokens": 10, "cached_tokens": 8, "cached_host_tokens": 5, "cached_disk_tokens": 4},
             "cached_host_tokens \\+ cached_disk_tokens exceeds cached_tokens"),
            ({"completion_tokens": 5, "accepted_prediction_tokens": 3, "rejected_prediction_tokens": 3},
             "accepted_prediction_tokens \\+ rejected_prediction_tokens exceeds completion_tokens"),
            ({"prompt_tokens": 10, "cache_retained_tokens": 11},
             "cache_retained_tokens exceeds prompt_tokens")):
        with pytest.raises(ValueError, match=message):
            Usage.of(**counts).check()


def test_clamped_cuts_each_kind_to_what_its_bound_leaves() -> None:
    merged = Usage.of(prompt_tokens=10, cached_tokens=12, cached_host_tokens=7, cached_disk_tokens=9,
                      completion_tokens=4, accepted_prediction_tokens=3, rejected_prediction_tokens=3,
                      cache_write_tokens=20)
    assert merged.clamped().fields() == {
        **dict.fromkeys(FIELDS, 0), "prompt_tokens": 10, "cached_tokens": 10, "cached_host_tokens": 7,
        "cached_disk_tokens": 3, "completion_tokens": 4, "accepted_prediction_tokens": 3,
        "rejected_prediction_tokens": 1, "cache_write_tokens": 10}
    assert merged.clamped().check() == merged.clamped()


def test_billed_tokens_partition_the_prompt_and_add_the_surcharges() -> None:
    usage = Usage.of(prompt_tokens=100, cached_tokens=40, cached_host_tokens=10, completion_tokens=7,
                     rejected_prediction_tokens=2, cache_write_tokens=48)
    assert usage.billed() == {TokenKind.INPUT: 60, TokenKind.CACHED_INPUT: 40, TokenKind.OUTPUT: 7,
                              TokenKind.CACHE_WRITE: 48, TokenKind.CACHE_PINNED: 0,
                              TokenKind.CACHE_RETAINED: 0}


def test_the_wire_form_reads_back_and_missing_fields_read_as_zero() -> None:
    usage = Usage.of(prompt_tokens=9, cached_tokens=3, cached_disk_tokens=3, completion_tokens=1)
    assert Usage.from_fields(usage.fields()) == usage
    assert Usage.from_fields({"prompt_tokens": 9, "reasoning_tokens": 4}) == Usage.of(prompt_tokens=9)
    with pytest.raises(ValueError, match="unknown usage fields"):
        Usage.of(reasoning_tokens=4)
    assert usage.replace(completion_tokens=6).completion_tokens == 6
