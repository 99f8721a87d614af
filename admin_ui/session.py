"""Dashboard sessions: password login on the ``admins`` table, a signed session cookie, CSRF tokens.

Cookie ``tollgate_admin`` (path ``/admin``): an ``itsdangerous`` timed signature (key:
``settings.session_secret``) over ``{"c": csrf token, "a": admin id, "p": password fingerprint}``;
``a``/``p`` only once logged in. It is HttpOnly, SameSite=Lax, and Secure whenever the request came over
https (behind a proxy, run uvicorn with ``--proxy-headers`` so the scheme is the client's). A session
lasts ``SESSION_MAX_AGE_S`` from login (the signature's timestamp; it is not extended by activity).

Invariants:
- Every dashboard page and action needs a logged-in admin; without one (no cookie, a bad or expired
  signature, an admin that was deleted or whose password changed since, or only a tenant API key in an
  ``Authorization`` header) the answer is a redirect to ``/admin/login`` and nothing else.
- The password fingerprint is an HMAC of the stored argon2 hash, so changing an admin's password ends
  every session of that admin; logging out replaces the cookie with an anonymous one.
- Every POST (the login form included) must carry the session's CSRF token in the ``csrf_token`` form
  field (compared in constant time), and a browser ``Origin`` header, when sent, must be this host;
  otherwise 403 and nothing changes. A login starts a new session with a new token (no fixation).
- Passwords are checked with argon2 (``argon2-cffi``, in a worker thread so the gateway's event loop
  keeps serving); an unknown email costs the same hash check.
  ``LOGIN_MAX_FAILURES`` failures for one email within ``LOGIN_FAILURE_WINDOW_S`` lock that email's
  login for the rest of the window (a Redis counter, shared by every gateway).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import secrets
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError
from fastapi import Depends, Request
from itsdangerous import BadSignature, URLSafeTimedSerializer
from redis.asyncio import Redis
from starlette.responses import Response

from gateway.admin.auth import AdminPrincipal
from gateway.admin.repository import AdminRepository
from gateway.admin.service import normalize_email
from gateway.errors import GatewayError
from tollgate.models import Admin
from tollgate.settings import Settings

COOKIE_NAME = "tollgate_admin"
COOKIE_PATH = "/admin"
SESSION_MAX_AGE_S = 12 * 3600
CSRF_FIELD = "csrf_token"
LOGIN_MAX_FAILURES = 10
LOGIN_FAILURE_WINDOW_S = 15 * 60
_SALT = "tollgate-admin-session"
_HASHER = PasswordHasher()


@functools.cache
def _dummy_hash() -> str:
    """Checked for unknown emails so that a miss takes as long as a wrong password. Made on first use,
    not on import: an argon2 hash costs ~0.3 s of CPU in every process that imports the gateway app
    (each gateway worker), most of which never see a login."""
    return _HASHER.hash(secrets.token_urlsafe(16))


class LoginRequired(Exception):
    """No logged-in admin: the dashboard answers with a redirect to the login page."""

    def __init__(self, next_path: str | None = None) -> None:
        super().__init__("login required")
        self.next_path = next_path


class CsrfRejected(Exception):
    """A POST without the session's CSRF token (or from another origin): 403, nothing done."""


@dataclass(slots=True)
class SessionState:
    csrf: str
    admin_id: int | None = None
    fingerprint: str | None = None
    changed: bool = False


def _serializer(settings: Settings) -> URLSafeTimedSerializer:
    return URLSafeTimedSerializer(settings.session_secret.get_secret_value(), salt=_SALT)


def password_fingerprint(settings: Settings, password_hash: str | None) -> str:
    key = settings.session_secret.get_secret_value().encode()
    return hmac.new(key, (password_hash or "").encode(), hashlib.sha256).hexdigest()[:32]


def load_session(request: Request) -> SessionState:
    """The request's session (cached on ``request.state``); a new anonymous one if the cookie is
    missing, forged or expired."""
    cached = getattr(request.state, "admin_session", None)
    if cached is not None:
        return cached
    settings: Settings = request.app.state.settings
    state: SessionState | None = None
    raw = request.cookies.get(COOKIE_NAME)
    if raw:
        try:
            data: Any = _serializer(settings).loads(raw, max_age=SESSION_MAX_AGE_S)
        except BadSignature:
            data = None
        if isinstance(data, dict) and isinstance(data.get("c"), str):
            admin_id = data.get("a")
            state = SessionState(csrf=data["c"], admin_id=admin_id if isinstance(admin_id, int) else None,
                                 fingerprint=data.get("p") if isinstance(data.get("p"), str) else None)
    if state is None:
        state = SessionState(csrf=secrets.token_urlsafe(32), changed=True)
    request.state.admin_session = state
    return state


