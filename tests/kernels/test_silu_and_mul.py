"""SiLU-and-mul vs its reference."""

from __future__ import annotations

import pytest
import torch

from kernels import launch_counts, silu_and_mul, silu_and_mul_reference

TOL = {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize(("leading", "intermediate"), [((1,), 64), ((13,), 1100), ((2, 3), 2731)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, leading, intermediate, device, rng, nan_output):
    x = (4 * torch.randn((*leading, 2 * intermediate), generator=rng)).to(dtype).to(device)
    out = nan_output((*leading, intermediate), dtype, device)
    before = launch_counts["silu_and_mul"]
    assert silu_and_mul(x, out=out) is out
    assert launch_counts["silu_and_mul"] == before + 1
    torch.testing.assert_close(out, silu_and_mul_reference(x), **TOL[dtype])


def test_rejects_bad_inputs(device):
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(torch.randn((2, 7), device=device))
    with pytest.raises(ValueError, match="out must have shape"):
        silu_and_mul(torch.randn((2, 8), device=device), out=torch.empty((2, 8), device=device))
    with pytest.raises(TypeError, match="out must have dtype"):
        silu_and_mul(torch.randn((2, 8), device=device), out=torch.empty((2, 4), device=device).half())
