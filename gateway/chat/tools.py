"""Tool calls: the JSON schema that forces one, and the parser that finds them in generated text.

Models served here use the Hermes/Qwen convention of their chat templates (``engine/tiny.py``): a call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` inside the assistant's text.

- ``tool_choice="auto"``: ``ToolCallParser`` splits the text into content and calls while it streams;
  text that might be the start of a ``<tool_call>`` tag is held back until it is known not to be one.
  A block whose JSON is not a call object stays in the content (the model's text is never lost).
- ``tool_choice="required"`` or a named function: the engine's constrained decoding
  (``forced_call_schema``) makes the whole output one call object, valid even for a random-weight
  model; the parser then reads the entire output as that call.
- ``parallel_tool_calls=false`` keeps only the first call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.chat.schemas import FunctionTool

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_schema(tool: FunctionTool) -> dict[str, Any]:
    params = tool.function.parameters or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_call_schema(tools: list[FunctionTool], name: str | None) -> dict[str, Any]:
    """JSON schema of one call: of function ``name``, or of any of ``tools`` (``required``)."""
    chosen = [t for t in tools if name is None or t.function.name == name]
    if len(chosen) == 1:
        return _call_schema(chosen[0])
    return {"anyOf": [_call_schema(t) for t in chosen]}


@dataclass(slots=True)
class ParsedCall:
    id: str
    name: str
    arguments: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _parse_call(text: str) -> ParsedCall | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedCall(new_call_id(), obj["name"], arguments)


class ToolCallParser:
    """Incremental splitter of generated text into content and tool calls (see module docstring)."""

    def __init__(self, *, forced: bool, parallel: bool = True) -> None:
        self.forced = forced
        self.parallel = parallel
        self.calls: list[ParsedCall] = []
        self._buffer = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        """Content that is final now, and calls completed by this text."""
        if self.forced:
            self._buffer += text
            return "", []
        self._buffer += text
        content, calls = [], []
        while self._buffer:
            if self._in_call:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG):]
                self._in_call = False
                call = _parse_call(body.strip())
                if call is None:
                    content.append(OPEN_TAG + body + CLOSE_TAG)
                else:
                    calls.append(call)
                continue
            start = self._buffer.find(OPEN_TAG)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN_TAG):]
                self._in_call = True
                continue
            hold = _partial_suffix(self._buffer, OPEN_TAG)
            content.append(self._buffer[: len(self._buffer) - hold])
            self._buffer = self._buffer[len(self._buffer) - hold:]
            break
        return "".join(content), self._keep(calls)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of generation: leftover content, and the forced call if there is one."""
        rest, self._buffer = self._buffer, ""
        if self.forced:
            call = _parse_call(rest.strip())
            return ("", self._keep([call])) if call is not None else (rest, [])
        if self._in_call:
            self._in_call = False
            return OPEN_TAG + rest, []
        return rest, []

    def _keep(self, calls: list[ParsedCall]) -> list[ParsedCall]:
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return calls


def _partial_suffix(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
