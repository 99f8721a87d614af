"""The engine serves LoRA adapters beside its base model: each adapter's greedy output equals PEFT's model
with that adapter, in one batch mixing adapters and the base model with fewer device slots than
adapters; the prefix cache never crosses adapters, nor a bundle replaced under the same name; a LoRA
request the engine cannot serve is refused, naming ``lora``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.llm import LLM
from engine.lora.registry import LoRARequest
from engine.outputs import RequestValidationError
from engine.sampling_params import SamplingParams
from tests.engine.test_lora_adapter import peft_bundle

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [list(range(40, 60)), list(range(100, 131)), list(range(7, 19))]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = [["q_proj", "v_proj"], ALL, ["down_proj", "up_proj"]]


def strong_bundle(base_dir: Path, out: Path, seed: int, targets: list[str], rank: int) -> Path:
    """A PEFT bundle whose updates are large enough to change a tiny random model's greedy tokens."""
    from safetensors.torch import load_file, save_file

    bundle = peft_bundle(base_dir, out, seed=seed, r=rank, lora_alpha=16, target_modules=targets)
    weights = load_file(str(bundle / "adapter_model.safetensors"))
    save_file({k: v * 20 if "lora_B" in k else v for k, v in weights.items()},
              str(bundle / "adapter_model.safetensors"))
    return bundle


def peft_greedy(base_dir: Path, bundle: Path | None, prompt: list[int]) -> list[int]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if bundle is not None:
        model = peft.PeftModel.from_pretrained(model, bundle)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY.max_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_batch_mixing_three_adapters_and_the_base_equals_peft(arch: str, request: pytest.FixtureRequest,
                                                                tmp_path: Path) -> None:
    base_dir: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    bundles = [strong_bundle(base_dir, tmp_path / f"a{i}", i + 1, targets, 4 + 4 * i)
               for i, targets in enumerate(TARGETS)]
    adapters = [LoRARequest(f"a{i}", str(b)) for i, b in enumerate(bundles)]
    cases = [(prompt, adapter) for prompt in PROMPTS for adapter in (None, *adapters)]
    # Two device slots for three adapters: the scheduler spreads them over steps, the runner swaps slots.
    with LLM(str(base_dir), num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64,  # type: ignore[arg-type]
             max_loras=2) as llm:
        outputs = llm.generate([p for p, _ in cases], GREEDY, lora_request=[a for _, a in cases])
        loads = llm.engine.runner.lora.loads  # type: ignore[union-attr]
    ours = {(tuple(p), a.name if a else None): o.outputs[0].token_ids for (p, a), o in zip(cases, outputs,
                                                                                          strict=True)}
    for prompt, adapter in cases:
        bundle = None if adapter is None else Path(adapter.path)
        want = peft_greedy(base_dir, bundle, prompt)
        assert ours[(tuple(prompt), adapter.name if adapter else None)] == want
    for adapter in adapters:  # the adapters change what the model says: the comparison above means something
        assert any(ours[(tuple(p), adapter.name)] != ours[(tuple(p), None)] for p in PROMPTS)
    assert loads >= 3


def test_the_prefix_cache_never_crosses_adapters_or_a_replaced_bundle(tiny_llama_dir: Path,
                                                                       tmp_path: Path) -> None:
    first = strong_bundle(tiny_llama_dir, tmp_path / "first", 1, TARGETS[1], 4)
    other = strong_bundle(tiny_llama_dir, tmp_path / "other", 2, TARGETS[1], 4)
    prompt = list(range(200, 248))  # three full blocks
    adapter = LoRARequest("mine", str(tmp_path / "mine"))
    shutil.copytree(first, tmp_path / "mine")
    with LLM(str(tiny_llama_dir), num_kv_blocks=128, max_loras=2) as llm:  # type: ignore[arg-type]
        def run(lora: LoRARequest | None) -> tuple[int, list[int]]:
            out = llm.generate([prompt], GREEDY, lora_request=lora)[0]
            assert out.usage is not None
            return out.usage.cached_tokens, out.outputs[0].token_ids

        cold, tokens = run(adapter)
        assert cold == 0 and run(adapter) == (32, tokens)  # the same adapter: its blocks are reused
        assert run(None)[0] == 0  # the base model computes its own
        assert run(LoRARequest("other", str(other)))[0] == 0
        shutil.rmtree(tmp_path / "mine")
        shutil.copytree(other, tmp_path / "mine")  # replaced under the same name and path
        cached, replaced = run(adapter)
        assert cached == 32  # blocks of the *other* bundle's contents, computed just above
        assert replaced == run(LoRARequest("other", str(other)))[1] != tokens


def test_a_lora_request_the_engine_cannot_serve_is_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    bundle = strong_bundle(tiny_llama_dir, tmp_path / "a", 1, ["q_proj"], 4)
    with LLM(str(tiny_llama_dir), num_kv_blocks=64) as plain:  # type: ignore[arg-type]
        with pytest.raises(RequestValidationError, match="max_loras is 0") as refused:
            plain.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("a", str(bundle)))
        assert refused.value.param == "lora"
    with LLM(str(tiny_llama_dir), num_kv_blocks=64, max_loras=1, max_lora_rank=2) as small:  # type: ignore[arg-type]
        with pytest.raises(RequestValidationError, match="r must be") as refused:
            small.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("a", str(bundle)))
        assert refused.value.param == "lora"
        with pytest.raises(RequestValidationError, match="no bundle"):
            small.generate([[5, 6, 7]], GREEDY, lora_request=LoRARequest("gone", str(tmp_path / "gone")))
        assert small.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids  # and the engine serves on


