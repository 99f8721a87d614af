"""Request pieces shared by ``/v1/chat/completions`` and ``/v1/completions`` (OpenAI's fields and ranges).

Invariants:
- Request models ignore unknown fields (forward compatibility with newer SDKs) but validate every
  field they know with OpenAI's types (strictly: no string taken for a number) and ranges; a violation
  is a pydantic error that ``gateway.errors`` turns into a 400 naming the parameter.
- Parameters the platform cannot honour are refused with a clear 400 (``unsupported_parameter``),
  never silently ignored when ignoring them would change the answer (``logit_bias``, ``suffix``,
  ``audio``, image input, ``best_of > n``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# OpenAI's ``service_tier`` values. Tiers the platform does not define (``scale``, ``fast``) mean "auto".
ServiceTierName = Literal["auto", "default", "flex", "scale", "priority", "fast"]

MAX_STOP_SEQUENCES = 4
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class RequestModel(BaseModel):
    """Base of every public request body: unknown fields are ignored, known ones validated, with their
    JSON types as OpenAI checks them (``strict``): ``"max_tokens": "2"`` or ``"stream": "yes"`` is a 400
    ``invalid_type``, not converted (an integer is still a number)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True, strict=True)


# JSON schemas of the request bodies, for the app's OpenAPI document (``gateway.api`` merges them into
# ``components.schemas``); the endpoints validate bodies themselves, straight from bytes.
OPENAPI_SCHEMAS: dict[str, Any] = {}


def openapi_request_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` for an endpoint whose JSON body is ``model``."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    OPENAPI_SCHEMAS.update(schema.pop("$defs", {}))
    OPENAPI_SCHEMAS[model.__name__] = schema
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


METADATA_MAX_KEYS = 16
METADATA_MAX_KEY_CHARS = 64
METADATA_MAX_VALUE_CHARS = 512


def check_metadata(value: dict[str, str] | None) -> dict[str, str] | None:
    """OpenAI's ``metadata`` (batches, responses): at most 16 keys of 64 characters, values of 512."""
    if value is None:
        return None
    if len(value) > METADATA_MAX_KEYS:
        raise ValueError(f"at most {METADATA_MAX_KEYS} keys are allowed")
    for key, item in value.items():
        if len(key) > METADATA_MAX_KEY_CHARS:
            raise ValueError(f"keys must be at most {METADATA_MAX_KEY_CHARS} characters")
        if len(item) > METADATA_MAX_VALUE_CHARS:
            raise ValueError(f"values must be at most {METADATA_MAX_VALUE_CHARS} characters")
    return value


def strict_schema_problem(schema: dict[str, Any] | None) -> str | None:
    """What makes ``schema`` unfit for strict mode (``strict: true`` on a JSON schema or a function), by
    OpenAI's rules for Structured Outputs: the root is an object, and every object lists each of its
    properties in ``required`` and sets ``additionalProperties`` to false. None when it is fit."""
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return "the root of a strict schema must be an object ('type': 'object')"
    pending: list[tuple[tuple[str, ...], Any]] = [((), schema)]
    while pending:
        context, node = pending.pop()
        if isinstance(node, list):
            pending += [((*context, str(i)), item) for i, item in enumerate(node)]
            continue
        if not isinstance(node, dict):
            continue
        properties = node.get("properties")
        if node.get("type") == "object" or isinstance(properties, dict):
            where = f"In context={context!r}, "
            if node.get("additionalProperties") is not False:
                return where + "'additionalProperties' is required to be supplied and to be false"
            missing = [key for key in properties or {} if key not in (node.get("required") or [])]
            if missing:
                return (where + "'required' is required to be supplied and to be an array including every "
                        f"key in properties. Missing {missing[0]!r}")
        for key in ("properties", "$defs", "definitions"):
            if isinstance(node.get(key), dict):
                pending += [((*context, key, name), sub) for name, sub in node[key].items()]
        for key in ("items", "anyOf", "prefixItems"):
            if key in node:
                pending.append(((*context, key), node[key]))
    return None


def check_strict(strict: bool | None, schema: dict[str, Any] | None, what: str) -> None:
    """A ValueError (a 400 naming the field) when ``strict`` is true and ``schema`` is unfit for it."""
    if strict:
        problem = strict_schema_problem(schema)
        if problem is not None:
            raise ValueError(f"Invalid schema for {what}: {problem}")


class StreamOptions(RequestModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class ResponseFormatText(RequestModel):
    type: Literal["text"]


class ResponseFormatJsonObject(RequestModel):
    type: Literal["json_object"]


class JsonSchemaSpec(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    # ``schema`` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _strict(self) -> JsonSchemaSpec:
        check_strict(self.strict, self.json_schema, f"response_format '{self.name}'")
        return self


class ResponseFormatJsonSchema(RequestModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema, Field(discriminator="type")
]


Stop = str | list[str] | None


def normalize_stop(value: Any) -> list[str]:
    """``stop`` as a list of at most four non-empty strings (``None`` → ``[]``)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError("expected a string or an array of up to 4 strings")
    if len(value) > MAX_STOP_SEQUENCES:
        raise ValueError(f"expected an array with maximum length {MAX_STOP_SEQUENCES}, got {len(value)}")
    return [s for s in value if s]


def unsupported(message: str) -> PydanticCustomError:
    """A validator's refusal of what this platform does not do: a 400 with code ``unsupported_parameter``
    naming the field (``gateway.errors``), where a plain ValueError says ``invalid_value``."""
    return PydanticCustomError("unsupported_parameter", message.replace("{", "{{").replace("}", "}}"))


def check_logit_bias(value: dict[str, int] | None) -> dict[str, int] | None:
    """Validate OpenAI's shape (token-id keys, biases in [-100, 100]); a non-empty map is refused
    because the engine's sampler has no per-token bias."""
    if not value:
        return value
    for key, bias in value.items():
        if not key.lstrip("-").isdigit():
            raise ValueError(f"keys must be token ids, got {key!r}")
        if not -100 <= bias <= 100:
            raise ValueError(f"bias for token {key} must be between -100 and 100, got {bias}")
    raise unsupported("logit_bias is not supported by this platform; remove it or send an empty object")


class SamplingFields(RequestModel):
    """Fields with the same meaning and range in both endpoints."""

    model: str = Field(min_length=1)
    n: int | None = Field(default=None, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: Stop = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, int] | None = None
    user: str | None = None
    service_tier: ServiceTierName | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        normalize_stop(value)
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, int] | None) -> dict[str, int] | None:
        return check_logit_bias(value)

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: Any) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        return value

    @property
    def stop_list(self) -> list[str]:
        return normalize_stop(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)
