"""``POST /v1/embeddings`` request body (OpenAI's ``CreateEmbeddingRequest``).

``input`` is a string, a list of strings, a list of token ids, or a list of lists of token ids; at most
``MAX_INPUTS`` inputs, none empty. ``encoding_format`` ``float`` (lists of numbers) or ``base64``
(little-endian float32 bytes, as OpenAI sends them). ``dimensions`` shortens each vector (its first
``dimensions`` values, re-normalised), up to the model's length.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gateway.openai.schemas import RequestModel

MAX_INPUTS = 2048


class CreateEmbeddingRequest(RequestModel):
    model: str = Field(min_length=1)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: str | list[str] | list[int] | list[list[int]]) -> str | list:
        if isinstance(value, str):
            if not value:
                raise ValueError("input must not be an empty string")
            return value
        if not value:
            raise ValueError("input must have at least one item")
        if all(isinstance(v, int) for v in value):
            return value
        if len(value) > MAX_INPUTS:
            raise ValueError(f"input has at most {MAX_INPUTS} items")
        for i, item in enumerate(value):
            if not item:
                raise ValueError(f"input[{i}] must not be empty")
        return value

    def check(self) -> None:
        """Rules across fields, as every request body has (batch lines call it): none here; the model's
        own limits (``dimensions``, vocabulary, context) are checked against its replicas."""

    def inputs(self) -> list[str | list[int]]:
        """Each input: a string or one list of token ids."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(v, int) for v in value):
            return [list(value)]  # type: ignore[arg-type]
        return list(value)  # type: ignore[arg-type]
