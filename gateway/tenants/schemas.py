"""Pydantic schemas of tenants and API keys (admin API, CLI, services).

Invariants: limits are non-negative integers or ``None`` (no limit); money is integer pico-USD
(``pico_usd_from_usd`` converts an exact decimal dollar amount and refuses sub-pico fractions); key
expiry times are timezone-aware. The secret key appears only in ``ApiKeyCreated``, returned once.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from tollgate.models import BIGINT_MAX, INTEGER_MAX

PICO_PER_USD = 10**12
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._@-]{0,127}$"


def _not_an_id(name: str) -> str:
    """Commands and routes take a tenant's name or its id: a name of digits alone would be read as an id."""
    if name.isdigit():
        raise ValueError("a tenant name must not be digits alone (it would be read as a tenant id)")
    return name


TenantName = Annotated[str, Field(pattern=TENANT_NAME_PATTERN), AfterValidator(_not_an_id)]

Limit = int | None


def pico_usd_from_usd(amount: str | int | Decimal) -> int:
    """Exact pico-USD of a dollar amount such as ``"250"`` or ``"12.50"``; ``ValueError`` if invalid."""
    try:
        value = Decimal(str(amount).strip())
    except InvalidOperation:
        raise ValueError(f"not a dollar amount: {amount!r}") from None
    if not value.is_finite() or value < 0:
        raise ValueError(f"a dollar amount must be finite and non-negative, got {amount!r}")
    pico = value * PICO_PER_USD
    if pico != pico.to_integral_value():
        raise ValueError(f"{amount!r} USD has a fraction smaller than a pico-dollar")
    return int(pico)


class _Limits(BaseModel):
    tpm_limit: Limit = Field(default=None, ge=0, le=BIGINT_MAX)
    rpm_limit: Limit = Field(default=None, ge=0, le=BIGINT_MAX)
    max_concurrency: Limit = Field(default=None, ge=0, le=INTEGER_MAX)
    batch_tpd_limit: Limit = Field(default=None, ge=0, le=BIGINT_MAX)
    monthly_budget_pico_usd: Limit = Field(default=None, ge=0, le=BIGINT_MAX)


class TenantCreate(_Limits):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    name: TenantName
    tier: str = "default"
    stripe_customer_id: str | None = Field(default=None, min_length=1, max_length=255)


class TenantUpdate(BaseModel):
    """Fields to change: only those given (``model_fields_set``) apply, so ``None`` clears a limit."""

    model_config = ConfigDict(extra="forbid")

    tier: str | None = None
    tpm_limit: Limit = Field(default=None, ge=0)
    rpm_limit: Limit = Field(default=None, ge=0)
    max_concurrency: Limit = Field(default=None, ge=0)
    batch_tpd_limit: Limit = Field(default=None, ge=0)
    monthly_budget_pico_usd: Limit = Field(default=None, ge=0)
    stripe_customer_id: str | None = Field(default=None, min_length=1, max_length=255)


class TenantRead(_Limits):
    model_config = ConfigDict(from_attributes=True)

    id: int
    name: str
    tier: str
    status: Literal["active", "suspended"]
    suspended_reason: Literal["admin", "billing"] | None
    stripe_customer_id: str | None
    created_at: datetime


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    name: str = Field(default="", max_length=128)
    scopes: list[str] | None = None
    allowed_models: list[str] | None = None
    expires_at: datetime | None = None

    @field_validator("expires_at")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("expires_at must include a timezone (e.g. 2030-01-01T00:00:00Z)")
        return value


class ApiKeyRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    tenant_id: int
    name: str
    prefix: str
    scopes: list[str] | None
    allowed_models: list[str] | None
    expires_at: datetime | None
    revoked_at: datetime | None
    last_used_at: datetime | None
    created_at: datetime


class ApiKeyCreated(ApiKeyRead):
    key: str
