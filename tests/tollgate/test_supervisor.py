"""The supervisor with small real child processes: restarts, fatal exits, health waits, clean stops."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.polling import wait_until
from tollgate.processes import group_alive
from tollgate.supervisor import ProcessSpec, StartupFailed, StopRequested, StopSignals, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def always(_proc) -> bool:
    return True


def never(_proc) -> bool:
    return False


@pytest.fixture
def supervisor(tmp_path: Path):
    messages: list[str] = []
    with StopSignals() as signals:
        sup = Supervisor(
            signals=signals,
            report=messages.append,
            health_poll_interval_s=0.05,
            restart_backoff_s=0.05,
            restart_backoff_max_s=0.2,
            stop_timeout_s=5,
            status_path=tmp_path / "status.json",
        )
        sup.messages = messages  # type: ignore[attr-defined]
        try:
            yield sup
        finally:
            sup.stop_all()


def spec(tmp_path: Path, name: str, argv: list[str] = SLEEPER, **kwargs) -> ProcessSpec:
    return ProcessSpec(name, argv, tmp_path / f"{name}.log", kwargs.pop("health", always), **kwargs)


def step_until(sup: Supervisor, condition, what: str) -> None:
    """Run supervisor passes until ``condition()`` holds; fails if a pass stops the platform first."""
    try:
        wait_until(lambda: condition() or not sup.step(), what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; reports: {sup.messages}") from None
    assert condition(), f"the supervisor gave up before {what}; reports: {sup.messages}"


def test_killed_stateless_child_is_reported_and_restarted(supervisor, tmp_path):
    child = supervisor.start(spec(tmp_path, "gateway"))
    supervisor.wait_healthy(["gateway"], 10)
    first = child.proc.pid
    os.kill(first, signal.SIGKILL)
    step_until(supervisor, lambda: child.restarts == 1 and child.state == "healthy", "the restart")
    assert child.proc.pid != first and child.proc.poll() is None
    assert any("gateway" in m and "SIGKILL" in m and "restarting" in m for m in supervisor.messages)
    assert '"restarts": 1' in (tmp_path / "status.json").read_text()


def test_backoff_doubles_for_a_crash_loop_and_is_capped(supervisor, tmp_path):
    child = supervisor.start(
        spec(tmp_path, "flaky", [sys.executable, "-c", "raise SystemExit(3)"], health=never)
    )
    step_until(supervisor, lambda: child.restarts >= 4, "four restarts")
    delays = [m.rsplit("restarting in ", 1)[1] for m in supervisor.messages if "restarting in" in m]
    assert delays[:4] == ["0.05s", "0.10s", "0.20s", "0.20s"]  # doubling, capped at restart_backoff_max_s
    assert all("exited with status 3" in m for m in supervisor.messages if "restarting in" in m)


def test_exit_of_a_stateful_child_stops_the_platform(supervisor, tmp_path):
    child = supervisor.start(
        spec(
            tmp_path,
            "postgres",
            [sys.executable, "-c", "print('disk full', flush=True); raise SystemExit(2)"],
            restart=False,
        )
    )
    wait_until(lambda: not supervisor.step(), "the supervisor to stop the platform")
    assert child.state == "exited" and child.last_exit == 2
    assert any("disk full" in m and "not restarted" in m for m in supervisor.messages)


def test_startup_failure_quotes_the_log(supervisor, tmp_path):
    supervisor.start(
        spec(
            tmp_path,
            "engine",
            [sys.executable, "-c", "print('no such model'); raise SystemExit(1)"],
            health=never,
        )
    )
    with pytest.raises(StartupFailed, match="(?s)engine exited with status 1.*no such model"):
        supervisor.wait_healthy(["engine"], 60)


def test_startup_timeout_names_the_unhealthy_process(supervisor, tmp_path):
    supervisor.start(spec(tmp_path, "worker", health=never))
    with pytest.raises(StartupFailed, match="worker was not healthy within"):
        supervisor.wait_healthy(["worker"], 0.3)


def switchable_probe() -> tuple[dict[str, bool], list[bool], Any]:
    """A health probe that answers ``healthy["ok"]`` and records each answer in ``probes``."""
    healthy = {"ok": True}
    probes: list[bool] = []

    def probe(_proc) -> bool:
        probes.append(healthy["ok"])
        return healthy["ok"]

    return healthy, probes, probe


def test_unhealthy_transition_is_reported_once(supervisor, tmp_path):
    healthy, probes, probe = switchable_probe()
    child = supervisor.start(spec(tmp_path, "beat", health=probe))
    supervisor.wait_healthy(["beat"], 5)
    healthy["ok"] = False
    step_until(supervisor, lambda: child.state == "unhealthy", "the failed probe")
    failed = len(probes)
    step_until(supervisor, lambda: len(probes) >= failed + 5, "five more failed probes")
    healthy["ok"] = True
    step_until(supervisor, lambda: child.state == "healthy", "the passing probe")
    assert probes.count(False) >= 6  # one transition, however many probes failed
    assert sum("fails its health check" in m for m in supervisor.messages) == 1
    assert sum("healthy again" in m for m in supervisor.messages) == 1


def test_probes_slow_down_once_every_child_is_healthy_and_speed_up_when_one_is_not(supervisor, tmp_path):
    supervisor.idle_poll_s = 3600.0  # never, within this test
    healthy, probes, probe = switchable_probe()
    child = supervisor.start(spec(tmp_path, "gateway", health=probe))
    supervisor.wait_healthy(["gateway"], 5)
    step_until(supervisor, lambda: supervisor._next_probe > time.monotonic() + 60, "the idle pace")
    before = len(probes)
    for _ in range(20):
        assert supervisor.step()
    assert len(probes) == before  # idle: no probe for an hour
    child.state = "unhealthy"  # as a probe that failed would leave it (or an exit)
    healthy["ok"] = False
    step_until(supervisor, lambda: len(probes) > before, "a probe at the usual pace again")


def test_stop_all_stops_whole_process_groups(supervisor, tmp_path):
    # A parent that leaves a grandchild behind (like uvicorn or Celery workers).
    tree = ["/bin/sh", "-c", "sleep 120 & sleep 120"]
    child = supervisor.start(spec(tmp_path, "tree", tree))
    pgid = child.proc.pid
    wait_until(lambda: len(os.popen(f"pgrep -g {pgid}").read().split()) >= 3, "the shell's two sleeps")
    supervisor.stop_all()
    assert not group_alive(pgid)
    assert child.state == "stopped"


# A child that drains for a while after SIGTERM (like a gateway finishing its streams), then exits 0.
DRAINER = [sys.executable, "-c", "import signal, sys, time\n"
           "def drain(*_):\n    time.sleep(0.5)\n    sys.exit(0)\n"
           "signal.signal(signal.SIGTERM, drain)\nprint('ready', flush=True)\ntime.sleep(120)"]


def test_a_child_gets_its_own_stop_timeout_to_drain(supervisor, tmp_path):
    supervisor.stop_timeout_s = 0.1  # far shorter than the drain: it would be SIGKILLed
    child = supervisor.start(spec(tmp_path, "gateway", DRAINER, stop_timeout_s=60.0))
    wait_until(lambda: "ready" in (tmp_path / "gateway.log").read_text(), "the child's SIGTERM handler")
    supervisor.stop_all()
    assert child.proc.returncode == 0  # drained and exited by itself, not killed


# A drainer that logs when it got SIGTERM and when it exits (CLOCK_MONOTONIC is system-wide).
STAMPED_DRAINER = [sys.executable, "-c", "import signal, sys, time\n"
                   "def drain(*_):\n    print('term', time.monotonic(), flush=True)\n    time.sleep(0.3)\n"
                   "    print('exit', time.monotonic(), flush=True)\n    sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, drain)\nprint('ready', flush=True)\ntime.sleep(120)"]


def test_consecutive_children_of_one_stop_group_stop_together_after_the_later_ones(supervisor, tmp_path):
    names = ("store", "engine-0", "engine-1", "gateway")
    groups = {"engine-0": "engines", "engine-1": "engines"}
    for name in names:
        supervisor.start(spec(tmp_path, name, STAMPED_DRAINER, stop_group=groups.get(name)))
    for name in names:
        wait_until(lambda n=name: "ready" in (tmp_path / f"{n}.log").read_text(), f"{name}'s SIGTERM handler")
    supervisor.stop_all()

    def stamp(name: str, event: str) -> float:
        line = next(x for x in (tmp_path / f"{name}.log").read_text().splitlines() if x.startswith(event))
        return float(line.split()[1])

    # Reverse start order; the two engines signalled before either finished draining.
    assert stamp("gateway", "exit") <= stamp("engine-0", "term")
    assert max(stamp("engine-0", "term"), stamp("engine-1", "term")) < min(stamp("engine-0", "exit"),
                                                                            stamp("engine-1", "exit"))
    assert max(stamp("engine-0", "exit"), stamp("engine-1", "exit")) <= stamp("store", "term")
    assert all(supervisor.children[n].state == "stopped" for n in names)


def test_stop_signal_interrupts_waits(supervisor, tmp_path):
    supervisor.start(spec(tmp_path, "slow", health=never))
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(StopRequested, match="SIGTERM"):
        supervisor.wait_healthy(["slow"], 30)


def test_duplicate_names_and_bad_settings_are_refused(supervisor, tmp_path):
    supervisor.start(spec(tmp_path, "one"))
    with pytest.raises(ValueError, match="already supervised"):
        supervisor.start(spec(tmp_path, "one"))
    with pytest.raises(ValueError):
        Supervisor(
            signals=supervisor.signals,
            report=print,
            health_poll_interval_s=0,
            restart_backoff_s=1,
            restart_backoff_max_s=1,
            stop_timeout_s=1,
        )
    with pytest.raises(ValueError):
        ProcessSpec("x", [], tmp_path / "x.log", always)
