"""The fused MoE kernel (grouped GEMMs over expert-sorted slots) vs its slot-by-slot reference."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import fused_moe, fused_moe_reference, launch_counts, moe_align_block_size
from kernels.fused_moe import MoETileConfig, max_padded_rows

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3)}


def routed(tokens: int, experts: int, top_k: int, gen: torch.Generator, used: int | None = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing of random logits; ``used``: only the first ``used`` experts are ever
    chosen (the rest stay empty)."""
    logits = torch.randn((tokens, experts), generator=gen)
    if used is not None:
        logits[:, used:] = -torch.inf
    weights, ids = torch.topk(logits.softmax(-1), top_k)
    return weights / weights.sum(-1, keepdim=True), ids


def experts_weights(experts: int, hidden: int, inter: int, dtype: torch.dtype, device: torch.device,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn((experts, 2 * inter, hidden), generator=gen) * hidden**-0.5).to(dtype).to(device)
    w2 = (torch.randn((experts, hidden, inter), generator=gen) * inter**-0.5).to(dtype).to(device)
    return w13, w2


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [
        (1, 4, 1, 64, 32),  # a single decode token, top-1
        (7, 8, 2, 48, 40),  # Mixtral's top-2; odd sizes (masked K and N tails)
        (37, 16, 8, 64, 24),  # Qwen3-MoE's top-8
        (300, 128, 8, 32, 16),  # several hundred tokens over 128 experts
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_reference(tokens, experts, top_k, hidden, inter, dtype, device, rng):
    x = torch.randn((tokens, hidden), generator=rng).to(dtype).to(device)
    w13, w2 = experts_weights(experts, hidden, inter, dtype, device, rng)
    weights, ids = routed(tokens, experts, top_k, rng)
    before = launch_counts["fused_moe"]
    out = fused_moe(x, w13, w2, weights.to(device), ids.to(device))
    assert launch_counts["fused_moe"] == before + 2  # two grouped GEMMs, whatever the expert count
    ref = fused_moe_reference(x, w13, w2, weights.to(device), ids.to(device))
    torch.testing.assert_close(out, ref, **TOL[dtype])


def test_empty_experts_and_one_busy_expert(device, rng):
    # 3 of 32 experts take every token: the other 29 are empty, and one block per busy expert is padding.
    x = torch.randn((50, 32), generator=rng).to(device)
    w13, w2 = experts_weights(32, 32, 16, torch.float32, device, rng)
    weights, ids = routed(50, 32, 2, rng, used=3)
    out = fused_moe(x, w13, w2, weights.to(device), ids.to(device))
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights.to(device), ids.to(device)),
                               **TOL[torch.float32])


def test_expert_parallel_shares_sum_to_the_whole(device, rng):
    """Each of two ranks holds half the experts (``expert_map``); their outputs add up to the whole."""
    experts, hidden, inter = 8, 32, 16
    x = torch.randn((9, hidden), generator=rng).to(device)
    w13, w2 = experts_weights(experts, hidden, inter, torch.float32, device, rng)
    weights, ids = routed(9, experts, 2, rng)
    weights, ids = weights.to(device), ids.to(device)
    whole = fused_moe_reference(x, w13, w2, weights, ids)
    total = torch.zeros_like(whole)
    for rank in range(2):
        held = range(rank * 4, rank * 4 + 4)
        expert_map = torch.full((experts,), -1, dtype=torch.int32)
        expert_map[list(held)] = torch.arange(4, dtype=torch.int32)
        expert_map = expert_map.to(device)
        part = fused_moe(x, w13[list(held)].contiguous(), w2[list(held)].contiguous(), weights, ids,
                         expert_map=expert_map)
        torch.testing.assert_close(
            part, fused_moe_reference(x, w13[list(held)], w2[list(held)], weights, ids, expert_map),
            **TOL[torch.float32])
        total += part
    torch.testing.assert_close(total, whole, **TOL[torch.float32])


