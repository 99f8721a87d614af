"""``POST /v1/chat/completions`` request body (OpenAI's ``CreateChatCompletionRequest``).

Messages are a union discriminated by ``role`` (``system``, ``developer``, ``user``, ``assistant``,
``tool``, and the deprecated ``function``); ``content`` is a string or an array of parts. Only text
parts can be served by a text model: image, audio and file parts are refused with a 400 naming the part.
``to_template_dict`` flattens a message to what chat templates expect (string content, tool calls with
string arguments).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from gateway.errors import InvalidRequestError
from gateway.generation.requests import BREAKPOINT_KEY
from gateway.openai.caching import PromptCacheBreakpoint, PromptCacheFields, breakpoint_offset
from gateway.openai.schemas import (
    RequestModel,
    ResponseFormat,
    ResponseFormatJsonObject,
    SamplingFields,
    check_metadata,
    check_strict,
    unsupported,
)

FUNCTION_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class TextPart(RequestModel):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class RefusalPart(RequestModel):
    type: Literal["refusal"]
    refusal: str


class UnsupportedContent(RequestModel):
    """A content part a text model cannot read (images, audio, files): validating one is a 400."""

    type: str

    @model_validator(mode="after")
    def _refuse(self) -> UnsupportedContent:
        raise unsupported(f"{self.type} content is not supported by this model (it reads text only)")


class ImagePart(UnsupportedContent):
    type: Literal["image_url"]


class AudioPart(UnsupportedContent):
    type: Literal["input_audio"]


class FilePart(UnsupportedContent):
    type: Literal["file"]


UserPart = Annotated[TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


def _text_of(content: str | list | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextPart) else getattr(p, "refusal", "") for p in content)


def message_text(message: Any) -> str:
    """The text a message carries (its text parts; an assistant's tool calls' arguments too)."""
    text = _text_of(getattr(message, "content", None))
    for call in getattr(message, "tool_calls", None) or ():
        text += call.function.arguments
    return text


def _unanswered(calls: list[str], index: int) -> InvalidRequestError:
    return InvalidRequestError(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(calls)}",
        param=f"messages[{index}].role", code="invalid_value")


class SystemMessage(RequestModel):
    role: Literal["system"]
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(RequestModel):
    role: Literal["developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(RequestModel):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class FunctionCallSpec(RequestModel):
    name: str
    arguments: str


class ToolCall(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallSpec


class AssistantMessage(RequestModel):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls and self.refusal is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(RequestModel):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionMessage(RequestModel):
    """Deprecated by OpenAI in favour of ``tool``; rendered as a tool response."""

    role: Literal["function"]
    content: str | None
    name: str


ChatMessage = Annotated[
    SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage,
    Field(discriminator="role"),
]


def to_template_dict(message: Any) -> dict[str, Any]:
    """A message as chat templates read it: ``developer`` as ``system``, string content."""
    role = message.role
    if role == "developer":
        role = "system"
    if role == "function":
        return {"role": "tool", "content": message.content or "", "name": message.name}
    out: dict[str, Any] = {"role": role, "content": _text_of(message.content)}
    if isinstance(message.content, list):
        marks = [(p.text, p.prompt_cache_breakpoint is not None) if isinstance(p, TextPart)
                 else (getattr(p, "refusal", ""), False) for p in message.content]
        offset = breakpoint_offset(marks)
        if offset is not None:
            out[BREAKPOINT_KEY] = offset
    if role == "assistant":
        if not out["content"] and message.refusal:
            out["content"] = message.refusal
        if message.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in message.tool_calls
            ]
    elif role == "tool":
        out["tool_call_id"] = message.tool_call_id
    if getattr(message, "name", None):
        out["name"] = message.name
    return out


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _strict(self) -> FunctionDefinition:
        check_strict(self.strict, self.parameters, f"function '{self.name}'")
        return self


class FunctionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class CustomTool(RequestModel):
    type: Literal["custom"]

    @model_validator(mode="after")
    def _refuse(self) -> CustomTool:
        raise unsupported("custom tools are not supported; use function tools")


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(RequestModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(RequestModel):
    """Only these of the request's tools may be called (``mode``: may, or must call one of them)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice


