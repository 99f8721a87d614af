"""Cache lifetimes as OpenAI's API sells them, turned into the engine's ``CacheSpec`` the same way for
chat, completions, responses and batch lines (``engine.kv.pins`` says what the engine does with it).

- ``prompt_cache_options.ttl`` (``30m``, the default when the object is sent): the request's cacheable
  prompt blocks stay in the replica's host tier for at least that long, within the tenant's quota of
  pinned blocks. Without ``prompt_cache_options`` nothing is pinned: a pin is a product, not a default.
- ``prompt_cache_options.mode``: ``implicit`` (default) caches the whole prompt, as without the object;
  ``explicit`` caches only up to the last ``prompt_cache_breakpoint`` of the prompt's text parts, and
  nothing when there is none. Breakpoints are positions in the prompt's tokens, rounded down to whole
  KV blocks by the engine (OpenAI does not round; a paged cache cannot do otherwise).
- ``prompt_cache_retention``: ``24h`` keeps the blocks on the replica's disk tier for a day (within the
  tenant's retention quota); ``in_memory`` keeps them off disk entirely. Absent: the cache's defaults.

A breakpoint travels from the request's text parts to the generation as
``gateway.generation.requests.BREAKPOINT_KEY`` on a chat-template message (``breakpoint_offset``: how many
characters of the message's content end at its last marked part); ``breakpoint_tokens`` there turns it
into prompt tokens.

The answer says what was applied: the Responses object repeats ``prompt_cache_options`` (ttl and mode)
and ``prompt_cache_retention``; usage details of every endpoint add ``cache_pinned_tokens`` and
``cache_retained_tokens`` (prompt tokens actually held; fewer than asked when a quota was reached) when a
ttl or a retention was asked for.
"""

from __future__ import annotations

from typing import Any, Literal

from engine.protocol import CacheSpec
from gateway.openai.schemas import RequestModel

TTL_SECONDS = {"30m": 30 * 60}
RETENTION_SECONDS = 24 * 60 * 60


class PromptCacheOptions(RequestModel):
    ttl: Literal["30m"] | None = None
    mode: Literal["implicit", "explicit"] | None = None


class PromptCacheBreakpoint(RequestModel):
    mode: Literal["explicit"] = "explicit"


class PromptCacheFields(RequestModel):
    """The request fields of cache lifetimes (chat, completions and responses bodies)."""

    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None

    @property
    def explicit_cache(self) -> bool:
        return self.prompt_cache_options is not None and self.prompt_cache_options.mode == "explicit"

    def cache_spec(self, breakpoint: int | None = None) -> CacheSpec | None:
        """The engine's lifetimes of this request (``breakpoint``: the prompt tokens before its last
        breakpoint, for explicit mode); None when it asks for none."""
        options, retention = self.prompt_cache_options, self.prompt_cache_retention
        if options is None and retention is None:
            return None
        return CacheSpec(
            prefix_tokens=(breakpoint or 0) if self.explicit_cache else None,
            ttl_s=TTL_SECONDS[options.ttl or "30m"] if options is not None else 0.0,
            retention_s=RETENTION_SECONDS if retention == "24h" else 0.0,
            persist=retention != "in_memory",
        )

    def applied_options(self) -> dict[str, Any] | None:
        """The Responses object's ``prompt_cache_options`` (None when the request sent none)."""
        options = self.prompt_cache_options
        if options is None:
            return None
        return {"ttl": options.ttl or "30m", "mode": options.mode or "implicit"}


def breakpoint_offset(texts: list[tuple[str, bool]]) -> int | None:
    """Characters of a message's content (its parts' texts, joined) up to the end of its last part
    marked with a breakpoint; None when none is."""
    offset, found = 0, None
    for text, marked in texts:
        offset += len(text)
        if marked:
            found = offset
    return found
