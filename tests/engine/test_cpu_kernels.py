"""engine.cpu_kernels: the C kernels equal the PyTorch ops they replace, and the engine falls back to
PyTorch where they cannot be built or do not apply."""

from __future__ import annotations

import logging

import pytest
import torch

from engine import cpu_kernels
from engine.models.llama import NativeOps, TorchOps


@pytest.fixture
def lib() -> cpu_kernels.Library:
    library = cpu_kernels.library()
    if library is None:
        pytest.skip("the native CPU kernels cannot be built here")
    return library


def _dense_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    # q: [H, D]; k, v: [S, KVH, D] -> [H, D]
    group = q.shape[0] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [S, H, D]
    weights = torch.softmax(torch.einsum("hd,shd->hs", q.double(), keys.double()) * scale, dim=-1)
    return torch.einsum("hs,shd->hd", weights, values.double()).float()


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(4, 2, 64, 16), (3, 3, 8, 16), (6, 2, 16, 5), (16, 1, 32, 8)])
@pytest.mark.parametrize("with_rows", [False, True], ids=["batch-rows", "selected-rows"])
def test_paged_decode_equals_dense_attention(lib: cpu_kernels.Library, num_heads: int, num_kv_heads: int,
                                             head_dim: int, block_size: int, with_rows: bool) -> None:
    g = torch.Generator().manual_seed(head_dim)
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 57, 200]
    tables = []
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 4
    free = torch.randperm(num_blocks, generator=g).tolist()  # shuffled, with holes
    for s in seq_lens:
        tables.append([free.pop() for _ in range(-(-s // block_size))])
    width = max(len(t) for t in tables) + 2  # padding columns are never read
    table_rows = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g) * 3
    n = len(seq_lens)
    num_rows = 2 * n if with_rows else n
    q = torch.randn(num_rows, num_heads, head_dim, generator=g)
    rows = torch.arange(1, 2 * n, 2) if with_rows else None
    out = torch.full_like(q, float("nan"))
    scale = head_dim**-0.5
    cpu_kernels.paged_decode(lib, q, out, rows, cache, table_rows, torch.tensor(seq_lens, dtype=torch.int32),
                             max(seq_lens), scale)
    for b, (s, table) in enumerate(zip(seq_lens, tables, strict=True)):
        blocks = torch.tensor(table)
        k = cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:s]
        v = cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:s]
        row = b if rows is None else int(rows[b])
        torch.testing.assert_close(out[row], _dense_decode(q[row], k, v, scale), atol=1e-5, rtol=1e-5)
    if rows is not None:  # rows that are not decodes are left alone
        assert out[0::2].isnan().all()


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_elementwise_kernels_equal_torch_ops(lib: cpu_kernels.Library, num_tokens: int) -> None:
    g = torch.Generator().manual_seed(num_tokens)
    hidden, num_heads, num_kv_heads, head_dim = 36, 4, 2, 12  # widths that are not multiples of 8
    x = torch.randn(num_tokens, hidden, generator=g) * 5
    residual = torch.randn(num_tokens, hidden, generator=g)
    weight = torch.randn(hidden, generator=g)
    torch.testing.assert_close(cpu_kernels.rms_norm(lib, x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6))
    ours = cpu_kernels.rms_norm(lib, x, weight, 1e-6, residual)
    theirs = TorchOps.rms_norm(x, weight, 1e-6, residual)
    assert isinstance(ours, tuple) and isinstance(theirs, tuple)
    torch.testing.assert_close(ours[0], theirs[0])
    torch.testing.assert_close(ours[1], theirs[1], atol=0, rtol=0)

    gate_up = torch.randn(num_tokens, 2 * 20, generator=g) * 30  # saturates the sigmoid both ways
    torch.testing.assert_close(cpu_kernels.silu_and_mul(lib, gate_up), TorchOps.silu_and_mul(gate_up))

    # q and k as strided views of a fused projection, as the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads,
                                                                                    head_dim)
    positions = torch.randint(0, 100, (num_tokens,), generator=g)
    cos_sin = torch.randn(100, head_dim, generator=g)
    rotated = cpu_kernels.rotary(lib, q, k, positions, cos_sin)
    assert rotated is not None
    for ours_t, theirs_t in zip(rotated, TorchOps.rotary(q, k, positions, cos_sin), strict=True):
        assert ours_t.is_contiguous()
        torch.testing.assert_close(ours_t, theirs_t)

    # Qwen3: per-head RMSNorm of q and k fused in front of the rotation.
    q_weight, k_weight = torch.randn(head_dim, generator=g), torch.randn(head_dim, generator=g)
    normed = cpu_kernels.rotary(lib, q, k, positions, cos_sin, (q_weight, k_weight), 1e-6)
    assert normed is not None
    q_normed = TorchOps.rms_norm(q.reshape(-1, head_dim), q_weight, 1e-6).view(q.shape)
    k_normed = TorchOps.rms_norm(k.reshape(-1, head_dim), k_weight, 1e-6).view(k.shape)
    for ours_t, theirs_t in zip(normed, TorchOps.rotary(q_normed, k_normed, positions, cos_sin), strict=True):
        torch.testing.assert_close(ours_t, theirs_t)


def test_native_ops_fall_back_to_torch_ops_where_the_kernels_do_not_apply() -> None:
    ops = NativeOps()
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    weight = torch.randn(16, dtype=torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6))
    gate_up = torch.randn(4, 10)[:, :8]  # rows not contiguous
    torch.testing.assert_close(ops.silu_and_mul(gate_up), TorchOps.silu_and_mul(gate_up))


def test_kernels_can_be_switched_off_or_missing(monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_library", None)
    monkeypatch.setenv("TOLLGATE_NATIVE_KERNELS", "0")
    assert cpu_kernels.library() is None

    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.delenv("TOLLGATE_NATIVE_KERNELS")
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that always fails
    with caplog.at_level(logging.WARNING, logger="engine.cpu_kernels"):
        assert cpu_kernels.library() is None
    assert "native CPU kernels unavailable" in caplog.text
    # The model still runs, on the PyTorch paths.
    x, weight = torch.randn(2, 8), torch.randn(8)
    torch.testing.assert_close(NativeOps().rms_norm(x, weight, 1e-6), TorchOps.rms_norm(x, weight, 1e-6))


def test_draw_by_inversion_samples_the_softmax_and_never_a_masked_token(lib: cpu_kernels.Library) -> None:
    vocab, rows = 37, 4000  # 37: a vectorised part and a scalar tail
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, generator=g) * 2
    logits[[3, 20, 36]] = float("-inf")
    drawn = cpu_kernels.draw_by_inversion(lib, logits.expand(rows, vocab), torch.Generator().manual_seed(1))
    assert drawn is not None and drawn.shape == (rows,)
    counts = torch.bincount(drawn, minlength=vocab).double()
    assert counts[[3, 20, 36]].sum() == 0
    expected = torch.softmax(logits.double(), 0) * rows
    # Pearson's chi-squared over the tokens that can be drawn: 33 degrees of freedom, p ~ 1e-6 at 80.
    allowed = expected > 0
    chi2 = ((counts[allowed] - expected[allowed]) ** 2 / expected[allowed]).sum()
    assert chi2 < 80
