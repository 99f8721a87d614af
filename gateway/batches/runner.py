"""The batch runner: validate a batch, run chunks of its lines, finalize it, sweep.

Called by the Celery tasks (``gateway.batches.tasks``), one unit of work per step; every step is
idempotent, so a redelivered or duplicated task is harmless.

- ``validate``: reads the input file line by line (``LineValidator``); any error → ``failed`` with the
  errors naming their lines, nothing inserted, nothing billed. Otherwise the lines become
  ``batch_items`` and the batch ``in_progress`` in one transaction (re-checked under the row lock, so
  two validators insert once), then run chains are kicked.
- ``run``: one task of a chain claims up to ``batch_chunk_size`` lines (leased), runs at most
  ``batch_line_concurrency`` at once through the interactive pipeline (``execute_line``) and records
  each result as it finishes. A watcher renews the leases and the chain slot and polls the batch every
  ``batch_status_poll_interval_s``: on cancel or expiry it stops the lines (engine aborts) and releases
  the ones not started. A line that cannot start goes back unchanged (attempt refunded): over the
  tenant's limits (TPD quota, budget, suspension) the chain ends and beat's sweep kicks it again
  later; with no capacity (interactive replicas over the soak watermark) the chain backs off for one
  poll interval and goes on.
- ``finalize``: once no line is pending or running (or, when cancelling/expiring, after the pending
  ones are marked cancelled/expired), writes the output file (completed lines) and the error file
  (the others) in line order, records them as ``batch_output`` files, and sets the final status.
  The writing transaction holds the batch row lock, so concurrent finalizers produce one set of files.
- ``sweep`` (beat): expired leases back to pending (or failed after ``batch_max_attempts``), batches
  past their window marked expiring, open batches kicked/finalized, validations re-sent, retention.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from gateway.adapters.service import list_adapters
from gateway.auth import Principal
from gateway.batches import repository as repo
from gateway.batches.dispatch import BatchDispatcher
from gateway.batches.lines import (
    DEFER_CAPACITY,
    LineResult,
    LineValidator,
    ParsedLine,
    batch_error,
    execute_line,
    line_request_id,
    output_record,
)
from gateway.batches.runtime import BatchRuntime
from gateway.batches.schemas import FINAL_STATUSES
from gateway.files.repository import FileRepository
from gateway.files.service import FileService, delete_expired, new_file_id, storage_key
from gateway.files.storage import FileMissing, FileStorage, iter_lines
from tollgate.db import Database
from tollgate.models import Batch
from tollgate.settings import Settings

logger = logging.getLogger("tollgate.batches")

GAVE_UP = {"code": "batch_attempts_exhausted",
           "message": "The request was interrupted too many times (worker failures) and was given up."}
CANCELLED = {"code": "batch_cancelled", "message": "The batch was cancelled before this request ran."}
EXPIRED = {"code": "batch_expired",
           "message": "This request could not be executed before the completion window expired."}
# The same for a line stopped while it ran: what it computed until then is billed (batch_items.cost_pico_usd).
CANCELLED_RUNNING = {"code": "batch_cancelled",
                     "message": "The batch was cancelled while this request was running; the tokens it had "
                                "computed are billed."}
EXPIRED_RUNNING = {"code": "batch_expired",
                   "message": "The completion window expired while this request was running; the tokens it "
                              "had computed are billed."}
WRITE_BATCH_LINES = 500


def owner_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class BatchRunner:
    def __init__(self, settings: Settings, db: Database, storage: FileStorage, dispatcher: BatchDispatcher,
                 runtime: Callable[[], Awaitable[BatchRuntime]]) -> None:
        self.settings = settings
        self.db = db
        self.storage = storage
        self.dispatch = dispatcher
        self._runtime = runtime

    def _lease_until(self) -> datetime:
        return datetime.now(UTC) + timedelta(seconds=self.settings.batch_lease_ttl_s)

    # -- validation ------------------------------------------------------------------------------
    async def validate(self, batch_id: str) -> str | None:
        """Validate and start the batch; returns its status afterwards (None: not found)."""
        async with self.db.session() as session:
            batch = await repo.get_batch(session, batch_id)
            if batch is None or batch.status != "validating":
                return batch.status if batch else None
            file = await FileRepository(session, batch.tenant_id).get(batch.input_file_id)
            allowed = Principal.of_owner(*await repo.owner_of(session, batch)).allowed_models
            adapters = {a.model: a.base_model for a in await list_adapters(session, batch.tenant_id)}
            endpoint = batch.endpoint
            input_file_id = batch.input_file_id
        if file is None:
            return await self._fail(batch_id, [batch_error(
                "invalid_file", f"The input file {input_file_id} was not found.", param="input_file_id")])
        served = frozenset(m.name for m in self.settings.models)
        validator = LineValidator(endpoint, served, allowed, adapters)
        lines: list[ParsedLine] = []
        number = 0
        limit = self.settings.batch_max_requests
        try:
            async for raw in iter_lines(self.storage.read(file.storage_key)):
                number += 1
                if not raw.strip():
                    continue
                if len(lines) + validator.error_count >= limit:
                    return await self._fail(batch_id, [batch_error(
                        "too_many_requests", f"A batch may have at most {limit} requests.")])
                parsed = validator.check(number, raw)
                if parsed is not None:
                    lines.append(parsed)
        except FileMissing:
            gone = batch_error("invalid_file", "The input file's content is gone.", param="input_file_id")
            return await self._fail(batch_id, [gone])
        if validator.errors:
            return await self._fail(batch_id, validator.errors)
        if not lines:
            return await self._fail(batch_id, [batch_error("empty_file", "The input file has no requests.")])
        async with self.db.session() as session:
            batch = await repo.lock_batch(session, batch_id)
            if batch is None or batch.status != "validating":
                return batch.status if batch else None
            await repo.insert_items(session, [
                {"batch_id": batch_id, "line": p.line, "custom_id": p.custom_id, "request_body": p.body,
                 "request_id": line_request_id(batch_id, p.custom_id)} for p in lines])
            batch.status = "in_progress"
            batch.in_progress_at = datetime.now(UTC)
            batch.request_total = len(lines)
            batch.model = validator.model
        await self.dispatch.kick(batch_id)
        return "in_progress"

    async def _fail(self, batch_id: str, errors: list[dict[str, Any]]) -> str | None:
        async with self.db.session() as session:
            batch = await repo.lock_batch(session, batch_id)
            if batch is None or batch.status != "validating":
                return batch.status if batch else None
            batch.status = "failed"
            batch.failed_at = datetime.now(UTC)
            batch.errors = errors
        return "failed"

    # -- running -----------------------------------------------------------------------------------
    async def run(self, batch_id: str, slot: int, token: str) -> int:
        """One task of a chain; returns how many lines it finished."""
        if not await self.dispatch.hold(batch_id, slot, token):
            return 0  # another chain owns the slot (a redelivered or superseded message)
        async with self.db.session() as session:
            batch = await repo.get_batch(session, batch_id)
            if batch is None or batch.status != "in_progress" or batch.expired_at is not None:
                stopped = batch is not None
                principal = None
            else:
                stopped = False
                tenant, key = await repo.owner_of(session, batch)
                principal = Principal.of_owner(tenant, key)
                endpoint = batch.endpoint
        if principal is None:
            await self.dispatch.end_chain(batch_id, slot, token)
            if stopped:
                await self.finalize(batch_id)
            return 0
        runtime = await self._runtime()  # before claiming: a runtime that cannot start holds no lease
        owner = owner_name()
        async with self.db.session() as session:
            claimed = await repo.claim_lines(session, batch_id, owner, self.settings.batch_chunk_size,
                                             self._lease_until())
        if not claimed:
            await self.dispatch.end_chain(batch_id, slot, token)
            await self.finalize(batch_id)
            return 0
        finished, deferred = await _Chunk(self, runtime, batch_id, endpoint, principal, owner, claimed,
                                          slot, token).run()
        if deferred == DEFER_CAPACITY:  # replicas busy with interactive work: back off a little, go on
            await asyncio.sleep(self.settings.batch_status_poll_interval_s)
        elif deferred is not None:  # over the tenant's limits: beat's sweep retries later
            await self.dispatch.end_chain(batch_id, slot, token)
            return finished
        if not await self.dispatch.continue_chain(batch_id, slot, token):
            await self.finalize(batch_id)
        return finished

    # -- finalization --------------------------------------------------------------------------------
    async def finalize(self, batch_id: str) -> str | None:
        """Finish the batch if no line is open; returns its status afterwards."""
        now = datetime.now(UTC)
        async with self.db.session() as session:
            batch = await repo.lock_batch(session, batch_id)
            if batch is None or batch.status in FINAL_STATUSES:
                return batch.status if batch else None
            cancelling = batch.status == "cancelling"
            if batch.status == "validating" and batch.expired_at is None:
                return batch.status
            if cancelling or batch.expired_at is not None:
                await repo.stop_pending_lines(session, batch_id, "cancelled" if cancelling else "expired",
                                              CANCELLED if cancelling else EXPIRED, now,
                                              CANCELLED_RUNNING if cancelling else EXPIRED_RUNNING)
            pending, running = await repo.count_open_lines(session, batch_id)
            if pending or running:
                return batch.status
            if batch.status in ("in_progress", "validating"):
                batch.status = "finalizing"
                batch.finalizing_at = now
        async with self.db.session() as session:
            batch = await repo.lock_batch(session, batch_id)
            if batch is None or batch.status in FINAL_STATUSES:
                return batch.status if batch else None
            lifetime = float(batch.output_expires_after_s or self.settings.files_retention_s)
            files = FileService(session, self.storage, self.settings, batch.tenant_id)
            batch.output_file_id = await self._write(session, files, batch, "output", True, lifetime)
            batch.error_file_id = await self._write(session, files, batch, "error", False, lifetime)
            done = datetime.now(UTC)
            if batch.status == "cancelling":
                batch.status, batch.cancelled_at = "cancelled", done
            elif batch.expired_at is not None:
                batch.status, batch.expired_at = "expired", done
            else:
                batch.status, batch.completed_at = "completed", done
            status = batch.status
        logger.info("batch %s %s", batch_id, status)
        return status

    async def _write(self, session: Any, files: FileService, batch: Batch, kind: str, completed: bool,
                     lifetime_s: float) -> str | None:
        """Write one result file; None when it would be empty."""
        items = repo.items_in_order(session, batch.id, completed=completed)
        first = await anext(items, None)
        if first is None:
            return None

        async def chunks() -> AsyncIterator[bytes]:
            buffer = [orjson.dumps(output_record(first))]
            async for item in items:
                buffer.append(orjson.dumps(output_record(item)))
                if len(buffer) >= WRITE_BATCH_LINES:
                    yield b"\n".join(buffer) + b"\n"
                    buffer = []
            if buffer:
                yield b"\n".join(buffer) + b"\n"

        file_id = new_file_id()
        key = storage_key(batch.tenant_id, file_id)
        size = await self.storage.write(key, chunks(), max_bytes=2**62)
        await files.record_output(file_id=file_id, filename=f"{batch.id}_{kind}.jsonl", size=size, key=key,
                                  lifetime_s=lifetime_s)
        return file_id

    # -- sweep ---------------------------------------------------------------------------------------
    async def sweep(self) -> dict[str, int]:
        settings = self.settings
        now = datetime.now(UTC)
        async with self.db.session() as session:
            _touched, freed = await repo.sweep_expired_leases(session, now, settings.batch_max_attempts,
                                                              GAVE_UP)
            for batch_id in await repo.due_for_expiry(session, now):
                batch = await repo.lock_batch(session, batch_id)
                if batch is not None and batch.expired_at is None:
                    batch.expired_at = now
            open_batches = await repo.batches_in(session, repo.ACTIVE_STATUSES)
        kicked = finalized = 0
        stale = now - timedelta(seconds=settings.batch_lease_ttl_s)
        for batch in open_batches:
            try:
                if batch.status == "validating" and batch.expired_at is None:
                    if batch.created_at < stale:
                        await self.dispatch.revalidate(batch.id)
                elif batch.status == "in_progress" and batch.expired_at is None:
                    kicked += await self.dispatch.kick(batch.id)
                elif await self.finalize(batch.id) in FINAL_STATUSES:
                    finalized += 1
            except Exception:  # one bad batch must not stop the sweep of the others
                logger.exception("sweeping batch %s failed", batch.id)
        removed_files, removed_items = await self.retention(now)
        return {"freed_leases": freed, "kicked": kicked, "finalized": finalized,
                "removed_files": removed_files, "removed_items": removed_items}

    async def retention(self, now: datetime) -> tuple[int, int]:
        """Delete expired files (rows, then bytes after the commit) and old finished batches' lines."""
        async with self.db.session() as session:
            stored = await delete_expired(session, now)
            items = await repo.delete_items_of_finished_batches(
                session, now - timedelta(seconds=self.settings.files_retention_s))
        for obj in stored:
            await self.storage.delete(obj.storage_key)
        return len(stored), items


