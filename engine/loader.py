"""Build a model from a Hugging Face checkpoint directory: ``config.json`` + ``*.safetensors``.

The model is constructed on the ``meta`` device (no memory, no random init), materialised empty on the
target device in the target dtype, then every parameter is filled from the safetensors files by its
HF name; q/k/v and gate/up are copied into their row ranges of the fused ``qkv_proj``/``gate_up_proj``,
and a mixture of experts' per-expert tensors (``...experts.N.gate_proj/up_proj/down_proj``, after the
family's renames, ``engine.models.registry``) into its stacked ``experts.w13`` / ``experts.w2``.
Invariants: every parameter is written exactly once from the checkpoint, shapes must match exactly,
and a missing or unexpected tensor is a ``ValueError`` naming it (never a silently random weight).
Random weights only when asked for by name (``load_format="random"``: a ``config.json`` alone, for
benchmarking model shapes whose checkpoints are not at hand, as vLLM's ``--load-format dummy``).
A rank of a tensor-parallel group (``engine.distributed``) reads only its slice of each tensor
(``safe_open(...).get_slice``): no rank materialises the whole model; padding rows of its vocabulary
shard are zeros.
The RoPE cache stays float32 whatever the model dtype.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from safetensors import safe_open
from torch import nn

from engine.attention.base import AttentionBackend
from engine.distributed import ShardSizes, TensorParallel
from engine.models.config import Fp8Args, ModelArgs
from engine.models.fp8 import FP8_DTYPE, checkpoint_scale_rows, quantize_fp8, use_fp8_layers
from engine.models.llama import LlamaForCausalLM
from engine.models.mxfp4 import dequantize_mxfp4
from engine.models.registry import checkpoint_renames, model_class

_M = TypeVar("_M", bound=nn.Module)

# HF tensor names that carry no parameter (buffers some exporters include).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# FP8 checkpoints' activation and KV-cache scales: activations are quantized per token here (see
# engine.models.fp8); the KV-cache scales are read by read_kv_scales.
_FP8_IGNORED_SUFFIXES = (".input_scale", ".input_scale_ub", ".k_scale", ".v_scale", ".kv_scale")


@runtime_checkable
class _HasDeviceCache(Protocol):
    """A module holding a computed (non-checkpoint) cache, recomputed once it is on its device."""

    def reset_cache(self) -> None: ...


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint (from its index when sharded), in a stable order."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        with index.open(encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [d / n for n in names]
        missing = [str(p) for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"checkpoint index names missing files: {', '.join(missing)}")
        return files
    # Mistral repos also ship consolidated*.safetensors in their own naming scheme: not ours.
    files = sorted(p for p in d.glob("*.safetensors") if not p.name.startswith("consolidated"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {d}")
    return files


# A routed expert's projection in the checkpoint (after the family's renames).
_EXPERT = re.compile(
    r"^(?P<parent>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
# gpt-oss's experts: one tensor per layer for all experts (``gate_up_proj [E, H, 2I]`` with gate and up
# interleaved, ``down_proj [E, I, H]``), or their MXFP4 ``_blocks`` + ``_scales``, and biases.
_FUSED_EXPERTS = re.compile(
    r"^(?P<parent>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<part>_bias|_blocks|_scales)?$"
)
_EXPERT_SCALE = re.compile(r"^.+\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight_scale(_inv)?$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _intermediate(hf_name: str, shard: ShardSizes) -> int:
    """This rank's intermediate size of the MLP that ``hf_name`` belongs to."""
    return shard.shared_intermediate_size if ".shared_experts." in hf_name else shard.intermediate_size


