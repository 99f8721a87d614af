"""Whether a request's structured-output constraint can become an xgrammar grammar, checked when its
``SamplingParams`` is built (so a bad schema is the request's 400, not a failure in the engine loop).

Kept apart from ``engine.grammar`` (the engine's grammar backend, which works on sequences and
sampling parameters) so that ``engine.sampling_params`` can call it without an import cycle. The JSON
grammar options live here, once, for both.
"""

from __future__ import annotations

import json
import re
from typing import Any

import xgrammar as xgr

# Compact JSON: no free whitespace between tokens.
SEPARATORS = (",", ":")


# xgrammar's C++ errors start with its log prefix: "[13:44:23] /project/cpp/json_schema_converter.cc:4944: ".
_LOG_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+:\d+: ")


def compiler_message(exc: BaseException) -> str:
    """What the grammar compiler objected to, without its log prefix (a time and a C++ source path)."""
    return _LOG_PREFIX.sub("", str(exc).strip())


def check_json_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError if the schema cannot be turned into a grammar."""
    try:
        xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses from C++
        raise ValueError(f"json_schema is not a supported JSON Schema: {compiler_message(exc)}") from None


def check_regex(regex: str) -> None:
    """Raise ValueError if the regular expression cannot be turned into a grammar."""
    try:
        xgr.Grammar.from_regex(regex)
    except Exception as exc:
        raise ValueError(f"regex is not supported: {compiler_message(exc)}") from None
