"""API key format, generation, parsing and hashing (pure functions, no I/O).

A key looks like ``sk-tg-<key_id>-<secret>``:
- ``key_id``: 12 lowercase base32 characters (60 bits), stored in ``api_keys.prefix`` and used to find
  the row; safe to log and to show in dashboards.
- ``secret``: 43 base62 characters (~256 bits) from ``secrets``; never stored.
Only ``hash_key(full_key, secret_key)`` = HMAC-SHA256(secret_key, full key) in hex is stored, so a
database leak alone does not let anyone authenticate, and the hash binds the secret to its key id.
``verify_key`` compares in constant time. ``parse_key`` raises ``ValueError`` on anything malformed, so
callers can answer 401 without touching the database.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string

KEY_PREFIX = "sk-tg-"
KEY_ID_LENGTH = 12
SECRET_LENGTH = 43
_KEY_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz234567"
_SECRET_ALPHABET = string.ascii_letters + string.digits
_KEY_RE = re.compile(
    rf"{re.escape(KEY_PREFIX)}(?P<key_id>[a-z2-7]{{{KEY_ID_LENGTH}}})-(?P<secret>[A-Za-z0-9]{{{SECRET_LENGTH}}})"
)


def generate_key() -> tuple[str, str, str]:
    """A fresh key: ``(key_id, secret, full_key)``."""
    key_id = "".join(secrets.choice(_KEY_ID_ALPHABET) for _ in range(KEY_ID_LENGTH))
    secret = "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(SECRET_LENGTH))
    return key_id, secret, f"{KEY_PREFIX}{key_id}-{secret}"


def parse_key(full_key: str) -> tuple[str, str]:
    """``(key_id, secret)`` of a well-formed key; ``ValueError`` otherwise (the message never echoes it)."""
    if not isinstance(full_key, str):
        raise ValueError("API key must be a string")
    match = _KEY_RE.fullmatch(full_key)
    if match is None:
        raise ValueError(f"malformed API key: expected {KEY_PREFIX}<key id>-<secret>")
    return match["key_id"], match["secret"]


def hash_key(full_key: str, secret_key: str | bytes) -> str:
    """HMAC-SHA256 of the full key under the server's ``key_hash_secret``, as 64 hex characters."""
    if not secret_key:
        raise ValueError("the key-hashing secret must not be empty")
    key = secret_key.encode() if isinstance(secret_key, str) else secret_key
    return hmac.new(key, full_key.encode(), hashlib.sha256).hexdigest()


def verify_key(full_key: str, stored_hash: str, secret_key: str | bytes) -> bool:
    """Constant-time check of ``full_key`` against a stored hash."""
    return hmac.compare_digest(hash_key(full_key, secret_key), stored_hash)


def display_prefix(key_id: str) -> str:
    """What dashboards show for a key: enough to recognise it, nothing to use it."""
    return f"{KEY_PREFIX}{key_id}-…"


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header value (scheme case-insensitive), or
    None when the header is missing, of another scheme, or empty."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None
