"""OpenAI's rate-limit response headers.

``x-ratelimit-{limit,remaining,reset}-{requests,tokens}``: the limit, what is left now, and how long
until the bucket is full again, in the duration format OpenAI sends (Go's ``time.Duration`` string,
millisecond precision: ``"20ms"``, ``"1s"``, ``"17.28s"``, ``"6m0s"``, ``"1h0m0s"``). A dimension
without a limit sends no headers. Rejections add ``retry-after`` (whole seconds, rounded up, at least 1)
and ``retry-after-ms`` (the official SDKs prefer it); ``x-should-retry: false`` tells them a retry will
not help soon.
"""

from __future__ import annotations


def format_duration_ms(ms: int) -> str:
    """``1500`` → ``"1.5s"``, ``360000`` → ``"6m0s"``, ``20`` → ``"20ms"``, ``0`` → ``"0s"``."""
    if ms <= 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    sec = f"{seconds}.{millis:03d}".rstrip("0") if millis else str(seconds)
    if hours:
        return f"{hours}h{minutes}m{sec}s"
    if minutes:
        return f"{minutes}m{sec}s"
    return f"{sec}s"


def rate_limit_headers(
    *,
    rpm_limit: int | None,
    requests_remaining: int,
    requests_reset_ms: int,
    tpm_limit: int | None,
    tokens_remaining: int,
    tokens_reset_ms: int,
) -> dict[str, str]:
    headers: dict[str, str] = {}
    if rpm_limit is not None:
        headers["x-ratelimit-limit-requests"] = str(rpm_limit)
        headers["x-ratelimit-remaining-requests"] = str(max(0, requests_remaining))
        headers["x-ratelimit-reset-requests"] = format_duration_ms(requests_reset_ms)
    if tpm_limit is not None:
        headers["x-ratelimit-limit-tokens"] = str(tpm_limit)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, tokens_remaining))
        headers["x-ratelimit-reset-tokens"] = format_duration_ms(tokens_reset_ms)
    return headers


def retry_headers(retry_after_ms: int | None, *, should_retry: bool) -> dict[str, str]:
    headers: dict[str, str] = {}
    if retry_after_ms is not None:
        retry_after_ms = max(1, retry_after_ms)
        headers["retry-after"] = str(max(1, -(-retry_after_ms // 1000)))
        headers["retry-after-ms"] = str(retry_after_ms)
    if not should_retry:
        headers["x-should-retry"] = "false"
    return headers
