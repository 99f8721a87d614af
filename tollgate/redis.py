"""Redis clients (redis-py 5+, asyncio and sync).

Invariants:
- Every key Tollgate writes starts with ``KEY_PREFIX`` (``tollgate:``), so a shared Redis can be
  inspected and a test can tell platform keys from anything else.
- Clients get short socket timeouts from the settings, so a Redis that is down fails a health check or
  an admission call quickly instead of hanging a request.
- Key-cache invalidation is one pub/sub channel, ``INVALIDATE_CHANNEL``, with one message format (a
  JSON object naming ``key_id``, ``api_key_id`` or ``tenant_id``, or ``"*"`` for everything): the
  gateway listens (``gateway.auth``), admin actions, the CLI and billing's suspensions publish. It lives
  here because all of them may import this module.
- Redis must run with ``appendonly yes`` (the usage outbox is durable) and ``maxmemory-policy
  noeviction`` (admission counters and the outbox must never be evicted silently);
  ``check_durability`` reports a server that does not.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
import redis
import redis.asyncio as aioredis

from tollgate.settings import Settings

logger = logging.getLogger(__name__)

KEY_PREFIX = "tollgate:"
INVALIDATE_CHANNEL = KEY_PREFIX + "invalidate"


async def publish_invalidation(client: aioredis.Redis, **what: Any) -> None:
    """Tell every gateway process to drop cached keys (``key_id=``, ``api_key_id=``, ``tenant_id=``;
    nothing: all of them)."""
    await client.publish(INVALIDATE_CHANNEL, orjson.dumps(what or "*"))


def redis_url(settings: Settings) -> str:
    """The configured Redis URL, or a clear error when there is none."""
    if not settings.redis_url:
        raise RuntimeError(
            "TOLLGATE_REDIS_URL is not set (e.g. redis://127.0.0.1:6379/0);"
            " `tollgate up` sets it for the processes it starts"
        )
    return settings.redis_url


# Connections one asyncio client (one gateway worker) may open. Beyond that, callers wait for a free one
# (up to ``health_check_timeout_s``) instead of failing: redis-py's default pool raises
# ``MaxConnectionsError`` past 100, which turned a burst of concurrent requests into 503s.
MAX_ASYNC_CONNECTIONS = 100


def create_redis(settings: Settings, *, decode_responses: bool = False) -> aioredis.Redis:
    """An asyncio client for the configured Redis (a blocking pool of ``MAX_ASYNC_CONNECTIONS``)."""
    timeout = settings.health_check_timeout_s
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url(settings),
        max_connections=MAX_ASYNC_CONNECTIONS,
        timeout=timeout,
        decode_responses=decode_responses,
        socket_connect_timeout=timeout,
        health_check_interval=30,
    )
    return aioredis.Redis.from_pool(pool)


def create_sync_redis(settings: Settings, *, decode_responses: bool = False) -> redis.Redis:
    """A blocking client (Celery signal handlers, the supervisor's health checks)."""
    timeout = settings.health_check_timeout_s
    return redis.Redis.from_url(
        redis_url(settings),
        decode_responses=decode_responses,
        socket_connect_timeout=timeout,
        socket_timeout=timeout,
    )


async def check_durability(client: aioredis.Redis) -> list[str]:
    """Problems with the server's configuration for Tollgate (empty when it is fit)."""
    config: dict[str, str] = {}
    for name in ("appendonly", "maxmemory-policy"):
        for key, value in (await client.config_get(name)).items():
            config[_text(key)] = _text(value)
    problems = []
    if config.get("appendonly") != "yes":
        problems.append("appendonly is not 'yes': the usage outbox would not survive a restart")
    policy = config.get("maxmemory-policy")
    if policy != "noeviction":
        problems.append(f"maxmemory-policy is {policy!r}, not 'noeviction': counters could be evicted")
    return problems


async def warn_if_not_durable(client: aioredis.Redis) -> list[str]:
    """Log (and return) ``check_durability``'s problems of the server ``client`` uses, at a process's
    start: a managed Redis is configured by its provider, and one that evicts or does not persist loses
    admission counters and usage records quietly. A server that refuses ``CONFIG GET`` (some managed
    ones do) or cannot be reached yet is logged as unchecked, never a reason not to start."""
    try:
        problems = await check_durability(client)
    except (redis.RedisError, OSError) as exc:
        logger.warning("could not check the Redis server's durability settings (%s): make sure it has "
                       "appendonly yes and maxmemory-policy noeviction", exc)
        return []
    for problem in problems:
        logger.warning("Redis server: %s", problem)
    return problems


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value
