"""Triton kernels for the engine, one file per op, each with its launcher and PyTorch reference.

Importing this package on a host without CUDA turns on Triton's interpreter (``TRITON_INTERPRET=1``)
if ``triton`` is not imported yet, because the variable is read when kernels are decorated and the
interpreter is the only way Triton runs on a CPU; see ``kernels/_common.py``.

Every launcher validates shapes, dtypes, devices and strides (``TypeError``/``ValueError`` with the
operand's name), accepts preallocated outputs, and counts its launches in ``launch_counts``.
"""

from __future__ import annotations

import os
import sys

import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels._common import kernels_are_interpreted, launch_counts, reset_launch_counts  # noqa: E402
from kernels.extend_attention import extend_attention, extend_attention_reference  # noqa: E402
from kernels.fp8_linear import fp8_linear, fp8_linear_reference  # noqa: E402
from kernels.fused_moe import fused_moe, fused_moe_reference, moe_align_block_size  # noqa: E402
from kernels.lora import (  # noqa: E402
    lora_expand,
    lora_expand_reference,
    lora_shrink,
    lora_shrink_reference,
)
from kernels.paged_decode_attention import (  # noqa: E402
    default_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from kernels.rms_norm import rms_norm, rms_norm_reference  # noqa: E402
from kernels.rotary_embedding import (  # noqa: E402
    rope_cos_sin_cache,
    rotary_embedding,
    rotary_embedding_reference,
)
from kernels.silu_and_mul import silu_and_mul, silu_and_mul_reference  # noqa: E402
from kernels.store_kv_cache import store_kv_cache, store_kv_cache_reference  # noqa: E402

__all__ = [
    "default_num_splits",
    "extend_attention",
    "extend_attention_reference",
    "fp8_linear",
    "fp8_linear_reference",
    "fused_moe",
    "fused_moe_reference",
    "kernels_are_interpreted",
    "launch_counts",
    "lora_expand",
    "lora_expand_reference",
    "lora_shrink",
    "lora_shrink_reference",
    "moe_align_block_size",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "reset_launch_counts",
    "rms_norm",
    "rms_norm_reference",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "rotary_embedding_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
    "store_kv_cache",
    "store_kv_cache_reference",
]
