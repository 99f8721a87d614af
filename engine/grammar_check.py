"""Whether a request's structured-output constraint can become an xgrammar grammar, checked when its
``SamplingParams`` is built (so a bad schema is the request's 400, not a failure in the engine loop).

Kept apart from ``engine.grammar`` (the engine's grammar backend, which works on sequences and
sampling parameters) so that ``engine.sampling_params`` can call it without an import cycle. The JSON
grammar options live here, once, for both.
"""

from __future__ import annotations

import json
from typing import Any

import xgrammar as xgr

# Compact JSON: no free whitespace between tokens.
SEPARATORS = (",", ":")


def check_json_schema(schema: dict[str, Any]) -> None:
    """Raise ValueError if the schema cannot be turned into a grammar."""
    try:
        xgr.Grammar.from_json_schema(
            json.dumps(schema), any_whitespace=False, separators=SEPARATORS, strict_mode=True
        )
    except Exception as exc:  # xgrammar raises RuntimeError/ValueError subclasses from C++
        raise ValueError(f"json_schema is not a supported JSON Schema: {exc}") from None


def check_regex(regex: str) -> None:
    """Raise ValueError if the regular expression cannot be turned into a grammar."""
    try:
        xgr.Grammar.from_regex(regex)
    except Exception as exc:
        raise ValueError(f"regex is not supported: {exc}") from None