class _Chunk:
    """The lines one task claimed, run with bounded concurrency under a lease/status watcher."""

    def __init__(self, runner: BatchRunner, runtime: BatchRuntime, batch_id: str, endpoint: str,
                 principal: Principal, owner: str, claimed: list[repo.ClaimedLine], slot: int,
                 token: str) -> None:
        self.runner = runner
        self.runtime = runtime
        self.batch_id = batch_id
        self.endpoint = endpoint
        self.principal = principal
        self.owner = owner
        self.claimed = claimed
        self.slot = slot
        self.token = token
        self.held = {c.id for c in claimed}
        self.stops = {c.id: asyncio.Event() for c in claimed}
        self.lost: set[int] = set()  # lines whose lease another chain took: they run again there
        self.stopping = False
        self.deferred: str | None = None
        self.finished = 0

    async def run(self) -> tuple[int, str | None]:
        semaphore = asyncio.Semaphore(self.runner.settings.batch_line_concurrency)
        watcher = asyncio.create_task(self._watch(), name=f"tollgate-batch-watch-{self.batch_id}")
        try:
            await asyncio.gather(*(self._line(line, semaphore) for line in self.claimed))
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        return self.finished, self.deferred

    async def _line(self, line: repo.ClaimedLine, semaphore: asyncio.Semaphore) -> None:
        db = self.runner.db
        async with semaphore:
            if self.stopping or self.deferred is not None or line.id not in self.held:
                async with db.session() as session:
                    await repo.release_line(session, line.id, self.owner, refund_attempt=True)
                return
            try:
                result = await execute_line(self.runtime, self.principal, self.endpoint, line.request_id,
                                            line.body, self.stops[line.id],
                                            retried=lambda: line.id in self.lost)  # fmt: skip
            except Exception:
                logger.exception("batch %s line %d crashed; it will be retried", self.batch_id, line.line)
                result = LineResult(status_code=500, body={"error": {
                    "message": "The server had an error while processing this request.",
                    "type": "server_error", "param": None, "code": None}})
        await self._record(line, result)

    async def _record(self, line: repo.ClaimedLine, result: LineResult) -> None:
        settings = self.runner.settings
        async with self.runner.db.session() as session:
            if result.deferred is not None:
                self.deferred = self.deferred or result.deferred
                await repo.release_line(session, line.id, self.owner, refund_attempt=True)
                return
            if result.status_code is None:  # stopped by cancel/expiry/lost lease: finalize decides
                await repo.release_line(session, line.id, self.owner, refund_attempt=False,
                                        cost_pico_usd=result.cost_pico_usd)
                return
            retryable = result.status_code >= 500 and line.attempts < settings.batch_max_attempts
            if not result.succeeded and retryable:
                await repo.release_line(session, line.id, self.owner, refund_attempt=False)
                return
            recorded = await repo.finish_item(
                session, self.batch_id, line.id, self.owner,
                status="completed" if result.succeeded else "failed", finished_at=datetime.now(UTC),
                response_status=result.status_code, response=result.body,
                served_pool=result.served_pool,
                tokens=result.usage() if result.succeeded else None,
                cost_pico_usd=result.cost_pico_usd)
        if recorded:
            self.finished += 1
        else:
            logger.warning("batch %s line %d finished after its lease was lost; result discarded",
                           self.batch_id, line.line)

    async def _watch(self) -> None:
        runner = self.runner
        interval = min(runner.settings.batch_status_poll_interval_s, runner.settings.batch_lease_ttl_s / 3)
        while True:
            await asyncio.sleep(interval)
            try:
                async with runner.db.session() as session:
                    self.held = await repo.renew_leases(session, list(self.held), self.owner,
                                                        runner._lease_until())
                    batch = await repo.get_batch(session, self.batch_id)
                await runner.dispatch.hold(self.batch_id, self.slot, self.token)
            except Exception:
                logger.exception("batch %s: lease renewal failed", self.batch_id)
                continue
            if batch is None or batch.status != "in_progress" or batch.expired_at is not None:
                self.stopping = True
            for line_id, stop in self.stops.items():
                if line_id not in self.held and not self.stopping:  # (a cancelled line runs nowhere again)
                    self.lost.add(line_id)
                if self.stopping or line_id not in self.held:
                    stop.set()
