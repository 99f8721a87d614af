"""Fixtures for the kernel tests.

Triton's interpreter: ``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is decorated, and
``triton.language``'s own helpers (``tl.sum``, ``tl.max``, ...) are decorated when ``triton`` is first
imported. So the variable is set here, at conftest import time, before any test module imports
``kernels`` or ``triton`` (``kernels/__init__.py`` does the same on hosts without CUDA). On a GPU host
it is left alone and the same tests run on the GPU with compiled kernels; the ``device`` fixture says
which. To run the interpreter tests on a GPU host: ``TRITON_INTERPRET=1 pytest tests/kernels``.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from kernels import kernels_are_interpreted  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the float32/float16 tests run: the GPU when kernels are compiled for it, else the CPU."""
    if torch.cuda.is_available() and not kernels_are_interpreted():
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture
def rng() -> torch.Generator:
    """A freshly seeded generator per test: every run draws new inputs. The seed is printed (pytest
    shows it with a failure); ``KERNEL_TEST_SEED=<seed>`` replays a failing case."""
    seed = int(os.environ.get("KERNEL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"rng seed: {seed} (replay with KERNEL_TEST_SEED={seed})")
    gen = torch.Generator()
    gen.manual_seed(seed)
    return gen


def poisoned(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer full of NaN, so any element a kernel forgets to write fails the comparison."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@dataclass
class PagedKV:
    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32


def make_paged_kv(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    gen: torch.Generator,
    block_size: int = 16,
    spare_blocks: int = 5,
) -> PagedKV:
    """A paged cache holding random K/V for ``seq_lens`` with adversarial paging.

    Physical block ids are a random permutation (so logical order != physical order), extra blocks
    that belong to no sequence are NaN, slots past each sequence's end in its last block are NaN, and
    block-table entries past a sequence's blocks are holes (-1 or out-of-range ids). A kernel that
    reads outside the context returns NaN and fails.
    """
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = perm[used : used + nb]
        used += nb
        block_tables[b, :nb] = ids.to(torch.int32)
        if b % 2:
            block_tables[b, nb:] = num_blocks + 1000 + b  # out-of-range garbage instead of -1
        for i, block in enumerate(ids.tolist()):
            valid = min(block_size, n - i * block_size)
            key_cache[block, :valid] = torch.randn((valid, num_kv_heads, head_dim), generator=gen).to(dtype)
            value_cache[block, :valid] = torch.randn((valid, num_kv_heads, head_dim), generator=gen).to(dtype)
    return PagedKV(
        key_cache.to(device),
        value_cache.to(device),
        block_tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


@pytest.fixture
def paged_kv():
    return make_paged_kv


@pytest.fixture
def nan_output():
    return poisoned
