"""What a generation is billed: the price it is charged at, the usage that is charged, its cost per kind.

- The price is the model's row in effect when the request was admitted; an adapter model
  (``gateway.adapters``) without a row of its own is priced as its base model.
- The usage charged is the engine's, within its bounds; an embedding request has no cache products.
- Pricing never raises into the request's end: a failure is logged and charges nothing (the record is
  still written, and the ledger's checks catch the gap).
"""

from __future__ import annotations

import logging
from datetime import datetime

from billing.price_cache import PriceBookCache
from billing.prices import Charge, Price, PriceNotFound, charge
from engine.usage import SURCHARGE_KINDS, Usage
from gateway.routing import ModelRoute

logger = logging.getLogger("tollgate.gateway.generation")


def price_at(prices: PriceBookCache, route: ModelRoute, at: datetime) -> Price:
    """``route``'s price in effect at ``at`` (``PriceNotFound`` when neither it nor its base has one)."""
    try:
        return prices.price_for(route.name, at)
    except PriceNotFound:
        if route.adapter is None:
            raise
        return prices.price_for(route.served, at)


def billed_usage(usage: Usage, *, embedding: bool) -> Usage:
    """The usage to meter: within its bounds; an embedding request has no cache products."""
    usage = usage.clamped()
    if embedding:
        usage = Usage({k: n for k, n in usage.counts.items() if k not in SURCHARGE_KINDS})
    return usage


def charged(usage: Usage, price: Price | None, request_class: str, *, embedding: bool,
            request_id: str) -> Charge:
    """``usage`` (already ``billed_usage``) at ``price``, per kind; nothing if pricing fails (logged)."""
    try:
        if price is None:
            raise PriceNotFound(f"request {request_id} has no price")
        return charge(usage, price, request_class, embedding=embedding)
    except Exception:
        logger.exception("pricing request %s failed", request_id)
        return Charge({})
