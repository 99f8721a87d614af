"""Secrets in the settings: outside development and test, the default key-hashing and session secrets
are refused and the internal token that engines demand of gateways and workers must be set, with no
default; a token too short to be random is refused anywhere."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tollgate.settings import DEV_SECRET, Settings

GOOD = {"key_hash_secret": "k" * 32, "session_secret": "s" * 32}
TOKEN = "a-random-internal-token-0123456789"


def production(**overrides: str) -> Settings:
    return Settings(**{"environment": "production", **GOOD, **overrides})  # type: ignore[arg-type]


def test_production_refuses_a_missing_internal_token() -> None:
    with pytest.raises(ValidationError, match="TOLLGATE_INTERNAL_TOKEN must be set outside development"):
        production()


@pytest.mark.parametrize("token", ["short", DEV_SECRET, f" {TOKEN} "])
def test_a_weak_or_default_token_is_refused(token: str) -> None:
    with pytest.raises(ValidationError, match="TOLLGATE_INTERNAL_TOKEN must be a random string"):
        production(internal_token=token)
    with pytest.raises(ValidationError, match="TOLLGATE_INTERNAL_TOKEN must be a random string"):
        Settings(environment="test", internal_token=token)  # type: ignore[arg-type]


def test_production_with_a_token_and_development_without_one() -> None:
    assert production(internal_token=TOKEN).internal_token.get_secret_value() == TOKEN  # type: ignore[union-attr]
    assert Settings(environment="development").internal_token is None
    assert Settings(environment="test").internal_token is None


def test_the_token_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOLLGATE_INTERNAL_TOKEN", TOKEN)
    settings = production()
    assert settings.internal_token is not None and settings.internal_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(settings)
