"""The last resort for a usage record Redis would not take: a local file, replayed into the outbox.

A request admitted while Redis was up may finish while it is down (killed, restarting, failing over). Its
usage record is then the only copy of what its client was told, and memory is not a place to keep it: the
process may be the next thing to die. So ``UsageSpool.keep`` appends the record as one JSON line to this
process's file ``DIR/usage-<pid>.jsonl`` (flushed and fsynced: this path runs only during an outage), and
``drain`` (a background task of every gateway and worker process, ``run``) appends the kept records to the
outbox once Redis answers, then drops them from the file. Files of processes that died are adopted: renamed
to the adopter's own name (atomically, so exactly one adopter takes a file) and drained with its own.

Invariants:
- A record leaves the spool only after Redis acknowledged its ``XADD``. A record appended twice (Redis took
  it, then the connection broke before the answer) is still one ledger row: ``request_id`` is the ledger's
  idempotency key (``billing.ledger``).
- One process writes one file (its pid in the name). A file is adopted only while no process of its pid
  runs; a restarted process that got the dead one's pid simply drains the file as its own.
- ``keep`` never raises (a disk that refuses the write is logged with the record: the last copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import RedisError

from billing.outbox import UsageRecord, append_usage

logger = logging.getLogger("tollgate.billing.usage_spool")

PREFIX = "usage-"
SUFFIX = ".jsonl"


def _owner(path: Path) -> int | None:
    """The pid whose file ``path`` is: ``usage-<pid>.jsonl``, or ``usage-<x>.jsonl.<pid>.adopting``."""
    parts = path.name.split(".")
    if path.name.endswith(".adopting") and len(parts) == 4 and parts[2].isdigit():
        return int(parts[2])
    pid = path.name.removeprefix(PREFIX).removesuffix(SUFFIX)
    return int(pid) if path.name.endswith(SUFFIX) and pid.isdigit() else None


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class UsageSpool:
    def __init__(self, directory: Path, *, retry_interval_s: float = 1.0) -> None:
        self.directory = directory
        self.retry_interval_s = retry_interval_s
        self.pid = os.getpid()
        self._kept = 0  # records this process kept since it started (for logs and tests)

    @property
    def path(self) -> Path:
        return self.directory / f"{PREFIX}{os.getpid()}{SUFFIX}"

    def keep(self, record: UsageRecord) -> bool:
        """Append ``record`` durably; False (after logging the record) if the disk refused it."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with open(self.path, "ab") as spool:
                spool.write(record.to_json() + b"\n")
                spool.flush()
                os.fsync(spool.fileno())
        except OSError as exc:
            logger.error("USAGE NOT RECORDED for request %s: Redis and the spool %s both refused it: %r (%s)",
                         record.request_id, self.path, exc, record.to_json().decode())
            return False
        self._kept += 1
        logger.warning("usage of request %s kept in %s until Redis takes it", record.request_id, self.path)
        return True

    def pending(self) -> bool:
        """Whether this process's file, or one left by a dead process, holds records."""
        with contextlib.suppress(OSError):
            return any(_owner(p) is not None and p.stat().st_size > 0
                       for p in self.directory.glob(f"{PREFIX}*"))
        return False

    def _adopt_orphans(self) -> None:
        """Move the records of dead processes' files into this process's file. An adopter that dies
        mid-way leaves its claimed file (``*.<pid>.adopting``) to be adopted in turn; merging one twice
        only appends records twice (one ledger row each)."""
        mine, me = self.path, os.getpid()
        for path in self.directory.glob(f"{PREFIX}*"):
            owner = _owner(path)
            if path == mine or owner is None or (owner != me and _pid_running(owner)):
                continue
            claimed = path.with_name(f"{path.name.split('.', 1)[0]}{SUFFIX}.{me}.adopting")
            try:
                path.rename(claimed)  # one adopter wins; the others find the file gone
            except FileNotFoundError:
                continue
            data = claimed.read_bytes()
            if data and not data.endswith(b"\n"):
                data += b"\n"  # a line cut by the writer's death stays one (unparseable) line
            with open(mine, "ab") as spool:
                spool.write(data)
                spool.flush()
                os.fsync(spool.fileno())
            claimed.unlink()

    async def drain(self, redis: Redis) -> int:
        """Append every kept record to the outbox; returns how many left the spool. Raises ``RedisError``
        while Redis still refuses (what was appended by then has left the spool)."""
        if not self.directory.is_dir():
            return 0
        self._adopt_orphans()
        path = self.path
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return 0
        done = 0
        appended = 0
        try:
            for line in data.splitlines(keepends=True):
                if not line.endswith(b"\n"):
                    break  # being written (never here: keep() writes whole lines between awaits)
                if line.strip():
                    try:
                        record = UsageRecord.from_json(line)
                    except (ValueError, KeyError, TypeError) as exc:
                        logger.error("dropping an unreadable spooled usage line %r: %r", line[:200], exc)
                    else:
                        await append_usage(redis, record)
                        appended += 1
                done += len(line)
        finally:
            self._drop_prefix(path, done)
        if appended:
            logger.warning("%d spooled usage records appended to the outbox", appended)
        return appended

    @staticmethod
    def _drop_prefix(path: Path, size: int) -> None:
        """Remove the first ``size`` bytes (drained) of ``path``, keeping lines kept meanwhile. No await in
        here: ``keep`` (synchronous, on the same event loop) cannot interleave."""
        if size == 0:
            return
        rest = path.read_bytes()[size:]
        if not rest:
            path.unlink()
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(rest)
        tmp.replace(path)

    async def run(self, redis: Redis) -> None:
        """Drain every ``retry_interval_s`` while anything is kept (a background task)."""
        while True:
            if self.pending():
                try:
                    await self.drain(redis)
                except (RedisError, OSError) as exc:
                    logger.info("spooled usage waits for Redis: %r", exc)
            await asyncio.sleep(self.retry_interval_s)
