"""Sending batch tasks to Celery, and the bounded set of run *chains* per batch.

A chain is a sequence of short ``batches.run`` tasks: each claims one chunk of lines, runs it, and
sends its successor while lines remain. A batch has at most ``batch_tasks_per_batch`` chains, one per
*slot*; slot ``s`` is owned through the Redis key ``tollgate:batch:chain:<batch id>:<s>`` whose value is
the chain's token, with a TTL of ``batch_lease_ttl_s`` refreshed by every task of the chain.

Invariants:
- ``kick`` starts a chain only for a free slot (``SET NX``), so beat's sweep may kick every open batch
  every interval without piling up tasks; a chain whose worker died frees its slot when the key
  expires, and the next sweep starts a new one. A task whose token no longer owns its slot (a
  redelivered or superseded message) runs no successor.
- Sending is synchronous in Celery; from async code it runs in a worker thread.
"""

from __future__ import annotations

import uuid
from typing import Any

from celery import Celery
from redis.asyncio import Redis

from tollgate.settings import Settings
from tollgate.task_sender import TaskSender

VALIDATE_TASK = "batches.validate"
RUN_TASK = "batches.run"
FINALIZE_TASK = "batches.finalize"
SWEEP_TASK = "batches.sweep"

# Compare-and-delete / compare-and-refresh of a slot key (only its owner may touch it).
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_HOLD_LUA = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] or not current then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


def chain_key(batch_id: str, slot: int) -> str:
    return f"tollgate:batch:chain:{batch_id}:{slot}"


class BatchDispatcher:
    def __init__(self, settings: Settings, redis: Redis, celery_app: Celery | None = None) -> None:
        self.settings = settings
        self.redis = redis
        self.sender = TaskSender(settings, celery_app)
        self._ttl_ms = max(1, int(settings.batch_lease_ttl_s * 1000))

    async def _send(self, name: str, args: list[Any], **options: Any) -> None:
        await self.sender.send(name, args, **options)

    async def validate(self, batch_id: str) -> None:
        await self._send(VALIDATE_TASK, [batch_id])

    async def revalidate(self, batch_id: str) -> bool:
        """Re-send a validation whose message may have been lost, at most once per five lease periods
        (a long validation is still running meanwhile; a second one would only repeat its work)."""
        if not await self.redis.set(f"tollgate:batch:revalidate:{batch_id}", 1, nx=True, px=5 * self._ttl_ms):
            return False
        await self.validate(batch_id)
        return True

    async def finalize(self, batch_id: str) -> None:
        await self._send(FINALIZE_TASK, [batch_id])

    async def kick(self, batch_id: str) -> int:
        """Start a chain in every free slot; returns how many were started."""
        started = 0
        for slot in range(self.settings.batch_tasks_per_batch):
            token = uuid.uuid4().hex
            if await self.redis.set(chain_key(batch_id, slot), token, nx=True, px=self._ttl_ms):
                await self._send(RUN_TASK, [batch_id, slot, token])
                started += 1
        return started

    async def hold(self, batch_id: str, slot: int, token: str) -> bool:
        """Refresh the slot's TTL if ``token`` owns it (or adopt a free slot); False if another chain
        owns it."""
        return bool(await self.redis.eval(_HOLD_LUA, 1, chain_key(batch_id, slot), token, str(self._ttl_ms)))

    async def continue_chain(self, batch_id: str, slot: int, token: str) -> bool:
        """Send the chain's next task if ``token`` still owns the slot."""
        if not await self.hold(batch_id, slot, token):
            return False
        await self._send(RUN_TASK, [batch_id, slot, token])
        return True

    async def end_chain(self, batch_id: str, slot: int, token: str) -> None:
        await self.redis.eval(_RELEASE_LUA, 1, chain_key(batch_id, slot), token)
