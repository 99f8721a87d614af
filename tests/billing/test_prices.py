"""Price book and cost math: exact integers, defaults, effective dates, $/Mtok conversion."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from billing.prices import (
    CACHE_TOKEN_FIELDS,
    OPTIONAL_PRICE_FIELDS,
    PRICE_FIELDS,
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
                              embedding_input=3_000_000, batch_embedding_input=1_500_000, cache_write=0,
                              cache_pin=0, cache_retention=0, batch_cache_write=0, batch_cache_pin=0,
                              batch_cache_retention=0)
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


def test_cache_prices_default_to_zero_and_batch_to_half_rounded_down() -> None:
    assert PRICE_FIELDS[-6:] == ("cache_write", "cache_pin", "cache_retention", "batch_cache_write",
                                 "batch_cache_pin", "batch_cache_retention")
    assert set(OPTIONAL_PRICE_FIELDS) == set(PRICE_FIELDS) - {"input", "output"}
    odd = Price.of(input=3_000_000, output=15_000_000, cache_write=3_750_001, cache_pin=7, cache_retention=1)
    assert (odd.cache_write, odd.cache_pin, odd.cache_retention) == (3_750_001, 7, 1)
    assert (odd.batch_cache_write, odd.batch_cache_pin, odd.batch_cache_retention) == (1_875_000, 3, 0)
    explicit = Price.of(input=1, output=1, cache_pin=10, batch_cache_pin=9, batch_cache_write=4)
    assert (explicit.cache_write, explicit.batch_cache_write) == (0, 4)
    assert (explicit.cache_pin, explicit.batch_cache_pin) == (10, 9)
    assert SONNETISH.cache_for_class("interactive") == SONNETISH.cache_for_class("batch") == (0, 0, 0)


# $3.75 per million tokens written to the cache, $0.30 pinned, $0.10 retained, on top of $3 / $0.30 / $15.
CACHER = Price.of(input=3_000_000, output=15_000_000, cache_write=3_750_000, cache_pin=300_000,
                  cache_retention=100_000)


def test_cache_products_are_charged_on_top_exactly() -> None:
    # 1,000 prompt tokens: 600 cached, 384 of the other 400 written to the cache, 992 pinned, 992 retained.
    plain = 400 * 3_000_000 + 600 * 300_000 + 200 * 15_000_000
    products = 384 * 3_750_000 + 992 * 300_000 + 992 * 100_000
    assert cost_pico_usd(CACHER, 1_000, 600, 200, "interactive", cache_write_tokens=384,
                         cache_pinned_tokens=992, cache_retained_tokens=992) == plain + products
    assert cost_pico_usd(CACHER, 1_000, 600, 200, "interactive") == plain
    # Each product alone, at its own price.
    assert cost_pico_usd(CACHER, 1_000, 600, 200, "interactive", cache_write_tokens=384) == (
        plain + 384 * 3_750_000)
    assert cost_pico_usd(CACHER, 1_000, 600, 200, "interactive", cache_pinned_tokens=992) == (
        plain + 992 * 300_000)
    assert cost_pico_usd(CACHER, 1_000, 600, 200, "interactive", cache_retained_tokens=992) == (
        plain + 992 * 100_000)
    # The batch class pays the batch prices, half by default.
    batch_plain = 400 * 1_500_000 + 600 * 150_000 + 200 * 7_500_000
    assert cost_pico_usd(CACHER, 1_000, 600, 200, "batch", cache_write_tokens=384, cache_pinned_tokens=992,
                         cache_retained_tokens=992) == (
        batch_plain + 384 * 1_875_000 + 992 * 150_000 + 992 * 50_000)
    # Default prices charge nothing for the products (OpenAI's default).
    assert cost_pico_usd(SONNETISH, 1_000, 600, 200, "interactive", cache_write_tokens=400,
                         cache_pinned_tokens=1_000, cache_retained_tokens=1_000) == plain


@pytest.mark.parametrize("name", CACHE_TOKEN_FIELDS)
@pytest.mark.parametrize("count", [-1, 1_001])
def test_cost_refuses_cache_counts_outside_the_prompt(name: str, count: int) -> None:
    with pytest.raises(ValueError, match=name):
        cost_pico_usd(CACHER, 1_000, 0, 0, "interactive", **{name: count})
    assert cost_pico_usd(CACHER, 1_000, 0, 0, "interactive", **{name: 1_000}) > 1_000 * 3_000_000


def test_embedding_cost_refuses_cache_products() -> None:
    for name in CACHE_TOKEN_FIELDS:
        with pytest.raises(ValueError, match="cache products"):
            cost_pico_usd(CACHER, 10, 0, 0, "interactive", embedding=True, **{name: 1})
    assert cost_pico_usd(CACHER, 10, 0, 0, "interactive", embedding=True, cache_write_tokens=0) == 30_000_000
    # Admission holds an embedding request's exact cost, whatever lifetimes were asked for.
    assert max_cost_pico_usd(CACHER, 10, 0, "batch", embedding=True, cache_pin=True,
                             cache_retention=True) == 10 * 1_500_000


def test_max_cost_holds_a_cache_write_of_every_prompt_token_and_the_lifetimes_asked_for() -> None:
    dearest = 3_000_000 + 3_750_000
    assert max_cost_pico_usd(CACHER, 1_000, 300, "interactive") == 1_000 * dearest + 300 * 15_000_000
    assert max_cost_pico_usd(CACHER, 1_000, 300, "interactive", cache_pin=True) == (
        1_000 * (dearest + 300_000) + 300 * 15_000_000)
    assert max_cost_pico_usd(CACHER, 1_000, 300, "interactive", cache_retention=True) == (
        1_000 * (dearest + 100_000) + 300 * 15_000_000)
    both = max_cost_pico_usd(CACHER, 1_000, 300, "batch", cache_pin=True, cache_retention=True)
    assert both == 1_000 * (1_500_000 + 1_875_000 + 150_000 + 50_000) + 300 * 7_500_000
    for klass in ("interactive", "batch"):
        bound = max_cost_pico_usd(CACHER, 1_000, 300, klass, cache_pin=True, cache_retention=True)
        for cached, written in ((0, 1_000), (500, 496), (1_000, 0)):
            for held in (0, 512, 1_000):
                assert cost_pico_usd(CACHER, 1_000, cached, 300, klass, cache_write_tokens=written,
                                     cache_pinned_tokens=held, cache_retained_tokens=held) <= bound
        assert bound == cost_pico_usd(CACHER, 1_000, 0, 300, klass, cache_write_tokens=1_000,
                                      cache_pinned_tokens=1_000, cache_retained_tokens=1_000)


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
    zeros = dict.fromkeys(PRICE_FIELDS, 0)
    with pytest.raises(ValueError):
        Price(**{**zeros, "input": -1})
    with pytest.raises(ValueError):
        Price(**{**zeros, "input": 1.5})
    for name in ("cache_write", "cache_pin", "cache_retention", "batch_cache_retention"):
        with pytest.raises(ValueError, match=name):
            Price.of(input=1, output=1, **{name: -1})
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
