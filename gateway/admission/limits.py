"""What admission needs to know about a tenant, and what it hands back for an admitted request.

Invariants:
- ``None`` in a limit means "no limit" (the ``tenants`` columns use ``NULL`` the same way); ``0`` means
  "nothing is allowed" and is rejected without a retry hint.
- ``TenantLimits.status`` is ``active``, ``suspended`` (an admin suspended the tenant: 403
  ``account_deactivated``) or ``suspended_billing`` (suspended for an unpaid bill: 429
  ``insufficient_quota``, like OpenAI's answer to an account out of credit). ``from_tenant`` folds the
  ``tenants.status`` / ``suspended_reason`` pair into that one string.
- An ``Admission`` is settled at most once; ``AdmissionController.settle`` marks it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

STATUS_ACTIVE = "active"
STATUS_SUSPENDED = "suspended"
STATUS_SUSPENDED_BILLING = "suspended_billing"


@dataclass(frozen=True, slots=True)
class TenantLimits:
    tenant_id: int
    tier: str
    status: str
    rpm_limit: int | None
    tpm_limit: int | None
    max_concurrency: int | None
    monthly_budget_pico_usd: int | None
    batch_tpd_limit: int | None

    def __post_init__(self) -> None:
        for name in ("rpm_limit", "tpm_limit", "max_concurrency", "monthly_budget_pico_usd",
                     "batch_tpd_limit"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")

    @classmethod
    def from_tenant(cls, tenant: Any) -> TenantLimits:
        """From a ``tollgate.models.Tenant`` row (or anything with its attributes)."""
        status = tenant.status
        if status != STATUS_ACTIVE:
            status = STATUS_SUSPENDED_BILLING if tenant.suspended_reason == "billing" else STATUS_SUSPENDED
        return cls(
            tenant_id=tenant.id,
            tier=tenant.tier,
            status=status,
            rpm_limit=tenant.rpm_limit,
            tpm_limit=tenant.tpm_limit,
            max_concurrency=tenant.max_concurrency,
            monthly_budget_pico_usd=tenant.monthly_budget_pico_usd,
            batch_tpd_limit=tenant.batch_tpd_limit,
        )


@dataclass
class Admission:
    """An admitted request: its concurrency lease, its token reservation and the ``x-ratelimit-*``
    headers to send with the response. ``tpm_limit`` is the limit the reservation was taken against
    (settle refunds into the same bucket)."""

    request_id: str
    tenant_id: int
    lease_id: str
    reserved_tokens: int
    headers: dict[str, str]
    tpm_limit: int | None = None
    # The UTC month ("2026-11") the request was admitted in: its cost is charged to that month's spend
    # counter however late it settles, as the ledger counts it in the month it arrived.
    month: str | None = None
    settled: bool = field(default=False, compare=False)


def reservation_tokens(prompt_tokens: int, max_tokens: int | None, default_max_tokens: int,
                       n: int = 1) -> int:
    """Tokens to reserve in the TPM bucket: the prompt plus the most the request may generate
    (``n`` completions of ``max_tokens``, or of the configured default when the client sent none)."""
    if prompt_tokens < 0 or n < 1:
        raise ValueError("prompt_tokens must be >= 0 and n >= 1")
    per_completion = max_tokens if max_tokens is not None else default_max_tokens
    return prompt_tokens + n * per_completion
