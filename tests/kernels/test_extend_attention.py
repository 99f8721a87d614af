"""Prefill / extend attention vs its reference: fresh prefill, chunked prefill, prefix hits, decode rows."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels import (
    extend_attention,
    extend_attention_reference,
    launch_counts,
    paged_decode_attention,
)

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}
# (context length incl. new tokens, new tokens): a fresh prefill, a later chunk of a chunked prefill
# over 21 cached tokens, a prefix-cache hit recomputing only the last prompt token, a decode step, and
# a chunk starting mid-block whose queries span several query tiles, and a short chunk after a long
# prefix (its first K/V tiles take the kernel's unmasked path). No length is a multiple of 16.
CASES = [(37, 37), (71, 50), (33, 1), (77, 1), (99, 86), (201, 10)]


def _query_start_loc(q_lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(dtype, group, head_dim, device, rng, paged_kv, nan_output):
    num_kv_heads = 2
    seq_lens = [n for n, _ in CASES]
    q_lens = [m for _, m in CASES]
    kv = paged_kv(seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device, gen=rng)
    q = torch.randn((sum(q_lens), num_kv_heads * group, head_dim), generator=rng).to(dtype).to(device)
    qsl = _query_start_loc(q_lens, device)
    out = nan_output(q.shape, dtype, device)
    before = launch_counts["extend_attention"]

    result = extend_attention(
        q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens,
        max_query_len=max(q_lens), scale=head_dim**-0.5, out=out,
    )  # fmt: skip

    assert result is out
    assert launch_counts["extend_attention"] == before + 1
    expected = extend_attention_reference(
        q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, scale=head_dim**-0.5
    )
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_decode_rows_agree_with_decode_kernel(device, rng, paged_kv):
    """A batch of one-token chunks through extend equals the split-K decode kernel."""
    seq_lens = [3, 64, 129]
    kv = paged_kv(seq_lens, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device, gen=rng)
    q = torch.randn((3, 8, 64), generator=rng).to(device)
    qsl = _query_start_loc([1, 1, 1], device)
    args = (kv.key_cache, kv.value_cache, kv.block_tables)
    extend = extend_attention(q, *args, qsl, kv.seq_lens, max_query_len=1, scale=0.125)
    decode = paged_decode_attention(q, *args, kv.seq_lens, scale=0.125, num_splits=2)
    torch.testing.assert_close(extend, decode, **TOL[torch.float32])


def test_non_power_of_two_group_strided_query_32_token_blocks(device, rng, paged_kv):
    seq_lens, q_lens = [20, 45], [20, 9]
    kv = paged_kv(seq_lens, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device, gen=rng,
                  block_size=32)  # fmt: skip
    qkv = torch.randn((sum(q_lens), 14 + 2 + 2, 64), generator=rng).to(device)
    q = qkv[:, :14]  # group of 7, heads strided inside a fused qkv buffer
    qsl = _query_start_loc(q_lens, device).long()
    args = (kv.key_cache, kv.value_cache, kv.block_tables.long(), qsl, kv.seq_lens.long())
    out = extend_attention(q, *args, max_query_len=20, scale=0.2)
    torch.testing.assert_close(out, extend_attention_reference(q, *args, scale=0.2), **TOL[torch.float32])


def test_rejects_bad_inputs(device, rng, paged_kv):
    kv = paged_kv([9, 4], num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device, gen=rng)
    q = torch.randn((5, 4, 64), device=device)
    qsl = _query_start_loc([3, 2], device)
    args = (kv.key_cache, kv.value_cache, kv.block_tables)
    with pytest.raises(ValueError, match="query_start_loc has 2 entries"):
        extend_attention(q, *args, qsl[:2], kv.seq_lens, max_query_len=3, scale=1.0)
    with pytest.raises(ValueError, match="block_tables has 1 rows"):
        extend_attention(q, *args[:2], kv.block_tables[:1], qsl, kv.seq_lens, max_query_len=3, scale=1.0)
    with pytest.raises(ValueError, match="max_query_len"):
        extend_attention(q, *args, qsl, kv.seq_lens, max_query_len=0, scale=1.0)
    with pytest.raises(TypeError, match="value_cache must have dtype"):
        extend_attention(q, kv.key_cache, kv.value_cache.half(), kv.block_tables, qsl, kv.seq_lens,
                         max_query_len=3, scale=1.0)  # fmt: skip


@pytest.mark.parametrize("window", [1, 5, 32, 128])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_sliding_window_and_sinks_match_reference(dtype, with_sinks, window, device, rng, paged_kv):
    """gpt-oss's layers: a query sees only its last ``window`` positions, and each head's sink logit joins
    the softmax's sum. The cases span windows inside one tile, across tiles and longer than a context."""
    seq_lens = [n for n, _ in CASES]
    q_lens = [m for _, m in CASES]
    kv = paged_kv(seq_lens, num_kv_heads=2, head_dim=64, dtype=dtype, device=device, gen=rng)
    q = torch.randn((sum(q_lens), 8, 64), generator=rng).to(dtype).to(device)
    qsl = _query_start_loc(q_lens, device)
    sinks = (2 * torch.randn(8, generator=rng)).to(device) if with_sinks else None
    out = extend_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens,
                           max_query_len=max(q_lens), scale=0.125, sinks=sinks, window=window)
    expected = extend_attention_reference(q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens,
                                          scale=0.125, sinks=sinks, window=window)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    # The decode kernel (split and unsplit) agrees on the sequences' last tokens.
    last = (qsl[1:] - 1).long()
    for splits in (1, 4):
        decoded = paged_decode_attention(q[last], kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                                         scale=0.125, num_splits=splits, sinks=sinks, window=window)
        torch.testing.assert_close(decoded, expected[last], **TOL[dtype])