def start_session(request: Request, admin_id: int, fingerprint: str) -> SessionState:
    state = SessionState(csrf=secrets.token_urlsafe(32), admin_id=admin_id, fingerprint=fingerprint,
                         changed=True)
    request.state.admin_session = state
    return state


def end_session(request: Request) -> None:
    request.state.admin_session = SessionState(csrf=secrets.token_urlsafe(32), changed=True)


def save_session(request: Request, response: Response) -> None:
    """Write the cookie if the session is new or changed (login, logout, first visit)."""
    state: SessionState | None = getattr(request.state, "admin_session", None)
    if state is None or not state.changed:
        return
    settings: Settings = request.app.state.settings
    payload: dict[str, Any] = {"c": state.csrf}
    if state.admin_id is not None:
        payload.update(a=state.admin_id, p=state.fingerprint)
    response.set_cookie(COOKIE_NAME, _serializer(settings).dumps(payload), max_age=SESSION_MAX_AGE_S,
                        path=COOKIE_PATH, httponly=True, samesite="lax", secure=request.url.scheme == "https")


async def current_admin(request: Request) -> AdminPrincipal:
    """The logged-in admin, re-read from the database on every request; ``LoginRequired`` otherwise."""
    state = load_session(request)
    if state.admin_id is None:
        raise LoginRequired(request.url.path)
    settings: Settings = request.app.state.settings
    async with request.app.state.db.session() as session:
        admin = await session.get(Admin, state.admin_id)
    expected = password_fingerprint(settings, admin.password_hash) if admin is not None else ""
    if (admin is None or admin.password_hash is None or state.fingerprint is None
            or not hmac.compare_digest(expected, state.fingerprint)):
        end_session(request)
        raise LoginRequired(request.url.path)
    return AdminPrincipal(id=admin.id, email=admin.email)


CurrentAdmin = Annotated[AdminPrincipal, Depends(current_admin)]


def _same_origin(request: Request) -> bool:
    origin = request.headers.get("origin")
    if origin is None or origin == "null":
        return origin is None
    parts = urlsplit(origin)
    return parts.netloc == request.headers.get("host", "") and parts.scheme == request.url.scheme


async def check_csrf(request: Request) -> dict[str, str]:
    """The POSTed form (text fields) once its CSRF token matches the session's; ``CsrfRejected`` if not."""
    form = await request.form()
    fields = {key: value for key, value in form.items() if isinstance(value, str)}
    presented = fields.pop(CSRF_FIELD, "")
    state = load_session(request)
    if not _same_origin(request) or not presented or state.changed \
            or not hmac.compare_digest(presented.encode(), state.csrf.encode()):
        raise CsrfRejected()
    return fields


class LoginFailed(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_login"


def _verify(stored: str, password: str) -> bool:
    try:
        return _HASHER.verify(stored, password)
    except (VerificationError, InvalidHashError):
        return False


def _failures_key(email: str) -> str:
    return f"tollgate:admin-login-failures:{hashlib.sha256(email.encode()).hexdigest()[:32]}"


async def authenticate_password(request: Request, email: str, password: str) -> AdminPrincipal:
    """The admin with this email and password; ``LoginFailed`` (one message for every reason)."""
    redis: Redis = request.app.state.redis
    try:
        email = normalize_email(email)
    except GatewayError:
        raise LoginFailed("Incorrect email or password.") from None
    key = _failures_key(email)
    failures = int(await redis.get(key) or 0)
    if failures >= LOGIN_MAX_FAILURES:
        raise LoginFailed("Too many failed logins for this email; try again in a few minutes.", status=429)
    async with request.app.state.db.session() as session:
        admin = await AdminRepository(session).get_by_email(email)
    stored = admin.password_hash if admin is not None and admin.password_hash else _dummy_hash()
    # argon2 is deliberately slow (tens of ms of CPU): off the event loop that serves /v1 traffic.
    ok = await asyncio.to_thread(_verify, stored, password) and admin is not None \
        and admin.password_hash is not None
    if not ok or admin is None:
        async with redis.pipeline(transaction=True) as pipe:
            pipe.incr(key)
            pipe.expire(key, LOGIN_FAILURE_WINDOW_S)
            await pipe.execute()
        raise LoginFailed("Incorrect email or password.")
    await redis.delete(key)
    settings: Settings = request.app.state.settings
    start_session(request, admin.id, password_fingerprint(settings, admin.password_hash))
    return AdminPrincipal(id=admin.id, email=admin.email)
