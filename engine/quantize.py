"""``tollgate model quantize``: write an FP8 checkpoint from a 16-bit one, in the formats the loader reads
(``engine.models.fp8``).

- ``fp8-channel``: compressed-tensors ``float-quantized`` with per-output-channel weight scales
  (``weight_scale [out, 1]``) and dynamic per-token activations;
- ``fp8-block``: block FP8 (``quant_method: "fp8"``) with ``weight_scale_inv [ceil(out/bn), ceil(in/bk)]``
  over ``block`` tiles (128 x 128 by default, as the published checkpoints use).

Every decoder projection (q/k/v/o, gate/up/down, a MoE's experts and shared experts) is quantized;
embeddings, norms, routers and the LM head stay as they are. The other files of the checkpoint (tokenizer,
chat template, generation config) are copied. The result is deterministic for a given input.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.loader import checkpoint_files
from engine.models.config import QUANTIZABLE, ModelArgs
from engine.models.fp8 import quantize_block_fp8, quantize_fp8

QUANTIZE_SCHEMES = ("fp8-channel", "fp8-block")


def _quantizable(name: str, tensor: torch.Tensor) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and tensor.dim() == 2 and module.rpartition(".")[2] in QUANTIZABLE \
        and tensor.is_floating_point() and tensor.dtype.itemsize >= 2


def quantization_config(scheme: str, block: tuple[int, int]) -> dict:
    if scheme == "fp8-block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    group = {"targets": ["Linear"], "weights": {**fp8, "strategy": "channel", "dynamic": False},
             "input_activations": {**fp8, "strategy": "token", "dynamic": True}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "quantization_status": "compressed", "config_groups": {"group_0": group}, "ignore": ["lm_head"]}


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str, block: tuple[int, int] = (128, 128)
                        ) -> Path:
    """Write ``src``'s FP8 version to ``dst`` (created; must not hold a checkpoint already)."""
    if scheme not in QUANTIZE_SCHEMES:
        raise ValueError(f"scheme must be one of {QUANTIZE_SCHEMES}, got {scheme!r}")
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    args = ModelArgs.from_hf_config(config)
    if config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')})")
    if (dst / "config.json").exists():
        raise ValueError(f"{dst} already holds a checkpoint")
    dst.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for path in checkpoint_files(src):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if not _quantizable(name, tensor):
                    out[name] = tensor
                elif scheme == "fp8-block":
                    out[name], out[name + "_scale_inv"] = quantize_block_fp8(tensor, block)
                else:
                    out[name], out[name + "_scale"] = quantize_fp8(tensor, tensor.shape[1])
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config["quantization_config"] = quantization_config(scheme, block)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for extra in src.iterdir():
        if extra.is_file() and extra.name != "config.json" and not extra.name.endswith(".safetensors") \
                and extra.name != "model.safetensors.index.json":
            shutil.copy2(extra, dst / extra.name)
    del args
    return dst
