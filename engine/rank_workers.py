"""Ranks 1..N-1 of a tensor-parallel replica: a process each, driven by rank 0 (docs/engine-internals.md).

Rank 0 is the engine process: it owns the scheduler, the block manager and its tiers, the KV events
and the HTTP server. ``RankWorkers`` (rank 0) spawns the other ranks; each builds a ``ModelRunner``
over its shard (``engine.distributed``) and then runs, in rank 0's order, what rank 0 sends down its
pipe: each step's inputs (host arrays; the block tables are the same on every rank), each step's
tier copies and the KV blocks pulled from a prefill replica. The input ids are broadcast from rank 0
inside the forward pass (decode ids sampled on rank 0's device never come back to a host), so a worker
needs nothing else. Only rank 0 samples. The one message a worker answers is a read of its heads of
leased KV blocks (``ask``, from a prefill replica's transfer threads, any thread): the answer comes back
up the same pipe once the worker has run what was sent to it before; one question is in flight at a
time, and the pipe's writers take turns.

Failure, never a hang:

- a worker that exits (crash, OOM kill, SIGKILL) is noticed by rank 0's watchdog thread, which logs which
  rank died and ends the engine process with ``RANK_DIED_EXIT_CODE`` (a collective with a dead peer
  could block forever); the supervisor or Kubernetes restarts the replica whole;
- a worker whose rank 0 is gone (its pipe closes, or its parent process exits) exits at once.

Workers start with ``spawn`` (never ``fork``: the engine process has threads and, on a GPU, a CUDA
context); ``close`` stops them and waits.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.kv.tiers import TransferPlan

logger = logging.getLogger(__name__)

RANK_DIED_EXIT_CODE = 70
_START_TIMEOUT_S = 600.0


class RankWorkers:
    """Rank 0's handle on ranks 1..N-1."""

    def __init__(self, config: EngineConfig, target: Callable[..., None]) -> None:
        """Spawn ranks 1..N-1, each running ``target(config, rank, init_method, conn)`` (a module-level
        function that builds the rank's runner and calls ``serve``)."""
        size = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="tollgate-tp-")
        self.init_method = Path(self._dir, "rendezvous").as_uri()
        ctx = mp.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs: list[Any] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=target, args=(config, rank, self.init_method, theirs),
                               name=f"tollgate-tp-rank-{rank}", daemon=True)  # fmt: skip
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._closing = False
        self._lock = threading.Lock()
        # The engine thread sends steps while transfer threads ask for KV shards: one writer per pipe at a
        # time, and one question in flight (its answers are the only messages that come back).
        self._send_locks = [threading.Lock() for _ in self._conns]
        self._ask_lock = threading.Lock()
        # Interpreter exit stops daemon processes: that must not read as a rank dying.
        atexit.register(self._mark_closing)
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def send(self, message: tuple[str, Any]) -> None:
        """Send every worker the same message (they run them in order). A dead worker's broken pipe is
        left to the watchdog."""
        for conn, lock in zip(self._conns, self._send_locks, strict=True):
            with lock:
                _send(conn, message)

    def send_each(self, messages: list[tuple[str, Any]]) -> None:
        """Send worker ``r`` (ranks 1..N-1) ``messages[r - 1]``: what differs by rank (its shard of a LoRA
        adapter being loaded)."""
        for conn, lock, message in zip(self._conns, self._send_locks, messages, strict=True):
            with lock:
                _send(conn, message)

    def ask(self, ranks: list[int], message: tuple[str, Any]) -> list[Any]:
        """Send ``message`` to workers ``ranks`` (each runs it after what was sent to it before) and return
        their answers, in order (any thread). ``RuntimeError`` if a worker cannot answer: it failed to
        run it, or it is gone (then the watchdog ends the replica)."""
        with self._ask_lock:
            for rank in ranks:
                with self._send_locks[rank - 1]:
                    _send(self._conns[rank - 1], message)
            answers = []
            for rank in ranks:
                try:
                    ok, answer = self._conns[rank - 1].recv()
                except (EOFError, OSError) as exc:  # (a broken pipe on the way out ends here too)
                    raise RuntimeError(f"tensor-parallel rank {rank} did not answer {message[0]!r}") from exc
                if not ok:
                    raise RuntimeError(f"tensor-parallel rank {rank} failed {message[0]!r}: {answer}")
                answers.append(answer)
            return answers

    def send_plan(self, plan: TransferPlan | None) -> None:
        """A step's tier copies to every worker: its own payload of each block read from disk (rank 0
        read them all), and no reads of its own."""
        for rank, conn in enumerate(self._conns, start=1):
            mine = plan
            if plan is not None and (plan.fill or plan.read):
                mine = replace(plan, read=[], fill=[(slot, data[rank]) for slot, data in plan.fill])  # type: ignore[index]
            with self._send_locks[rank - 1]:
                _send(conn, ("transfer", mine))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the workers (after the messages already sent) and wait for them."""
        self._mark_closing()
        self.send(("stop", None))
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _mark_closing(self) -> None:
        with self._lock:
            self._closing = True

    def _watch(self) -> None:
        sentinels = {p.sentinel: (rank, p) for rank, p in enumerate(self._procs, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        with self._lock:
            if self._closing:
                return
        rank, proc = sentinels[ready[0]]  # type: ignore[index]
        proc.join(1)
        logger.critical("tensor-parallel rank %d (pid %d) exited with code %s: the replica cannot go on "
                        "without it; exiting with code %d so that it is restarted whole", rank, proc.pid,
                        proc.exitcode, RANK_DIED_EXIT_CODE)
        for handler in logging.getLogger().handlers:
            handler.flush()
        for other in self._procs:
            if other.is_alive():
                other.kill()
        os._exit(RANK_DIED_EXIT_CODE)


def _send(conn: multiprocessing.connection.Connection, message: tuple[Any, Any]) -> None:
    """Send to one worker; a dead worker's broken pipe is left to the watchdog."""
    try:
        conn.send(message)
    except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
        pass


def exit_with_parent() -> None:
    """End this worker as soon as rank 0's process is gone (a collective would wait for it forever)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


class RankRunner(Protocol):
    def run_on_worker(self, kind: str, payload: object) -> None: ...

    def answer(self, kind: str, payload: object) -> object: ...

    def close(self) -> None: ...


def start_rank(rank: int) -> None:
    """First thing in a worker process: exit with rank 0, log under the rank's name."""
    exit_with_parent()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")


ASKED = frozenset({"kv_read"})  # the messages a worker answers (``RankWorkers.ask``)


def serve(runner: RankRunner, conn: multiprocessing.connection.Connection) -> None:
    """Run what rank 0 sends, in order, until it says stop or is gone; then close the runner. A question
    (``ASKED``) is answered ``(True, answer)``, or ``(False, why)`` if it failed: the worker goes on."""
    try:
        while True:
            try:
                kind, payload = conn.recv()
            except (EOFError, OSError):
                break  # rank 0 is gone
            if kind == "stop":
                break
            if kind not in ASKED:
                runner.run_on_worker(kind, payload)
                continue
            try:
                reply: tuple[bool, object] = (True, runner.answer(kind, payload))
            except Exception as exc:  # rank 0's transfer ends early; the replica goes on
                logger.exception("answering %r failed", kind)
                reply = (False, repr(exc))
            _send(conn, reply)
    finally:
        runner.close()
