"""The LoRA torch path (the CPU's, and the kernels' reference) adds each row's own adapter update for every
shape of a pass's groups: slots consecutive or not, groups of one size or padded, one adapter on every row
or on some, base-model rows in between."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter
from engine.lora.layers import LoRALinear, LoRASlots

IN, OUT, RANK, SLOTS = 24, 20, 4, 5


@pytest.fixture
def projection() -> tuple[LoRALinear, LoRASlots, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    slots = LoRASlots(SLOTS, RANK)
    wrapper = LoRALinear(nn.Linear(IN, OUT, bias=False), slots, IN, (OUT,), False, torch.device("cpu"),
                         torch.float32)
    slots.wrapped[(0, "o_proj")] = wrapper
    updates = {}
    for slot in range(1, SLOTS + 1):
        a, b = torch.randn(RANK, IN), torch.randn(OUT, RANK)
        slots.load(slot, LoRAAdapter(RANK, 0.5, ("o_proj",), f"d{slot}", {0: {"o_proj": (a, b)}}))
        updates[slot] = (a, b * 0.5)
    return wrapper, slots, updates


@pytest.mark.parametrize("rows", [
    [1, 1, 2, 2, 3, 3],          # consecutive slots, groups of one size
    [2, 4, 2, 4, 5, 5],          # slots not consecutive
    [1, 3, 3, 3, 0, 1],          # padded groups, a base-model row
    [2, 2, 2, 2],                # one adapter on every row
    [0, 4, 0, 4, 0],             # one adapter on some rows
    [0, 0, 0],                   # the base model only
])
def test_every_row_gets_its_own_adapter(projection, rows: list[int]) -> None:
    wrapper, slots, updates = projection
    x = torch.randn(len(rows), IN)
    slots.bind(np.array(rows, dtype=np.int64), torch.device("cpu"))
    with torch.no_grad():
        got = wrapper(x)
        want = wrapper.base(x)
        for i, slot in enumerate(rows):
            if slot:
                a, b = updates[slot]
                want[i] += b @ (a @ x[i])
    slots.unbind()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
