"""A small process supervisor: a table of children, health waits, a restart policy, signal handling.

Invariants:
- Each child is spawned by ``tollgate.processes.spawn``: its own process group, stdout/stderr appended
  to its log file, sent its stop signal if we die. ``stop_all`` stops children in reverse start order (clients
  before the servers they use), consecutive children of one ``stop_group`` together (the engine replicas,
  the data stores), and signals whole groups, so no process of ours survives it.
- A child that exits is always reported (name, pid, status, log). One whose spec says ``restart`` is
  started again after an exponential backoff (``restart_backoff_s`` doubling up to
  ``restart_backoff_max_s``; the count resets once it has been healthy that long); any other child's
  exit makes ``run`` return 1, so the caller stops everything instead of running half a platform.
- Health is a probe per child (HTTP ``/health``, a heartbeat, a connection), polled every
  ``health_poll_interval_s`` while any child is not healthy and every ``idle_poll_interval_s`` once all
  are (an idle platform costs its supervisor little; an exit is noticed at once either way);
  transitions between healthy and unhealthy are reported once each.
- SIGINT/SIGTERM (and SIGCHLD, to notice exits at once) wake the loop through a self-pipe
  (``signal.set_wakeup_fd``); a stop request interrupts a health wait as well as ``run``.
- ``status_path``, when given, always holds the current table as JSON (pids, states, restarts).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tollgate.processes import spawn, stop

HealthProbe = Callable[[subprocess.Popen[bytes]], bool]


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived while waiting."""


class StartupFailed(RuntimeError):
    """A child exited during startup or was not healthy in time (the message ends with its log's tail)."""


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    log_path: Path
    health: HealthProbe
    restart: bool = True
    stop_signal: int = signal.SIGTERM
    # How long a stop waits before SIGKILL; None: the supervisor's stop_timeout_s. A gateway gets its
    # drain timeout (plus a margin) so that stopping the platform does not cut its streams short.
    stop_timeout_s: float | None = None
    # Children started one after the other with the same group are stopped at once (their stops wait in
    # parallel); None: alone.
    stop_group: str | None = None
    user: str | None = None
    cwd: Path | None = None
    env: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.argv:
            raise ValueError("a process needs a name and a command")


@dataclass
class Child:
    spec: ProcessSpec
    proc: subprocess.Popen[bytes] | None = None
    state: str = "starting"  # starting | healthy | unhealthy | backoff | exited | stopped
    restarts: int = 0
    consecutive_failures: int = 0
    started_at: float = 0.0
    healthy_since: float | None = None
    restart_at: float | None = None
    last_exit: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log yet)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])


