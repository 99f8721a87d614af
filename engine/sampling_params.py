"""Sampling parameters of one request, with vLLM-compatible names and OpenAI's value ranges.

Torch-free: the gateway and the offline API build these. ``__post_init__`` validates every field and
raises ``ValueError`` naming the parameter, so a bad request becomes a 400, never a 500.

Conventions:

- ``temperature == 0`` means greedy decoding (argmax); ``top_p``/``top_k``/``seed`` are then ignored.
- ``top_k`` of ``-1`` or ``0`` disables top-k (vLLM uses -1, some clients send 0); otherwise >= 1.
  ``min_p`` (vLLM's, 0..1, 0 = off) drops the tokens less likely than ``min_p`` times the most likely.
- ``presence_penalty``/``frequency_penalty`` (OpenAI, -2..2) apply to the tokens generated so far;
  ``repetition_penalty`` (vLLM/HF, > 0, 1 = off) applies to prompt and generated tokens.
- ``logprobs``: ``None`` = none; ``k`` in 0..20 = the sampled token's logprob plus the ``k`` most likely
  alternatives (OpenAI's ``top_logprobs``), from the model's raw distribution (before penalties,
  temperature, top-k/top-p and grammar masks), as OpenAI and vLLM report them.
- ``prompt_logprobs`` (vLLM's): ``None`` = none; ``k`` in 0..20 = every prompt token's logprob after the
  tokens before it (the first has none) plus the ``k`` most likely tokens at that position, from the raw
  distribution. Such a request computes its whole prompt (no prefix-cache hits: a cached position has no
  logits), chunk by chunk.
- ``seed``: the same seed, prompt and parameters give the same tokens whatever else runs in the batch.
- Structured output: ``json_object`` (any JSON object) or ``json_schema`` (a JSON Schema dict; the
  gateway also uses it to force a tool call's arguments) or ``regex``; at most one of them. A schema is
  checked by compiling it with the grammar library (imported lazily, only when a schema is given).
- ``stop`` strings are matched on the detokenized text by the engine loop; ``stop_token_ids`` end the
  sequence like EOS (which ``ignore_eos`` disables; explicit ``stop_token_ids`` still apply).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_STOP_SEQUENCES = 16


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    # Drop tokens whose probability is below min_p times the most likely one's (0: off).
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int = 16
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    json_schema: dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.n = _int("n", self.n, 1, MAX_N)
        self.temperature = _float("temperature", self.temperature, 0.0, 2.0)
        self.top_p = _float("top_p", self.top_p, 0.0, 1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, -1, None)
        if self.top_k == 0:
            self.top_k = -1
        self.min_p = _float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            self.seed = _int("seed", self.seed, -(2**63), 2**63 - 1)
        self.presence_penalty = _float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty, 0.0, 2.0)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        self.max_tokens = _int("max_tokens", self.max_tokens, 1, None)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, 0, MAX_TOP_LOGPROBS)
        self.stop = _stop_strings(self.stop)
        if not isinstance(self.stop_token_ids, list | tuple):
            raise ValueError("stop_token_ids must be a list of token ids")
        self.stop_token_ids = [_int("stop_token_ids[]", t, 0, 2**31 - 1) for t in self.stop_token_ids]
        for name in ("ignore_eos", "json_object", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        self._check_structured()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def structured(self) -> bool:
        return self.json_schema is not None or self.json_object or self.regex is not None

    def _check_structured(self) -> None:
        given = [
            name
            for name, on in (
                ("json_schema", self.json_schema is not None),
                ("json_object", self.json_object),
                ("regex", self.regex is not None),
            )
            if on
        ]
        if len(given) > 1:
            raise ValueError(f"at most one of json_schema, json_object and regex may be set, got {given}")
        if self.regex is not None:
            if not isinstance(self.regex, str) or not self.regex:
                raise ValueError("regex must be a non-empty string")
            from engine.grammar_check import check_regex

            check_regex(self.regex)
        if self.json_schema is not None:
            if not isinstance(self.json_schema, dict):
                raise ValueError(f"json_schema must be a JSON object, got {type(self.json_schema).__name__}")
            try:
                json.dumps(self.json_schema, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"json_schema is not serializable as JSON: {exc}") from None
            from engine.grammar_check import check_json_schema

            check_json_schema(self.json_schema)


_GREEDY_EPS = 1e-5


def _int(name: str, value: Any, lo: int | None, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def _float(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo:g}, {hi:g}], got {value}")
    return value


def _stop_strings(stop: Any) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
        raise ValueError("stop must be a string or a list of strings")
    if len(stop) > MAX_STOP_SEQUENCES:
        raise ValueError(f"stop accepts at most {MAX_STOP_SEQUENCES} sequences, got {len(stop)}")
    if any(not s for s in stop):
        raise ValueError("stop sequences must be non-empty strings")
    return list(stop)
