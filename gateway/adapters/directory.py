"""Which route a model name of a request is, adapters included: every endpoint's lookup
(``gateway.generation.requests.lookup_model``) asks it for names of the ``ft:`` form.

Invariants:
- A tenant's adapter model resolves only for a principal of that tenant that may use it (its key
  names the adapter's model or its base, or names none); for anyone else, and for a deleted adapter, it
  does not exist (None: the caller's 404 ``model_not_found``).
- The route shares its base model's replicas, tokenizer, limits and pools (``ModelRoute.base``) and
  carries the adapter's store id and digest (``ModelRoute.adapter``).
- Lookups are cached for ``ttl_s`` (a miss too, so a flood of unknown names does not reach Postgres).
  A deletion is forgotten at once by the gateway that deleted it and, through the invalidation channel
  (``tollgate.redis.INVALIDATE_CHANNEL``, ``{"adapter_model": ...}``), by every other within a second;
  meanwhile its bundle is already gone from the store, so no replica can serve it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.auth import Principal
from gateway.routing import ModelRoute, Router, ServedAdapter
from tollgate.models import Adapter

# At most this many names are remembered (a flood of made-up names evicts the oldest).
MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class _Entry:
    tenant_id: int
    base: str
    adapter: ServedAdapter
    created: int


class AdapterDirectory:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], router: Router, ttl_s: float) -> None:
        self._sessions = sessions
        self._router = router
        self._ttl_s = ttl_s
        self._cache: dict[str, tuple[float, _Entry | None]] = {}

    async def route(self, principal: Principal, model: str) -> ModelRoute | None:
        """The route of adapter model ``model`` for ``principal`` (None: not one it can see)."""
        entry = await self._entry(model)
        if entry is None or entry.tenant_id != principal.tenant_id:
            return None
        if not (principal.may_use(model) or principal.may_use(entry.base)):
            return None
        base = self._router.models.get(entry.base)
        if base is None:
            return None
        return ModelRoute(name=model, path=base.path, pools=base.pools, replicas=base.replicas,
                          created=entry.created, routed=base.routed, base=base.name, adapter=entry.adapter)

    async def _entry(self, model: str) -> _Entry | None:
        now = time.monotonic()
        held = self._cache.get(model)
        if held is not None and held[0] > now:
            return held[1]
        async with self._sessions() as session:
            row = (await session.execute(select(Adapter).where(
                Adapter.model == model, Adapter.deleted_at.is_(None)))).scalar()
        entry = None
        if row is not None:
            entry = _Entry(row.tenant_id, row.base_model, ServedAdapter(row.id, row.digest),
                           int(row.created_at.timestamp()))
        if len(self._cache) >= MAX_ENTRIES:
            self._cache.pop(next(iter(self._cache)))
        self._cache[model] = (now + self._ttl_s, entry)
        return entry

    def forget(self, model: str) -> None:
        self._cache.pop(model, None)

    def invalidate(self, message: dict) -> None:
        """Apply an invalidation message naming an adapter model (others are not about adapters)."""
        model = message.get("adapter_model")
        if isinstance(model, str):
            self.forget(model)
