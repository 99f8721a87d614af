"""Engine test fixtures: tiny random-weight checkpoints, written once per test session (per xdist worker).

``tiny_llama_dir`` / ``tiny_qwen2_dir`` / ``tiny_qwen3_dir`` (and the mixtures of experts,
``tiny_qwen3_moe_dir`` / ``tiny_mixtral_dir`` / ``tiny_glm4_moe_dir``) are directories holding a complete HF
checkpoint (config, safetensors, BPE tokenizer, chat template) from ``engine.tiny``; treat them as
read-only, they are shared by every test of the session. ``hf_moe_dirs`` holds the MoE families with
weights that transformers wrote.

``one_torch_thread`` (a module opts in with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)
runs the module with one intra-op torch thread and restores the previous count after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.tiny import ARCHS, create_tiny_checkpoint


def _tiny_fixture(arch: str) -> Callable[[pytest.TempPathFactory], Path]:
    """A session fixture ``tiny_<arch>_dir``: ``engine.tiny``'s checkpoint of ``arch``, written once."""

    def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return create_tiny_checkpoint(tmp_path_factory.mktemp(f"tiny_{arch}"), arch=arch, seed=0)

    return pytest.fixture(scope="session", name=f"tiny_{arch}_dir")(tiny)


# tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir, tiny_qwen3_moe_dir, tiny_mixtral_dir, tiny_glm4_moe_dir,
# tiny_gpt_oss_dir: one per architecture engine.tiny writes.
for _arch in ARCHS:
    globals()[f"tiny_{_arch}_dir"] = _tiny_fixture(_arch)


def transformers_checkpoint(tmp_path_factory: pytest.TempPathFactory, arch: str, seed: int = 1) -> Path:
    """A tiny checkpoint whose weights transformers' own class wrote (``from_config`` with a fixed seed,
    then ``save_pretrained``, float32), beside ``engine.tiny``'s tokenizer and chat template: the
    reference the engine's families are held against, independent of ``engine.tiny``'s weight writer."""
    import transformers

    out = create_tiny_checkpoint(tmp_path_factory.mktemp(f"hf_{arch}"), arch=arch, seed=0)
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    (out / "model.safetensors").unlink()
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Per MoE family, a checkpoint written by transformers (see ``transformers_checkpoint``)."""
    from engine.tiny import MOE_FAMILIES

    return {family: transformers_checkpoint(tmp_path_factory, family) for family in MOE_FAMILIES}


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny models: one intra-op thread is fastest, and xdist workers must not oversubscribe the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
