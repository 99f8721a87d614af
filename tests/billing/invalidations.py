"""Waiting for one gateway cache invalidation on Redis pub/sub in a test.

The xdist workers share one Redis server (a database each), but pub/sub channels ignore the database:
a subscriber also hears the key revocations and tenant invalidations of tests running in other
workers. A test therefore waits for the message it expects and skips the others."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson


async def next_invalidation(pubsub: Any, expected: dict[str, Any], timeout_s: float = 5.0) -> None:
    """Return once ``expected`` arrives on the subscribed channel; TimeoutError if it does not."""
    async with asyncio.timeout(timeout_s):
        while True:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None and orjson.loads(message["data"]) == expected:
                return
