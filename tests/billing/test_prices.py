"""Price book and cost math: exact integers, defaults, effective dates, $/Mtok conversion."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing.prices import (
    Price,
    PriceBook,
    PriceNotFound,
    cost_pico_usd,
    max_cost_pico_usd,
    pico_to_usd_per_mtok,
    usd_per_mtok_to_pico,
)

# $3 / $0.30 / $15 per million tokens.
SONNETISH = Price.of(input=3_000_000, output=15_000_000)


def test_defaults_cached_is_a_tenth_and_batch_is_half_rounded_down() -> None:
    assert SONNETISH == Price(input=3_000_000, cached_input=300_000, output=15_000_000,
                              batch_input=1_500_000, batch_cached_input=150_000, batch_output=7_500_000,
                              embedding_input=3_000_000, batch_embedding_input=1_500_000)
    odd = Price.of(input=7, output=9)
    assert (odd.cached_input, odd.batch_input, odd.batch_cached_input, odd.batch_output) == (0, 3, 0, 4)
    assert (odd.embedding_input, odd.batch_embedding_input) == (7, 3)
    explicit = Price.of(input=10, output=20, cached_input=5, batch_output=11)
    assert (explicit.cached_input, explicit.batch_cached_input, explicit.batch_output) == (5, 2, 11)


def test_embedding_prices_default_to_input_and_half_of_the_embedding_price() -> None:
    embedding = Price.of(input=3_000_000, output=15_000_000, embedding_input=21, batch_input=1)
    assert (embedding.embedding_input, embedding.batch_embedding_input) == (21, 10)
    both = Price.of(input=3_000_000, output=15_000_000, embedding_input=20, batch_embedding_input=15)
    assert (both.embedding_input, both.batch_embedding_input) == (20, 15)
    assert Price.of(input=8, output=1, batch_embedding_input=5).embedding_input == 8


# $0.02 per million tokens for embeddings (text-embedding-3-small), $3 for chat input.
EMBEDDER = Price.of(input=3_000_000, output=15_000_000, embedding_input=20_000)


def test_embedding_cost_is_every_prompt_token_at_the_embedding_price() -> None:
    assert cost_pico_usd(EMBEDDER, 1_000, 0, 0, "interactive", embedding=True) == 1_000 * 20_000
    # Cached tokens get no discount: the same cost, whatever the prefix cache served.
    assert cost_pico_usd(EMBEDDER, 1_000, 600, 0, "interactive", embedding=True) == 20_000_000
    assert cost_pico_usd(EMBEDDER, 1_000, 1_000, 0, "interactive", embedding=True) == 20_000_000
    # The batch class pays the batch embedding price (half by default), never the chat prices.
    assert cost_pico_usd(EMBEDDER, 1_000, 600, 0, "batch", embedding=True) == 1_000 * 10_000
    assert cost_pico_usd(EMBEDDER, 1_000, 0, 0, "interactive") == 1_000 * 3_000_000
    assert cost_pico_usd(EMBEDDER, 0, 0, 0, "batch", embedding=True) == 0


def test_embedding_cost_refuses_completion_tokens_and_impossible_counts() -> None:
    with pytest.raises(ValueError, match="completion tokens"):
        cost_pico_usd(EMBEDDER, 10, 0, 1, "interactive", embedding=True)
    with pytest.raises(ValueError):
        cost_pico_usd(EMBEDDER, 10, 11, 0, "interactive", embedding=True)
    with pytest.raises(ValueError):
        cost_pico_usd(EMBEDDER, -1, 0, 0, "interactive", embedding=True)
    with pytest.raises(ValueError):
        cost_pico_usd(EMBEDDER, 1, 0, 0, "premium", embedding=True)
    with pytest.raises(ValueError, match="completion tokens"):
        max_cost_pico_usd(EMBEDDER, 10, 1, "interactive", embedding=True)


def test_embedding_max_cost_is_the_exact_cost() -> None:
    for klass in ("interactive", "batch"):
        bound = max_cost_pico_usd(EMBEDDER, 1_000, 0, klass, embedding=True)
        assert bound == cost_pico_usd(EMBEDDER, 1_000, 0, 0, klass, embedding=True)
        assert all(cost_pico_usd(EMBEDDER, 1_000, cached, 0, klass, embedding=True) == bound
                   for cached in (0, 500, 1_000))
    assert max_cost_pico_usd(EMBEDDER, 1_000, 0, "batch", embedding=True) == 1_000 * 10_000
    # An embedding price dearer than the chat input is held in full.
    dear = Price.of(input=1, output=1, embedding_input=50)
    assert max_cost_pico_usd(dear, 7, 0, "interactive", embedding=True) == 350


def test_cost_is_exact_with_cached_tokens_at_the_cached_price() -> None:
    # 1,000 prompt tokens of which 600 cached, 200 completion tokens.
    expected = 400 * 3_000_000 + 600 * 300_000 + 200 * 15_000_000
    assert cost_pico_usd(SONNETISH, 1_000, 600, 200, "interactive") == expected == 4_380_000_000
    batch = 400 * 1_500_000 + 600 * 150_000 + 200 * 7_500_000
    assert cost_pico_usd(SONNETISH, 1_000, 600, 200, "batch") == batch
    # Far beyond float precision, still exact.
    huge = Price.of(input=123_456_789_123, output=987_654_321_987)
    assert cost_pico_usd(huge, 10**9, 3, 10**9, "interactive") == (
        (10**9 - 3) * 123_456_789_123 + 3 * 12_345_678_912 + 10**9 * 987_654_321_987)


def test_cost_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError):
        cost_pico_usd(SONNETISH, 10, 11, 0, "interactive")
    with pytest.raises(ValueError):
        cost_pico_usd(SONNETISH, -1, 0, 0, "interactive")
    with pytest.raises(ValueError):
        cost_pico_usd(SONNETISH, 1, 0, 0, "premium")


def test_max_cost_bounds_every_actual_cost() -> None:
    bound = max_cost_pico_usd(SONNETISH, 1_000, 300, "interactive")
    for cached in (0, 500, 1_000):
        for completion in (0, 150, 300):
            assert cost_pico_usd(SONNETISH, 1_000, cached, completion, "interactive") <= bound
    assert bound == cost_pico_usd(SONNETISH, 1_000, 0, 300, "interactive")


@pytest.mark.parametrize(("usd", "pico"), [("3", 3_000_000), ("0.3", 300_000), ("15.000001", 15_000_001),
                                          ("0", 0), ("0.000001", 1), ("1e3", 1_000_000_000)])
def test_usd_per_mtok_converts_exactly(usd: str, pico: int) -> None:
    assert usd_per_mtok_to_pico(usd) == pico
    assert pico_to_usd_per_mtok(pico) == Decimal(usd)


@pytest.mark.parametrize("bad", ["0.0000001", "-1", "abc", "NaN", "inf", "1.23456789"])
def test_usd_per_mtok_refuses_non_integral_or_invalid_prices(bad: str) -> None:
    with pytest.raises(ValueError):
        usd_per_mtok_to_pico(bad)


def test_price_rejects_negative_or_fractional_values() -> None:
    with pytest.raises(ValueError):
        Price(input=-1, cached_input=0, output=0, batch_input=0, batch_cached_input=0, batch_output=0,
              embedding_input=0, batch_embedding_input=0)
    with pytest.raises(ValueError):
        Price(input=1.5, cached_input=0, output=0, batch_input=0, batch_cached_input=0,  # type: ignore[arg-type]
              batch_output=0, embedding_input=0, batch_embedding_input=0)
    with pytest.raises(ValueError, match="embedding_input"):
        Price.of(input=1, output=1, embedding_input=-1)
    with pytest.raises(ValueError, match="batch_embedding_input"):
        Price.of(input=1, output=1, batch_embedding_input=-5)
    with pytest.raises(ValueError, match="embedding_input"):
        Price.of(input=1, output=1, embedding_input=True)


def test_price_book_picks_the_row_in_effect() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    old, new = Price.of(input=1, output=2), Price.of(input=10, output=20)
    book = PriceBook([("m", t0 + timedelta(days=30), new), ("m", t0, old),
                      ("other", t0, SONNETISH)])
    assert book.models() == ["m", "other"]
    assert book.price_for("m", t0) is old
    assert book.price_for("m", t0 + timedelta(days=29, hours=23)) is old
    assert book.price_for("m", t0 + timedelta(days=30)) is new
    assert book.price_for("m", t0 + timedelta(days=3000)) is new
    with pytest.raises(PriceNotFound):
        book.price_for("m", t0 - timedelta(seconds=1))
    with pytest.raises(PriceNotFound):
        book.price_for("unpriced", t0)
    with pytest.raises(ValueError):
        book.price_for("m", datetime(2026, 2, 1))
