"""``POST /v1/completions`` request body (OpenAI's legacy ``CreateCompletionRequest``).

``prompt`` is a string, an array of strings, an array of token ids, or an array of token-id arrays;
``prompts()`` normalises it to a list whose items are strings or token-id lists. Each prompt yields
``n`` choices, numbered ``prompt_index * n + i`` as OpenAI does.

``echo`` with ``logprobs`` scores the prompt too (what evaluation harnesses send): the prompt tokens come
first in the choice's ``logprobs``, the first with a null logprob. Refused with a 400 because the engine
cannot honour them: ``suffix`` (no fill-in-the-middle), ``best_of`` other than ``n`` (no server-side
ranking).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from gateway.errors import InvalidRequestError
from gateway.openai.caching import PromptCacheFields
from gateway.openai.schemas import SamplingFields


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields, PromptCacheFields):
    prompt: Prompt | None = None
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=0, le=20)
    # Not in OpenAI's legacy schema; accepted as on chat: a routing hint (same tenant + key → one replica),
    # and the cache lifetimes (a legacy prompt has no parts to put breakpoints on: ``explicit`` mode
    # caches nothing).
    prompt_cache_key: str | None = None
    # vLLM's extension: each choice also carries ``prompt_logprobs`` (per prompt token, the first null: its
    # id, logprob, rank and decoded text, with this many likeliest tokens).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list) or not value:
            raise ValueError("expected a string, an array of strings, or a non-empty array of token ids")
        if all(isinstance(v, str) for v in value):
            return value
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            if any(v < 0 for v in value):
                raise ValueError("token ids must be non-negative integers")
            return value
        if all(isinstance(v, list) for v in value):
            for item in value:
                if not item or not all(_is_token_id(t) for t in item):
                    raise ValueError("each token-id array must be a non-empty array of non-negative integers")
            return value
        raise ValueError("expected a string, an array of strings, an array of token ids, or an array of "
                         "token-id arrays")

    def check(self) -> None:
        if self.suffix:
            raise InvalidRequestError("Invalid 'suffix': suffix is not supported by this model.",
                                      param="suffix", code="unsupported_parameter")
        n = self.n or 1
        if self.best_of not in (None, 0, 1) and self.best_of != n:
            raise InvalidRequestError(
                "Invalid 'best_of': ranking several candidates server-side is not supported; "
                "set best_of equal to n or leave it out.", param="best_of", code="unsupported_parameter")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a token-id list (OpenAI's default prompt is an empty document)."""
        p = self.prompt
        if p is None or isinstance(p, str):
            return [p or ""]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
