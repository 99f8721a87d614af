"""``tollgate model create-tiny``: a tiny checkpoint that transformers loads, deterministic per seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine.tiny import create_tiny_checkpoint
from tollgate.cli import main

transformers = pytest.importorskip("transformers")


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_cli_writes_deterministic_checkpoint(tmp_path: Path) -> None:
    runner = CliRunner()
    for name in ("a", "b"):
        result = runner.invoke(
            main, ["model", "create-tiny", str(tmp_path / name), "--arch", "qwen2", "--seed", "3"]
        )
        assert result.exit_code == 0, result.output
    result = runner.invoke(
        main, ["model", "create-tiny", str(tmp_path / "c"), "--arch", "qwen2", "--seed", "4"]
    )
    assert result.exit_code == 0, result.output
    a, b, c = (_files(tmp_path / n) for n in "abc")
    assert a == b
    assert a["tokenizer.json"] == c["tokenizer.json"]
    assert a["model.safetensors"] != c["model.safetensors"]


def test_cli_rejects_unknown_arch(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["model", "create-tiny", str(tmp_path), "--arch", "gpt2"])
    assert result.exit_code != 0
    assert "gpt2" in result.output


def test_invalid_arguments_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch must be one of"):
        create_tiny_checkpoint(tmp_path, arch="deepseek_v3")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        create_tiny_checkpoint(tmp_path / "file")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_transformers_loads_checkpoint(arch: str, request: pytest.FixtureRequest) -> None:
    d: Path = request.getfixturevalue(f"tiny_{arch}_dir")
    config = json.loads((d / "config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    tok = transformers.AutoTokenizer.from_pretrained(d)
    assert len(tok) == config["vocab_size"] == model.config.vocab_size
    assert 2000 <= config["vocab_size"] <= 4096
    assert tok.eos_token == "<|im_end|>"

    text = "Hello world, ça va? 你好 🚀"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    # A trained BPE merges common words: far fewer tokens than bytes.
    assert len(tok("the function returns the value", add_special_tokens=False)["input_ids"]) < 12

    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), config["vocab_size"])
    assert torch.isfinite(logits).all()


def test_chat_template_renders_tools_and_tool_messages(tiny_qwen2_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama_variant_has_bos(tiny_llama_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama_dir)
    assert tok("hi")["input_ids"][0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n")


def test_engine_command_builds_config_and_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.server

    calls: list[tuple] = []
    monkeypatch.setattr(engine.server, "serve", lambda *a, **kw: calls.append((a, kw)))
    args = [
        "engine",
        "--model",
        str(tmp_path),
        "--port",
        "8123",
        "--pool",
        "batch",
        "--num-kv-blocks",
        "32",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "256",
        "--no-prefix-caching",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (config,), kwargs = calls[0]
    assert kwargs == {"host": "127.0.0.1", "port": 8123, "pool": "batch", "model_name": None,
                      "drain_timeout_s": 120.0, "internal_token": None}
    assert (config.model, config.num_kv_blocks, config.max_num_seqs, config.max_model_len) == (
        str(tmp_path),
        32,
        4,
        256,
    )
    assert config.attention_backend == "torch" and not config.enable_prefix_caching

    result = CliRunner().invoke(main, ["engine", "--model", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "is not a directory" in result.output


def test_the_cli_offers_every_family_the_writer_knows() -> None:
    from engine.tiny import ARCHS
    from tollgate.commands.model import _ARCHS

    assert _ARCHS == ARCHS
