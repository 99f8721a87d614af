"""LoRA adapters on a tensor-parallel replica: each rank holds its shard of every adapter (split as the
layer it modifies), and a 2-rank replica (rank 1 a spawned process, gloo on the CPU) generates exactly the
single-rank engine's greedy tokens for a batch mixing three adapters and the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.distributed import ShardSizes
from engine.llm import LLM
from engine.lora.adapter import load_adapter
from engine.lora.layers import shard_adapter
from engine.lora.registry import LoRARequest
from engine.models.config import ModelArgs
from tests.engine.test_lora_serving import ALL, GREEDY, PROMPTS, TARGETS, strong_bundle

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_the_shards_of_an_adapter_put_together_are_the_adapter(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """Column-parallel modules split B's output rows, row-parallel ones A's input columns, at the base
    weights' offsets (query heads, KV heads, MLP columns); the rest is whole on every rank."""
    args = ModelArgs.from_pretrained(tiny_qwen3_dir)
    adapter = load_adapter(strong_bundle(tiny_qwen3_dir, tmp_path / "a", 1, ALL, 4), args)
    shards = [shard_adapter(adapter, args, ShardSizes.of(args, r, 2)) for r in range(2)]
    assert shard_adapter(adapter, args, ShardSizes.of(args)) is adapter
    for layer, modules in adapter.weights.items():
        for module, (a, b) in modules.items():
            parts = [s.weights[layer][module] for s in shards]
            if module in ("o_proj", "down_proj"):
                assert all(torch.equal(pb, b) for _, pb in parts)
                assert torch.equal(torch.cat([pa for pa, _ in parts], dim=1), a)
                assert parts[0][0].shape[1] == a.shape[1] // 2
            else:
                assert all(torch.equal(pa, a) for pa, _ in parts)
                assert torch.equal(torch.cat([pb for _, pb in parts], dim=0), b)
                assert parts[0][1].shape[0] == b.shape[0] // 2
    assert shards[0].digest == adapter.digest and shards[0].scaling == adapter.scaling


@pytest.mark.slow  # a spawned rank per replica
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_two_ranks_give_the_single_rank_tokens_for_a_batch_of_three_adapters_and_the_base(
    arch: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    base_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    bundles = [strong_bundle(base_dir, tmp_path / f"a{i}", i + 1, targets, 4 + 4 * i)
               for i, targets in enumerate(TARGETS)]
    adapters = [LoRARequest(f"a{i}", str(b)) for i, b in enumerate(bundles)]
    cases = [(prompt, adapter) for prompt in PROMPTS for adapter in (None, *adapters)]
    # Two slots for three adapters: slots are swapped between steps, on both ranks alike.
    common = dict(num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, max_loras=2)

    def generate(llm: LLM) -> list[list[int]]:
        outputs = llm.generate([p for p, _ in cases], GREEDY, lora_request=[a for _, a in cases])
        return [o.outputs[0].token_ids for o in outputs]

    with LLM(str(base_dir), **common) as whole:  # type: ignore[arg-type]
        expected = generate(whole)
    with LLM(str(base_dir), tensor_parallel_size=2, **common) as split:  # type: ignore[arg-type]
        got = generate(split)
        lora = split.engine.runner.lora
        assert lora is not None and lora.loads >= 3 and lora.evictions >= 1
    assert got == expected
    for i in range(1, 4):  # the adapters change the tokens: the comparison means something
        assert any(expected[j * 4 + i] != expected[j * 4] for j in range(len(PROMPTS)))
