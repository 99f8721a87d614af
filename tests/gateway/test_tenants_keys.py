"""API key format: generation, parsing, hashing (pure functions)."""

from __future__ import annotations

import pytest

from gateway.tenants.keys import KEY_PREFIX, display_prefix, generate_key, hash_key, parse_key, verify_key


def test_generated_keys_parse_back_and_are_unique():
    seen = set()
    for _ in range(200):
        key_id, secret, full = generate_key()
        assert full == f"{KEY_PREFIX}{key_id}-{secret}"
        assert parse_key(full) == (key_id, secret)
        seen.add(key_id)
    assert len(seen) == 200


@pytest.mark.parametrize("bad", [
    "", "sk-tg-", "Bearer sk-tg-abc", "sk-xx-aaaaaaaaaaaa-" + "A" * 43, "sk-tg-aaaaaaaaaaaa-" + "A" * 42,
    "sk-tg-AAAAAAAAAAAA-" + "A" * 43, "sk-tg-aaaaaaaaaaaa-" + "A" * 42 + "-",
    "sk-tg-aaaaaaaaaaa1-" + "A" * 43,
    " sk-tg-aaaaaaaaaaaa-" + "A" * 43, "sk-tg-aaaaaaaaaaaa-" + "A" * 43 + "\n",
])
def test_malformed_keys_raise_value_error_without_echoing_them(bad):
    with pytest.raises(ValueError) as info:
        parse_key(bad)
    assert len(bad) < 10 or bad not in str(info.value)


def test_non_string_key_is_rejected():
    with pytest.raises(ValueError):
        parse_key(None)  # type: ignore[arg-type]


def test_hash_is_keyed_hmac_and_verification_is_exact():
    _, _, full = generate_key()
    digest = hash_key(full, "secret-a")
    assert len(digest) == 64 and int(digest, 16) >= 0
    assert digest == hash_key(full, b"secret-a")
    assert digest != hash_key(full, "secret-b")
    assert verify_key(full, digest, "secret-a")
    assert not verify_key(full, digest, "secret-b")
    assert not verify_key(full[:-1] + ("x" if full[-1] != "x" else "y"), digest, "secret-a")


def test_empty_hash_secret_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        hash_key("sk-tg-x", "")


def test_display_prefix_hides_the_secret():
    key_id, secret, _ = generate_key()
    shown = display_prefix(key_id)
    assert key_id in shown and secret not in shown
