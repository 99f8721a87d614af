"""``ModelArgs``: the few numbers a decoder needs, read from a Hugging Face ``config.json``. No torch.

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

ROPE_TYPES = ("default", "linear", "llama3")


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
    torch_dtype: str | None = None

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
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"config.json: rope type {self.rope_type!r} is not supported ({ROPE_TYPES})")
        if self.rope_type != "default" and self.rope_params.get("factor", 0) <= 0:
            raise ValueError(f"config.json: rope type {self.rope_type!r} needs a positive factor")

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
        rope_keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        rope_params = {k: float(v) for k, v in rope.items() if k in rope_keys}

        attention_bias = bool(cfg.get("attention_bias", False))
        sliding_window = cfg.get("sliding_window")
        if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
            sliding_window = None
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
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_window=sliding_window,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelArgs:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} is not a Hugging Face checkpoint directory (no config.json)")
        with path.open(encoding="utf-8") as f:
            return cls.from_hf_config(json.load(f))
