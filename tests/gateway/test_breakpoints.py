"""``prompt_cache_breakpoint`` positions (``gateway.generation.requests.breakpoint_tokens``) on the tiny
checkpoint's real chat template: the tokens of the prompt before the breakpoint, whatever comes after it
in the same message (tool calls) or the conversation; a template that refuses a conversation without a
user turn still renders (the conversation keeps its shape)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.tiny import create_tiny_checkpoint
from engine.tokenizer import Tokenizer
from gateway.generation.requests import BREAKPOINT_KEY, breakpoint_tokens

RULES = "Answer briefly. Cite the section. Never guess a number you were not given."
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "ledger"}'}}
# What strict templates (Qwen3's) do with a conversation that has no user turn.
GUARD = ("{%- if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
         "{{- raise_exception('No user query found in messages.') }}{%- endif %}")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_pretrained(create_tiny_checkpoint(tmp_path_factory.mktemp("bp_tiny"), seed=0))


def reference(tokenizer: Tokenizer, messages: list[dict], text_before: str) -> int:
    """The prompt's whole tokens up to the end of ``text_before``'s (only) occurrence in the rendered
    conversation (a token that spans the end does not count)."""
    rendered = tokenizer.apply_chat_template(messages)
    end = rendered.index(text_before) + len(text_before)
    prompt = tokenizer.encode(rendered, add_special_tokens=False)
    for count in range(len(prompt), -1, -1):
        if len(tokenizer.decode(prompt[:count], skip_special_tokens=False)) <= end:
            return count
    return 0


async def test_a_breakpoint_in_the_system_prompt(tokenizer: Tokenizer) -> None:
    messages = [{"role": "system", "content": RULES + " Today: sunny.", BREAKPOINT_KEY: len(RULES)},
                {"role": "user", "content": "Which section?"}]
    prompt = tokenizer.encode_chat(messages)
    count = await breakpoint_tokens(tokenizer, messages, None, prompt, "messages")
    assert count == reference(tokenizer, messages, RULES)
    assert 0 < count < len(prompt)


async def test_tool_calls_after_an_assistant_breakpoint_are_not_counted(tokenizer: Tokenizer) -> None:
    said = "Let me look that up."
    messages = [{"role": "user", "content": "Find the ledger."},
                {"role": "assistant", "content": said, "tool_calls": [CALL], BREAKPOINT_KEY: len(said)},
                {"role": "tool", "tool_call_id": "call_1", "content": "found"}]
    prompt = tokenizer.encode_chat(messages)
    count = await breakpoint_tokens(tokenizer, messages, None, prompt, "messages")
    assert count == reference(tokenizer, messages, said)
    assert tokenizer.decode(prompt[count:]).count("lookup") == 1  # the call is after the breakpoint


async def test_no_breakpoint_is_none(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert await breakpoint_tokens(tokenizer, messages, None, tokenizer.encode_chat(messages), "x") is None


async def test_a_template_that_needs_a_user_turn_still_renders(tmp_path: Path) -> None:
    model = create_tiny_checkpoint(tmp_path / "guarded", seed=0)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = GUARD + config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_pretrained(model)
    messages = [{"role": "system", "content": RULES, BREAKPOINT_KEY: len(RULES)},
                {"role": "user", "content": "Which section?"}]
    prompt = tokenizer.encode_chat(messages)
    assert await breakpoint_tokens(tokenizer, messages, None, prompt, "messages") == reference(
        tokenizer, messages, RULES)
