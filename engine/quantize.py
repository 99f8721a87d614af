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
# What the KV-cache scales are calibrated on when no text is given: prose, code and chat, the kinds of
# text a platform serves (a calibration set of one's own traffic is better: --calibration-file).
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the quarterly figures. Revenue rose by 12 percent, while costs "
    "fell slightly, and the board approved the new budget for the coming year.\n"
    "def merge(left, right):\n    out = []\n    while left and right:\n        out.append(left.pop(0) "
    "if left[0] <= right[0] else right.pop(0))\n    return out + left + right\n"
    "User: Can you summarise the article in two sentences?\nAssistant: Certainly. The article argues that "
    "cities should invest in public transport, and it gives three examples where that paid off."
)
KV_SCALE_MARGIN = 1.25  # headroom over the largest value seen in calibration (e4m3 saturates at 448)


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


def calibrate_kv_scales(model_dir: str | Path, texts: list[str]) -> list[tuple[float, float]]:
    """Per layer, the FP8 KV-cache scales (K, V) that map the largest magnitude of K and V seen over
    ``texts`` (prefilled through the model in float32 on the CPU) to 448 / ``KV_SCALE_MARGIN``."""
    from engine.attention.base import AttentionMetadata
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.loader import load_model
    from engine.tokenizer import Tokenizer

    args = ModelArgs.from_pretrained(model_dir)
    seen: list[list[float]] = [[0.0, 0.0] for _ in range(args.num_layers)]

    class Recording(TorchAttentionBackend):
        calls = 0

        def forward(self, q, k, v, kv_cache, meta, **kwargs):  # type: ignore[no-untyped-def]
            layer = seen[Recording.calls % args.num_layers]
            layer[0] = max(layer[0], float(k.abs().max()))
            layer[1] = max(layer[1], float(v.abs().max()))
            Recording.calls += 1
            return super().forward(q, k, v, kv_cache, meta, **kwargs)

    backend = Recording(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)
    model = load_model(model_dir, backend, torch.float32, "cpu", args=args)
    tokenizer = Tokenizer.from_pretrained(model_dir)
    block = 16
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer.encode(text)[: args.max_position_embeddings]
            n = len(ids)
            blocks = -(-n // block)
            caches = [torch.zeros(2, blocks, block, args.num_kv_heads, args.head_dim)
                      for _ in range(args.num_layers)]
            meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                     torch.tensor([n], dtype=torch.int32),
                                     torch.arange(blocks, dtype=torch.int32)[None], n, n, [n], [n], block)
            model(torch.tensor(ids), torch.arange(n), caches, meta)
    return [(max(k, 1e-6) * KV_SCALE_MARGIN / 448.0, max(v, 1e-6) * KV_SCALE_MARGIN / 448.0) for k, v in seen]


def quantize_checkpoint(src: str | Path, dst: str | Path, scheme: str, block: tuple[int, int] = (128, 128),
                        kv_cache_texts: list[str] | None = None) -> Path:
    """Write ``src``'s FP8 version to ``dst`` (created; must not hold a checkpoint already);
    ``kv_cache_texts``: calibrate FP8 KV-cache scales on them and write them too (``self_attn.k_scale``
    / ``v_scale`` and the config's ``kv_cache_scheme``, as compressed-tensors does)."""
    if scheme not in QUANTIZE_SCHEMES:
        raise ValueError(f"scheme must be one of {QUANTIZE_SCHEMES}, got {scheme!r}")
    src, dst = Path(src), Path(dst)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    ModelArgs.from_hf_config(config)  # refuses what the engine could not serve
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
    config["quantization_config"] = quantization_config(scheme, block)
    if kv_cache_texts:
        for layer, (k_scale, v_scale) in enumerate(calibrate_kv_scales(src, kv_cache_texts)):
            out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(k_scale, dtype=torch.float32)
            out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(v_scale, dtype=torch.float32)
        config["quantization_config"]["kv_cache_scheme"] = {
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for extra in src.iterdir():
        if extra.is_file() and extra.name != "config.json" and not extra.name.endswith(".safetensors") \
                and extra.name != "model.safetensors.index.json":
            shutil.copy2(extra, dst / extra.name)
    return dst
