"""``benchmarks/kernels.py`` keeps working: without a GPU it refuses plainly, and ``--smoke`` runs every
case at toy sizes through the interpreter, checks each against its reference and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the benchmark runs for real")
def test_refuses_without_gpu():
    result = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "needs a CUDA GPU" in result.stderr and "--smoke" in result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU host the benchmark runs for real")
def test_smoke_mode_writes_every_kernel(tmp_path: Path):
    out = tmp_path / "kernels.json"
    command = [sys.executable, str(SCRIPT), "--smoke", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "NOT performance figures" in result.stdout
    payload = json.loads(out.read_text())
    assert payload["interpreter"] is True
    kernels = {r["kernel"] for r in payload["results"]}
    assert kernels == {
        "paged_decode_attention", "extend_attention", "store_kv_cache", "rms_norm+residual",
        "rotary_embedding", "silu_and_mul", "fused_moe",
    }  # fmt: skip
    assert all(r["floor_us"] > 0 and r["time_us"] > 0 for r in payload["results"])
    # Paged decode again with each other pipeline depth, over the same tensors, after every kernel's own
    # row (a run cut short keeps those); a variant has no baseline of its own.
    variants = [r for r in payload["results"] if r["variant"] is not None]
    assert {r["variant"] for r in variants} == {"5 stages", "7 stages", "32 keys, 5 stages"}
    assert {r["kernel"] for r in variants} == {"paged_decode_attention"}
    assert all(r["baseline_us"] is None for r in variants)
    first_variant = payload["results"].index(variants[0])
    assert all(r["variant"] is not None for r in payload["results"][first_variant:])
    assert "paged_decode_attention [5 stages]" in result.stdout
