"""Embeddings: how a prompt's final hidden states become one vector (no torch here; the runner pools).

An embedding request is a sequence that is prefilled and never sampled: when its last prompt chunk has
run, the engine finishes it with the pooled vector (``RequestDelta.embedding``) and zero completion
tokens. It is scheduled, batched, preempted and fairly shared like any prefill.

- ``mode``: ``last`` (the last token's hidden state: decoder embedding models such as Qwen3-Embedding,
  and any generative checkpoint served for embeddings), ``mean`` (the mean over the prompt's tokens)
  or ``first`` (the first token's: a CLS-style model). The hidden states are the model's final normed
  ones, the input of its LM head.
- ``normalize``: L2-normalise the vector (cosine similarity = dot product).
- ``checkpoint_pooling`` reads what the checkpoint says: sentence-transformers' ``1_Pooling/config.json``
  (``pooling_mode_lasttoken`` / ``pooling_mode_mean_tokens`` / ``pooling_mode_cls_token``) and a
  ``Normalize`` module in ``modules.json``; without them, last token, normalised.
- ``last`` pooling may use the prefix cache (the last token's state depends on the cached K/V only);
  ``mean`` and ``first`` need every prompt token's hidden state, so the engine computes their whole
  prompt (no prefix hit), and a preempted one restarts its sum.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_MODES = ("last", "mean", "first")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    mode: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.mode not in POOLING_MODES:
            raise ValueError(f"pooling mode must be one of {POOLING_MODES}, got {self.mode!r}")

    @property
    def uses_prefix_cache(self) -> bool:
        return self.mode == "last"


_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
             "pooling_mode_cls_token": "first"}


def checkpoint_pooling(model_dir: str | Path) -> PoolingParams:
    """The pooling a checkpoint declares (see the module docstring); last token, normalised if none."""
    root = Path(model_dir)
    mode, normalize = "last", True
    pooling = root / "1_Pooling" / "config.json"
    modules = root / "modules.json"
    if pooling.is_file():
        config = json.loads(pooling.read_text())
        chosen = [name for key, name in _ST_MODES.items() if config.get(key)]
        if len(chosen) != 1:
            raise ValueError(f"{pooling}: expected exactly one of {sorted(_ST_MODES)} to be true")
        mode = chosen[0]
        normalize = False
        if modules.is_file():
            normalize = any(str(m.get("type", "")).endswith("Normalize")
                            for m in json.loads(modules.read_text()))
    return PoolingParams(mode, normalize)