def _fused_shards(
    args: ModelArgs, shard: ShardSizes | None = None, inter: int | None = None
) -> dict[str, tuple[str, int, int]]:
    """HF projection name -> (fused name, first row, number of rows) on this rank; ``inter``: the MLP's
    intermediate size on this rank (default: the dense MLP's)."""
    shard = shard or ShardSizes.of(args)
    q, kv = shard.num_heads * args.head_dim, shard.num_kv_heads * args.head_dim
    inter = shard.intermediate_size if inter is None else inter
    return {
        "q_proj": ("qkv_proj", 0, q),
        "k_proj": ("qkv_proj", q, kv),
        "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, inter),
        "up_proj": ("gate_up_proj", inter, inter),
    }


def _source_slice(hf_name: str, args: ModelArgs, shard: ShardSizes) -> tuple[int, int, int] | None:
    """(dimension, first index, length) of this rank's slice of a checkpoint tensor; None: the whole."""
    module, _, leaf = hf_name.rpartition(".")
    proj = module.rpartition(".")[2]
    d = args.head_dim
    if proj == "q_proj":
        return 0, shard.first_head * d, shard.num_heads * d
    if proj in ("k_proj", "v_proj"):
        return 0, shard.first_kv_head * d, shard.num_kv_heads * d
    inter = _intermediate(hf_name, shard)
    if proj in ("gate_proj", "up_proj"):
        return 0, shard.rank * inter, inter
    if proj == "o_proj" and leaf == "weight":
        return 1, shard.first_head * d, shard.num_heads * d
    if proj == "down_proj" and leaf == "weight":
        return 1, shard.rank * inter, inter
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, shard.vocab_start, shard.vocab_rows
    if leaf == "sinks":  # gpt-oss: one per query head
        return 0, shard.first_head, shard.num_heads
    return None


def _expected_hf_names(
    model: nn.Module, shards: dict[str, tuple[str, int, int]], args: ModelArgs
) -> set[str]:
    by_fused: dict[str, list[str]] = {}
    for hf, (fused, _, _) in shards.items():
        by_fused.setdefault(fused, []).append(hf)
    names: set[str] = set()
    num_experts = args.moe.num_experts if args.moe is not None else 0
    for name, _ in model.named_parameters():  # tied weights appear once, under the embedding's name
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if module.endswith(".experts") and args.model_type == "gpt_oss":  # all experts in one tensor
            proj = "gate_up_proj" if leaf.startswith("w13") else "down_proj"
            names.add(f"{module}.{proj}" + ("_bias" if leaf.endswith("_bias") else ""))
        elif module.endswith(".experts") and leaf in ("w13_scale", "w2_scale"):
            continue  # FP8 experts' scales come with their weights (_load_expert)
        elif module.endswith(".experts") and leaf in ("w13", "w2"):  # every expert, held here or not
            projs = ("gate_proj", "up_proj") if leaf == "w13" else ("down_proj",)
            names.update(f"{module}.{e}.{p}.weight" for e in range(num_experts) for p in projs)
        elif leaf == "weight_scale" and args.fp8 is not None and args.fp8.quantize_at_load:
            continue  # made at load from the 16-bit weight
        else:
            if leaf == "weight_scale" and args.fp8 is not None:
                leaf = args.fp8.scale_name
            if proj in by_fused:
                names.update(f"{parent}.{hf}.{leaf}" for hf in by_fused[proj])
            else:
                names.add(f"{module}.{leaf}")
    return names


