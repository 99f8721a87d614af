"""GPU-only checks: bfloat16 (which Triton's interpreter cannot emulate) at model-like shapes, and the
decode path under CUDA-graph capture. Skipped without a CUDA device or when the kernels were built for
the interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels as K

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or K.kernels_are_interpreted(),
        reason="needs a CUDA GPU with compiled (not interpreted) Triton kernels",
    ),
]

BF16 = dict(atol=2e-2, rtol=2e-2)
CUDA = torch.device("cuda")


@pytest.mark.parametrize(("group", "head_dim", "num_splits"), [(1, 128, 1), (4, 128, None), (8, 64, 7)])
def test_decode_bf16(group, head_dim, num_splits, rng, paged_kv, nan_output):
    seq_lens = [1, 15, 1000, 4097, 333]
    kv = paged_kv(seq_lens, num_kv_heads=8, head_dim=head_dim, dtype=torch.bfloat16, device=CUDA, gen=rng)
    q = torch.randn((len(seq_lens), 8 * group, head_dim), generator=rng).bfloat16().to(CUDA)
    out = nan_output(q.shape, torch.bfloat16, CUDA)
    K.paged_decode_attention(
        q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale=head_dim**-0.5,
        num_splits=num_splits, out=out,
    )  # fmt: skip
    expected = K.paged_decode_attention_reference(
        q, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, scale=head_dim**-0.5
    )
    torch.testing.assert_close(out, expected, **BF16)


@pytest.mark.parametrize(("group", "head_dim"), [(1, 128), (4, 128), (8, 64), (7, 128)])
def test_extend_bf16(group, head_dim, rng, paged_kv, nan_output):
    cases = [(517, 517), (1200, 300), (64, 1), (2049, 17)]
    seq_lens, q_lens = [n for n, _ in cases], [m for _, m in cases]
    kv = paged_kv(seq_lens, num_kv_heads=4, head_dim=head_dim, dtype=torch.bfloat16, device=CUDA, gen=rng)
    q = torch.randn((sum(q_lens), 4 * group, head_dim), generator=rng).bfloat16().to(CUDA)
    qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=CUDA)
    out = nan_output(q.shape, torch.bfloat16, CUDA)
    args = (q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens)
    K.extend_attention(*args, max_query_len=max(q_lens), scale=head_dim**-0.5, out=out)
    torch.testing.assert_close(out, K.extend_attention_reference(*args, scale=head_dim**-0.5), **BF16)


def test_store_rmsnorm_rotary_silu_bf16(rng):
    key = torch.randn((77, 8, 128), generator=rng).bfloat16().to(CUDA)
    value = torch.randn((77, 8, 128), generator=rng).bfloat16().to(CUDA)
    cache = torch.full((2, 40, 16, 8, 128), float("nan"), dtype=torch.bfloat16, device=CUDA)
    expected_cache = cache.clone()
    slots = torch.randperm(640, generator=rng)[:77].to(CUDA)
    slots[::9] = -1
    K.store_kv_cache(key, value, cache[0], cache[1], slots)
    K.store_kv_cache_reference(key, value, expected_cache[0], expected_cache[1], slots)
    torch.testing.assert_close(cache, expected_cache, atol=0, rtol=0, equal_nan=True)

    x = torch.randn((77, 4096), generator=rng).bfloat16().to(CUDA)
    residual = torch.randn((77, 4096), generator=rng).bfloat16().to(CUDA)
    weight = torch.randn(4096, generator=rng).bfloat16().to(CUDA)
    fused = K.rms_norm(x, weight, 1e-5, residual)
    for got, want in zip(fused, K.rms_norm_reference(x, weight, 1e-5, residual), strict=True):
        torch.testing.assert_close(got, want, **BF16)

    cos_sin = K.rope_cos_sin_cache(128, 8192, 500000.0, device=CUDA)
    q = torch.randn((77, 32, 128), generator=rng).bfloat16().to(CUDA)
    positions = torch.randint(0, 8192, (77,), generator=rng).to(CUDA)
    for got, want in zip(K.rotary_embedding(q, key, positions, cos_sin),
                         K.rotary_embedding_reference(q, key, positions, cos_sin), strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, **BF16)

    gate_up = torch.randn((77, 2 * 14336), generator=rng).bfloat16().to(CUDA)
    torch.testing.assert_close(K.silu_and_mul(gate_up), K.silu_and_mul_reference(gate_up), **BF16)


def test_decode_under_cuda_graph_replays_new_metadata(rng, paged_kv):
    """Captured once, replayed after the metadata tensors change in place: no host sync, fixed grid."""
    seq_lens = [5, 700, 33]
    kv = paged_kv(seq_lens, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, device=CUDA, gen=rng)
    q = torch.randn((3, 8, 128), generator=rng).bfloat16().to(CUDA)
    block_tables, lens = kv.block_tables.clone(), kv.seq_lens.clone()
    out = torch.empty_like(q)

    def step() -> None:
        K.paged_decode_attention(q, kv.key_cache, kv.value_cache, block_tables, lens, scale=0.088,
                                 num_splits=4, out=out)  # fmt: skip

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # Sequences swap places and shrink (the cache beyond each original length is NaN).
    block_tables.copy_(kv.block_tables.flip(0))
    lens.copy_(torch.tensor([1, 650, 4], device=CUDA, dtype=torch.int32))
    q.copy_(torch.randn((3, 8, 128), generator=rng).bfloat16().to(CUDA))
    graph.replay()
    torch.cuda.synchronize()
    expected = K.paged_decode_attention_reference(
        q, kv.key_cache, kv.value_cache, block_tables, lens, scale=0.088
    )
    torch.testing.assert_close(out, expected, **BF16)