def test_sinks_and_window_are_checked(device, rng, paged_kv):
    kv = paged_kv([20], num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device, gen=rng)
    q = torch.randn((20, 8, 64), generator=rng).to(device)
    qsl = _query_start_loc([20], device)
    with pytest.raises(ValueError, match="one logit per query head"):
        extend_attention(q, kv.key_cache, kv.value_cache, kv.block_tables, qsl, kv.seq_lens, max_query_len=20,
                         scale=0.125, sinks=torch.zeros(4, device=device))
    with pytest.raises(ValueError, match="window must be a non-negative int"):
        paged_decode_attention(q[:1], kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
                               scale=0.125, window=-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_an_fp8_cache_is_dequantized_in_registers(dtype, device, rng, paged_kv):
    """``--kv-cache-dtype fp8``: K and V stored as e4m3 with a scale each; extend and decode (split and
    not) read the bytes and dequantize them, equal to the reference over the dequantized cache."""
    from kernels.store_kv_cache import quantize_kv

    seq_lens = [n for n, _ in CASES]
    q_lens = [m for _, m in CASES]
    kv = paged_kv(seq_lens, num_kv_heads=2, head_dim=64, dtype=torch.float32, device=device, gen=rng)
    kv_scale = (0.02, 0.015)  # values up to ~4 / 0.02 = 200, inside e4m3's 448
    key_cache, value_cache = quantize_kv(kv.key_cache, kv_scale[0]), quantize_kv(kv.value_cache, kv_scale[1])
    q = torch.randn((sum(q_lens), 8, 64), generator=rng).to(dtype).to(device)
    qsl = _query_start_loc(q_lens, device)
    out = extend_attention(q, key_cache, value_cache, kv.block_tables, qsl, kv.seq_lens,
                           max_query_len=max(q_lens), scale=0.125, kv_scale=kv_scale)
    expected = extend_attention_reference(q, key_cache, value_cache, kv.block_tables, qsl, kv.seq_lens,
                                          scale=0.125, kv_scale=kv_scale)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    last = (qsl[1:] - 1).long()
    for splits in (1, 4):
        decoded = paged_decode_attention(q[last], key_cache, value_cache, kv.block_tables, kv.seq_lens,
                                         scale=0.125, num_splits=splits, kv_scale=kv_scale)
        torch.testing.assert_close(decoded, expected[last], **TOL[dtype])
