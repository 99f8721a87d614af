"""benchmarks/lora.py runs its mixed workload and cold load and writes every figure it prints."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import lora


def test_the_mixed_workload_and_cold_load_are_measured(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    assert lora.main(["--requests", "4", "--prompt-tokens", "8", "--output-tokens", "4", "--repeat", "1",
                      "--counts", "0,2,3", "--max-loras", "2", "--rank", "4", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["mixed"]) == {"0", "2", "3"}
    for run in report["mixed"].values():
        assert run["output_tokens"] == 16 and run["tokens_per_s"] > 0
    assert report["mixed"]["0"]["slot_loads"] == 0 and report["mixed"]["3"]["slot_loads"] >= 1
    assert report["cold_load"]["read_ms"] > 0 and report["cold_load"]["slot_copy_ms"] > 0
