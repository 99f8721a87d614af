"""Plumbing shared by every op in ``kernels/``: launch counting, device checks, input checks.

Interpreter. Triton decides whether a ``@triton.jit`` function is compiled or interpreted when it is
*decorated*, reading ``TRITON_INTERPRET`` then; ``triton.language``'s own helpers (``tl.sum``,
``tl.max``, ``tl.cdiv`` ...) are decorated when ``triton`` is first imported. So the variable must be
set before anything imports ``triton``: setting it later yields kernels whose library calls fail inside
the interpreter. ``kernels/__init__.py`` therefore sets ``TRITON_INTERPRET=1`` itself when the host has
no CUDA device and ``triton`` is not imported yet (on such a host the interpreter is the only way a
Triton kernel runs at all); tests set it too, before importing anything (``tests/kernels/conftest.py``).
The interpreter runs one program at a time in NumPy: it is for tests and the CPU engine with
``attention_backend="triton"``, never for speed. If ``triton`` was imported earlier without the
variable, :func:`launcher_for` refuses CPU tensors with a message saying so, rather than crashing deep
in the launch.

Launch counting. Every launcher increments ``launch_counts[op]`` once per call that launches work, so a
test can prove that a code path really ran the Triton kernels rather than falling back to PyTorch.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# op name -> number of launcher calls that launched a kernel. Read by tests; reset with
# reset_launch_counts(). Plain Counter: launches happen on the engine's single stepping thread.
launch_counts: Counter[str] = Counter()


@dataclass(frozen=True)
class TileConfig:
    """How a tiled kernel is launched: its tile sizes (constexprs) and Triton's ``num_warps`` /
    ``num_stages`` (software-pipelining depth of the loads in its main loop). Each launcher has a choice
    function returning one (the engine launches nothing else), which the ahead-of-time compile tests
    enumerate; the launchers also take one explicitly, for tuning (benchmarks/)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    @property
    def launch_options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages}


def reset_launch_counts() -> None:
    launch_counts.clear()


def count_launch(op: str) -> None:
    launch_counts[op] += 1


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher made it: the kernel, its grid, positional arguments and
    keyword arguments (constexprs and launch options)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Recorder:
    def __init__(self, kernel: Any, into: list[Launch]) -> None:
        self._kernel, self._into = kernel, into

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        def record(*args: Any, **kwargs: Any) -> None:
            self._into.append(Launch(self._kernel, tuple(grid), args, kwargs))

        return record


_recording: list[Launch] | None = None
_recording_capability: tuple[int, int] | None = None


@contextmanager
def recorded_launches(capability: tuple[int, int] = (9, 0)) -> Iterator[list[Launch]]:
    """Within the block, launchers record their launches in the yielded list instead of running them
    (outputs are left unwritten), on any device, choosing their tiles as they would on a GPU of
    compute ``capability``. ``kernels.aot`` compiles what they record."""
    global _recording, _recording_capability
    previous = _recording, _recording_capability
    _recording, _recording_capability = [], capability
    try:
        yield _recording
    finally:
        _recording, _recording_capability = previous


@functools.cache
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def target_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability a launch on ``device`` compiles for (tile choices depend on it): the
    GPU's, the recording's under :func:`recorded_launches`, None for the interpreter."""
    if _recording_capability is not None:
        return _recording_capability
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def launcher_for(kernel: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """The kernel object to index with a grid for ``dtype`` tensors on ``device``; refuses what cannot
    run correctly: compiled kernels on CPU tensors, and bfloat16 in the interpreter (its NumPy
    emulation of bfloat16 rounds wrongly, off by several ulps). Under :func:`recorded_launches`, a
    recorder instead."""
    if _recording is not None:
        return _Recorder(kernel, _recording)
    if isinstance(kernel, InterpretedFunction):
        if not isinstance(tl.standard.sum, InterpretedFunction):
            raise RuntimeError(
                "TRITON_INTERPRET=1 was set after triton was imported, so triton.language's helpers are "
                "compiled while this kernel is interpreted and it cannot run. Set TRITON_INTERPRET=1 before "
                "anything imports triton (torch._dynamo and transformers' models do)."
            )
        if dtype == torch.bfloat16:
            raise TypeError(
                "bfloat16 is not supported by Triton's interpreter (TRITON_INTERPRET=1); use float32 or "
                "float16 on the CPU, bfloat16 on a GPU"
            )
        return kernel
    if device.type == "cuda":
        return kernel
    raise RuntimeError(
        f"Triton kernel {kernel.fn.__name__} was compiled for CUDA but got tensors on {device}; run "
        "Triton on the CPU by setting TRITON_INTERPRET=1 before triton is first imported"
    )


@triton.jit
def _decorated_like_the_kernels() -> None:
    """Never launched: decorated when this module is imported, as every kernel module's kernels are
    (they all import this module first), so its type says how they were decorated."""
    pass


@triton.jit
def e4m3_to_f32(bits):
    """e4m3fn bytes -> fp32, exactly: (-1)^s * (8 + m) * 2^(e - 10), or m * 2^-9 for e = 0. For what
    reads FP8 as bytes (FP8 weights, an FP8 KV cache): Triton has no e4m3 type on sm_80/86."""
    bits = bits.to(tl.int32)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).to(tl.float32)
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125,
                         (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32)))
    return tl.where((bits & 0x80) != 0, -magnitude, magnitude)


def kernels_are_interpreted() -> bool:
    """True when this process runs the Triton kernels in the interpreter (CPU tensors allowed)."""
    return isinstance(_decorated_like_the_kernels, InterpretedFunction)


def check_tensor(
    name: str,
    t: Any,
    *,
    ndim: int | None = None,
    dtypes: Iterable[torch.dtype] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> None:
    """Raise ``TypeError``/``ValueError`` with a message naming ``name`` if ``t`` is not as required."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None:
        allowed = tuple(dtypes)
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise TypeError(f"{name} must have dtype in ({names}), got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all operands on one device)")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {tuple(t.stride())}")


FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def check_paged_kv_cache(
    key_cache: Any, value_cache: Any, *, dtype: torch.dtype, device: torch.device, head_dim: int
) -> tuple[int, int]:
    """Check the two halves of a layer's paged cache ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    returns ``(block_size, num_kv_heads)``."""
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(name, cache, ndim=4, dtypes=(dtype,), device=device, last_dim_contiguous=True)
        if cache.shape[3] != head_dim:
            raise ValueError(f"{name} head_dim {cache.shape[3]} != head_dim {head_dim} of the tokens")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}")
    block_size = key_cache.shape[1]
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"cache block_size must be a power of two, got {block_size}")
    return block_size, key_cache.shape[2]


def check_block_tables(block_tables: Any, batch: int, device: torch.device) -> None:
    check_tensor("block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=device)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {batch} sequences")
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables rows must be contiguous, got strides {block_tables.stride()}")
