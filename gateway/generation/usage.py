"""The tokens a generation used, as the engine reported them (summed over its prompts)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens the engines newly wrote to their prefix caches (OpenAI's ``cache_write_tokens``).
    cache_write_tokens: int = 0
    # Prompt tokens the request's cache lifetimes held (``prompt_cache_options.ttl``: pinned in host
    # memory; ``prompt_cache_retention`` 24h: kept on disk), within the tenant's quotas.
    cache_pinned_tokens: int = 0
    cache_retained_tokens: int = 0
    # Of ``cached_tokens``, those the engines loaded from host memory and read from disk (the rest were in
    # the device pool): where a tenant's cache hits come from.
    cached_host_tokens: int = 0
    cached_disk_tokens: int = 0
    # Predicted Outputs: drafted prediction tokens that made it into the output, and those thrown away
    # (which ``completion_tokens`` includes: they are billed as output, as OpenAI bills them).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