@torch.no_grad()
def load_weights(
    model: nn.Module, args: ModelArgs, model_dir: str | Path, shard: ShardSizes | None = None
) -> None:
    """Fill every parameter of ``model`` from the checkpoint's safetensors files (see module docs);
    ``shard``: this rank's slices only."""
    shard = shard or ShardSizes.of(args)
    params: dict[str, torch.Tensor] = dict(model.named_parameters())
    shards = _fused_shards(args, shard)
    expected = _expected_hf_names(model, shards, args)
    renames = checkpoint_renames(args)
    seen: set[str] = set()
    packed: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 blocks / scales waiting for their other half
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for stored_name in f.keys():
                hf_name = stored_name
                for old, new in renames:
                    hf_name = hf_name.replace(old, new)
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                if args.fp8 is not None and hf_name.endswith(_FP8_IGNORED_SUFFIXES):
                    continue
                if args.fp8 is not None and _EXPERT_SCALE.match(hf_name):
                    continue  # read with its expert's FP8 weight
                if hf_name == "lm_head.weight" and args.tie_word_embeddings:
                    continue
                layer = _LAYER.match(hf_name)
                if layer and int(layer.group(1)) >= args.num_layers and args.model_type == "glm4_moe":
                    continue  # GLM's multi-token-prediction layers, past the decoder: not served
                fused = _FUSED_EXPERTS.match(hf_name) if args.model_type == "gpt_oss" else None
                if fused is not None and fused["part"] in ("_blocks", "_scales"):
                    whole = f"{fused['parent']}.{fused['proj']}"
                    halves = packed.setdefault(whole, {})
                    halves[fused["part"]] = f.get_tensor(stored_name)
                    if len(halves) == 2:
                        stacked = "w13" if fused["proj"] == "gate_up_proj" else "w2"
                        target = params[f"{fused['parent']}.{stacked}"]
                        rows = dequantize_mxfp4(halves["_blocks"], halves["_scales"], target.dtype)
                        _load_fused_experts(rows, fused["parent"], fused["proj"], "", params, shard)
                        del packed[whole]
                        seen.add(whole)
                    continue
                if hf_name not in expected:
                    raise ValueError(
                        f"{path.name}: unexpected tensor {stored_name!r} for {args.architecture}"
                    )
                if hf_name in seen:
                    raise ValueError(f"{path.name}: tensor {stored_name!r} appears twice in the checkpoint")
                if fused is not None:
                    tensor = f.get_tensor(stored_name)
                    if fused["proj"] == "gate_up_proj" and not fused["part"]:
                        tensor = tensor.transpose(1, 2)  # [E, H, 2I] -> rows [E, 2I, H]
                    elif fused["proj"] == "down_proj" and not fused["part"]:
                        tensor = tensor.transpose(1, 2)  # [E, I, H] -> rows [E, H, I]
                    _load_fused_experts(tensor, fused["parent"], fused["proj"], fused["part"] or "", params,
                                        shard)
                    seen.add(hf_name)
                    continue
                expert = _EXPERT.match(hf_name)
                if expert is not None:
                    _load_expert(f, stored_name, expert, params, shard, args)
                    seen.add(hf_name)
                    continue
                part = _source_slice(hf_name, args, shard) if shard.size > 1 else None
                module, _, leaf = hf_name.rpartition(".")
                if args.fp8 is not None and leaf == args.fp8.scale_name:
                    # Sliced as its weight is (rows, or input columns of a row-parallel layer).
                    weight_part = _source_slice(f"{module}.weight", args, shard) if shard.size > 1 else None
                    _load_fp8_scale(f.get_tensor(stored_name), hf_name, weight_part, params, args, shard)
                    seen.add(hf_name)
                    continue
                if part is None:
                    tensor = f.get_tensor(stored_name)
                else:
                    dim, first, length = part
                    view = f.get_slice(stored_name)
                    tensor = view[first:first + length] if dim == 0 else view[:, first:first + length]
                parent, _, proj = module.rpartition(".")
                if proj in shards:
                    into, row, num_rows = _fused_shards(args, shard, _intermediate(hf_name, shard))[proj]
                    target = params[f"{parent}.{into}.{leaf}"].narrow(0, row, num_rows)
                    if args.fp8 is not None and target.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
                        # --quantization fp8
                        scale = params[f"{parent}.{into}.weight_scale"].narrow(0, row, num_rows)
                        _quantize_into(tensor, target, scale, hf_name, args.fp8)
                        seen.add(hf_name)
                        continue
                else:
                    target = params[hf_name]
                    if args.fp8 is not None and target.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
                        # --quantization fp8
                        _quantize_into(tensor, target, params[f"{module}.weight_scale"], hf_name, args.fp8)
                        seen.add(hf_name)
                        continue
                    if part is not None and part[0] == 0 and target.shape[0] > part[2]:
                        target[part[2]:].zero_()  # the vocabulary shard's padding rows
                        target = target.narrow(0, 0, part[2])
                if tuple(tensor.shape) != tuple(target.shape):
                    raise ValueError(f"{path.name}: {hf_name!r} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(target.shape)}")
                target.copy_(tensor)
                seen.add(hf_name)
    if packed:
        raise ValueError(f"checkpoint {model_dir} has MXFP4 tensors without their other half: "
                         f"{', '.join(f'{name} {sorted(halves)}' for name, halves in packed.items())}")
    missing = sorted(expected - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"checkpoint {model_dir} lacks weights: {shown}")


