"""``benchmarks/tensor_parallel.py`` runs a workload at 1 and 2 ranks and reports the same greedy tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two replicas, one with a spawned rank
def test_the_benchmark_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    done = subprocess.run([sys.executable, "benchmarks/tensor_parallel.py", "--num-seqs", "3", "--prompt-len",
                           "20", "40", "--output-len", "4", "8", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| ranks |" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["sizes"]) == {"1", "2"}
    assert all(size["same_greedy_tokens"] and size["steps"] > 0 for size in result["sizes"].values())
