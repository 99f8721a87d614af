"""``POST /v1/responses`` request body (OpenAI's ``CreateResponse``).

``input`` is a string (one user message) or a list of items: messages (``role`` user, assistant,
system or developer; ``content`` a string or ``input_text`` / ``output_text`` / ``refusal`` parts),
``function_call`` items (a call the model made earlier) and ``function_call_output`` items (its result).
An item without ``type`` is a message, as OpenAI reads it. Only text can be served by a text model:
image, file and audio parts are refused with a 400 naming the part, and so are hosted tools (web
search, file search, ...), which this platform does not run; function tools are served. ``text.format``
is ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``, ``strict``), at the top of the
format object as the Responses API has it (not nested as in chat).

Unknown fields are ignored (newer SDKs), known ones validated with OpenAI's ranges (``RequestModel``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from gateway.chat.schemas import FUNCTION_NAME_PATTERN, UnsupportedContent
from gateway.errors import InvalidRequestError
from gateway.openai.caching import PromptCacheBreakpoint, PromptCacheFields
from gateway.openai.schemas import RequestModel, ServiceTierName, check_metadata, check_strict, unsupported


class InputText(RequestModel):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class OutputText(RequestModel):
    type: Literal["output_text"]
    text: str


class Refusal(RequestModel):
    type: Literal["refusal"]
    refusal: str


def _part_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("input_text", "output_text", "refusal") else "unsupported"


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")] | Annotated[UnsupportedContent, Tag("unsupported")],
    Discriminator(_part_kind),
]


def part_text(part: InputText | OutputText | Refusal | UnsupportedContent) -> str:
    return part.refusal if isinstance(part, Refusal) else getattr(part, "text", "")


class MessageItem(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part_text(p) for p in self.content)


class FunctionCallItem(RequestModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(RequestModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=64)
    output: str | list[ContentPart]

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part_text(p) for p in self.output)


class _UnsupportedItem(RequestModel):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> _UnsupportedItem:
        raise unsupported(f"input items of type '{self.type}' are not supported: send messages, "
                         "function_call and function_call_output items")


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("message", "function_call", "function_call_output") else "unsupported"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[_UnsupportedItem, Tag("unsupported")],
    Discriminator(_item_kind),
]


class FunctionToolParam(RequestModel):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _strict(self) -> FunctionToolParam:
        check_strict(self.strict, self.parameters, f"function '{self.name}'")
        return self


class _UnsupportedTool(RequestModel):
    type: str

    @model_validator(mode="after")
    def _refuse(self) -> _UnsupportedTool:
        raise ValueError(f"'{self.type}' tools are not run by this platform; use function tools")


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "function" if kind == "function" else "unsupported"


Tool = Annotated[
    Annotated[FunctionToolParam, Tag("function")] | Annotated[_UnsupportedTool, Tag("unsupported")],
    Discriminator(_tool_kind),
]


class ToolChoiceFunction(RequestModel):
    type: Literal["function"]
    name: str


class FormatText(RequestModel):
    type: Literal["text"]


class FormatJsonObject(RequestModel):
    type: Literal["json_object"]


class FormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _strict(self) -> FormatJsonSchema:
        check_strict(self.strict, self.json_schema, f"text.format '{self.name}'")
        return self


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema, Field(discriminator="type")]


class TextParam(RequestModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class CreateResponseRequest(PromptCacheFields):
    model: str = Field(min_length=1)
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(default=None, max_length=64)
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: ServiceTierName | None = None
    store: bool | None = None
    stream: bool | None = False
    background: bool | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Refused (``check``): each would change the answer, and this platform has neither.
    conversation: Any = None
    prompt: Any = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[Any]) -> str | list[Any]:
        if isinstance(value, list) and not value:
            raise ValueError("input must have at least one item")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return check_metadata(value)

    def check(self) -> None:
        """Rules across fields, and what this platform does not do (each a 400 naming its parameter)."""
        names = {t.name for t in self.function_tools}
        if isinstance(self.tool_choice, ToolChoiceFunction) and self.tool_choice.name not in names:
            raise InvalidRequestError(
                f"Invalid 'tool_choice': the function '{self.tool_choice.name}' is not among the tools.",
                param="tool_choice", code="invalid_value")
        if self.tool_choice == "required" and not names:
            raise InvalidRequestError("Invalid 'tool_choice': 'required' needs at least one tool.",
                                      param="tool_choice", code="invalid_value")
        if self.background and self.stream:
            raise InvalidRequestError("Background responses are not streamed here; poll them instead.",
                                      param="stream", code="unsupported_parameter")
        if self.background and self.store is False:
            raise InvalidRequestError("A background response must be stored ('store' true): it is polled.",
                                      param="store", code="invalid_value")
        if self.conversation is not None:
            raise InvalidRequestError("Conversations are not supported here; continue a conversation with "
                                      "'previous_response_id'.", param="conversation",
                                      code="unsupported_parameter")
        if self.prompt is not None:
            raise InvalidRequestError("Stored prompt templates are not supported here; send the "
                                      "'instructions' and 'input' themselves.", param="prompt",
                                      code="unsupported_parameter")
        if self.truncation == "auto":
            raise InvalidRequestError("truncation 'auto' is not supported; the request fails with a 400 "
                                      "when the input is too long ('disabled').", param="truncation",
                                      code="unsupported_parameter")

    @property
    def function_tools(self) -> list[FunctionToolParam]:
        return [t for t in self.tools or () if isinstance(t, FunctionToolParam)]

    @property
    def format(self) -> FormatText | FormatJsonObject | FormatJsonSchema:
        return self.text.format if self.text is not None and self.text.format is not None else FormatText(
            type="text")

    @property
    def wants_logprobs(self) -> bool:
        """Logprobs are returned when ``include`` asks for them (``top_logprobs`` says how many
        alternatives each carries), as OpenAI does."""
        return "message.output_text.logprobs" in (self.include or ())


class ListInputItemsQuery(BaseModel):
    """A query string: every value arrives as text, so not strict."""

    model_config = ConfigDict(extra="ignore")

    limit: int = Field(default=20, ge=1, le=100)
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None

