"""Spawning and stopping child processes, each in its own process group.

Invariants:
- Every child leads a new process group (``setpgid(0, 0)``), so stopping it signals the whole group: a
  uvicorn or Celery parent and all of its worker processes stop together and nothing is orphaned.
- Children are not in the terminal's foreground group: Ctrl-C reaches only the parent, which stops the
  children in its own order (clients before the servers they talk to).
- Unless told otherwise, a child receives ``parent_death_signal`` when the process that spawned it dies,
  even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), so a killed supervisor does not leave servers behind.
- When root asks for ``user``, the child runs with that user's uid, primary gid and no supplementary
  groups (Postgres refuses to run as root).
"""

from __future__ import annotations

import ctypes
import os
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent(sig: int, parent_pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def spawn(
    argv: Sequence[str],
    *,
    log_path: Path,
    user: str | None = None,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    parent_death_signal: int | None = signal.SIGTERM,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` as the leader of a new process group, stdout and stderr appended to ``log_path``."""
    if not argv:
        raise ValueError("argv must not be empty")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    uid = gid = None
    extra_groups: list[int] | None = None
    if user is not None:
        if os.geteuid() != 0:
            raise PermissionError(f"only root can start a process as user {user!r}")
        entry = pwd.getpwnam(user)
        uid, gid, extra_groups = entry.pw_uid, entry.pw_gid, []
    preexec = None
    if parent_death_signal is not None and sys.platform.startswith("linux"):
        parent_pid, sig = os.getpid(), int(parent_death_signal)

        def preexec() -> None:
            _die_with_parent(sig, parent_pid)

    with log_path.open("ab") as log:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env=dict(env) if env is not None else None,
            process_group=0,
            preexec_fn=preexec,
            close_fds=True,
            user=uid,
            group=gid,
            extra_groups=extra_groups,
        )


def group_alive(pgid: int) -> bool:
    """True while any process of group ``pgid`` exists (zombies included until they are reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def stop(proc: subprocess.Popen[bytes], *, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int | None:
    """Signal the child's process group, wait up to ``timeout`` for it, then SIGKILL whatever remains.

    Returns the leader's exit status. Group members that outlive their leader are killed too.
    """
    pgid = proc.pid
    if proc.poll() is None:
        signal_group(pgid, sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            signal_group(pgid, signal.SIGKILL)
            proc.wait()
    elif group_alive(pgid):  # the leader died on its own; its workers may still run
        signal_group(pgid, sig)
    deadline = time.monotonic() + timeout
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if group_alive(pgid):
        signal_group(pgid, signal.SIGKILL)
    return proc.returncode


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs and is not a zombie (works for processes that are not our children)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


def running_processes() -> Iterator[tuple[int, int, int]]:
    """``(pid, parent pid, process group)`` of every process that runs (zombies excluded), from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_bytes().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] not in (b"Z", b"X"):
            yield int(entry.name), int(fields[1]), int(fields[2])


def children(pid: int) -> list[int]:
    """The running processes whose parent is ``pid``."""
    return [child for child, parent, _ in running_processes() if parent == pid]


def group_running(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs (zombies, which run no code, do not count)."""
    return any(group == pgid for _, _, group in running_processes())


def stop_pid(pid: int, *, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
    """Stop a process group we did not spawn (or whose ``Popen`` we no longer hold) by its leader's pid."""
    signal_group(pid, sig)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    signal_group(pid, signal.SIGKILL)


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 90.0) -> None:
    """Poll ``url`` until it answers 200; raise ``RuntimeError`` with the tail of ``log`` if ``proc``
    exits first or ``timeout_s`` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready in {timeout_s:.0f}s:\n{log.read_text()[-4000:]}")
        time.sleep(0.1)
