"""Prefix-cache block hashes: a SHA-256 chain over the full blocks of a token sequence.

Imported by the gateway (prefix-affinity routing) and by the engine's block manager, so both compute
the same digests in every process, on every machine and across restarts (Python's ``hash()`` is
salted per process and is never used).

For block ``i`` (tokens ``token_ids[i*B:(i+1)*B]``, only *full* blocks are hashed)::

    h_i = sha256(salt_digest | h_{i-1} | tokens of block i as little-endian int32)
    h_{-1} = 32 zero bytes
    salt_digest = sha256(b"tollgate-cache-salt\\0" | utf-8 salt)   (32 zero bytes when salt is None)

Every component before the tokens has a fixed width (32 bytes), so the encoding is unambiguous. The
salt is the tenant's ``cache_salt``: two tenants with different salts never share a digest, so one
tenant's cache never serves another. Because each digest covers its parent, equal digests imply equal
prefixes (up to SHA-256 collisions).

This module imports nothing beyond the standard library.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ZERO_DIGEST = bytes(32)
_SALT_DOMAIN = b"tollgate-cache-salt\0"
_INT32_MAX = 2**31 - 1


def salt_digest(salt: str | None) -> bytes:
    """The 32-byte salt component of every block hash (zero bytes for no salt)."""
    if salt is None:
        return _ZERO_DIGEST
    if not isinstance(salt, str):
        raise TypeError(f"cache salt must be a str or None, got {type(salt).__name__}")
    return hashlib.sha256(_SALT_DOMAIN + salt.encode("utf-8")).digest()


def adapter_cache_salt(cache_salt: str | None, adapter_digest: str) -> str:
    """The salt of a request run through a LoRA adapter: the tenant's salt and the adapter's content
    digest (never its name or id), so blocks are shared only by requests whose K/V are the same. The
    engine keys its prefix cache with it, and the gateway's KV index computes the same hashes."""
    return f"{cache_salt or ''}|lora:{adapter_digest}"


def hash_block(parent: bytes | None, block_token_ids: Sequence[int], salt: bytes = _ZERO_DIGEST) -> bytes:
    """Digest of one full block given its parent's digest (None for the first block).

    ``salt`` is the output of :func:`salt_digest`, computed once per sequence.
    """
    if parent is not None and len(parent) != 32:
        raise ValueError(f"parent digest must be 32 bytes, got {len(parent)}")
    if len(salt) != 32:
        raise ValueError(f"salt digest must be 32 bytes, got {len(salt)}")
    try:
        packed = struct.pack(f"<{len(block_token_ids)}i", *block_token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, {_INT32_MAX}]: {exc}") from None
    if any(t < 0 for t in block_token_ids):
        raise ValueError(f"token ids must be integers in [0, {_INT32_MAX}], got a negative id")
    h = hashlib.sha256(salt)
    h.update(parent if parent is not None else _ZERO_DIGEST)
    h.update(packed)
    return h.digest()


def prefix_block_hashes(
    token_ids: Sequence[int], block_size: int = 16, salt: str | None = None
) -> list[bytes]:
    """One chained SHA-256 digest per full block of ``token_ids`` (a trailing partial block is skipped)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    salt_bytes = salt_digest(salt)
    hashes: list[bytes] = []
    parent: bytes | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], salt_bytes)
        hashes.append(parent)
    return hashes
