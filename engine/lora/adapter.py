"""A PEFT LoRA bundle, read and checked against the base model it is for, before anything serves it.

A bundle is PEFT's ``save_pretrained`` output: ``adapter_config.json`` and ``adapter_model.safetensors``
(tensors named ``base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight``).

Invariants:
- ``load_adapter(bundle, base)`` returns a ``LoRAAdapter`` only for a bundle the engine can serve on
  ``base`` exactly as PEFT computes it, ``y = W x + scaling * B (A x)``; anything else is an
  ``AdapterError`` naming the field (a 400 at registration, never a failure at serving time):
  - PEFT type ``LORA``, a task type for causal language models (or none);
  - target modules among the projections the engine wraps (``TARGET_MODULES``: attention q/k/v/o and
    the dense MLP's gate/up/down; a mixture-of-experts base takes attention adapters only), ``bias:
    "none"``, and every other config field either informational or unset: DoRA, ``modules_to_save``,
    per-module ranks or alphas, layer subsets, ``fan_in_fan_out`` and any feature a later PEFT adds are
    refused, not ignored;
  - rank ``1..max_rank``; ``lora_alpha`` positive; ``use_rslora`` gives ``scaling = alpha / sqrt(r)``,
    else ``alpha / r``;
  - exactly the expected tensors: for every layer of the base and every target module an A of
    ``[r, in_features]`` and a B of ``[out_features, r]``, floating point, finite, nothing else;
  - at most ``max_bytes`` of weights.
- ``digest`` is a SHA-256 of the config fields that change the computation and of every tensor's bytes,
  so a bundle replaced under the same name has another digest (prefix-cache keys use it, never a name).
- Weights are kept in float32 on the host, by layer and module: ``weights[layer][module] = (A, B)``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from engine.models.config import ModelArgs

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
TARGET_MODULES = (*ATTENTION_MODULES, *MLP_MODULES)
DEFAULT_MAX_RANK = 64
DEFAULT_MAX_BYTES = 1 << 30
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)"
                     r"\.lora_([AB])\.weight$")
_CAUSAL_TASKS = (None, "CAUSAL_LM")
# The config fields read here; those that change nothing in serving; any other set to a value is a
# feature this engine does not compute (DoRA, modules_to_save, rank patterns, layer subsets, ...), refused.
_READ = frozenset({"peft_type", "task_type", "r", "lora_alpha", "use_rslora", "target_modules", "bias"})
_INFORMATIONAL = frozenset({"base_model_name_or_path", "revision", "inference_mode", "init_lora_weights",
                            "lora_dropout", "peft_version", "auto_mapping", "megatron_core",
                            "qalora_group_size", "ensure_weight_tying"})


class AdapterError(ValueError):
    """A bundle that cannot be served on its base; ``param`` names what is wrong."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LoRAAdapter:
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    digest: str
    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(repr=False)

    @property
    def num_bytes(self) -> int:
        return sum(4 * (a.numel() + b.numel()) for layer in self.weights.values() for a, b in layer.values())


def module_shapes(base: ModelArgs) -> dict[str, tuple[int, int]]:
    """``(in_features, out_features)`` of each projection a LoRA may target on ``base``."""
    q, kv = base.num_heads * base.head_dim, base.num_kv_heads * base.head_dim
    shapes = {"q_proj": (base.hidden_size, q), "k_proj": (base.hidden_size, kv),
              "v_proj": (base.hidden_size, kv), "o_proj": (q, base.hidden_size)}
    if base.moe is None:
        inter = base.intermediate_size
        shapes |= {"gate_proj": (base.hidden_size, inter), "up_proj": (base.hidden_size, inter),
                   "down_proj": (inter, base.hidden_size)}
    return shapes


def _config(bundle: Path) -> dict[str, Any]:
    try:
        config = json.loads((bundle / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"the bundle has no {CONFIG_FILE}", "adapter_config") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not JSON: {exc}", "adapter_config") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must be a JSON object", "adapter_config")
    return config


