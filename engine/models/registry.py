"""Which model class serves a checkpoint: by ``config.json``'s ``architectures``, else its ``model_type``.

Every supported architecture is the Llama decoder family, implemented once in ``engine.models.llama``;
an unknown one is a ``ValueError`` that names the supported ones.
"""

from __future__ import annotations

from engine.models.config import ModelArgs
from engine.models.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
_MODEL_TYPES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
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
