"""``billing.prices.new_price_start``: the one rule for where a new price row starts, shared by the admin
API and ``tollgate prices set``: now when omitted, never in the past, always timezone-aware."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from billing.prices import PastEffectiveFrom, new_price_start

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def test_omitted_starts_now_and_future_or_now_is_kept() -> None:
    assert new_price_start(None, NOW) == NOW
    assert new_price_start(NOW, NOW) == NOW
    later = NOW + timedelta(days=3)
    assert new_price_start(later, NOW) == later


@pytest.mark.parametrize("past", [NOW - timedelta(microseconds=1), NOW - timedelta(days=400)])
def test_past_start_is_refused(past: datetime) -> None:
    with pytest.raises(PastEffectiveFrom) as caught:
        new_price_start(past, NOW)
    assert caught.value.effective_from == past and caught.value.now == NOW
    assert isinstance(caught.value, ValueError) and "past" in str(caught.value)


def test_naive_start_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone"):
        new_price_start(datetime(2099, 1, 1), NOW)


def test_default_now_is_the_clock() -> None:
    before = datetime.now(UTC)
    assert before <= new_price_start(None) <= datetime.now(UTC)
    with pytest.raises(PastEffectiveFrom):
        new_price_start(before - timedelta(seconds=1))


def test_a_start_from_the_year_3000_on_is_refused() -> None:
    """9999-12-31 at UTC-5 is year 10000 in UTC: stored, no gateway could load its price book again."""
    from datetime import timezone

    assert new_price_start(datetime(2999, 12, 31, tzinfo=UTC), NOW).year == 2999
    for start in (datetime(3000, 1, 1, tzinfo=UTC),
                  datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5)))):
        with pytest.raises(ValueError, match="before 3000-01-01"):
            new_price_start(start, NOW)