@pytest.mark.parametrize("block_m", [16, 64])
def test_align_sorts_slots_by_expert_in_whole_blocks(block_m, rng):
    tokens, experts, top_k = 23, 6, 2
    _, ids = routed(tokens, experts, top_k, rng, used=4)  # experts 4 and 5 empty
    sorted_slots, block_experts, num_padded = moe_align_block_size(ids, experts, block_m)
    size = max_padded_rows(tokens * top_k, experts, block_m)
    assert sorted_slots.numel() == size and block_experts.numel() == -(-size // block_m)
    used = int(num_padded)
    assert used % block_m == 0 and used <= size
    flat = ids.reshape(-1)
    real = sorted_slots[:used][sorted_slots[:used] < tokens * top_k]
    assert sorted(real.tolist()) == list(range(tokens * top_k))  # every slot exactly once
    assert (sorted_slots[used:] == tokens * top_k).all()
    for block in range(used // block_m):
        rows = sorted_slots[block * block_m:(block + 1) * block_m]
        rows = rows[rows < tokens * top_k]
        assert (flat[rows.long()] == block_experts[block]).all()  # a block is one expert's


def test_explicit_tile_and_bad_inputs(device, rng):
    x = torch.randn((5, 32), generator=rng).to(device)
    w13, w2 = experts_weights(4, 32, 16, torch.float32, device, rng)
    weights, ids = routed(5, 4, 2, rng)
    weights, ids = weights.to(device), ids.to(device)
    tile = MoETileConfig(block_m=32, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=tile),
                               fused_moe_reference(x, w13, w2, weights, ids), **TOL[torch.float32])
    with pytest.raises(ValueError, match="w2 must be"):
        fused_moe(x, w13, w2[:, :, :8].contiguous(), weights, ids)
    with pytest.raises(TypeError, match="topk_weights must have dtype"):
        fused_moe(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(x, w13, w2, weights[:3], ids[:3])
    assert fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_gpt_oss_experts_biases_and_clamped_swiglu(dtype, device, rng):
    """gpt-oss's experts: biases on both projections, and the clamped SwiGLU (inputs big enough that the
    clamps bite)."""
    tokens, experts, top_k, hidden, inter = 19, 8, 4, 48, 24
    x = (3 * torch.randn((tokens, hidden), generator=rng)).to(dtype).to(device)
    w13, w2 = experts_weights(experts, hidden, inter, dtype, device, rng)
    w13_bias = torch.randn((experts, 2 * inter), generator=rng).to(dtype).to(device)
    w2_bias = torch.randn((experts, hidden), generator=rng).to(dtype).to(device)
    weights, ids = routed(tokens, experts, top_k, rng)
    args = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation="swiglu_oai", swiglu_alpha=1.702,
                swiglu_limit=2.0)
    out = fused_moe(x, w13, w2, weights.to(device), ids.to(device), **args)
    expected = fused_moe_reference(x, w13, w2, weights.to(device), ids.to(device), **args)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    with pytest.raises(ValueError, match="activation must be"):
        fused_moe(x, w13, w2, weights.to(device), ids.to(device), activation="gelu")


def test_tuned_configs_are_read_and_the_nearest_token_count_wins(tmp_path):
    from kernels.fused_moe import config_file_name, nearest_config, read_tuned_configs

    tile = dict(block_n=64, block_k=64, group_m=1, num_warps=4, num_stages=3)
    path = tmp_path / config_file_name(128, 1536, "NVIDIA H100 80GB HBM3")
    assert path.name == "E=128,N=1536,device_name=NVIDIA_H100_80GB_HBM3.json"
    path.write_text(json.dumps({"1": dict(block_m=16, **tile), "64": dict(block_m=32, **tile),
                                "1024": dict(block_m=64, **tile)}))
    tuned = read_tuned_configs(path)
    assert [nearest_config(tuned, n).block_m for n in (1, 20, 40, 500, 4096)] == [16, 16, 32, 32, 64]
    assert read_tuned_configs(tmp_path / "none.json") == {}
    # Whatever tile is chosen, the answer is the same (tiles change speed only).
    gen = torch.Generator().manual_seed(2)
    x = torch.randn((9, 32), generator=gen)
    w13, w2 = experts_weights(4, 32, 16, torch.float32, torch.device("cpu"), gen)
    weights, ids = routed(9, 4, 2, gen)
    for cfg in tuned.values():
        torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=cfg),
                                   fused_moe_reference(x, w13, w2, weights, ids), **TOL[torch.float32])


@pytest.mark.parametrize("group", [None, 32], ids=["per-channel", "32-column-blocks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_experts_are_decoded_in_registers(group, dtype, device, rng):
    """FP8 experts (e4m3 weights, fp32 scales per row and group of columns): the kernel equals the
    reference over the dequantized experts, for per-channel and block scales."""
    from engine.models.fp8 import quantize_fp8

    tokens, experts, top_k, hidden, inter = 21, 8, 2, 64, 32
    x = torch.randn((tokens, hidden), generator=rng).to(dtype).to(device)
    w13, w2 = experts_weights(experts, hidden, inter, torch.float32, torch.device("cpu"), rng)
    q13, s13 = zip(*(quantize_fp8(w, group or hidden) for w in w13), strict=True)
    q2, s2 = zip(*(quantize_fp8(w, group or inter) for w in w2), strict=True)
    fp8 = dict(w13_scale=torch.stack(s13).to(device), w2_scale=torch.stack(s2).to(device))
    q13, q2 = torch.stack(q13).to(device), torch.stack(q2).to(device)
    weights, ids = routed(tokens, experts, top_k, rng)
    out = fused_moe(x, q13, q2, weights.to(device), ids.to(device), **fp8)
    expected = fused_moe_reference(x, q13, q2, weights.to(device), ids.to(device), **fp8)
    torch.testing.assert_close(out, expected, **TOL[dtype])
