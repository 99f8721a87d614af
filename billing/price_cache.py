"""The gateway's and batch runner's copy of the price book, reloaded from Postgres in the background.

Invariants: a failed reload keeps the last good book (and logs); the first load must succeed, so a
process never serves with an empty book it mistook for a loaded one. ``billing.prices`` stays pure
(no database); the rows come from ``billing.repository``.
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

SessionFactory = Callable[[], AbstractAsyncContextManager[AsyncSession]]


async def load_price_book(session: AsyncSession) -> PriceBook:
    return PriceBook(await all_prices(session))


class PriceBookCache:
    """Holds the current ``PriceBook`` and reloads it every ``refresh_interval_s`` (a background task of
    the gateway's lifespan)."""

    def __init__(self, session_factory: SessionFactory, refresh_interval_s: float = 10.0) -> None:
        self._session_factory = session_factory
        self._interval = refresh_interval_s
        self.book = PriceBook()

    async def refresh(self) -> PriceBook:
        async with self._session_factory() as session:
            self.book = await load_price_book(session)
        return self.book

    async def run(self) -> None:
        """Reload forever (cancel to stop)."""
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.refresh()
            except Exception:
                logger.exception("price book refresh failed; keeping the previous one")

    def price_for(self, model: str, at: datetime | None = None) -> Price:
        return self.book.price_for(model, at)
