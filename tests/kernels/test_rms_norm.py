"""Fused residual-add + RMSNorm vs the unfused reference, including in-place use."""

from __future__ import annotations

import pytest
import torch

from kernels import launch_counts, rms_norm, rms_norm_reference

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize(("leading", "hidden"), [((7,), 64), ((3, 5), 1000), ((2,), 4099)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, leading, hidden, with_residual, device, rng, nan_output):
    shape = (*leading, hidden)
    x = (3 * torch.randn(shape, generator=rng)).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(hidden, generator=rng)).to(dtype).to(device)
    residual = torch.randn(shape, generator=rng).to(dtype).to(device) if with_residual else None
    out = nan_output(shape, dtype, device)
    residual_out = nan_output(shape, dtype, device) if with_residual else None
    before = launch_counts["rms_norm"]

    result = rms_norm(x, weight, 1e-6, residual, out=out, residual_out=residual_out)

    assert launch_counts["rms_norm"] == before + 1
    expected = rms_norm_reference(x, weight, 1e-6, residual)
    if with_residual:
        assert result[0] is out and result[1] is residual_out
        torch.testing.assert_close(out, expected[0], **TOL[dtype])
        torch.testing.assert_close(residual_out, expected[1], **TOL[dtype])
    else:
        assert result is out
        torch.testing.assert_close(out, expected, **TOL[dtype])


def test_in_place(device, rng):
    """The runner's form: out over x and residual_out over residual."""
    x = torch.randn((9, 96), generator=rng).to(device)
    residual = torch.randn((9, 96), generator=rng).to(device)
    weight = torch.randn(96, generator=rng).to(device)
    expected = rms_norm_reference(x, weight, 1e-5, residual)
    rms_norm(x, weight, 1e-5, residual, out=x, residual_out=residual)
    torch.testing.assert_close(x, expected[0], **TOL[torch.float32])
    torch.testing.assert_close(residual, expected[1], **TOL[torch.float32])


def test_rejects_bad_inputs(device):
    x = torch.randn((4, 32), device=device)
    with pytest.raises(ValueError, match="weight has 31 elements"):
        rms_norm(x, torch.ones(31, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual shape"):
        rms_norm(x, torch.ones(32, device=device), 1e-6, torch.randn((4, 31), device=device))
    with pytest.raises(TypeError, match="residual must have dtype"):
        rms_norm(x, torch.ones(32, device=device), 1e-6, x.half())
    with pytest.raises(ValueError, match="eps must be positive"):
        rms_norm(x, torch.ones(32, device=device), 0.0)
    with pytest.raises(ValueError, match="residual_out given without residual"):
        rms_norm(x, torch.ones(32, device=device), 1e-6, residual_out=x)
