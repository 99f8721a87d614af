"""The FP8 linear kernel (weight-only and W8A8) against its fp32 reference, under Triton's interpreter.

The interpreter runs FP8 loads and ``tl.dot`` correctly; the kernel never rounds to FP8 itself
(activations are quantized in PyTorch), so its results are compared with tight tolerances."""

from __future__ import annotations

import pytest
import torch

from engine.models.fp8 import quantize_fp8
from kernels import fp8_linear, fp8_linear_reference, launch_counts

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


def _weights(n: int, k: int, group: int, gen: torch.Generator, device: torch.device):
    w = torch.randn((n, k), generator=gen) * k**-0.5
    q, scale = quantize_fp8(w, group)
    return q.to(device), scale.to(device)


@pytest.mark.parametrize(("m", "n", "k", "group"), [
    (1, 48, 64, 64),  # a decode row, per-channel scales
    (5, 130, 96, 96),  # ragged N and K, per-channel
    (37, 64, 256, 128),  # block FP8: two 128-column groups
    (70, 40, 96, 32),  # small blocks, a ragged last M tile
])
@pytest.mark.parametrize("w8a8", [False, True], ids=["weight-only", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(m, n, k, group, w8a8, dtype, device, rng):
    if w8a8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 tensor cores (W8A8) need sm_89 or later")
    x = torch.randn((m, k), generator=rng).to(dtype).to(device)
    weight, scale = _weights(n, k, group, rng, device)
    before = launch_counts["fp8_linear"]
    out = fp8_linear(x, weight, scale, w8a8=w8a8)
    assert launch_counts["fp8_linear"] == before + 1
    torch.testing.assert_close(out, fp8_linear_reference(x, weight, scale, w8a8=w8a8), **TOL[dtype])


def test_weight_only_equals_the_dequantized_matmul(device, rng):
    x = torch.randn((9, 128), generator=rng).to(device)
    weight, scale = _weights(33, 128, 128, rng, device)
    dense = weight.float() * scale  # one scale per row
    torch.testing.assert_close(fp8_linear(x, weight, scale, w8a8=False), x @ dense.T, **TOL[torch.float32])


def test_bad_inputs_are_refused(device, rng):
    x = torch.randn((3, 64), generator=rng).to(device)
    weight, scale = _weights(8, 64, 64, rng, device)
    with pytest.raises(TypeError, match="weight must have dtype"):
        fp8_linear(x, weight.float(), scale)
    with pytest.raises(ValueError, match="weight_scale must be"):
        fp8_linear(x, weight, scale[:4])
    with pytest.raises(ValueError, match="power of two"):
        fp8_linear(torch.randn((3, 72), generator=rng).to(device), *_weights(8, 72, 24, rng, device))


def test_every_e4m3_code_is_decoded_exactly_by_the_weight_only_path(device):
    """sm_80 has no e4m3 type in Triton: the weight-only path reads bytes and decodes them itself."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).view(256, 1).to(device)
    ones = torch.ones((256, 1), device=device)
    out = fp8_linear(torch.ones((1, 1), device=device), codes, ones, w8a8=False)
    want = codes.float().view(-1)
    finite = torch.isfinite(want)  # 0x7F and 0xFF are NaN
    assert torch.equal(out[0][finite], want[finite])
