"""The authenticator's in-process cache: invalidation messages drop exactly what they name."""

from __future__ import annotations

import time

import pytest

from gateway.admission.limits import TenantLimits
from gateway.auth import Authenticator, Principal, _CacheSlot, _KeyEntry
from gateway.errors import AuthenticationError
from tollgate.settings import Settings


def _entry(tenant_id: int, api_key_id: int) -> _KeyEntry:
    limits = TenantLimits(tenant_id, "default", "active", None, None, None, None, None)
    return _KeyEntry("hash", Principal(tenant_id, api_key_id, limits, None), None, False)


@pytest.fixture
def auth() -> Authenticator:
    a = Authenticator(None, None, Settings(environment="test"))  # type: ignore[arg-type]
    for key_id, (tenant, key) in {"k1": (1, 11), "k2": (1, 12), "k3": (2, 21)}.items():
        a._cache[key_id] = _CacheSlot(_entry(tenant, key), time.monotonic() + 60)
    return a


@pytest.mark.parametrize(("message", "left"), [
    (b'{"key_id": "k1"}', {"k2", "k3"}),
    (b'{"api_key_id": 21}', {"k1", "k2"}),
    (b'{"tenant_id": 1}', {"k3"}),
    (b'"*"', set()),
    (b"not json", set()),
    (b'{"something": "else"}', set()),
])
def test_invalidation_messages(auth: Authenticator, message: bytes, left: set[str]) -> None:
    auth.invalidate(message)
    assert set(auth._cache) == left


@pytest.mark.parametrize("header", [None, "", "Bearer ", "Token abc", "Bearer sk-tg-short"])
async def test_malformed_headers_never_touch_the_database(auth: Authenticator, header: str | None) -> None:
    with pytest.raises(AuthenticationError) as err:
        await auth.authenticate(header)
    assert err.value.status == 401
