"""Tool calls: the JSON schema that forces one, and the parser that finds them in generated text.

Models served here use the Hermes/Qwen convention of their chat templates (``engine/tiny.py``): a call is
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` inside the assistant's text.

- ``tool_choice="auto"``: ``ToolCallParser`` splits the text into content and calls while it streams;
  text that might be the start of a ``<tool_call>`` tag is held back until it is known not to be one.
  A block whose JSON is not a call object stays in the content (the model's text is never lost).
- ``tool_choice="required"`` or a named function: the engine's constrained decoding
  (``forced_call_schema``) makes the whole output one call object, valid even for a random-weight
  model; the parser then reads the entire output as that call. The schema lists ``name`` before
  ``arguments`` and the grammar keeps that order, so the name is always generated first.
- A forced call cut short (``max_tokens``, a stop sequence) is still the call, as OpenAI answers it: no
  content; the call's ``arguments`` are the JSON text generated for them so far, verbatim (``""`` if
  none), and ``truncated`` is set so the caller reports the engine's finish reason, not ``tool_calls``.
  Its name is the generated one if complete; if the cut falls inside the name (or before it), the name
  is the one of ``names`` (the functions the call may name: the named function, or every tool for
  ``required``) that starts with what was generated, when exactly one does. When several do (or none),
  the name cannot be known and there is no call at all, rather than a call naming a function that
  does not exist; still no content. Output that is not even the beginning of a call object (it cannot
  come from the grammar) stays content.
- ``parallel_tool_calls=false`` keeps only the first call.

``ToolUse`` is what a request's tools and ``tool_choice`` make of a generation, the same for chat and
the Responses API: the tools the template shows, the forced-call schema, and a parser per completion.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
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


@dataclass(frozen=True, slots=True)
class ToolUse:
    """``tools`` in use (none when there are none or ``tool_choice`` is ``none``); ``forced``: the output
    is one call (``required``, or the function ``forced_name``)."""

    tools: list[FunctionTool]
    forced_name: str | None
    forced: bool

    @classmethod
    def of(cls, tools: list[FunctionTool], choice: str | None, forced_name: str | None) -> ToolUse:
        """``choice``: ``none``, ``auto``, ``required`` or None (a named function: ``forced_name``)."""
        used = tools if choice != "none" else []
        return cls(used, forced_name, bool(used) and (choice == "required" or forced_name is not None))

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them (None: no tools in the prompt)."""
        return [t.model_dump(mode="json", exclude_none=True) for t in self.tools] or None

    @property
    def response_format(self) -> dict[str, Any] | None:
        """The engine's constrained decoding of a forced call (None: not forced)."""
        if not self.forced:
            return None
        return {"type": "json_schema", "json_schema": forced_call_schema(self.tools, self.forced_name)}

    def parser(self, *, parallel: bool) -> ToolCallParser | None:
        """A parser for one completion (None without tools)."""
        if not self.tools:
            return None
        names = [self.forced_name] if self.forced_name is not None else [t.function.name for t in self.tools]
        return ToolCallParser(forced=self.forced, parallel=parallel, names=names)


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


@dataclass(slots=True)
class _Prefix:
    """What the beginning of a call object says: the name (``name_done``: its string is closed) and the
    arguments' text so far."""

    name: str = ""
    name_done: bool = False
    arguments: str = ""


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def _string_end(text: str, i: int) -> int | None:
    """Index just past the JSON string opening at ``text[i]``; ``None`` if the text ends inside it."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text[j] == '"':
            return j + 1
        else:
            j += 1
    return None


def _value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value starting at ``text[i]``; ``None`` if the text ends inside it."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] not in "{[":
        j = i
        while j < len(text) and text[j] not in ",}] \t\r\n":
            j += 1
        return j if j < len(text) else None  # a number may go on
    depth, j = 0, i
    while j < len(text):
        if text[j] == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if text[j] in "{[":
            depth += 1
        elif text[j] in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return None


def _partial_string(body: str) -> str:
    """The characters of a JSON string cut after ``"`` + ``body`` (a cut escape is dropped)."""
    for cut in range(min(len(body), 6) + 1):
        try:
            return json.loads('"' + body[: len(body) - cut] + '"')
        except ValueError:
            continue
    return ""


def _call_prefix(text: str) -> _Prefix | None:
    """The call that ``text``, the beginning of a call object cut short, starts; ``None`` if ``text``
    is not the beginning of a JSON object (or is a whole one: that is not a cut)."""
    found = _Prefix()
    i = _skip_ws(text, 0)
    if i == len(text):
        return found
    if text[i] != "{":
        return None
    i += 1
    while True:
        i = _skip_ws(text, i)
        if i == len(text):
            return found
        if text[i] != '"':
            return None
        key_end = _string_end(text, i)
        if key_end is None:
            return found
        key = json.loads(text[i:key_end])
        i = _skip_ws(text, key_end)
        if i == len(text):
            return found
        if text[i] != ":":
            return None
        i = _skip_ws(text, i + 1)
        if i == len(text):
            return found
        end = _value_end(text, i)
        if key == "name":
            if text[i] != '"':
                return None
            if end is None:
                found.name = _partial_string(text[i + 1:])
                return found
            found.name, found.name_done = json.loads(text[i:end]), True
        elif key in ("arguments", "parameters"):
            found.arguments = text[i:end] if end is not None else text[i:]
        if end is None:
            return found
        i = _skip_ws(text, end)
        if i == len(text):
            return found
        if text[i] != ",":
            return None
        i += 1


class ToolCallParser:
    """Incremental splitter of generated text into content and tool calls (see module docstring).

    ``names``: the functions a forced call may name, to name a call cut inside its name. ``truncated``
    turns true when ``finish`` finds a forced call cut short."""

    def __init__(self, *, forced: bool, parallel: bool = True, names: Sequence[str] = ()) -> None:
        self.forced = forced
        self.parallel = parallel
        self.names = tuple(names)
        self.truncated = False
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
            if call is not None:
                return "", self._keep([call])
            return self._cut_call(rest)
        if self._in_call:
            self._in_call = False
            return OPEN_TAG + rest, []
        return rest, []

    def _cut_call(self, text: str) -> tuple[str, list[ParsedCall]]:
        prefix = _call_prefix(text)
        if prefix is None:
            return text, []
        self.truncated = True
        if prefix.name_done:
            name = prefix.name
        else:
            candidates = [n for n in self.names if n.startswith(prefix.name)]
            if len(candidates) != 1:
                return "", []
            name = candidates[0]
        return "", self._keep([ParsedCall(new_call_id(), name, prefix.arguments)])

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
