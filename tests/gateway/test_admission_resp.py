"""The lean RESP2 connection of the admission hot path against a real Redis: replies of every type,
error replies, concurrent callers pipelining on one socket, a cancelled caller, a dead server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from gateway.admission.resp import LeanRedis, _Incomplete, _parse, encode_command
from tests.polling import eventually
from tollgate.local_services import free_port


def test_parse_every_reply_type_and_partial_input() -> None:
    data = b"*5\r\n+OK\r\n:-12\r\n$3\r\nabc\r\n$-1\r\n*2\r\n:1\r\n$0\r\n\r\n"
    value, end = _parse(data, 0)
    assert value == [b"OK", -12, b"abc", None, [1, b""]] and end == len(data)
    for cut in range(1, len(data)):
        with pytest.raises(_Incomplete):
            _parse(data[:cut], 0)
    error, _ = _parse(b"-NOSCRIPT No matching script\r\n", 0)
    assert isinstance(error, NoScriptError)
    assert encode_command("SET", b"k", 5) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$1\r\n5\r\n"


async def test_lean_connection_against_redis(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    lean = LeanRedis.for_client(client)
    assert lean is not None
    try:
        assert await lean.call("SET", "lean:k", "v") == b"OK"
        results = await asyncio.gather(*(lean.call("INCR", "lean:n") for _ in range(50)))
        assert sorted(results) == list(range(1, 51))
        assert await lean.call("EVAL", "return {1, 'two', {3}}", 0) == [1, b"two", [3]]
        with pytest.raises(NoScriptError):
            await lean.call("EVALSHA", "0" * 40, 0)
        with pytest.raises(ResponseError):
            await lean.call("INCR", "lean:k")  # not an integer
        ok, bad = await lean.pipeline(("GET", "lean:k"), ("HGET", "lean:k", "f"))
        assert ok == b"v" and isinstance(bad, ResponseError)
        # A caller cancelled mid-flight does not shift replies onto the next caller. BLPOP holds its reply
        # (and, the connection's replies being in order, every later one) until the list gets an element.
        def in_flight(count: int) -> bool:
            return lean._protocol is not None and len(lean._protocol.pending) == count

        await client.delete("lean:list")
        slow = asyncio.create_task(lean.call("BLPOP", "lean:list", 0))
        await eventually(lambda: in_flight(1), "the BLPOP sent")
        slow.cancel()
        following = asyncio.create_task(lean.call("GET", "lean:k"))
        await eventually(lambda: in_flight(2), "the GET sent behind the cancelled BLPOP")
        await client.rpush("lean:list", "x")  # the BLPOP's reply comes now, then the GET's
        assert await following == b"v"
        assert slow.cancelled()
        assert await client.get("lean:k") == b"v"  # the same database as the redis-py client
    finally:
        lean.close()
        await client.aclose()


async def test_unreachable_redis_raises_connection_error() -> None:
    lean = LeanRedis("127.0.0.1", free_port(), timeout_s=1)
    with pytest.raises(RedisConnectionError):
        await lean.call("PING")
