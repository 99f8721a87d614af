"""LoRA adapters on a GPU: the engine's projections take the grouped Triton kernels (``kernels.lora``), and
in float32 generate the greedy tokens of the PyTorch path for a batch mixing three adapters and the base
model; two GPUs (tensor parallel) generate the single GPU's. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.lora.registry import LoRARequest
from tests.engine.test_lora_serving import GREEDY, PROMPTS, TARGETS, strong_bundle

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

COMMON: dict = dict(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2, device="cuda",
                    dtype="float32", enable_prefix_caching=False)


def _cases(base_dir: Path, tmp_path: Path) -> list[tuple[list[int], LoRARequest | None]]:
    bundles = [strong_bundle(base_dir, tmp_path / f"a{i}", i + 1, targets, 4 + 4 * i)
               for i, targets in enumerate(TARGETS)]
    adapters = [LoRARequest(f"a{i}", str(b)) for i, b in enumerate(bundles)]
    return [(prompt, adapter) for prompt in PROMPTS for adapter in (None, *adapters)]


def _generate(llm: LLM, cases: list[tuple[list[int], LoRARequest | None]]) -> list[list[int]]:
    outputs = llm.generate([p for p, _ in cases], GREEDY, lora_request=[a for _, a in cases])
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_kernels_give_the_torch_paths_tokens(arch: str, request: pytest.FixtureRequest,
                                                 tmp_path: Path) -> None:
    import kernels

    base_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    cases = _cases(base_dir, tmp_path)
    with LLM(str(base_dir), **COMMON) as gpu:
        lora = gpu.engine.runner.lora
        assert lora is not None and lora.use_kernels  # the kernels by default on CUDA
        before = kernels.launch_counts["lora_expand"]
        got = _generate(gpu, cases)
        assert kernels.launch_counts["lora_expand"] > before
        lora.use_kernels = False  # the same engine on the batched PyTorch path
        expected = _generate(gpu, cases)
    assert got == expected
    assert got[1] != got[0]  # the adapters change the tokens


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpus_give_the_single_gpu_tokens(tiny_llama_dir: Path, tmp_path: Path) -> None:
    cases = _cases(tiny_llama_dir, tmp_path)
    with LLM(str(tiny_llama_dir), **COMMON) as one:
        expected = _generate(one, cases)
    with LLM(str(tiny_llama_dir), tensor_parallel_size=2, **COMMON) as two:
        assert _generate(two, cases) == expected
