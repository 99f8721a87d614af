"""Engine test fixtures: tiny random-weight checkpoints, written once per test session (per xdist worker).

``tiny_llama_dir`` / ``tiny_qwen2_dir`` / ``tiny_qwen3_dir`` are directories holding a complete HF
checkpoint (config, safetensors, BPE tokenizer, chat template) from ``engine.tiny``; treat them as
read-only, they are shared by every test of the session.

``one_torch_thread`` (a module opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)
runs the module with one intra-op torch thread and restores the previous count after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.tiny import create_tiny_checkpoint


def _tiny(tmp_path_factory: pytest.TempPathFactory, arch: str) -> Path:
    return create_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{arch}"), arch=arch, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is fastest, and xdist workers must not oversubscribe the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
