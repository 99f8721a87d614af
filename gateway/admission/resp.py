"""A lean Redis connection for the two round trips every request makes (admission, settle + meter).

redis-py's asyncio client costs ~110 µs of CPU per command in the gateway (connection-pool checkout,
two ``wait_for`` timeouts, a ``StreamReader`` parser); this is one ``asyncio.Protocol`` connection
speaking RESP2, shared by all requests of a process: commands are written as they come (so concurrent
requests pipeline on the one socket) and replies resolve futures in order. ~25 µs per command.

It is used only where it is safe to: a plain TCP ``redis.asyncio.Redis`` client (no TLS, no Unix
socket, no credential provider, not a cluster). ``LeanRedis.for_client`` returns None otherwise and the
caller keeps using redis-py. Failures raise redis-py's exceptions (``ConnectionError``,
``TimeoutError``, ``ResponseError``/``NoScriptError``), so callers handle both the same way; a broken
connection fails every pending command and the next command reconnects.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

DEFAULT_TIMEOUT_S = 5.0


def encode_command(*args: Any) -> bytes:
    """One RESP2 command (an array of bulk strings)."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, bytes):
            data = arg
        elif isinstance(arg, str):
            data = arg.encode()
        elif isinstance(arg, int | float):
            data = repr(arg).encode()
        else:
            raise TypeError(f"cannot send {type(arg).__name__} to Redis")
        out.append(b"$%d\r\n" % len(data))
        out.append(data)
        out.append(b"\r\n")
    return b"".join(out)


class _Incomplete(Exception):
    pass


