"""Helpers the benchmarks share: an A/B of the engine with another paged-decode tile."""

from __future__ import annotations

import importlib

import pytest
import torch

import kernels
from benchmarks.common import use_decode_tile
from kernels._common import recorded_launches

decode = importlib.import_module("kernels.paged_decode_attention")  # the module, not the launcher


def test_a_decode_tile_override_reaches_every_decode_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode, "decode_tile_config", decode.decode_tile_config)  # restored afterwards
    chosen = decode.decode_tile_config
    assert use_decode_tile(None) is None and decode.decode_tile_config is chosen
    assert use_decode_tile("32,8,5") == {"block_n": 32, "num_warps": 8, "num_stages": 5}
    q = torch.empty((2, 8, 64))
    cache = torch.empty((6, 16, 2, 64))
    tables = torch.arange(6, dtype=torch.int32).view(2, 3)
    lens = torch.tensor([40, 33], dtype=torch.int32)
    with recorded_launches(capability=(9, 0)) as launches:
        kernels.paged_decode_attention(q, cache, cache, tables, lens, scale=0.125, num_splits=2)
    options = launches[0].kwargs
    assert (options["BLOCK_N"], options["num_warps"], options["num_stages"]) == (32, 8, 5)
    assert options["GROUP_PAD"] == 16  # the group's rows stay the launcher's choice


@pytest.mark.parametrize("spec", ["64,4", "64,4,five", ""])
def test_a_malformed_decode_tile_is_refused(spec: str) -> None:
    with pytest.raises(SystemExit, match="KEYS,WARPS,STAGES"):
        use_decode_tile(spec)
