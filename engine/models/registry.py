"""Which model class serves a checkpoint: by ``config.json``'s ``architectures``, else its ``model_type``.

Every supported architecture is a Llama-style decoder, implemented once in ``engine.models.llama``
(dense MLPs, or ``engine.models.moe`` blocks where ``ModelArgs.moe`` says so); an unknown one is a
``ValueError`` that names the supported ones. ``checkpoint_renames`` maps a family's checkpoint names
onto the model's where they differ (Mixtral's ``block_sparse_moe.experts.N.w1/w2/w3``, gpt-oss's
``mlp.router``).
"""

from __future__ import annotations

from engine.models.config import ModelArgs
from engine.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Glm4MoeForCausalLM": LlamaForCausalLM,
    "GptOssForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_moe": LlamaForCausalLM,
    "mixtral": LlamaForCausalLM,
    "glm4_moe": LlamaForCausalLM,
    "gpt_oss": LlamaForCausalLM,
}
# (checkpoint substring, model substring), applied in order to every tensor name.
_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "mixtral": ((".block_sparse_moe.", ".mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                (".w2.", ".down_proj.")),
    "gpt_oss": ((".mlp.router.", ".mlp.gate."),),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_class(args: ModelArgs) -> type[LlamaForCausalLM]:
    if args.architecture in _ARCHITECTURES:
        return _ARCHITECTURES[args.architecture]
    if args.model_type in _MODEL_TYPES:
        return _MODEL_TYPES[args.model_type]
    raise ValueError(
        f"unsupported model architecture {args.architecture or args.model_type!r}; "
        f"supported: {', '.join(supported_architectures())}"
    )


def checkpoint_renames(args: ModelArgs) -> tuple[tuple[str, str], ...]:
    return _RENAMES.get(args.model_type, ())
