"""benchmarks/moe.py runs its CPU table on a tiny layer and writes the figures it printed."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import moe


def test_the_cpu_table_compares_three_equal_implementations(tmp_path: Path, capsys) -> None:
    out = tmp_path / "moe.json"
    assert moe.main(["--shape", "tiny", "--tokens", "1", "5", "--repeat", "1", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert [row["tokens"] for row in payload["cpu"]] == [1, 5]
    for row in payload["cpu"]:  # each was checked equal to the engine's output before it was timed
        assert {"engine_ms", "per_token_loop_ms", "transformers_ms"} <= row.keys()
    assert "| tokens | engine ms" in capsys.readouterr().out
