"""``ModelArgs``: the few numbers a decoder needs, read from a Hugging Face ``config.json``. No torch.

Mixtures of experts (Qwen3-MoE, Mixtral, GLM-4.5) add ``MoEArgs``; GLM's partial rotary embedding is
``partial_rotary_dim`` (``rotary_dim``: the rotated dimensions of a head).

Accepts both the classic layout (``rope_theta`` + ``rope_scaling``) and transformers 5's
``rope_parameters``. Invariants checked in ``__post_init__`` (``ValueError``): positive sizes,
``num_heads`` a multiple of ``num_kv_heads``, ``hidden_act == "silu"``, a supported RoPE type
(``default``, ``linear``, ``llama3``). A sliding window that is actually enabled is reported in
``sliding_window`` (the runner then caps ``max_model_len`` at it, where full attention is exact).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROUTERS = ("softmax", "sigmoid_grouped", "topk_softmax")
ACTIVATIONS = ("silu", "swiglu_oai")
FP8_SCHEMES = ("channel", "tensor", "block")
# Projections a quantized checkpoint may hold in FP8 (the decoder's linears; never embeddings, norms,
# routers or the LM head).
QUANTIZABLE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class MoEArgs:
    """A mixture-of-experts feed-forward (``engine.models.moe``), as a checkpoint's config describes it.

    ``router``: ``softmax`` (Qwen3-MoE, Mixtral: softmax over all experts, then the top k, renormalised
    over the k when ``renormalize``), ``sigmoid_grouped`` (GLM-4.5 / DeepSeek-V3: sigmoid scores, the
    top k chosen on scores plus ``e_score_correction_bias`` within the best ``topk_groups`` of
    ``num_groups`` expert groups, weighted by the plain scores, renormalised, times ``routed_scaling``)
    or ``topk_softmax`` (gpt-oss: the top k router logits, a router bias included, softmaxed over the k).
    ``activation``: ``silu`` (SiLU(gate) * up) or ``swiglu_oai`` (gpt-oss: gate clamped above at
    ``swiglu_limit``, up to +-limit, ``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``);
    ``expert_bias``: the experts' projections carry biases (gpt-oss).
    ``dense_layers``: the layers that keep a dense MLP of the model's ``intermediate_size``.
    ``shared_intermediate_size``: a shared expert every token goes through as well (0: none)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax"
    renormalize: bool = True
    dense_layers: tuple[int, ...] = ()
    shared_intermediate_size: int = 0
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    activation: str = "silu"
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "intermediate_size", "num_groups", "topk_groups"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"config.json: {name} of the experts must be a positive integer, got {value!r}"
                )
        if self.top_k > self.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok ({self.top_k}) exceeds the "
                             f"{self.num_experts} experts")
        if self.router not in ROUTERS:
            raise ValueError(f"MoE router {self.router!r} is not supported ({ROUTERS})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {self.activation!r} is not supported ({ACTIVATIONS})")
        if self.num_experts % self.num_groups or self.topk_groups > self.num_groups:
            raise ValueError(f"config.json: {self.num_experts} experts do not split into n_group "
                             f"{self.num_groups} with topk_group {self.topk_groups}")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"config.json: topk_group {self.topk_groups} of {self.num_groups} groups holds "
                             f"fewer than num_experts_per_tok ({self.top_k}) experts")

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True, slots=True)
class Fp8Args:
    """How a checkpoint's linear layers are quantized in FP8 (formats and layout: ``engine.models.fp8``)."""

    scheme: str  # channel | tensor | block
    block: tuple[int, int] = (128, 128)  # (rows, columns) of a block, for the block scheme
    ignore: tuple[str, ...] = ()  # module names (or ``re:``-prefixed patterns) left 16-bit
    quantize_at_load: bool = False  # a 16-bit checkpoint quantized when loaded (``--quantization fp8``)

    def __post_init__(self) -> None:
        if self.scheme not in FP8_SCHEMES:
            raise ValueError(f"FP8 scheme {self.scheme!r} is not supported ({FP8_SCHEMES})")
        if self.scheme == "block" and min(self.block) <= 0:
            raise ValueError(f"weight_block_size must be positive, got {list(self.block)}")

    @property
    def scale_name(self) -> str:
        """The checkpoint's name of a weight's scale tensor."""
        return "weight_scale_inv" if self.scheme == "block" else "weight_scale"

    def group(self, in_features: int) -> int:
        """Input columns per scale of a weight with ``in_features`` columns."""
        return self.block[1] if self.scheme == "block" else in_features

    def quantizes(self, module_name: str) -> bool:
        """Whether the module of this (checkpoint) name holds FP8 weights."""
        import re

        if module_name.rpartition(".")[2] not in QUANTIZABLE:
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Fp8Args | None:
        """The FP8 scheme of a ``config.json`` (None for a 16-bit checkpoint); ``ValueError`` for a
        quantization Tollgate does not read."""
        q = cfg.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method == "fp8":
            if q.get("activation_scheme", "dynamic") != "dynamic":
                raise ValueError("block FP8 with static activation scales is not supported "
                                 f"(activation_scheme {q.get('activation_scheme')!r})")
            block = q.get("weight_block_size")
            if block is None:
                raise ValueError("quant_method fp8 without weight_block_size: only block FP8 is read")
            return cls(scheme="block", block=(int(block[0]), int(block[1])),
                       ignore=tuple(q.get("modules_to_not_convert") or ()))
        if method == "fbgemm_fp8":  # fbgemm's per-channel FP8 (weight_scale [out, 1]; input_scale_ub skipped)
            return cls(scheme="channel", ignore=tuple(q.get("modules_to_not_convert") or ()))
        if method == "compressed-tensors":
            if q.get("format") not in ("float-quantized", "naive-quantized", None):
                raise ValueError(f"compressed-tensors format {q.get('format')!r} is not supported "
                                 "(float-quantized FP8 is)")
            groups = list((q.get("config_groups") or {}).values())
            if len(groups) != 1:
                raise ValueError("compressed-tensors: exactly one config group is supported")
            weights = groups[0].get("weights") or {}
            if weights.get("type") != "float" or weights.get("num_bits") != 8:
                raise ValueError(f"compressed-tensors weights {weights} are not FP8 (type float, 8 bits)")
            strategy = weights.get("strategy")
            if strategy not in ("channel", "tensor"):
                raise ValueError(f"compressed-tensors weight strategy {strategy!r} is not supported "
                                 "(channel, tensor)")
            return cls(scheme=strategy, ignore=tuple(q.get("ignore") or ()))
        if method == "mxfp4":
            return None  # gpt-oss's MXFP4 experts: dequantized at load by the loader
        raise ValueError(f"quantization {method!r} is not supported (fp8 block, compressed-tensors FP8, "
                         "fbgemm_fp8)")


