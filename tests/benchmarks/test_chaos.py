"""The chaos benchmark's short run (``benchmarks/chaos.py --short``): the whole platform with two engine
replicas under a mixed load of three tenants while an engine replica, a gateway worker, Redis, Postgres and
the Celery worker are each killed once and come back. Its judge compares every request the clients made
with the ledger; the test asserts the judge's verdict and that each fault was injected and recovered from.
(The long run's figures are in benchmarks/RESULTS.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]


def test_the_ledger_survives_every_fault(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    done = subprocess.run([sys.executable, "benchmarks/chaos.py", "--short", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    failed = {check: n for check, n in result["checks"].items() if n}
    assert not failed, (failed, result["examples"], done.stdout[-3000:])
    assert done.returncode == 0
    assert sorted(f["kind"] for f in result["faults"]) == sorted(
        ["engine", "gateway_worker", "redis", "postgres", "celery_worker"])
    assert all(f["component_s"] is not None and f["recovery_s"] is not None for f in result["faults"])
    # The load really ran through the faults: requests of every kind completed, batches too.
    ok = {key.split("/")[0] for key, n in result["outcomes"].items() if key.endswith("/ok") and n}
    assert {"chat", "chat_stream", "cached_chat", "embeddings", "response", "background"} <= ok
    assert result["batches"] >= 4 and result["ledger_rows_checked"] > 100
