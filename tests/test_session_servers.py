"""The early teardown of session fixtures that start servers (``tests/conftest.py``'s
``STOPPED_AFTER_LAST_USER``), checked on a small suite run by a pytest of its own: in one process a
fixture stops after the last test of the run that uses it; under xdist, at the end of its xdist group,
or after an ungrouped test whose next test does not use it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CONFTEST = '''
import os
from pathlib import Path

import pytest

from tests.conftest import (  # noqa: F401  (the hooks under test, and the xdist group fix they rely on)
    pytest_collection_modifyitems,
    pytest_runtest_teardown,
)

EVENTS = Path(os.environ["EVENTS"])


def log(event):
    with EVENTS.open("a") as out:
        out.write(event + "\\n")


@pytest.fixture(scope="session")
def platform():
    log("up")
    yield
    log("down")


@pytest.fixture(scope="session")
def platform_client(platform):
    log("client up")
    yield
    log("client down")
'''

TESTS = '''
from conftest import log


def test_a(platform_client):
    log("a")


def test_b(platform):
    log("b")


def test_c():
    log("c")


def test_d(platform):
    log("d")


def test_e():
    log("e")
'''


GROUPED_TESTS = '''
import pytest

from conftest import log


@pytest.mark.xdist_group("g")
def test_a(platform):
    log("a")


@pytest.mark.xdist_group("g")
def test_b():
    log("b")


@pytest.mark.xdist_group("g")
def test_c(platform):
    log("c")


@pytest.mark.xdist_group("g")
def test_d():
    log("d")


def test_e():
    log("e")
'''


def _run(tmp_path: Path, *args: str, tests: str = TESTS) -> list[str]:
    # The conftest one directory below the rootdir, as tests/conftest.py is: pytest asks a session
    # fixture's hooks of the rootdir's conftests only, so a hook that works at the rootdir may not here.
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    (suite / "test_servers.py").write_text(tests)
    events = tmp_path / "events"
    # Only the plugins the small suite needs: the installed ones (schemathesis, hypothesis, ...) take
    # seconds to import in each process.
    env = {**os.environ, "EVENTS": str(events), "PYTHONPATH": f"{ROOT}{os.pathsep}{suite}",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                           str(suite)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return events.read_text().splitlines()


def test_one_process_keeps_a_server_up_until_its_last_user(tmp_path: Path) -> None:
    events = _run(tmp_path)
    assert events == ["up", "client up", "a", "b", "c", "d", "client down", "down", "e"]


@pytest.mark.skipif(sys.platform != "linux", reason="xdist's popen workers as CI runs them")
def test_an_xdist_worker_stops_a_server_when_the_next_test_does_not_use_it(tmp_path: Path) -> None:
    events = _run(tmp_path, "-p", "xdist.plugin", "-n", "1")
    # The dependent fixture goes first, as at the session's end; a later user starts the server again.
    assert events == ["up", "client up", "a", "b", "client down", "down", "c", "up", "d", "down", "e"]


@pytest.mark.skipif(sys.platform != "linux", reason="xdist's popen workers as CI runs them")
def test_an_xdist_worker_keeps_a_server_for_its_whole_group(tmp_path: Path) -> None:
    # b and d do not use the server, but their group's later tests do (c) or may: it stops when the
    # group ends, though the group's last test (d) does not use it.
    events = _run(tmp_path, "-p", "xdist.plugin", "-n", "1", "--dist", "loadgroup", tests=GROUPED_TESTS)
    assert events == ["up", "a", "b", "c", "d", "down", "e"]
