"""Tool-call parsing of generated text (streamed in pieces or whole) and forced-call schemas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gateway.chat.schemas import FunctionTool
from gateway.chat.tools import ToolCallParser, forced_call_schema

TEXT = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
       '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'


def run(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list]:
    content, calls = "", []
    for piece in pieces:
        c, k = parser.feed(piece)
        content += c
        calls += k
    c, k = parser.finish()
    return content + c, calls + k


@pytest.mark.parametrize("step", [1, 2, 3, 7, len(TEXT)])
def test_calls_are_found_whatever_the_chunking(step: int) -> None:
    content, calls = run(ToolCallParser(forced=False), [TEXT[i:i + step] for i in range(0, len(TEXT), step)])
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert len({c.id for c in calls}) == 2


def test_parallel_false_keeps_first_call_and_bad_blocks_stay_text() -> None:
    _, calls = run(ToolCallParser(forced=False, parallel=False), [TEXT])
    assert [c.name for c in calls] == ["get_weather"]
    content, calls = run(ToolCallParser(forced=False), ["a <tool_call>not json</tool_call> b <tool_c"])
    assert calls == [] and content == "a <tool_call>not json</tool_call> b <tool_c"


def test_forced_output_is_one_call() -> None:
    content, calls = run(ToolCallParser(forced=True), ['{"name": "f", ', '"arguments": {"x": 1}}'])
    assert content == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    content, calls = run(ToolCallParser(forced=True), ['{"name": "f", "argu'])  # cut by max_tokens
    assert calls == [] and content == '{"name": "f", "argu'


def test_forced_schema_accepts_only_the_chosen_calls() -> None:
    tools = [FunctionTool.model_validate({"type": "function", "function": {
        "name": n, "parameters": {"type": "object", "properties": {"a": {"type": "integer"}},
                                  "required": ["a"]}}}) for n in ("f", "g")]
    named = forced_call_schema(tools, "g")
    jsonschema.validate({"name": "g", "arguments": {"a": 1}}, named)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"a": 1}}, named)
    anyone = forced_call_schema(tools, None)
    jsonschema.validate({"name": "f", "arguments": {"a": 1}}, anyone)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "g", "arguments": {}}, anyone)
