"""Response pieces shared by the endpoints: ids, fingerprints, usage, log-probabilities.

Log-probabilities come from the engine as token ids; their text and bytes come from the model's
tokenizer (``token_text`` replaces an incomplete UTF-8 sequence with U+FFFD; ``bytes`` keeps the raw
bytes so clients can reassemble characters split across tokens, as OpenAI documents).
"""

from __future__ import annotations

import functools
import hashlib
import uuid
from typing import Any

from engine.protocol import TokenLogprob
from engine.tokenizer import Tokenizer
from engine.usage import Usage
from gateway.routing import ModelRoute


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def system_fingerprint(route: ModelRoute) -> str:
    """Changes when the served checkpoint's shape changes (OpenAI: "backend configuration")."""
    info = route.info()
    if info is None:
        return _fingerprint(route.name, route.path, 0, 0)
    return _fingerprint(route.name, route.path, info.max_model_len, info.vocab_size)


@functools.lru_cache(maxsize=256)
def _fingerprint(name: str, path: str | None, max_model_len: int, vocab_size: int) -> str:
    basis = f"{name}|{path}|{max_model_len}|{vocab_size}"
    return "fp_" + hashlib.sha256(basis.encode()).hexdigest()[:10]


def _cache_details(usage: Usage, lifetimes: bool) -> dict[str, int]:
    details = {"cached_tokens": usage.cached_tokens, "cache_write_tokens": usage.cache_write_tokens}
    if lifetimes:  # what the request's cache lifetimes held (``gateway.openai.caching``)
        details |= {"cache_pinned_tokens": usage.cache_pinned_tokens,
                    "cache_retained_tokens": usage.cache_retained_tokens}
    return details


def completion_usage(usage: Usage, lifetimes: bool = False) -> dict[str, Any]:
    """OpenAI's ``CompletionUsage`` (chat and text completions); ``lifetimes``: with the prompt tokens
    the request's cache lifetimes held."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"audio_tokens": 0, **_cache_details(usage, lifetimes)},
        "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                      "accepted_prediction_tokens": usage.accepted_prediction_tokens,
                                      "rejected_prediction_tokens": usage.rejected_prediction_tokens},
    }


def response_usage(usage: Usage, lifetimes: bool = False) -> dict[str, Any]:
    """OpenAI's ``ResponseUsage`` (the Responses API); ``lifetimes`` as for ``completion_usage``."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": _cache_details(usage, lifetimes),
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def chat_token_logprobs(tokenizer: Tokenizer, records: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's ``ChatCompletionTokenLogprob`` list."""
    out = []
    for r in records:
        out.append({
            "token": tokenizer.token_text(r.token_id),
            "logprob": r.logprob,
            "bytes": list(tokenizer.token_bytes(r.token_id)),
            "top_logprobs": [
                {"token": tokenizer.token_text(t.token_id), "logprob": t.logprob,
                 "bytes": list(tokenizer.token_bytes(t.token_id))}
                for t in r.top_logprobs
            ],
        })
    return out


def prompt_logprobs_by_id(tokenizer: Tokenizer, records: list[TokenLogprob | None]) -> list[Any]:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id: {logprob, rank,
    decoded_token}}`` holding the prompt token and the likeliest ones (ranked 1, 2, ...)."""
    out: list[Any] = []
    for record in records:
        if record is None:
            out.append(None)
            continue
        entry = {str(t.token_id): {"logprob": t.logprob, "rank": i + 1,
                                   "decoded_token": tokenizer.token_text(t.token_id)}
                 for i, t in enumerate(record.top_logprobs)}
        entry[str(record.token_id)] = {"logprob": record.logprob, "rank": record.rank,
                                       "decoded_token": tokenizer.token_text(record.token_id)}
        out.append(entry)
    return out


class CompletionLogprobs:
    """OpenAI's legacy ``logprobs`` object of one choice, built incrementally (``text_offset`` counts
    characters from the start of the choice's text)."""

    def __init__(self, tokenizer: Tokenizer, start_offset: int = 0) -> None:
        self._tokenizer = tokenizer
        self._offset = start_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add_prompt(self, prompt_ids: list[int], records: list[TokenLogprob | None]) -> dict[str, Any]:
        """The echoed prompt's tokens, before any generated one: each with its logprob after the tokens
        before it (the first has none: null, as OpenAI answers); returns the object for just them. Their
        offsets count from the start of the echo."""
        chunk = CompletionLogprobs(self._tokenizer)
        offset = 0
        for token_id, record in zip(prompt_ids, records, strict=True):
            text = self._tokenizer.token_text(token_id)
            top = None if record is None else {self._tokenizer.token_text(t.token_id): t.logprob
                                               for t in record.top_logprobs}
            for target in (self, chunk):
                target.tokens.append(text)
                target.token_logprobs.append(None if record is None else record.logprob)
                target.top_logprobs.append(top)
                target.text_offset.append(offset)
            offset += len(text)
        return chunk.as_openai()

    def add(self, records: list[TokenLogprob]) -> dict[str, Any]:
        """Append records; returns the object for just these records (a stream chunk's logprobs)."""
        chunk = CompletionLogprobs(self._tokenizer, self._offset)
        for r in records:
            text = self._tokenizer.token_text(r.token_id)
            for target in (self, chunk):
                target.tokens.append(text)
                target.token_logprobs.append(r.logprob)
                target.top_logprobs.append({self._tokenizer.token_text(t.token_id): t.logprob
                                            for t in r.top_logprobs})
                target.text_offset.append(self._offset)
            self._offset += len(text)
        return chunk.as_openai()

    def as_openai(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
