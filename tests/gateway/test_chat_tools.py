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
    parser = ToolCallParser(forced=True)
    content, calls = run(parser, ['{"name": "f", ', '"arguments": {"x": 1}}'])
    assert content == "" and calls[0].name == "f" and json.loads(calls[0].arguments) == {"x": 1}
    assert not parser.truncated


# Compact, name first: what the engine's grammar generates for a forced call.
FORCED = '{"name":"get_weather","arguments":{"city":"Paris","days":3}}'
FORCED_ARGS = '{"city":"Paris","days":3}'
TOOL_NAMES = ("get_weather", "get_time")


@pytest.mark.parametrize("cut, arguments", [
    ("", ""),                                                      # nothing generated
    ("{", ""),                                                     # right after the opening brace
    ('{"na', ""),                                                  # inside the first key
    ('{"name":"get_w', ""),                                        # inside the name
    ('{"name":"get_weather"', ""),                                 # the name complete
    ('{"name":"get_weather","arguments":', ""),
    ('{"name":"get_weather","arguments":{', "{"),                  # inside the arguments
    ('{"name":"get_weather","arguments":{"city":"Par', '{"city":"Par'),
    ('{"name":"get_weather","arguments":{"city":"Paris","days":3', '{"city":"Paris","days":3'),
    ('{"name":"get_weather","arguments":{"city":"Paris","days":3}', FORCED_ARGS),  # only "}" missing
    ('{ "name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),      # not compact
])
@pytest.mark.parametrize("step", [1, 5, 1000])
def test_forced_call_cut_short_is_still_the_named_call(cut: str, arguments: str, step: int) -> None:
    parser = ToolCallParser(forced=True, names=["get_weather"])
    content, calls = run(parser, [cut[i:i + step] for i in range(0, len(cut), step)])
    assert content == "" and parser.truncated
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", arguments)]
    assert calls[0].id.startswith("call_")


def test_forced_call_cut_anywhere_carries_a_prefix_of_its_arguments() -> None:
    for k in range(len(FORCED)):
        parser = ToolCallParser(forced=True, names=["get_weather"])
        content, calls = run(parser, [FORCED[:k]])
        assert content == "" and parser.truncated and len(calls) == 1, FORCED[:k]
        assert calls[0].name == "get_weather" and FORCED_ARGS.startswith(calls[0].arguments), FORCED[:k]


@pytest.mark.parametrize("cut, name", [
    ('{"name":"get_w', "get_weather"),          # only one tool's name starts so: it is that one
    ('{"name":"get_t', "get_time"),
    ('{"name":"get_w\\', "get_weather"),        # cut inside an escape
    ('{"name":"get_', None),                     # two tools' names start so: no call
    ("{", None),
    ("", None),
])
def test_required_call_cut_inside_its_name(cut: str, name: str | None) -> None:
    parser = ToolCallParser(forced=True, names=TOOL_NAMES)
    content, calls = run(parser, [cut])
    assert content == "" and parser.truncated
    assert [c.name for c in calls] == ([name] if name else [])
    assert all(c.arguments == "" for c in calls)


def test_forced_output_that_is_no_call_object_stays_content() -> None:
    for text in ('Sure! {"name"', '{"name":"f","arguments":{}}}', '["get_weather"'):
        parser = ToolCallParser(forced=True, names=["f"])
        assert run(parser, [text]) == (text, []) and not parser.truncated


def test_parallel_calls_cut_in_the_second_call_keep_the_first() -> None:
    # A forced output is one call by construction; several calls come only with tool_choice "auto",
    # whose text is left as it was: the cut block stays content, the whole call is a call.
    cut = TEXT[: TEXT.rindex('"arguments"') + 8]
    parser = ToolCallParser(forced=False)
    content, calls = run(parser, [cut[i:i + 4] for i in range(0, len(cut), 4)])
    assert [c.name for c in calls] == ["get_weather"] and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert content == "Let me check." + cut[cut.rindex("<tool_call>"):] and not parser.truncated


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
