"""``billing.prices.new_price_start``: the one rule for where a new price row starts, shared by the admin
API and ``tollgate prices set``: ``PRICE_LEAD`` ahead when omitted (every gateway has loaded it by then),
never sooner, never in the past, always timezone-aware."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from billing.prices import PRICE_LEAD, PastEffectiveFrom, new_price_start

NOW = datetime(2026, 11, 22, 12, 0, tzinfo=UTC)


def test_omitted_starts_a_lead_ahead_and_a_later_start_is_kept() -> None:
    assert new_price_start(None, NOW) == NOW + PRICE_LEAD
    assert new_price_start(NOW + PRICE_LEAD, NOW) == NOW + PRICE_LEAD
    later = NOW + timedelta(days=3)
    assert new_price_start(later, NOW) == later


@pytest.mark.parametrize("soon", [NOW, NOW + PRICE_LEAD - timedelta(microseconds=1)])
def test_a_start_sooner_than_the_lead_is_refused(soon: datetime) -> None:
    """Some gateway would not have the row yet: it would price by the old one what the ledger's rollups
    price by the new one."""
    with pytest.raises(ValueError, match="at least 15 s ahead"):
        new_price_start(soon, NOW)


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
    assert before + PRICE_LEAD <= new_price_start(None) <= datetime.now(UTC) + PRICE_LEAD
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


def test_the_lead_outlasts_the_gateways_price_book_refresh() -> None:
    from gateway.deps import PRICE_REFRESH_INTERVAL_S

    assert PRICE_LEAD.total_seconds() > PRICE_REFRESH_INTERVAL_S
