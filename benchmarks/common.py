"""Shared helpers of the benchmarks: random-weight checkpoints of a chosen shape, result tables, JSON.

A benchmark checkpoint reuses ``engine.tiny``'s real BPE tokenizer, chat template and weight
initialisation, with the dimensions replaced (e.g. Qwen3-0.6B's), so nothing is downloaded. Its
``vocab_size`` may exceed the tokenizer's (as real checkpoints' padded vocabularies do).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

# Qwen3-0.6B's config.json dimensions (the model nano-vllm benchmarks).
QWEN3_0_6B = dict(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  intermediate_size=3072, num_hidden_layers=28, vocab_size=151936,
                  max_position_embeddings=40960)
# A Qwen3-shaped model a 2-core CPU runs in a minute: ~3.9M parameters (4 layers, GQA 4:2, tied
# embeddings over the tiny tokenizer's ~3k vocabulary); the test checkpoints have hidden 64-128, 2 layers.
QWEN3_CPU_SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                       intermediate_size=768, num_hidden_layers=4, max_position_embeddings=4096)


def create_checkpoint(out_dir: str | Path, dims: dict[str, int], seed: int = 0) -> Path:
    """Write a random-weight Qwen3 checkpoint with ``dims`` overriding the tiny one's config."""
    from safetensors.torch import save_file

    from engine.tiny import create_tiny_checkpoint, random_weights

    out = Path(out_dir)
    marker = out / "benchmark-dims.json"
    if marker.is_file() and json.loads(marker.read_text()) == {**dims, "seed": seed}:
        return out
    create_tiny_checkpoint(out, arch="qwen3", seed=seed)
    config = json.loads((out / "config.json").read_text())
    config.update(dims)
    config["max_window_layers"] = config["num_hidden_layers"]
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_weights(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    marker.write_text(json.dumps({**dims, "seed": seed}))
    return out


def machine_description(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    import os

    return f"{os.cpu_count()}-core CPU ({platform.machine()})"


def format_table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(c) for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


DECODE_TILE_HELP = ("launch paged decode with this tile instead of the launcher's (keys per tile, warps, "
                    "pipeline stages; e.g. 64,4,5): an A/B of the same workload against a run without it")


def use_decode_tile(spec: str | None) -> dict[str, int] | None:
    """Make every paged decode launch of this process use ``spec`` ("KEYS,WARPS,STAGES") instead of
    ``decode_tile_config``'s tile (the GQA group's rows stay the launcher's); the tile as a dict for the
    results, or None when ``spec`` is None. Before the engine starts: CUDA graphs capture the launches."""
    if spec is None:
        return None
    try:
        keys, warps, stages = (int(part) for part in spec.split(","))
    except ValueError:
        raise SystemExit(f"--decode-tile wants KEYS,WARPS,STAGES (e.g. 64,4,5), got {spec!r}") from None
    import importlib

    from kernels._common import TileConfig

    # The module: the package re-exports its launcher under the same name.
    decode = importlib.import_module("kernels.paged_decode_attention")

    chosen = decode.decode_tile_config

    def override(head_dim: int, group: int, dtype: Any, capability: Any = None) -> TileConfig:
        return TileConfig(chosen(head_dim, group, dtype, capability).block_m, keys, warps, stages)

    decode.decode_tile_config = override
    return {"block_n": keys, "num_warps": warps, "num_stages": stages}
