"""The gateway's and batch runner's copy of the price book, reloaded from Postgres in the background.

Invariants: a failed reload keeps the last good book (and logs); a process never serves with an empty
book it mistook for a loaded one: until the first load succeeds ``price_for`` raises ``PricesNotLoaded``
(the gateway answers 503 ``prices_unavailable``, to be retried) and the reload runs every
``RETRY_INTERVAL_S``. So a gateway worker that starts while Postgres is down (restarted after a crash
during a database outage) comes up and serves as soon as it can, instead of failing its start-up, which
would make uvicorn stop every worker. ``billing.prices`` stays pure (no database); the rows come from
``billing.repository``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncSession

from billing.prices import Price, PriceBook
from billing.repository import all_prices

logger = logging.getLogger("tollgate.billing")

RETRY_INTERVAL_S = 1.0


class PricesNotLoaded(LookupError):
    """The price book has not been loaded yet (the database was unreachable): nothing can be priced."""

SessionFactory = Callable[[], AbstractAsyncContextManager[AsyncSession]]


async def load_price_book(session: AsyncSession) -> PriceBook:
    return PriceBook(await all_prices(session))


class PriceBookCache:
    """Holds the current ``PriceBook`` and reloads it every ``refresh_interval_s`` (a background task of
    the gateway's lifespan)."""

    def __init__(self, session_factory: SessionFactory, refresh_interval_s: float = 10.0,
                 retry_interval_s: float = RETRY_INTERVAL_S) -> None:  # fmt: skip
        self._session_factory = session_factory
        self._interval = refresh_interval_s
        self._retry_interval = retry_interval_s
        self.book = PriceBook()
        self.loaded = False

    async def refresh(self) -> PriceBook:
        async with self._session_factory() as session:
            self.book = await load_price_book(session)
        self.loaded = True
        return self.book

    async def start(self) -> None:
        """The first load; if the database cannot be reached, stay unloaded (``run`` retries)."""
        try:
            await self.refresh()
        except Exception as exc:
            logger.warning("cannot load the price book yet (%s); retrying every %.0f s, refusing requests "
                           "meanwhile", exc, self._retry_interval)

    async def run(self) -> None:
        """Reload forever (cancel to stop): every ``refresh_interval_s``, every ``retry_interval_s``
        until the first load succeeded."""
        while True:
            await asyncio.sleep(self._interval if self.loaded else self._retry_interval)
            try:
                await self.refresh()
            except Exception:
                if self.loaded:
                    logger.exception("price book refresh failed; keeping the previous one")
                else:
                    logger.warning("cannot load the price book yet; retrying")

    def price_for(self, model: str, at: datetime | None = None) -> Price:
        if not self.loaded:
            raise PricesNotLoaded("the price book is not loaded yet")
        return self.book.price_for(model, at)
