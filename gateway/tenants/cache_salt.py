"""A tenant's prompt-cache salt: the generation service salts every prefix-cache block hash with it, and the
admin API names it to purge a tenant's cached blocks, so both import it from here.

Invariant: an HMAC of the tenant id under the gateway's key-hash secret, so no tenant can guess another's
salt, and every gateway of a deployment computes the same one.
"""

from __future__ import annotations

import hashlib
import hmac


def cache_salt(secret: str, tenant_id: int) -> str:
    """Per-tenant prefix-cache salt (32 hex characters)."""
    return hmac.new(secret.encode(), f"tenant:{tenant_id}".encode(), hashlib.sha256).hexdigest()[:32]