def _parse(buf: bytes, pos: int) -> tuple[Any, int]:
    """One reply at ``pos``: (value, position after it); ``_Incomplete`` if it has not all arrived."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        raise _Incomplete
    kind = buf[pos:pos + 1]
    line = buf[pos + 1:end]
    pos = end + 2
    if kind == b"+":
        return line, pos
    if kind == b":":
        return int(line), pos
    if kind == b"$":
        length = int(line)
        if length < 0:
            return None, pos
        if len(buf) < pos + length + 2:
            raise _Incomplete
        return buf[pos:pos + length], pos + length + 2
    if kind == b"*":
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = _parse(buf, pos)
            items.append(item)
        return items, pos
    if kind == b"-":
        message = line.decode(errors="replace")
        error = NoScriptError(message) if message.startswith("NOSCRIPT") else ResponseError(message)
        return error, pos
    raise RedisConnectionError(f"unreadable Redis reply type {kind!r}")


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.pending: collections.deque[asyncio.Future[Any]] = collections.deque()
        self.buffer = b""
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        pos = 0
        try:
            while pos < len(buf) and self.pending:
                try:
                    value, pos = _parse(buf, pos)
                except _Incomplete:
                    break
                future = self.pending.popleft()
                if not future.done():
                    if isinstance(value, Exception):
                        future.set_exception(value)
                    else:
                        future.set_result(value)
        except (ValueError, RedisConnectionError) as exc:
            self.fail(RedisConnectionError(f"unreadable Redis reply: {exc}"))
            return
        self.buffer = buf[pos:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(f"Redis connection lost: {exc or 'closed'}"))

    def fail(self, error: Exception) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()
        while self.pending:
            future = self.pending.popleft()
            if not future.done():
                future.set_exception(error)


class LeanRedis:
    """One shared RESP2 connection; ``call``/``pipeline`` send commands and await their replies."""

    def __init__(self, host: str, port: int, *, db: int = 0, username: str | None = None,
                 password: str | None = None, timeout_s: float | None = None,
                 connect_timeout_s: float | None = None) -> None:
        self._host, self._port, self._db = host, port, db
        self._username, self._password = username, password
        self._timeout_s = timeout_s or DEFAULT_TIMEOUT_S
        self._connect_timeout_s = connect_timeout_s or self._timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Future[_Protocol] | None = None

    @classmethod
    def for_client(cls, redis: Any) -> LeanRedis | None:
        """A lean connection to the server of this redis-py client, or None where it does not apply."""
        if type(redis) is not Redis:
            return None
        pool = getattr(redis, "connection_pool", None)
        if pool is None or pool.connection_class is not Connection:
            return None
        kw = pool.connection_kwargs
        if kw.get("credential_provider") is not None or not isinstance(kw.get("host", "localhost"), str):
            return None
        return cls(kw.get("host", "localhost"), int(kw.get("port", 6379)), db=int(kw.get("db", 0) or 0),
                   username=kw.get("username"), password=kw.get("password"),
                   timeout_s=kw.get("socket_timeout"), connect_timeout_s=kw.get("socket_connect_timeout"))

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, protocol = await loop.create_connection(_Protocol, self._host, self._port)
                setup: list[tuple[Any, ...]] = []
                if self._password is not None:
                    setup.append(("AUTH", self._username, self._password) if self._username
                                 else ("AUTH", self._password))
                if self._db:
                    setup.append(("SELECT", self._db))
                if setup:
                    replies = await self._send(protocol, setup)
                    for reply in replies:
                        if isinstance(reply, Exception):
                            protocol.fail(RedisConnectionError(str(reply)))
                            raise RedisConnectionError(f"Redis refused the connection set-up: {reply}")
        except TimeoutError:
            raise RedisTimeoutError("Timeout connecting to Redis") from None
        except OSError as exc:
            raise RedisConnectionError(f"Error connecting to Redis: {exc}") from exc
        return protocol

    async def _protocol_ready(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and not protocol.lost:
            return protocol
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect_and_keep())
        return await asyncio.shield(self._connecting)

    async def _connect_and_keep(self) -> _Protocol:
        protocol = await self._connect()
        self._protocol = protocol
        return protocol

    async def _send(self, protocol: _Protocol, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Write the commands in one write; their replies (an error reply is returned, not raised)."""
        if protocol.lost or protocol.transport is None:
            raise RedisConnectionError("Redis connection lost")
        loop = asyncio.get_running_loop()
        # A caller cancelled mid-flight leaves its (cancelled) futures in the queue: their replies are
        # read and dropped in order, so no reply ever goes to the wrong caller.
        futures = [loop.create_future() for _ in commands]
        protocol.pending.extend(futures)
        protocol.transport.write(b"".join(encode_command(*c) for c in commands))
        replies: list[Any] = []
        try:
            async with asyncio.timeout(self._timeout_s):
                for future in futures:
                    try:
                        replies.append(await future)
                    except ResponseError as exc:
                        replies.append(exc)
        except TimeoutError:
            protocol.fail(RedisTimeoutError("Timeout reading from Redis"))
            raise RedisTimeoutError("Timeout reading from Redis") from None
        return replies

    async def pipeline(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Send several commands in one write; their replies in order (error replies as exceptions in
        the list). Raises ``ConnectionError``/``TimeoutError`` when the connection fails."""
        return await self._send(await self._protocol_ready(), list(commands))

    async def call(self, *command: Any) -> Any:
        """One command; an error reply raises (``NoScriptError``, ``ResponseError``)."""
        (reply,) = await self.pipeline(tuple(command))
        if isinstance(reply, Exception):
            raise reply
        return reply

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None


class RedisCommands:
    """Raw commands in one round trip: on a ``LeanRedis`` connection where it applies, else on redis-py's
    pipeline; either way the replies in order, error replies as exceptions in the list, and a failed
    connection raised as redis-py's ``ConnectionError``/``TimeoutError``."""

    def __init__(self, redis: Redis) -> None:
        self._redis = redis
        self._lean = LeanRedis.for_client(redis)

    async def pipeline(self, *commands: tuple[Any, ...]) -> list[Any]:
        if self._lean is not None:
            return await self._lean.pipeline(*commands)
        async with self._redis.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=False))

    def close(self) -> None:
        if self._lean is not None:
            self._lean.close()
