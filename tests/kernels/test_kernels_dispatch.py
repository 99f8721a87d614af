"""Where the kernels run: the interpreter on CUDA-less hosts, and what it refuses."""

from __future__ import annotations

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
