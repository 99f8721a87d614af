"""benchmarks/fp8.py's accuracy table: every model and FP8 variant measured against the 16-bit original."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import fp8


def test_the_accuracy_table_covers_every_model_and_variant(tmp_path: Path) -> None:
    out = tmp_path / "fp8.json"
    assert fp8.main(["--prompts", "2", "--tokens", "4", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["accuracy"]
    assert {(r["arch"], r["variant"]) for r in rows} == {(a, v) for a in fp8.ARCHS for v in fp8.VARIANTS}
    for r in rows:
        assert 0 < r["mean_abs_logit_error"] <= r["max_abs_logit_error"] < r["logit_spread"] * 5
        assert 0.5 <= r["top1_agreement"] <= 1 and 0 <= r["identical_greedy_tokens"] <= 1


def test_the_trained_model_kv_table_trains_then_measures() -> None:
    rows, training = fp8.trained_kv_rows(seconds=1.0, windows=1)
    assert training["steps"] >= 1 and training["train_tokens"] > 10_000
    assert [r["scales"] for r in rows] == ["1.0", "calibrated"]
    for r in rows:
        assert r["positions"] == 96 and 0.5 <= r["top1_agreement"] <= 1
        for margin in fp8.MARGINS:
            assert 0 <= r[f"share_margin_{margin}"] <= 1