def http_probe(url: str, timeout: float) -> HealthProbe:
    """Healthy when ``GET url`` answers 200. One HTTP client for the probe's life: ``httpx.get`` builds a
    client, and with it a TLS context, per call (~30 ms of CPU; a probe a second per child kept an idle
    ``tollgate up`` at ~12% of a core); a reused one costs ~0.2 ms."""
    client: httpx.Client | None = None

    def probe(_proc: subprocess.Popen[bytes]) -> bool:
        nonlocal client
        if client is None:
            client = httpx.Client(timeout=timeout)
        try:
            return client.get(url).status_code == 200
        except httpx.HTTPError:
            return False

    return probe


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class StopSignals:
    """Context manager turning SIGINT/SIGTERM into a stop request and SIGCHLD into a wake-up."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}
        self._read_fd = self._write_fd = -1
        self._old_wakeup = -1

    def __enter__(self) -> StopSignals:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self._old_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._on_stop)
        self._old[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda *_: None)
        return self

    def _on_stop(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signum

    def wait(self, timeout: float) -> None:
        """Sleep up to ``timeout`` seconds, less if a signal arrives; ``StopRequested`` once one did."""
        if self.received is None and timeout > 0:
            ready, _, _ = select.select([self._read_fd], [], [], timeout)
            if ready:
                try:
                    while os.read(self._read_fd, 512):
                        pass
                except BlockingIOError:
                    pass
        if self.received is not None:
            raise StopRequested(signal.Signals(self.received).name)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._old_wakeup)
        os.close(self._read_fd)
        os.close(self._write_fd)


class Supervisor:
    def __init__(self, *, signals: StopSignals, report: Callable[[str], None], health_poll_interval_s: float,
                 restart_backoff_s: float, restart_backoff_max_s: float, stop_timeout_s: float,
                 status_path: Path | None = None, idle_poll_interval_s: float | None = None) -> None:
        if health_poll_interval_s <= 0 or restart_backoff_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("poll interval, restart backoff and stop timeout must be positive")
        if restart_backoff_max_s < restart_backoff_s:
            raise ValueError("restart_backoff_max_s must be >= restart_backoff_s")
        self.signals = signals
        self.report = report
        self.poll_s = health_poll_interval_s
        self.idle_poll_s = max(idle_poll_interval_s or health_poll_interval_s, health_poll_interval_s)
        self.backoff_s = restart_backoff_s
        self.backoff_max_s = restart_backoff_max_s
        self.stop_timeout_s = stop_timeout_s
        self.status_path = status_path
        self.children: dict[str, Child] = {}
        self.ready = False
        self._next_probe = 0.0

    # ------------------------------------------------------------------ starting

    def start(self, spec: ProcessSpec) -> Child:
        if spec.name in self.children:
            raise ValueError(f"a process named {spec.name!r} is already supervised")
        child = Child(spec)
        self.children[spec.name] = child
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> int:
        spec = child.spec
        child.proc = spawn(spec.argv, log_path=spec.log_path, user=spec.user, cwd=spec.cwd, env=spec.env,
                           parent_death_signal=spec.stop_signal)
        child.state, child.started_at = "starting", time.monotonic()
        child.healthy_since = child.restart_at = None
        self.write_status()
        return child.proc.pid

    def wait_healthy(self, names: Iterable[str], timeout: float) -> None:
        """Block until every named child passes its probe; ``StartupFailed`` if one exits or times out."""
        pending = list(names)
        deadline = time.monotonic() + timeout
        while pending:
            for name in list(pending):
                child = self.children[name]
                if child.proc is None:
                    raise StartupFailed(f"{name} was never started")
                code = child.proc.poll()
                if code is not None:
                    child.state, child.last_exit = "exited", code
                    self.write_status()
                    log = child.spec.log_path
                    raise StartupFailed(f"{name} {describe_exit(code)} while starting; its log ({log}) ends "
                                        f"with:\n{log_tail(log)}")
                if child.spec.health(child.proc):
                    self._mark_healthy(child)
                    pending.remove(name)
            if pending and time.monotonic() > deadline:
                name = pending[0]
                raise StartupFailed(f"{name} was not healthy within {timeout:.0f}s; its log "
                                    f"({self.children[name].spec.log_path}) ends with:\n"
                                    f"{log_tail(self.children[name].spec.log_path)}")
            if pending:
                self.signals.wait(min(self.poll_s, 0.25))

    def _mark_healthy(self, child: Child) -> None:
        if child.state != "healthy":
            if child.state == "unhealthy":
                self.report(f"{child.spec.name} is healthy again")
            child.state, child.healthy_since = "healthy", time.monotonic()
            self.write_status()

    # ------------------------------------------------------------------ running

    def run(self) -> int:
        """Supervise until a stop signal (returns 0) or the exit of a child that is not restarted (1)."""
        self.ready = True
        self.write_status()
        try:
            while self.step():
                self.signals.wait(self._next_wake(self._next_probe))
        except StopRequested:
            return 0
        return 1

    def step(self) -> bool:
        """One pass: reap and restart children, probe health when due. False when the platform must stop."""
        now = time.monotonic()
        for child in self.children.values():
            if not self._check_exit(child, now):
                return False
        settled = all(child.state == "healthy" for child in self.children.values())
        if not settled:  # a child exited or turned unhealthy during an idle interval: probe at the usual pace
            self._next_probe = min(self._next_probe, now + self.poll_s)
        if now >= self._next_probe:
            for child in self.children.values():
                self._probe(child)
            settled = all(child.state == "healthy" for child in self.children.values())
            self._next_probe = now + (self.idle_poll_s if settled else self.poll_s)
        return True

    def _next_wake(self, next_probe: float) -> float:
        wake = next_probe
        for child in self.children.values():
            if child.restart_at is not None:
                wake = min(wake, child.restart_at)
        return max(0.0, wake - time.monotonic())

    def _check_exit(self, child: Child, now: float) -> bool:
        """Handle an exited child; False when the platform must stop."""
        if child.state == "backoff":
            if child.restart_at is not None and now >= child.restart_at:
                child.restarts += 1
                pid = self._spawn(child)
                self.report(f"{child.spec.name} restarted (pid {pid}, restart #{child.restarts})")
            return True
        proc = child.proc
        if proc is None or proc.poll() is None:
            return True
        code = proc.returncode
        child.last_exit = code
        stop(proc, timeout=self.stop_timeout_s)  # reap it and any process it left in its group
        message = f"{child.spec.name} (pid {proc.pid}) {describe_exit(code)}; log: {child.spec.log_path}"
        if not child.spec.restart:
            child.state = "exited"
            self.write_status()
            self.report(f"{message}\n{log_tail(child.spec.log_path)}\n"
                        f"{child.spec.name} is not restarted automatically: stopping everything")
            return False
        if child.healthy_since is not None and now - child.healthy_since >= self.backoff_max_s:
            child.consecutive_failures = 0
        child.consecutive_failures += 1
        delay = min(self.backoff_s * 2 ** (child.consecutive_failures - 1), self.backoff_max_s)
        child.state, child.restart_at, child.healthy_since = "backoff", now + delay, None
        self.write_status()
        self.report(f"{message}; restarting in {delay:.2f}s")
        return True

    def _probe(self, child: Child) -> None:
        if child.proc is None or child.state in ("backoff", "exited", "stopped"):
            return
        if child.proc.poll() is not None:
            return
        if child.spec.health(child.proc):
            self._mark_healthy(child)
        elif child.state == "healthy":
            child.state, child.healthy_since = "unhealthy", None
            self.write_status()
            self.report(f"{child.spec.name} (pid {child.proc.pid}) fails its health check")

    # ------------------------------------------------------------------ stopping

    def stop_all(self) -> None:
        self.ready = False
        stages: list[list[Child]] = []
        for child in reversed(list(self.children.values())):
            group = child.spec.stop_group
            if stages and group is not None and stages[-1][0].spec.stop_group == group:
                stages[-1].append(child)
            else:
                stages.append([child])
        for stage in stages:
            with ThreadPoolExecutor(max_workers=len(stage)) as pool:
                list(pool.map(self._stop_child, stage))
        self.write_status()

    def _stop_child(self, child: Child) -> None:
        if child.proc is not None and child.state != "stopped":
            timeout = child.spec.stop_timeout_s or self.stop_timeout_s
            stop(child.proc, sig=child.spec.stop_signal, timeout=timeout)
        child.state = "stopped"

    def write_status(self) -> None:
        if self.status_path is None:
            return
        table = {
            name: {"pid": c.proc.pid if c.proc else None, "state": c.state, "restarts": c.restarts,
                   "last_exit": c.last_exit, "log": str(c.spec.log_path), **c.extra}
            for name, c in self.children.items()
        }
        body = json.dumps({"pid": os.getpid(), "ready": self.ready, "processes": table}, indent=2)
        tmp = self.status_path.with_suffix(".tmp")
        tmp.write_text(body)
        tmp.replace(self.status_path)
