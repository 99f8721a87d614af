"""Tollgate's inference engine: paged KV cache, prefix cache, continuous batching, sampler.

Imports are lazy so that the torch-free modules (``engine.protocol``, ``engine.tokenizer``) can be
used by the gateway without importing torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