def _load_fp8_expert(f: Any, stored_name: str, match: re.Match[str], params: dict[str, torch.Tensor],
                     shard: ShardSizes, args: ModelArgs, local: int, first: int) -> None:
    """An FP8 model's expert projection: its FP8 rows and row scales (from the checkpoint, or made here
    from a 16-bit tensor), this rank's slice of them, into ``w13``/``w2`` and their ``_scale``."""
    fp8 = args.fp8
    assert fp8 is not None
    proj, inter = match["proj"], shard.moe_intermediate_size
    weight = f.get_tensor(stored_name)
    if weight.dtype == FP8_DTYPE:
        scale_name = stored_name.removesuffix("weight") + fp8.scale_name
        if scale_name not in f.keys():
            raise ValueError(f"{stored_name!r} is FP8 but its scale {scale_name!r} is not in the same file")
        scale = checkpoint_scale_rows(f.get_tensor(scale_name), weight.shape[0], fp8)
    else:  # a 16-bit expert of an FP8 model: quantized here, per row (and block of columns)
        weight, scale = quantize_fp8(weight, fp8.group(weight.shape[1]))
    if proj == "down_proj":  # this rank's input columns (whole groups of them)
        groups_per_col = scale.shape[1] / weight.shape[1]
        group = weight.shape[1] if scale.shape[1] == 1 else round(1 / groups_per_col)
        if scale.shape[1] > 1 and first % group:
            raise ValueError(f"{stored_name!r}: tensor parallelism splits its input at column {first}, "
                             f"inside a {group}-column FP8 block; choose a tensor_parallel_size that keeps "
                             "blocks whole")
        weight = weight[:, first:first + inter]
        if scale.shape[1] > 1:
            scale = scale[:, first // group:first // group + params[f"{match['parent']}.w2_scale"].shape[2]]
        _copy_checked(params[f"{match['parent']}.w2"][local], weight, stored_name)
        _copy_checked(params[f"{match['parent']}.w2_scale"][local], scale, stored_name + " scale")
        return
    row = 0 if proj == "gate_proj" else inter
    target = params[f"{match['parent']}.w13"][local].narrow(0, row, inter)
    target_scale = params[f"{match['parent']}.w13_scale"][local].narrow(0, row, inter)
    _copy_checked(target, weight[first:first + inter], stored_name)
    _copy_checked(target_scale, scale[first:first + inter], stored_name + " scale")


def _quantize_into(tensor: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, name: str,
                   fp8: Fp8Args) -> None:
    """``--quantization fp8``: a 16-bit checkpoint tensor quantized per output row (and group of input
    columns, as ``fp8`` says) into an FP8 weight."""
    if tuple(tensor.shape) != tuple(weight.shape):
        raise ValueError(f"{name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(weight.shape)}")
    q, s = quantize_fp8(tensor, fp8.group(tensor.shape[1]))
    weight.copy_(q)
    scale.copy_(s)


def _load_fp8_scale(tensor: torch.Tensor, hf_name: str, part: tuple[int, int, int] | None,
                    params: dict[str, torch.Tensor], args: ModelArgs, shard: ShardSizes) -> None:
    """A checkpoint's FP8 weight scale, as the model keeps it: one row of group scales per output row of
    this rank (per-tensor scales repeated, block scales expanded to their rows; see engine.models.fp8)."""
    fp8 = args.fp8
    assert fp8 is not None
    module = hf_name.rpartition(".")[0]
    parent, _, proj = module.rpartition(".")
    shards = _fused_shards(args, shard, _intermediate(hf_name, shard))
    if proj in shards:
        fused, row, rows = shards[proj]
        target = params[f"{parent}.{fused}.weight_scale"].narrow(0, row, rows)
    else:
        target = params[f"{module}.weight_scale"]
    rows, groups = target.shape
    first_row = part[1] if part is not None and part[0] == 0 else 0
    full = checkpoint_scale_rows(tensor, first_row + rows, fp8)
    if fp8.scheme == "block":
        bk = fp8.block[1]
        if part is not None and part[0] == 1:  # this rank's input columns: whole blocks of them
            first, length = part[1], part[2]
            if first % bk or length % bk and first + length != full.shape[1] * bk:
                raise ValueError(f"{hf_name!r}: tensor parallelism splits its input at column {first}, "
                                 f"inside a {bk}-column FP8 block; choose a tensor_parallel_size that keeps "
                                 "blocks whole")
            full = full[:, first // bk:first // bk + groups]
    full = full[first_row:first_row + rows]
    if tuple(full.shape) != (rows, groups):
        raise ValueError(f"{hf_name!r}: scales of shape {tuple(tensor.shape)} do not cover this rank's "
                         f"{rows} x {groups} weight groups")
    target.copy_(full)


def _load_expert(f: Any, stored_name: str, match: re.Match[str], params: dict[str, torch.Tensor],
                 shard: ShardSizes, args: ModelArgs) -> None:
    """Copy one routed expert's projection into its place in the stacked ``experts.w13`` / ``w2``: with
    expert parallelism only the experts this rank holds (whole), else this rank's intermediate slice. An
    FP8 model's experts are FP8 too (``_load_fp8_expert``)."""
    local = int(match["expert"]) - shard.first_expert
    if not 0 <= local < shard.num_experts:
        return  # another rank's expert
    proj, inter = match["proj"], shard.moe_intermediate_size
    first = 0 if shard.expert_parallel else shard.rank * inter
    if params[f"{match['parent']}.w2"].dtype == FP8_DTYPE:
        _load_fp8_expert(f, stored_name, match, params, shard, args, local, first)
        return
    view = f.get_slice(stored_name)
    if view.get_dtype() == "F8_E4M3":
        raise ValueError(f"{stored_name!r} is FP8, but config.json has no quantization_config saying how")
    if proj == "down_proj":
        target = params[f"{match['parent']}.w2"][local]
        tensor = view[:, first:first + inter]
    else:
        row = 0 if proj == "gate_proj" else inter
        target = params[f"{match['parent']}.w13"][local].narrow(0, row, inter)
        tensor = view[first:first + inter]
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{stored_name!r} has shape {tuple(view.get_shape())}: the model expects this "
                         f"rank's {tuple(target.shape)} of it")
    target.copy_(tensor)


def _load_fused_experts(rows: torch.Tensor, parent: str, proj: str, part: str,
                        params: dict[str, torch.Tensor], shard: ShardSizes) -> None:
    """gpt-oss: this rank's share of one layer's experts, from a tensor of all of them with its output
    features as rows (``gate_up`` rows interleave gate and up; biases are ``[E, rows]``): the held
    experts, de-interleaved into ``[gate | up]``, sliced on the intermediate dimension without expert
    parallelism."""
    inter = shard.moe_intermediate_size
    first = 0 if shard.expert_parallel else shard.rank * inter
    held = rows[shard.first_expert:shard.first_expert + shard.num_experts]
    if proj == "gate_up_proj":
        target = params[f"{parent}.w13{part}"]
        gate, up = held[:, 0::2], held[:, 1::2]
        halves = (gate[:, first:first + inter], up[:, first:first + inter])
        for i, half in enumerate(halves):
            part_target = target.narrow(1, i * inter, inter)
            _copy_checked(part_target, half, f"{parent}.{proj}{part}")
    elif part == "_bias":
        _copy_checked(params[f"{parent}.w2_bias"], held, f"{parent}.{proj}{part}")
    else:
        _copy_checked(params[f"{parent}.w2"], held[:, :, first:first + inter], f"{parent}.{proj}")


def _copy_checked(target: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{name!r}: this rank's part has shape {tuple(tensor.shape)}, the model expects "
                         f"{tuple(target.shape)}")
    target.copy_(tensor)


def read_kv_scales(model_dir: str | Path, num_layers: int) -> list[tuple[float, float]]:
    """Each layer's FP8 KV-cache scales (K, V) from the checkpoint (compressed-tensors'
    ``kv_cache_scheme`` writes ``model.layers.N.self_attn.k_scale`` / ``v_scale``), 1.0 where it has none."""
    scales = [[1.0, 1.0] for _ in range(num_layers)]
    pattern = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(k|v)_scale$")
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                match = pattern.match(name)
                if match and int(match[1]) < num_layers:
                    value = float(f.get_tensor(name).float().max())
                    scales[int(match[1])][0 if match[2] == "k" else 1] = value
    return [(k, v) for k, v in scales]


def quantized_args(args: ModelArgs, quantization: str | None) -> ModelArgs:
    """``args`` with ``--quantization fp8`` applied: a 16-bit checkpoint's linears quantized per output
    channel at load. A checkpoint that is FP8 already keeps its own scheme."""
    if quantization != "fp8" or args.fp8 is not None:
        return args
    fp8 = Fp8Args(scheme="channel", ignore=("lm_head",), quantize_at_load=True)
    return dataclasses.replace(args, fp8=fp8)


LOAD_FORMATS = ("safetensors", "random")


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter on its device: norm weights 1 + N(0, 0.1), the rest N(0, 0.02) (the tiny
    checkpoints' initialisation). Deterministic for a seed and device."""
    for i, (name, param) in enumerate(model.named_parameters()):
        gen = torch.Generator(device=param.device).manual_seed(seed * 100_003 + i)
        if name.endswith("norm.weight"):
            param.normal_(1.0, 0.1, generator=gen)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def _materialize(model: _M, dtype: torch.dtype, device: torch.device) -> _M:
    """``model.to(dtype).to_empty(device=device)`` without its cost: ``to_empty`` runs ``empty_like`` on
    each meta tensor through torch's Python reference implementations, whose first call imports sympy
    and torch's symbolic shapes (~0.5 s of CPU in every engine process). ``torch.empty`` of the shape
    allocates the same uninitialised storage (floating-point tensors in ``dtype``, others as they are)."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    model._apply(empty)
    return model


def load_model(
    model_dir: str | Path,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device | str,
    max_positions: int | None = None,
    args: ModelArgs | None = None,
    fused_kernels: bool = False,
    load_format: str = "safetensors",
    seed: int = 0,
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM:
    """Construct the checkpoint's model class in ``dtype`` on ``device`` and load its weights (or draw
    them, for ``load_format="random"``); ``tp``: this rank's shard of them only."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    args = args or ModelArgs.from_pretrained(model_dir)
    cls = model_class(args)
    with torch.device("meta"):
        model = cls(args, backend, max_positions, fused_kernels=fused_kernels, tp=tp)
        if args.fp8 is not None:
            use_fp8_layers(model, args.fp8, use_kernel=fused_kernels)
    model = _materialize(model, dtype, torch.device(device))
    model.tie_weights()
    for module in model.modules():
        if isinstance(module, _HasDeviceCache):
            module.reset_cache()
    if load_format == "random":
        init_random_weights(model, seed)
        model.tie_weights()
    else:
        load_weights(model, args, model_dir, model.shard)
    return model.eval()
