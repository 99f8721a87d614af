"""LoRA bundles (``engine.lora.adapter``): PEFT's own ``save_pretrained`` output read back exactly, and every
bundle that does not fit its base refused with the field named, before anything serves it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.lora.adapter import AdapterError, load_adapter
from engine.models.config import ModelArgs


def peft_bundle(base_dir: Path, out: Path, *, seed: int = 0, **config: object) -> Path:
    """A random LoRA adapter for ``base_dir`` written by PEFT (``init_lora_weights=False``: PEFT's default
    zero B would make it a no-op)."""
    import peft
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    settings = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"],
                "init_lora_weights": False, "task_type": "CAUSAL_LM", **config}
    peft.get_peft_model(model, peft.LoraConfig(**settings)).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def llama_bundle(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return peft_bundle(tiny_llama_dir, tmp_path_factory.mktemp("lora") / "a")


def test_a_peft_bundle_reads_back_exactly(tiny_llama_dir: Path, llama_bundle: Path) -> None:
    base = ModelArgs.from_pretrained(tiny_llama_dir)
    adapter = load_adapter(llama_bundle, base)
    assert adapter.rank == 4 and adapter.scaling == 2.0
    assert adapter.target_modules == ("q_proj", "v_proj", "down_proj")
    tensors = load_file(str(llama_bundle / "adapter_model.safetensors"))
    assert sorted(adapter.weights) == list(range(base.num_layers))
    for layer, modules in adapter.weights.items():
        for module, (a, b) in modules.items():
            part = "mlp" if module == "down_proj" else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            assert torch.equal(a, tensors[f"{prefix}.lora_A.weight"])
            assert torch.equal(b, tensors[f"{prefix}.lora_B.weight"])
    assert adapter.num_bytes == sum(4 * t.numel() for t in tensors.values())
    assert load_adapter(llama_bundle, base).digest == adapter.digest


def test_the_digest_follows_the_contents_not_the_name(tiny_llama_dir: Path, tmp_path: Path) -> None:
    base = ModelArgs.from_pretrained(tiny_llama_dir)
    first = load_adapter(peft_bundle(tiny_llama_dir, tmp_path / "same", seed=1), base).digest
    again = load_adapter(peft_bundle(tiny_llama_dir, tmp_path / "same", seed=2), base).digest
    assert first != again
    rslora = load_adapter(peft_bundle(tiny_llama_dir, tmp_path / "rs", seed=1, use_rslora=True), base)
    assert rslora.scaling == 8 / 2 and rslora.digest != first


def _edited(bundle: Path, out: Path, *, config: dict | None = None,
            tensors: dict[str, torch.Tensor | None] | None = None) -> Path:
    shutil.copytree(bundle, out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if tensors is not None:
        weights = load_file(str(out / "adapter_model.safetensors"))
        for name, value in tensors.items():
            if value is None:
                del weights[name]
            else:
                weights[name] = value
        save_file(weights, str(out / "adapter_model.safetensors"))
    return out


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(("edit", "param"), [
    ({"config": {"peft_type": "IA3"}}, "peft_type"),
    ({"config": {"task_type": "SEQ_CLS"}}, "task_type"),
    ({"config": {"r": 0}}, "r"),
    ({"config": {"r": 128}}, "r"),
    ({"config": {"lora_alpha": -1}}, "lora_alpha"),
    ({"config": {"use_dora": True}}, "use_dora"),
    ({"config": {"bias": "all"}}, "bias"),
    ({"config": {"modules_to_save": ["lm_head"]}}, "modules_to_save"),
    ({"config": {"rank_pattern": {"q_proj": 8}}}, "rank_pattern"),
    ({"config": {"fan_in_fan_out": True}}, "fan_in_fan_out"),
    ({"config": {"layers_to_transform": [0]}}, "layers_to_transform"),
    ({"config": {"target_modules": ["embed_tokens"]}}, "target_modules"),
    ({"config": {"target_modules": "q_proj"}}, "target_modules"),
    ({"tensors": {A0: None}}, "adapter_model"),  # a missing tensor
    ({"tensors": {A0: torch.zeros(4, 7)}}, "adapter_model"),  # made for another base
    ({"tensors": {A0: torch.zeros(4, 128, dtype=torch.int32)}}, "adapter_model"),
    ({"tensors": {A0: torch.full((4, 128), float("nan"))}}, "adapter_model"),
    ({"tensors": {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 128)}}, "adapter_model"),
    ({"tensors": {"base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight": torch.zeros(4, 128)}},
     "adapter_model"),
])
def test_a_bundle_that_does_not_fit_is_refused_naming_the_field(
        tiny_llama_dir: Path, llama_bundle: Path, tmp_path: Path, edit: dict, param: str) -> None:
    base = ModelArgs.from_pretrained(tiny_llama_dir)
    assert base.hidden_size == 128  # the shapes above
    with pytest.raises(AdapterError) as refused:
        load_adapter(_edited(llama_bundle, tmp_path / "bad", **edit), base)
    assert refused.value.param == param, str(refused.value)


def test_unreadable_or_oversized_bundles_are_refused(tiny_llama_dir: Path, llama_bundle: Path,
                                                      tmp_path: Path) -> None:
    base = ModelArgs.from_pretrained(tiny_llama_dir)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter(tmp_path, base)
    broken = _edited(llama_bundle, tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(AdapterError, match="cannot be read"):
        load_adapter(broken, base)
    with pytest.raises(AdapterError, match="exceed"):
        load_adapter(llama_bundle, base, max_bytes=1024)


def test_a_mixture_of_experts_base_takes_attention_adapters_only(tiny_qwen3_moe_dir: Path,
                                                                  tmp_path: Path) -> None:
    base = ModelArgs.from_pretrained(tiny_qwen3_moe_dir)
    bundle = peft_bundle(tiny_qwen3_moe_dir, tmp_path / "attn", target_modules=["q_proj", "o_proj"])
    assert load_adapter(bundle, base).target_modules == ("q_proj", "o_proj")
    mlp = _edited(bundle, tmp_path / "mlp", config={"target_modules": ["q_proj", "down_proj"]})
    with pytest.raises(AdapterError, match="cannot be served on this base"):
        load_adapter(mlp, base)
