"""Where the kernels run: the interpreter on CUDA-less hosts, and what it refuses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels as K

interpreter_only = pytest.mark.skipif(
    not K.kernels_are_interpreted(), reason="kernels are compiled for CUDA in this process"
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host may compile the kernels")
def test_cuda_less_host_interprets():
    assert K.kernels_are_interpreted()


@interpreter_only
def test_interpreter_refuses_bfloat16():
    x = torch.randn((3, 64)).bfloat16()
    with pytest.raises(TypeError, match="bfloat16 is not supported by Triton's interpreter"):
        K.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(TypeError, match="bfloat16"):
        K.silu_and_mul(x)


def test_launch_counts_count_launches_only(device):
    K.reset_launch_counts()
    assert dict(K.launch_counts) == {}
    x = torch.randn((2, 8), device=device)
    K.silu_and_mul(x)
    K.silu_and_mul(x[:0])  # nothing to launch
    with pytest.raises(ValueError):
        K.silu_and_mul(torch.randn((2, 7), device=device))
    assert dict(K.launch_counts) == {"silu_and_mul": 1}


_LATE_INTERPRET = """
import os, torch, triton
os.environ["TRITON_INTERPRET"] = "1"
import kernels
kernels.silu_and_mul(torch.randn(2, 8))
"""
_NO_INTERPRET = """
import torch, triton, kernels
kernels.silu_and_mul(torch.randn(2, 8))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA-less host behaviour")
@pytest.mark.parametrize(
    ("script", "message"),
    [
        (_LATE_INTERPRET, "TRITON_INTERPRET=1 was set after triton was imported"),
        (_NO_INTERPRET, "was compiled for CUDA but got tensors on cpu"),
    ],
    ids=["set-too-late", "never-set"],
)
def test_misordered_interpreter_setup_fails_with_a_clear_message(script, message):
    """If triton was imported before TRITON_INTERPRET=1 was set, launches say so instead of crashing
    deep inside Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=root,
                            timeout=300)  # fmt: skip
    assert result.returncode != 0
    assert message in result.stderr
