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
from tests.polling import DEFAULT_TIMEOUT_S, eventually
from tollgate.redis import INVALIDATE_CHANNEL
from tollgate.settings import Settings


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
        await asyncio.wait_for(auth.subscribed.wait(), DEFAULT_TIMEOUT_S)
        auth._cache["cached"] = _CacheSlot(None, time.monotonic() + 3600)
        # Nothing flushes it but a reconnect (or a message): once the listener has applied a message
        # published after it (messages are applied in order), it is still there.
        auth._cache["marker"] = _CacheSlot(None, time.monotonic() + 3600)
        server.publish(INVALIDATE_CHANNEL, b'{"key_id": "marker"}')
        await eventually(lambda: "marker" not in auth._cache, "the listener to apply the marker message")
        assert "cached" in auth._cache

        assert server.client_kill_filter(_type="pubsub") == 1
        await eventually(lambda: "cached" not in auth._cache, "the stale cache flushed after the reconnect")
        await eventually(lambda: server.pubsub_numsub(INVALIDATE_CHANNEL)[0][1] == 1, "one subscriber again")
        assert auth.subscribed.is_set()

        # Subscribed again: messages are applied (and a single key is dropped, not the whole cache).
        auth._cache["a"] = _CacheSlot(None, time.monotonic() + 60)
        auth._cache["b"] = _CacheSlot(None, time.monotonic() + 60)
        server.publish(INVALIDATE_CHANNEL, b'{"key_id": "a"}')
        await eventually(lambda: "a" not in auth._cache, "the listener to drop key a")
        assert "b" in auth._cache
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await client.aclose()
        server.close()
