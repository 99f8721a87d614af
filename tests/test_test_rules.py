"""The test suite's own rules, executable (tests/polling.py says why):

- no sleep outside ``tests/polling.py``'s polling loops, except on a line that says why it is not a
  wait for a state (``# not a wait: ...``, e.g. a fake server's pacing that the test configures);
- no assertion on elapsed wall-clock time (that is a benchmark);
- no seed or expected value from Python's ``hash()``, which is salted per process.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
EXEMPT_MARK = "# not a wait:"
CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name not in ("polling.py", "test_test_rules.py"))


def _is_sleep(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr == "sleep"
    return isinstance(func, ast.Name) and func.id == "sleep"


def _reads_clock(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in CLOCKS
               and isinstance(n.func.value, ast.Name) and n.func.value.id in ("time", "loop")
               for n in ast.walk(node))  # fmt: skip


def _clock_names(tree: ast.AST) -> set[str]:
    """Names assigned from an expression that reads a clock (start times, elapsed times)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            if _reads_clock(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def violations() -> list[str]:
    found = []
    for path in _test_files():
        source = path.read_text()
        lines = source.splitlines()
        tree = ast.parse(source)
        clock_names = _clock_names(tree)
        rel = path.relative_to(TESTS.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _is_sleep(node) and EXEMPT_MARK not in lines[node.lineno - 1]:
                found.append(f"{rel}:{node.lineno}: sleep (wait for the state with tests/polling.py)")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hash":
                found.append(f"{rel}:{node.lineno}: hash() is salted per process")
            if isinstance(node, ast.Assert):
                names = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}
                if _reads_clock(node.test) or names & clock_names:
                    found.append(f"{rel}:{node.lineno}: assertion on elapsed time (a benchmark's job)")
    return found


def test_tests_wait_for_states_not_for_time():
    assert violations() == []


def test_the_rules_catch_what_they_forbid(tmp_path, monkeypatch):
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import asyncio, time\n"
        "async def test_x():\n"
        "    start = time.monotonic()\n"
        "    await asyncio.sleep(0.5)\n"
        "    time.sleep(0.1)  # not a wait: the fake engine's pacing\n"
        "    elapsed = time.monotonic() - start\n"
        "    assert elapsed < 2\n"
        "    assert time.perf_counter() > 0\n"
        "    seed = hash('x')\n"
    )
    monkeypatch.setattr(__import__(__name__), "TESTS", tmp_path)
    found = violations()
    assert [f.split(": ", 1)[1].split(" ")[0] for f in found].count("sleep") == 1
    assert sum("elapsed time" in f for f in found) == 2
    assert sum("hash()" in f for f in found) == 1
