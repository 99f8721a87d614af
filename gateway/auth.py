"""API-key authentication with a short in-process cache invalidated through Redis pub/sub.

``Authenticator.authenticate("Bearer sk-tg-<key id>-<secret>") -> Principal``:
- The key is parsed without I/O (``gateway.tenants.keys``); a malformed key is a 401 at once.
- The key row and its tenant are found by key id (``api_keys.prefix``), then the HMAC-SHA256 of the
  presented key is compared with the stored hash in constant time, on every request (the cache holds
  the stored hash, never the secret).
- Results (including "no such key") are cached for ``key_cache_ttl_s``; concurrent misses for one key
  share one database query. The hot path therefore does no database query for a known key.
- Revocation, key changes and tenant changes are published on ``tollgate:invalidate``; every gateway
  process listens and drops the matching entries within milliseconds. The whole cache is dropped each
  time the subscription (re)connects, since messages sent while it was down are lost; the TTL bounds
  staleness even then.

``api_keys.last_used_at`` is written in batches (every ``LAST_USED_FLUSH_S``, one UPDATE for all keys
used since), never per request.

Invalidation messages (JSON): ``{"key_id": "<prefix>"}``, ``{"api_key_id": 12}``, ``{"tenant_id": 3}``, or
anything else (``"*"``, unparsable) → flush everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.admission.limits import TenantLimits
from gateway.errors import AuthenticationError, ServiceUnavailableError
from gateway.tenants.keys import bearer_token, parse_key, verify_key
from gateway.tenants.repository import ApiKeyRepository
from tollgate.background import cancel_and_wait
from tollgate.models import ApiKey, Tenant
from tollgate.redis import INVALIDATE_CHANNEL
from tollgate.settings import Settings

logger = logging.getLogger("tollgate.gateway.auth")

# Unknown key ids are remembered this long at most (a flood of bad keys must not reach Postgres).
NEGATIVE_TTL_S = 1.0
LAST_USED_FLUSH_S = 30.0


@dataclass(frozen=True, slots=True)
class Principal:
    tenant_id: int
    api_key_id: int
    tenant: TenantLimits
    # None: every model; otherwise the model names this key may use.
    allowed_models: frozenset[str] | None
    scopes: frozenset[str] | None = None
    key_id: str = ""

    def may_use(self, model: str) -> bool:
        return self.allowed_models is None or model in self.allowed_models

    @classmethod
    def of_owner(cls, tenant: Tenant, key: ApiKey | None) -> Principal:
        """Who work stored earlier runs as (a batch's lines, a background response): its tenant, with
        the model restrictions of the key that created it (none once that key is gone)."""
        allowed = key.allowed_models if key is not None else None
        return cls(tenant_id=tenant.id, api_key_id=key.id if key is not None else None,  # type: ignore[arg-type]
                   tenant=TenantLimits.from_tenant(tenant),
                   allowed_models=frozenset(allowed) if allowed is not None else None)


@dataclass(slots=True)
class _KeyEntry:
    key_hash: str
    principal: Principal
    expires_at: datetime | None
    revoked: bool


@dataclass(slots=True)
class _CacheSlot:
    entry: _KeyEntry | None  # None: no such key
    valid_until: float


_MISSING_KEY = (
    "You didn't provide an API key. You need to provide your API key in an Authorization header using "
    "Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


def _incorrect_key(presented: str) -> AuthenticationError:
    shown = presented[:10] + "*" * 4 if len(presented) > 14 else "*" * 4
    return AuthenticationError(f"Incorrect API key provided: {shown}.")


class Authenticator:
    def __init__(self, session_factory: async_sessionmaker[AsyncSession], redis: Redis,
                 settings: Settings) -> None:
        self._sessions = session_factory
        self._redis = redis
        self._secret = settings.key_hash_secret.get_secret_value()
        self._ttl = settings.key_cache_ttl_s
        self._cache: dict[str, _CacheSlot] = {}
        self._inflight: dict[str, asyncio.Future[_KeyEntry | None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._used: set[int] = set()
        self.subscribed = asyncio.Event()
        # Called with the invalidation messages about other caches (``{"adapter_model": ...}``).
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    # -- public API -----------------------------------------------------------------------------
    async def authenticate(self, authorization: str | None) -> Principal:
        presented = bearer_token(authorization)
        if presented is None:
            raise AuthenticationError(_MISSING_KEY, code=None)
        try:
            key_id, _ = parse_key(presented)
        except ValueError:
            raise _incorrect_key(presented) from None
        entry = await self._entry(key_id)
        if entry is None or entry.revoked or not verify_key(presented, entry.key_hash, self._secret):
            raise _incorrect_key(presented)
        if entry.expires_at is not None and entry.expires_at <= datetime.now(UTC):
            raise AuthenticationError("The API key provided has expired.", code="expired_api_key")
        self._used.add(entry.principal.api_key_id)
        return entry.principal

    def flush(self) -> None:
        self._cache.clear()

    def invalidate(self, message: Any) -> None:
        """Apply one ``tollgate:invalidate`` message (see the module docstring)."""
        try:
            data = orjson.loads(message) if isinstance(message, bytes | str) else message
        except orjson.JSONDecodeError:
            data = None
        if not isinstance(data, dict):
            self.flush()
            return
        if "adapter_model" in data:  # not about keys: for the adapter lookups (``gateway.adapters``)
            for listener in self.listeners:
                listener(data)
        elif "key_id" in data:
            self._cache.pop(str(data["key_id"]), None)
        elif "api_key_id" in data:
            self._drop(lambda p: p.api_key_id == data["api_key_id"])
        elif "tenant_id" in data:
            self._drop(lambda p: p.tenant_id == data["tenant_id"])
        else:
            self.flush()

    async def start(self) -> None:
        self._tasks = [asyncio.create_task(self._listen(), name="tollgate-auth-invalidate"),
                       asyncio.create_task(self._flush_last_used_forever(), name="tollgate-auth-last-used")]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, what="the key cache")
        self._tasks = []
        await self.flush_last_used()

    async def flush_last_used(self) -> None:
        """Write ``last_used_at`` of the keys used since the last flush (one statement)."""
        if not self._used:
            return
        used, self._used = sorted(self._used), set()
        try:
            async with self._sessions() as session:
                await ApiKeyRepository(session).touch_last_used(used, datetime.now(UTC))
                await session.commit()
        except Exception as exc:
            logger.warning("could not record key use: %s", exc)

    async def _flush_last_used_forever(self) -> None:
        while True:
            await asyncio.sleep(LAST_USED_FLUSH_S)
            await self.flush_last_used()

    # -- cache ----------------------------------------------------------------------------------
    def _drop(self, match: Any) -> None:
        for key_id, slot in list(self._cache.items()):
            if slot.entry is not None and match(slot.entry.principal):
                del self._cache[key_id]

    async def _entry(self, key_id: str) -> _KeyEntry | None:
        slot = self._cache.get(key_id)
        now = time.monotonic()
        if slot is not None and slot.valid_until > now:
            return slot.entry
        pending = self._inflight.get(key_id)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[_KeyEntry | None] = asyncio.get_running_loop().create_future()
        self._inflight[key_id] = future
        try:
            entry = await self._load(key_id)
        except Exception as exc:
            future.set_exception(exc)
            future.exception()  # consumed here; waiters re-raise it
            raise
        else:
            future.set_result(entry)
            ttl = self._ttl if entry is not None else min(self._ttl, NEGATIVE_TTL_S)
            self._cache[key_id] = _CacheSlot(entry, time.monotonic() + ttl)
            return entry
        finally:
            del self._inflight[key_id]

    async def _load(self, key_id: str) -> _KeyEntry | None:
        try:
            async with self._sessions() as session:
                row = await ApiKeyRepository(session).get_by_prefix(key_id)
        except Exception as exc:
            logger.warning("key lookup failed: %s", exc)
            raise ServiceUnavailableError("Authentication is temporarily unavailable; please retry.",
                                          headers={"retry-after": "1"}) from exc
        if row is None:
            return None
        key, tenant = row
        principal = Principal(
            tenant_id=tenant.id,
            api_key_id=key.id,
            tenant=TenantLimits.from_tenant(tenant),
            allowed_models=frozenset(key.allowed_models) if key.allowed_models is not None else None,
            scopes=frozenset(key.scopes) if key.scopes is not None else None,
            key_id=key.prefix,
        )
        return _KeyEntry(key.key_hash, principal, key.expires_at, key.revoked_at is not None)

    # -- pub/sub --------------------------------------------------------------------------------
    async def _listen(self) -> None:
        """Apply invalidation messages; flush the whole cache at every subscription confirmation.

        Messages published while the subscription is down are lost, so the cache is flushed each time
        the server confirms ``SUBSCRIBE``: the first time, after this loop reconnects on an error, and
        when redis-py reconnects and resubscribes by itself inside ``get_message`` (it does when the
        client retries connection errors; no exception reaches this loop then, only the confirmation).
        """
        backoff = 0.05
        while True:
            pubsub = self._redis.pubsub(ignore_subscribe_messages=False)
            try:
                await pubsub.subscribe(INVALIDATE_CHANNEL)
                backoff = 0.05
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is None:
                        continue
                    kind = message.get("type")
                    if kind == "message":
                        self.invalidate(message.get("data"))
                    elif kind == "subscribe":
                        self.flush()  # anything published while we were not subscribed is lost
                        if self.subscribed.is_set():
                            logger.warning("invalidation subscription re-established; key cache flushed")
                        self.subscribed.set()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                self.subscribed.clear()
                logger.warning("invalidation subscription lost (%s); reconnecting", exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

