"""Admin credentials: the admin API token format, its hash, and the FastAPI dependency that checks it.

An admin token looks like ``tg-admin-<43 base62 characters>`` (~256 bits from ``secrets``). Only
HMAC-SHA256(``key_hash_secret``, token) in hex is stored (``admins.api_token_hash``, unique), so the
row is found by its hash and a database leak alone opens nothing. Tokens are printed once, by
``tollgate admins create`` / ``rotate-token``.

``current_admin`` answers, in the ``{"error": {...}}`` body of ``/v1``:
- 401 when the ``Authorization: Bearer`` header is missing, malformed or names no admin;
- 403 when it carries a valid *tenant* API key: tenant keys never open the admin API, and saying so
  (instead of a 401) tells the caller it used the wrong kind of credential.
The check runs on every request (no cache): admin traffic is small and a rotated token must stop
working at once.
"""

from __future__ import annotations

import hmac
import re
import secrets
import string
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.admin.repository import AdminRepository
from gateway.admin.uow import AdminSession
from gateway.errors import AuthenticationError, PermissionDeniedError
from gateway.tenants.keys import bearer_token, hash_key, parse_key, verify_key
from gateway.tenants.repository import ApiKeyRepository
from tollgate.models import Admin
from tollgate.settings import Settings

ADMIN_TOKEN_PREFIX = "tg-admin-"
ADMIN_TOKEN_SECRET_LENGTH = 43
_TOKEN_ALPHABET = string.ascii_letters + string.digits
_TOKEN_RE = re.compile(rf"{re.escape(ADMIN_TOKEN_PREFIX)}[A-Za-z0-9]{{{ADMIN_TOKEN_SECRET_LENGTH}}}")
_CHALLENGE = {"www-authenticate": 'Bearer realm="tollgate-admin"'}

_MISSING_TOKEN = ("You didn't provide an admin token. The admin API needs one in an Authorization header "
                  "using Bearer auth (i.e. Authorization: Bearer tg-admin-...).")
_INVALID_TOKEN = "Incorrect admin token provided."
_TENANT_KEY = ("Tenant API keys cannot be used with the admin API; use an admin token "
               "(created with `tollgate admins create EMAIL`).")


def generate_admin_token() -> str:
    return ADMIN_TOKEN_PREFIX + "".join(secrets.choice(_TOKEN_ALPHABET)
                                        for _ in range(ADMIN_TOKEN_SECRET_LENGTH))


def is_admin_token(token: str) -> bool:
    return _TOKEN_RE.fullmatch(token) is not None


def hash_admin_token(token: str, settings: Settings) -> str:
    return hash_key(token, settings.key_hash_secret.get_secret_value())


@dataclass(frozen=True, slots=True)
class AdminPrincipal:
    id: int
    email: str

    @property
    def actor(self) -> str:
        """How this admin appears in ``audit_log.actor``."""
        return f"admin:{self.email}"


async def authenticate_admin_token(session: AsyncSession, token: str, settings: Settings) -> Admin | None:
    """The admin that ``token`` belongs to, or None (malformed, unknown or rotated away)."""
    if not is_admin_token(token):
        return None
    digest = hash_admin_token(token, settings)
    admin = await AdminRepository(session).get_by_token_hash(digest)
    if admin is None or admin.api_token_hash is None or not hmac.compare_digest(admin.api_token_hash, digest):
        return None
    return admin


async def _is_tenant_key(session: AsyncSession, presented: str, settings: Settings) -> bool:
    try:
        key_id, _ = parse_key(presented)
    except ValueError:
        return False
    found = await ApiKeyRepository(session).get_by_prefix(key_id)
    return found is not None and verify_key(presented, found[0].key_hash,
                                            settings.key_hash_secret.get_secret_value())


async def current_admin(request: Request, session: AdminSession) -> AdminPrincipal:
    """FastAPI dependency: the admin behind the request's bearer token (401/403 otherwise)."""
    settings: Settings = request.app.state.settings
    presented = bearer_token(request.headers.get("authorization"))
    if presented is None:
        raise AuthenticationError(_MISSING_TOKEN, code=None, headers=_CHALLENGE)
    admin = await authenticate_admin_token(session, presented, settings)
    if admin is not None:
        return AdminPrincipal(id=admin.id, email=admin.email)
    if await _is_tenant_key(session, presented, settings):
        raise PermissionDeniedError(_TENANT_KEY, code="tenant_key_not_allowed")
    raise AuthenticationError(_INVALID_TOKEN, code="invalid_admin_token", headers=_CHALLENGE)


CurrentAdmin = Annotated[AdminPrincipal, Depends(current_admin)]