def test_a_replica_serves_an_adapter_of_its_store_by_id(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Over HTTP a request names its adapter by id, found in the replica's store (``--lora-dir``): the
    tokens equal the offline API's with that bundle; an id that is not in the store, or not an id, is a
    400 naming ``lora``, and the replica serves on."""
    import httpx

    from engine.config import EngineConfig
    from engine.protocol import FinalRecord, parse_record
    from engine.server import build_engine, create_app
    from tests.engine.test_server import _Server

    store = tmp_path / "store"
    bundle = strong_bundle(tiny_llama_dir, store / "ft:tiny:acme:support:1", 1, ALL, 4)
    prompt = list(range(40, 60))
    with LLM(str(tiny_llama_dir), num_kv_blocks=64, max_loras=1) as llm:  # type: ignore[arg-type]
        expected = llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", str(bundle)))[0]
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_loras=2, lora_dir=str(store))
    body = {"prompt_token_ids": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with _Server(create_app(build_engine(config))) as server, httpx.Client(base_url=server.url,
                                                                            timeout=60) as client:
        with client.stream("POST", "/generate", json={**body, "request_id": "a",
                                                      "lora": "ft:tiny:acme:support:1"}) as r:
            assert r.status_code == 200
            records = [parse_record(line) for line in r.iter_lines() if line]
        assert isinstance(records[-1], FinalRecord)
        assert [t for rec in records[:-1] for t in rec.token_ids] == expected.outputs[0].token_ids
        for i, bad in enumerate(["missing", "../store/ft:tiny:acme:support:1", "/etc"]):
            r = client.post("/generate", json={**body, "request_id": f"bad{i}", "lora": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
        r = client.post("/generate", json={**body, "request_id": "base", "max_tokens": 2})
        assert r.status_code == 200
        assert client.get("/load").json()["adapters"] == ["ft:tiny:acme:support:1"]


def test_a_replica_checks_an_adapter_of_its_store_before_it_is_registered(tiny_llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    """``POST /lora/check``: the digest, rank, targets and size of a bundle the replica can serve (the
    digest the prefix cache keys use); a 400 naming ``lora`` that says what does not fit otherwise."""
    import httpx

    from engine.config import EngineConfig
    from engine.lora.adapter import load_adapter
    from engine.models.config import ModelArgs
    from engine.server import build_engine, create_app
    from tests.engine.test_server import _Server

    store = tmp_path / "store"
    good = strong_bundle(tiny_llama_dir, store / "good", 1, ["q_proj", "v_proj"], 4)
    strong_bundle(tiny_llama_dir, store / "too-big", 2, ["q_proj"], 16)
    shutil.copytree(good, store / "broken")
    (store / "broken" / "adapter_config.json").write_text("{not json")
    config = EngineConfig(model=str(tiny_llama_dir), num_kv_blocks=64, max_loras=1, max_lora_rank=8,
                          lora_dir=str(store))
    digest = load_adapter(good, ModelArgs.from_pretrained(tiny_llama_dir)).digest
    with _Server(create_app(build_engine(config))) as server, httpx.Client(base_url=server.url,
                                                                            timeout=60) as client:
        r = client.post("/lora/check", json={"lora": "good"})
        assert r.status_code == 200, r.text
        assert r.json()["digest"] == digest and r.json()["rank"] == 4
        assert r.json()["target_modules"] == ["q_proj", "v_proj"] and r.json()["num_bytes"] > 0
        for lora, says in [("too-big", "r must be"), ("broken", "not JSON"), ("missing", "no bundle"),
                           ("../good", "not an adapter id")]:
            r = client.post("/lora/check", json={"lora": lora})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora", r.text
            assert says in r.json()["error"]["message"]
        assert client.get("/load").json()["adapters"] == ["good"]


def test_attention_adapters_on_a_mixture_of_experts_equal_peft(tiny_glm4_moe_dir: Path,
                                                               tmp_path: Path) -> None:
    """GLM-4.5's tiny base (a dense first layer, then experts): an attention adapter beside the base model,
    both equal to PEFT; only the attention projections are wrapped."""
    bundle = strong_bundle(tiny_glm4_moe_dir, tmp_path / "a", 1, ["q_proj", "o_proj"], 4)
    prompt = list(range(40, 60))
    with LLM(str(tiny_glm4_moe_dir), num_kv_blocks=64, max_loras=2) as llm:  # type: ignore[arg-type]
        adapted, plain = llm.generate([prompt, prompt], GREEDY,
                                      lora_request=[LoRARequest("a", str(bundle)), None])
        wrapped = {name for _, name in llm.engine.runner.lora.wrapped}  # type: ignore[union-attr]
    assert wrapped == {"qkv_proj", "o_proj"}
    assert adapted.outputs[0].token_ids == peft_greedy(tiny_glm4_moe_dir, bundle, prompt)
    assert plain.outputs[0].token_ids == peft_greedy(tiny_glm4_moe_dir, None, prompt)