class PredictionContent(RequestModel):
    """Predicted Outputs: text the answer is expected to repeat, mostly (a file regenerated with small
    edits). It only makes the answer faster (speculative decoding); the answer is what it would be
    without it. ``rejected_prediction_tokens`` are billed as output, as OpenAI bills them."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return _text_of(self.content)


class ChatCompletionRequest(SamplingFields, PromptCacheFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, min_length=1, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Only kept with a stored completion at OpenAI (``store``; not kept here): checked as OpenAI does.
    metadata: dict[str, str] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    # A routing hint: one tenant's requests with the same key are served by the same replica.
    prompt_cache_key: str | None = None
    prediction: PredictionContent | None = None

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, value: list[str] | None) -> list[str] | None:
        if value and any(m != "text" for m in value):
            raise unsupported("only the 'text' modality is supported by this model")
        return value

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            raise unsupported("audio output is not supported by this model")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any) -> Any:
        if value is not None:
            raise unsupported("the deprecated functions/function_call are not supported; "
                             "use tools and tool_choice")
        return value

    def check(self) -> None:
        """Rules across fields (pydantic would report them without a parameter name)."""
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequestError("logprobs must be set to true if top_logprobs is used.",
                                      param="top_logprobs", code="invalid_value")
        if not self.tools:
            for name in ("tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    raise InvalidRequestError(
                        f"Invalid value for '{name}': '{name}' is only allowed when 'tools' are specified.",
                        param=name, code="invalid_value")
        if isinstance(self.response_format, ResponseFormatJsonObject) and not any(
                "json" in message_text(m).lower() for m in self.messages):
            raise InvalidRequestError(
                "'messages' must contain the word 'json' in some form, to use 'response_format' of type "
                "'json_object'.", param="messages", code="invalid_value")
        self._check_tool_responses()
        if isinstance(self.tool_choice, AllowedToolsChoice):
            self._narrow_to_allowed_tools(self.tool_choice.allowed_tools)
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.function_tools}
            if self.tool_choice.function.name not in names:
                raise InvalidRequestError(
                    f"Invalid 'tool_choice': the function '{self.tool_choice.function.name}' "
                    "is not among the tools.", param="tool_choice", code="invalid_value")
        elif self.tool_choice == "required" and not self.tools:
            raise InvalidRequestError("Invalid 'tool_choice': 'required' needs at least one tool.",
                                      param="tool_choice", code="invalid_value")
        if self.prediction is not None:
            self._check_prediction()

    def _narrow_to_allowed_tools(self, allowed: AllowedTools) -> None:
        """``allowed_tools``: the request goes on with only those tools and its mode as ``tool_choice``
        (the model sees and may call just them). Every one named must be among the tools."""
        names = {t.function.name for t in self.function_tools}
        for index, ref in enumerate(allowed.tools):
            if ref.function.name not in names:
                raise InvalidRequestError(
                    f"Invalid 'tool_choice': the allowed function '{ref.function.name}' is not among the "
                    "tools.", param=f"tool_choice.allowed_tools.tools[{index}]", code="invalid_value")
        keep = {ref.function.name for ref in allowed.tools}
        self.tools = [t for t in self.function_tools if t.function.name in keep]
        self.tool_choice = allowed.mode

    def _check_tool_responses(self) -> None:
        """As OpenAI: a ``tool`` message answers a call of the assistant message right before the tool
        messages it belongs to, and every call of an assistant message is answered before the next
        message of another role (or the end)."""
        open_calls: list[str] = []  # the last assistant message's calls, not answered yet
        called: set[str] = set()
        for index, message in enumerate(self.messages):
            if isinstance(message, ToolMessage):
                if message.tool_call_id not in called:
                    raise InvalidRequestError(
                        "Invalid parameter: messages with role 'tool' must be a response to a preceding "
                        f"message with 'tool_calls' (no call has the id '{message.tool_call_id}').",
                        param=f"messages[{index}].tool_call_id", code="invalid_value")
                if message.tool_call_id in open_calls:
                    open_calls.remove(message.tool_call_id)
                continue
            if isinstance(message, FunctionMessage):  # the deprecated form answers without ids
                open_calls = []
                continue
            if open_calls:
                raise _unanswered(open_calls, index - 1)
            tool_calls = message.tool_calls if isinstance(message, AssistantMessage) else None
            called = {call.id for call in tool_calls or ()}
            open_calls = [call.id for call in tool_calls or ()]
        if open_calls:
            raise _unanswered(open_calls, len(self.messages) - 1)

    def _check_prediction(self) -> None:
        """What OpenAI documents Predicted Outputs cannot be combined with: n > 1, logprobs, positive
        presence or frequency penalties, tools."""
        conflicts = (
            ("n", (self.n or 1) > 1, "n greater than 1"),
            ("logprobs", bool(self.logprobs), "logprobs"),
            ("presence_penalty", (self.presence_penalty or 0) > 0, "presence_penalty greater than 0"),
            ("frequency_penalty", (self.frequency_penalty or 0) > 0, "frequency_penalty greater than 0"),
            ("tools", bool(self.tools), "tools"),
        )
        for param, conflict, what in conflicts:
            if conflict:
                raise InvalidRequestError(f"Predicted outputs ('prediction') are not supported with {what}.",
                                          param=param, code="unsupported_parameter")

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [t for t in self.tools or () if isinstance(t, FunctionTool)]
