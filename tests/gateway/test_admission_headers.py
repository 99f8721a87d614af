"""OpenAI's rate-limit header formats (pure functions)."""

from __future__ import annotations

import pytest

from gateway.admission.headers import format_duration_ms, rate_limit_headers, retry_headers
from gateway.admission.limits import TenantLimits, reservation_tokens


@pytest.mark.parametrize(("ms", "text"), [
    (0, "0s"), (20, "20ms"), (999, "999ms"), (1000, "1s"), (1500, "1.5s"), (17_280, "17.28s"),
    (60_000, "1m0s"), (360_000, "6m0s"), (61_001, "1m1.001s"), (3_600_000, "1h0m0s"), (3_723_000, "1h2m3s"),
])
def test_durations_use_openais_format(ms: int, text: str) -> None:
    assert format_duration_ms(ms) == text


def test_headers_only_for_limited_dimensions_and_never_negative() -> None:
    headers = rate_limit_headers(rpm_limit=None, requests_remaining=0, requests_reset_ms=0,
                                 tpm_limit=1000, tokens_remaining=-50, tokens_reset_ms=1500)
    assert headers == {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "0",
                       "x-ratelimit-reset-tokens": "1.5s"}


def test_retry_after_rounds_up_to_whole_seconds() -> None:
    assert retry_headers(1001, should_retry=True) == {"retry-after": "2", "retry-after-ms": "1001"}
    assert retry_headers(0, should_retry=True) == {"retry-after": "1", "retry-after-ms": "1"}
    assert retry_headers(None, should_retry=False) == {"x-should-retry": "false"}


def test_reservation_is_prompt_plus_max_tokens_or_the_default() -> None:
    assert reservation_tokens(100, 50, 1024) == 150
    assert reservation_tokens(100, None, 1024) == 1124
    assert reservation_tokens(100, 50, 1024, n=3) == 250


class _Tenant:
    id, tier, rpm_limit, tpm_limit, max_concurrency = 7, "flex", 10, None, 2
    batch_tpd_limit, monthly_budget_pico_usd = None, 5

    def __init__(self, status: str, reason: str | None) -> None:
        self.status, self.suspended_reason = status, reason


def test_tenant_status_folds_the_suspension_reason() -> None:
    assert TenantLimits.from_tenant(_Tenant("active", None)).status == "active"
    assert TenantLimits.from_tenant(_Tenant("suspended", "admin")).status == "suspended"
    assert TenantLimits.from_tenant(_Tenant("suspended", "billing")).status == "suspended_billing"
    with pytest.raises(ValueError):
        TenantLimits(1, "default", "active", -1, None, None, None, None)
