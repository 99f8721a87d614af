"""The authenticator flushes its key cache whenever its invalidation subscription is re-established,
however the reconnect happens: by its own loop after a connection error surfaces (the default client),
or inside redis-py, which reconnects and resubscribes silently when the client retries connection errors
(no exception reaches the listener; only the server's new ``subscribe`` confirmation shows it).
A private Redis server: ``CLIENT KILL TYPE pubsub`` there touches no other test's subscribers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.auth import Authenticator, _CacheSlot
from tollgate.redis import INVALIDATE_CHANNEL
from tollgate.settings import Settings


async def _eventually(predicate: Any, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


@pytest.mark.parametrize("client_retries", [False, True], ids=["error-surfaces", "redis-py-reconnects"])
async def test_cache_flushed_when_the_subscription_comes_back(private_redis: Any,
                                                             client_retries: bool) -> None:
    options: dict[str, Any] = {"health_check_interval": 30}
    if client_retries:
        options |= {"retry": Retry(NoBackoff(), 3), "retry_on_error": [RedisConnectionError]}
    client = aioredis.Redis.from_url(private_redis.url, **options)
    server = redis.Redis.from_url(private_redis.url)
    auth = Authenticator(None, client, Settings(environment="test"))  # type: ignore[arg-type]
    listener = asyncio.create_task(auth._listen())
    try:
        await asyncio.wait_for(auth.subscribed.wait(), 5)
        auth._cache["cached"] = _CacheSlot(None, time.monotonic() + 60)
        await asyncio.sleep(0.2)
        assert "cached" in auth._cache  # nothing flushes it but a reconnect (or a message)

        assert server.client_kill_filter(_type="pubsub") == 1
        assert await _eventually(lambda: "cached" not in auth._cache), "stale cache kept after reconnect"
        assert await _eventually(lambda: server.pubsub_numsub(INVALIDATE_CHANNEL)[0][1] == 1)
        assert auth.subscribed.is_set()

        # Subscribed again: messages are applied (and a single key is dropped, not the whole cache).
        auth._cache["a"] = _CacheSlot(None, time.monotonic() + 60)
        auth._cache["b"] = _CacheSlot(None, time.monotonic() + 60)
        server.publish(INVALIDATE_CHANNEL, b'{"key_id": "a"}')
        assert await _eventually(lambda: "a" not in auth._cache)
        assert "b" in auth._cache
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await client.aclose()
        server.close()
