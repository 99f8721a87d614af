"""The copying checkpoint (``engine.copying``, ``tollgate model create-copying``): a real Llama checkpoint
that ``transformers`` runs to the same tokens, continues a repeated stretch of its context token for
token, answers a chat by quoting the tool output it was given, and on which automatic speculation (prompt
lookup) is accepted without changing a token."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer
from tollgate.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def copying_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("copying") / "model"
    result = CliRunner().invoke(main, ["model", "create-copying", str(out), "--seed", "0"])
    assert result.exit_code == 0, result.output
    return out


def _tool_output(rng: random.Random) -> str:
    words = "ledger invoice refund audit vendor payment quarter revenue".split()
    # Every 10-token stretch occurs once: a stretch seen twice continues from its latest occurrence.
    rows = [{"id": rng.randrange(10_000), "name": f"{rng.choice(words)} {rng.randrange(10_000)}",
             "total": round(rng.uniform(0, 5000), 2)} for _ in range(5)]
    return json.dumps({"ok": True, "rows": rows})


def _chat(tok: Tokenizer, doc: str) -> list[int]:
    return tok.encode_chat([{"role": "system", "content": "Relay the tool's result."},
                            {"role": "user", "content": doc}])


def test_the_same_seed_writes_the_same_files(copying_dir: Path, tmp_path: Path) -> None:
    CliRunner().invoke(main, ["model", "create-copying", str(tmp_path / "again")])
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        assert (tmp_path / "again" / name).read_bytes() == (copying_dir / name).read_bytes(), name


def test_a_repeated_stretch_is_continued_token_for_token(copying_dir: Path) -> None:
    rng = random.Random(1)
    prompts, expected = [], []
    for length in (60, 300, 1000, 1900):
        seq = [rng.randrange(3000) for _ in range(length)]
        cut = rng.randrange(8, length - 40)
        prompts.append(seq + seq[cut - 6 : cut])  # six tokens seen before: the rest follows
        expected.append(seq[cut : cut + 32])
    with LLM(model=str(copying_dir), max_num_seqs=4, speculation="off") as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_transformers_runs_it_to_the_same_tokens(copying_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_pretrained(copying_dir)
    prompt = _chat(tok, _tool_output(random.Random(2)))
    model = AutoModelForCausalLM.from_pretrained(copying_dir, dtype=torch.float32)
    with torch.no_grad():
        mask = torch.ones(1, len(prompt), dtype=torch.long)
        theirs = model.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=40,
                                do_sample=False)[0, len(prompt):].tolist()
    with LLM(model=str(copying_dir), speculation="off") as llm:
        ours = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].token_ids
    assert ours == theirs[: len(ours)] and len(ours) >= 20


def test_a_chat_answer_quotes_the_tool_output_and_speculation_changes_nothing(copying_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(copying_dir)
    rng = random.Random(3)
    docs = [_tool_output(rng) for _ in range(3)]
    prompts = [_chat(tok, d) for d in docs]
    answers, steps = {}, {}
    for speculation in ("off", "auto"):
        with LLM(model=str(copying_dir), max_num_seqs=1, speculation=speculation) as llm:
            before = llm.stats.num_steps
            outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=400))
            steps[speculation] = llm.stats.num_steps - before
        answers[speculation] = [o.outputs[0] for o in outputs]
    assert [c.token_ids for c in answers["auto"]] == [c.token_ids for c in answers["off"]]
    for completion, doc in zip(answers["off"], docs, strict=True):
        text = tok.decode(completion.token_ids)
        assert completion.finish_reason == "stop" and text in doc and len(text) > 0.9 * len(doc), text
    # Prompt lookup drafts what the model then copies: several tokens per forward pass.
    assert steps["auto"] < 0.5 * steps["off"], steps
