"""A Redis stream read by a consumer group, for outboxes copied into Postgres by a flusher.

``StreamGroup`` is one consumer of one group on one stream. ``next_entries`` collects up to a batch of
entries: the consumer's own pending ones first (a batch whose write failed before), then entries other
consumers left pending longer than ``claim_idle_ms`` (their process died: ``XAUTOCLAIM``), then new ones
(``XREADGROUP >``). ``acknowledge`` removes entries (``XACK`` + ``XDEL`` in one ``MULTI``, with any extra
commands the caller adds) once what they carry is committed; until then they stay pending, so a crash
or a database outage loses nothing and the next flush retries them.

Users: the usage outbox (``billing.ledger``) and the stored-response outbox (``gateway.responses.store``).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

Entry = tuple[str, dict[bytes, bytes] | None]


def consumer_name() -> str:
    """This process's consumer name (host and pid: one per worker process)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def claim_idle_ms(flush_interval_s: float) -> int:
    """How long another consumer's pending entries wait before a flusher takes them over: 30 flush
    intervals (30 s at the default 1 s), far above one batch's write time."""
    return max(100, int(flush_interval_s * 30_000))


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _stream_entries(reply: Any) -> list[Entry]:
    """Entries of our one stream from an XREADGROUP reply (RESP2 list or RESP3 dict)."""
    if not reply:
        return []
    batches = list(reply.values()) if isinstance(reply, dict) else [entries for _, entries in reply]
    return [(text(entry[0]), entry[1] or None) for entries in batches for entry in entries]


class StreamGroup:
    def __init__(self, redis: Redis, stream: str, group: str, *, consumer: str,
                 claim_idle_ms: int = 60_000) -> None:
        if claim_idle_ms < 0:
            raise ValueError("claim_idle_ms must be >= 0")
        self.redis, self.stream, self.group = redis, stream, group
        self.consumer = consumer
        self.claim_idle_ms = claim_idle_ms

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def next_entries(self, want: int) -> list[Entry]:
        """Up to ``want`` entries, each once; an entry deleted from the stream while pending comes back
        with ``None`` fields (acknowledge it)."""
        seen: set[str] = set()
        entries: list[Entry] = []

        def take(batch: list[Entry]) -> None:
            for entry_id, fields in batch:
                if entry_id not in seen and len(entries) < want:
                    seen.add(entry_id)
                    entries.append((entry_id, fields))

        take(_stream_entries(await self.redis.xreadgroup(
            self.group, self.consumer, {self.stream: "0"}, count=want)))
        if len(entries) < want:
            reply = await self.redis.xautoclaim(self.stream, self.group, self.consumer,
                                                self.claim_idle_ms, "0-0", count=want - len(entries))
            take([(text(entry_id), fields or None) for entry_id, fields in reply[1]])
            take([(text(entry_id), None) for entry_id in (reply[2] if len(reply) > 2 else [])])
        if len(entries) < want:
            take(_stream_entries(await self.redis.xreadgroup(
                self.group, self.consumer, {self.stream: ">"}, count=want - len(entries))))
        return entries

    async def acknowledge(self, entry_ids: list[str],
                          also: Callable[[Pipeline], None] | None = None) -> None:
        """``XACK`` + ``XDEL`` ``entry_ids`` in one transaction, after ``also``'s commands."""
        async with self.redis.pipeline(transaction=True) as pipe:
            if also is not None:
                also(pipe)
            if entry_ids:
                pipe.xack(self.stream, self.group, *entry_ids)
                pipe.xdel(self.stream, *entry_ids)
            await pipe.execute()

    async def forget_idle_consumers(self, idle_ms: int) -> int:
        """Remove consumers (dead worker processes) with nothing pending that have been idle longer
        than ``idle_ms``, so the group's consumer list does not grow forever."""
        removed = 0
        for info in await self.redis.xinfo_consumers(self.stream, self.group):
            name = text(info["name"])
            if name != self.consumer and info["pending"] == 0 and info["idle"] > idle_ms:
                removed += await self.redis.xgroup_delconsumer(self.stream, self.group, name)
        return removed
