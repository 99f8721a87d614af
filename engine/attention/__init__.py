"""Attention backends over the paged KV cache; see ``engine.attention.base`` for the seam and layout.

``get_backend(name)`` returns the backend class: ``"torch"`` (reference, CPU and GPU) or ``"triton"``
(paged kernels from ``kernels/``, imported lazily so that CPU-only hosts never import it).
"""

from __future__ import annotations

from engine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]


def get_backend(name: str) -> type[AttentionBackend]:
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend
    if name == "triton":
        try:
            from engine.attention.triton_backend import TritonAttentionBackend
        except ImportError as e:
            raise ValueError(f"attention backend 'triton' is not available: {e}") from e
        return TritonAttentionBackend
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")