def _check_config(config: dict[str, Any], shapes: dict[str, tuple[int, int]],
                  max_rank: int) -> tuple[int, float, tuple[str, ...]]:
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"peft_type must be LORA, got {config.get('peft_type')!r}", "peft_type")
    if config.get("task_type") not in _CAUSAL_TASKS:
        raise AdapterError(f"task_type must be CAUSAL_LM, got {config.get('task_type')!r}", "task_type")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise AdapterError(f"r must be an integer in [1, {max_rank}], got {rank!r}", "r")
    if (not isinstance(alpha, int | float) or isinstance(alpha, bool) or not alpha > 0
            or not math.isfinite(alpha)):
        raise AdapterError(f"lora_alpha must be a positive number, got {alpha!r}", "lora_alpha")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias {config.get('bias')!r} is not supported (LoRA weights only)", "bias")
    for name, value in config.items():
        if name not in _READ and name not in _INFORMATIONAL and value not in (None, False, {}, [], ""):
            raise AdapterError(f"{name} {value!r} is not supported (plain LoRA on the projections only)",
                               name)
    targets = config.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list) or not targets:
        raise AdapterError("target_modules must be a non-empty list of module names", "target_modules")
    unknown = sorted(set(targets) - set(shapes))
    if unknown:
        raise AdapterError(f"target_modules {unknown} cannot be served on this base (it takes "
                           f"{', '.join(m for m in TARGET_MODULES if m in shapes)})", "target_modules")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), tuple(m for m in TARGET_MODULES if m in targets)


def load_adapter(bundle: str | Path, base: ModelArgs, *, max_rank: int = DEFAULT_MAX_RANK,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> LoRAAdapter:
    """The bundle at ``bundle``, checked against ``base`` (see the module invariants)."""
    bundle = Path(bundle)
    shapes = module_shapes(base)
    config = _config(bundle)
    rank, scaling, targets = _check_config(config, shapes, max_rank)
    path = bundle / WEIGHTS_FILE
    if not path.is_file():
        raise AdapterError(f"the bundle has no {WEIGHTS_FILE}", "adapter_model")
    expected = sum((shapes[m][0] + shapes[m][1]) * rank for m in targets) * base.num_layers * 4
    if expected > max_bytes or path.stat().st_size > 2 * max_bytes:
        raise AdapterError(f"the adapter's weights ({expected} bytes in float32) exceed {max_bytes} bytes",
                           "adapter_model")
    try:
        tensors = load_file(str(path))
    except Exception as exc:  # safetensors' own errors: a truncated or foreign file
        raise AdapterError(f"{WEIGHTS_FILE} cannot be read: {exc}", "adapter_model") from None
    weights: dict[int, dict[str, list[torch.Tensor | None]]] = {}
    for name, tensor in tensors.items():
        match = _TENSOR.match(name)
        if match is None:
            raise AdapterError(f"unexpected tensor {name!r} (LoRA A/B of the decoder's projections only)",
                               "adapter_model")
        layer, module, which = int(match[1]), match[3], match[4]
        if layer >= base.num_layers or module not in targets:
            raise AdapterError(f"tensor {name!r} has no place on this base ({base.num_layers} layers, "
                               f"targets {list(targets)})", "adapter_model")
        fan_in, fan_out = shapes[module]
        want = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != want:
            raise AdapterError(f"tensor {name!r} has shape {list(tensor.shape)}, this base needs "
                               f"{list(want)}", "adapter_model")
        if not tensor.is_floating_point():
            raise AdapterError(f"tensor {name!r} is {tensor.dtype}, not floating point", "adapter_model")
        value = tensor.float()
        if not torch.isfinite(value).all():
            raise AdapterError(f"tensor {name!r} holds a non-finite value", "adapter_model")
        weights.setdefault(layer, {}).setdefault(module, [None, None])[0 if which == "A" else 1] = value
    missing = [f"layers.{i}.{m}.lora_{w}" for i in range(base.num_layers) for m in targets for j, w in
               enumerate("AB") if weights.get(i, {}).get(m, [None, None])[j] is None]
    if missing:
        raise AdapterError(f"the bundle lacks {len(missing)} tensors, e.g. {missing[0]}", "adapter_model")
    digest = hashlib.sha256(json.dumps({"r": rank, "scaling": scaling, "targets": targets}).encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].float().contiguous().numpy().tobytes())
    final: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer, modules in weights.items():
        for module, (a, b) in modules.items():
            assert a is not None and b is not None  # every pair is complete (checked above)
            final.setdefault(layer, {})[module] = (a, b)
    return LoRAAdapter(rank, scaling, targets, digest.hexdigest(), final)