@dataclass(frozen=True, slots=True)
class ModelArgs:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    # Extra RoPE parameters (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    rope_params: dict[str, float] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    moe: MoEArgs | None = None
    # Dimensions of each head that RoPE rotates (the first ones; GLM's partial rotary); None: all.
    partial_rotary_dim: int | None = None
    # Each layer's sliding window (None: full attention); empty: every layer full. A query at position p
    # of a windowed layer sees positions (p - window, p].
    layer_windows: tuple[int | None, ...] = ()
    attention_sinks: bool = False  # a learned logit per head in every softmax's sum (gpt-oss)
    fp8: Fp8Args | None = None  # FP8 linear layers (a quantized checkpoint, or quantized at load)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act != "silu":
            raise ValueError(f"config.json: hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.partial_rotary_dim is not None and (
            self.partial_rotary_dim % 2 or not 0 < self.partial_rotary_dim <= self.head_dim
        ):
            raise ValueError(f"config.json: partial_rotary_factor gives {self.partial_rotary_dim} rotary "
                             f"dimensions of {self.head_dim}: must be even and positive")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: rope type {self.rope_type!r} is not supported ({ROPE_TYPES})")
        if self.rope_type != "default" and self.rope_params.get("factor", 0) <= 0:
            raise ValueError(f"config.json: rope type {self.rope_type!r} needs a positive factor")

    @property
    def rotary_dim(self) -> int:
        return self.partial_rotary_dim or self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type", "")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in cfg]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads

        rope: dict[str, Any] = dict(cfg.get("rope_scaling") or {})
        params = cfg.get("rope_parameters")
        if isinstance(params, dict):
            rope = {**params, **rope}
        rope_theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        rope_keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                     "beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim", "truncate")
        rope_params = {k: float(v) for k, v in rope.items() if k in rope_keys and v is not None}
        original = rope.get("original_max_position_embeddings")
        if rope_type == "yarn" and "factor" not in rope_params and original:
            rope_params["factor"] = cfg.get("max_position_embeddings", 2048) / rope_params[
                "original_max_position_embeddings"]

        moe = _moe_args(cfg, model_type)
        partial = float(rope.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
        partial_rotary_dim = int(head_dim * partial) if partial < 1.0 else None
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding_window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
            sliding_window = None
        layer_windows = _layer_windows(cfg, model_type, sliding_window)
        return cls(
            architecture=archs[0] if archs else "",
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_params=rope_params,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases (and none on o_proj); Llama-style attention_bias covers all four.
            qkv_bias=model_type in ("qwen2", "gpt_oss") or attention_bias,
            o_bias=model_type == "gpt_oss" or (model_type not in ("qwen2", "glm4_moe") and attention_bias),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3" or (model_type == "qwen3_moe")
            or (model_type == "glm4_moe" and bool(cfg.get("use_qk_norm", False))),
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_window=sliding_window,
            moe=moe,
            partial_rotary_dim=partial_rotary_dim,
            layer_windows=layer_windows,
            attention_sinks=model_type == "gpt_oss",
            fp8=Fp8Args.from_hf_config(cfg),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelArgs:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json)")
        with path.open(encoding="utf-8") as f:
            return cls.from_hf_config(json.load(f))


def _moe_args(cfg: dict[str, Any], model_type: str) -> MoEArgs | None:
    """The experts of a Qwen3-MoE, Mixtral or GLM-4.5 config (None for a dense model)."""
    layers = cfg["num_hidden_layers"]
    # transformers 5 writes ``num_local_experts`` where the published configs say ``num_experts`` /
    # ``n_routed_experts``: both are read. 0: none listed (refused by ``MoEArgs`` for an MoE model type).
    experts: int = cfg.get("num_experts") or cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
    if model_type == "qwen3_moe":
        if not experts:
            return None
        step = cfg.get("decoder_sparse_step", 1) or 1
        only_mlp = set(cfg.get("mlp_only_layers") or [])
        dense = tuple(i for i in range(layers) if i in only_mlp or (i + 1) % step)
        return MoEArgs(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["moe_intermediate_size"],
                       renormalize=bool(cfg.get("norm_topk_prob", False)), dense_layers=dense)
    if model_type == "mixtral":
        return MoEArgs(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["intermediate_size"], renormalize=True)
    if model_type == "gpt_oss":
        return MoEArgs(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["intermediate_size"], router="topk_softmax",
                       activation="swiglu_oai", expert_bias=True,
                       swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                       swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    if model_type == "glm4_moe":
        inter = cfg["moe_intermediate_size"]
        return MoEArgs(num_experts=experts, top_k=cfg["num_experts_per_tok"],
                       intermediate_size=inter, router="sigmoid_grouped",
                       renormalize=bool(cfg.get("norm_topk_prob", True)),
                       dense_layers=tuple(range(min(layers, cfg.get("first_k_dense_replace", 0)))),
                       shared_intermediate_size=inter * int(cfg.get("n_shared_experts") or 0),
                       num_groups=int(cfg.get("n_group") or 1), topk_groups=int(cfg.get("topk_group") or 1),
                       routed_scaling=float(cfg.get("routed_scaling_factor", 1.0)))
    return None


def _layer_windows(
    cfg: dict[str, Any], model_type: str, sliding_window: int | None
) -> tuple[int | None, ...]:
    """Each layer's sliding window: from ``layer_types`` where the config lists them (gpt-oss alternates
    ``sliding_attention`` and ``full_attention``), Qwen2's layers from ``max_window_layers`` on, else
    every layer (Mistral, Mixtral)."""
    layers = cfg["num_hidden_layers"]
    if not sliding_window:
        return ()
    types = cfg.get("layer_types")
    if types:
        if len(types) != layers:
            raise ValueError(f"config.json: layer_types lists {len(types)} layers, the model has {layers}")
        return tuple(sliding_window if t == "sliding_attention" else None for t in types)
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):
        first = cfg.get("max_window_layers", 0)
        return tuple(sliding_window if i >= first else None for i in range(layers))
    return (sliding_window,) * layers
