"""Pydantic schemas of the admin API (``/admin/v1``): requests are strict (unknown fields → 400),
responses are what the dashboard renders.

Invariants:
- Money crosses the API in USD and is stored in whole pico-USD. USD amounts are decimal strings
  (``"12.50"``), integers, or JSON numbers with at most 15 significant digits (a JSON number is read as
  a binary float; 15 digits always survive that round trip, more may not, so those must be strings).
  A fraction smaller than one pico-USD is refused, never rounded. Responses carry the integer pico-USD
  and an exact USD decimal string.
- Prices are given in USD per million tokens (``"3"`` = 3,000,000 pico-USD per token), converted
  exactly by ``billing.prices.usd_per_mtok_to_pico``.
- Limits fit their columns (BIGINT, INTEGER for ``max_concurrency``) and are never negative; ``null``
  means "no limit". In a PATCH only the fields present apply, so ``null`` clears a limit.
- Datetimes in requests must carry a timezone (query strings without one are read as UTC).
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, field_validator

from billing.prices import PRICE_FIELDS, pico_to_usd_per_mtok, usd_per_mtok_to_pico
from engine.usage import KINDS
from gateway.tenants.schemas import (
    PICO_PER_USD,
    ApiKeyCreate,
    ApiKeyRead,
    TenantCreate,
    TenantName,
    TenantRead,
    TenantUpdate,
    pico_usd_from_usd,
)
from tollgate.models import BIGINT_MAX, INTEGER_MAX

FLOAT_EXACT_DIGITS = 15


def usd_string(pico: int | Decimal) -> str:
    """Exact USD of a pico-USD amount as a plain decimal string (``1_500_000_000_000`` → ``"1.5"``)."""
    value = (Decimal(pico) / PICO_PER_USD).normalize()
    return format(value, "f")


def _exact_decimal(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a decimal amount, got a boolean")
    if isinstance(value, float):
        digits = Decimal(repr(value)).normalize().as_tuple().digits
        if len(digits) > FLOAT_EXACT_DIGITS:
            raise ValueError(f"send amounts with more than {FLOAT_EXACT_DIGITS} significant digits as a "
                             'string (e.g. "1234.567890123456")')
        return repr(value)
    return value


def _usd_to_pico(value: Any) -> int | None:
    if value is None:
        return None
    pico = pico_usd_from_usd(_exact_decimal(value))
    if pico > BIGINT_MAX:
        raise ValueError(f"at most {usd_string(BIGINT_MAX)} USD")
    return pico


def _usd_per_mtok_to_pico(value: Any) -> int | None:
    if value is None:
        return None
    pico = usd_per_mtok_to_pico(_exact_decimal(value))
    if pico > BIGINT_MAX:
        raise ValueError("price too large")
    return pico


UsdAmount = Annotated[int | None, BeforeValidator(_usd_to_pico)]
UsdPerMtok = Annotated[int | None, BeforeValidator(_usd_per_mtok_to_pico)]
RequiredUsdPerMtok = Annotated[int, BeforeValidator(_usd_per_mtok_to_pico)]


def _not_a_boolean(value: Any) -> Any:
    """``true`` is not a limit of 1 (which would all but block the tenant). Digits in a string are still
    a number: the dashboard's forms send them so."""
    if isinstance(value, bool):
        raise ValueError("a limit is a whole number or null, not a boolean")
    return value


BigLimit = Annotated[Annotated[int, Field(ge=0, le=BIGINT_MAX)] | None, BeforeValidator(_not_a_boolean)]
IntLimit = Annotated[Annotated[int, Field(ge=0, le=INTEGER_MAX)] | None, BeforeValidator(_not_a_boolean)]


# ------------------------------------------------------------------------------------------ tenants


class TenantCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    name: TenantName
    tier: str = "default"
    tpm_limit: BigLimit = None
    rpm_limit: BigLimit = None
    max_concurrency: IntLimit = None
    batch_tpd_limit: BigLimit = None
    monthly_budget_usd: UsdAmount = None
    stripe_customer_id: str | None = Field(default=None, min_length=1, max_length=255)

    def to_tenant_create(self) -> TenantCreate:
        fields = self.model_dump(exclude={"monthly_budget_usd"})
        return TenantCreate(**fields, monthly_budget_pico_usd=self.monthly_budget_usd)


class TenantUpdateRequest(BaseModel):
    """Only the fields present change; ``null`` clears a limit (tier cannot be cleared)."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    tier: str | None = None
    tpm_limit: BigLimit = None
    rpm_limit: BigLimit = None
    max_concurrency: IntLimit = None
    batch_tpd_limit: BigLimit = None
    monthly_budget_usd: UsdAmount = None
    stripe_customer_id: str | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("tier")
    @classmethod
    def _tier_not_null(cls, value: str | None) -> str | None:
        if value is None:
            raise ValueError("tier cannot be cleared")
        return value

    def to_tenant_update(self) -> TenantUpdate:
        given = self.model_dump(include=self.model_fields_set)
        if "monthly_budget_usd" in given:
            given["monthly_budget_pico_usd"] = given.pop("monthly_budget_usd")
        return TenantUpdate(**given)


class SuspendRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    note: str | None = Field(default=None, max_length=1000)


class ReactivateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    force: bool = False
    note: str | None = Field(default=None, max_length=1000)


class PurgeCacheRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    note: str | None = Field(default=None, max_length=1000, description="Why (kept in the audit log).")


class ReplicaPurgeOut(BaseModel):
    url: str
    purged_blocks: int | None = Field(description="Blocks dropped from every tier; null if not purged.")
    error: str | None = Field(description="Why the replica was not purged (retry the purge); else null.")


class CachePurgeReport(BaseModel):
    tenant_id: int
    replicas: list[ReplicaPurgeOut]
    purged_blocks: int = Field(description="Blocks dropped over all replicas.")

    @classmethod
    def of(cls, purge: Any) -> CachePurgeReport:
        replicas = [ReplicaPurgeOut(url=r.url, purged_blocks=r.purged_blocks, error=r.error)
                    for r in purge.replicas]
        return cls(tenant_id=purge.tenant_id, replicas=replicas, purged_blocks=purge.purged_blocks)


class AdminTenant(TenantRead):
    monthly_budget_usd: str | None

    @classmethod
    def of(cls, tenant: Any) -> AdminTenant:
        read = TenantRead.model_validate(tenant)
        budget = read.monthly_budget_pico_usd
        return cls(**read.model_dump(), monthly_budget_usd=None if budget is None else usd_string(budget))


class TenantList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdminTenant]
    total: int
    limit: int
    offset: int
    has_more: bool


# ------------------------------------------------------------------------------------------ keys

KeyCreateRequest = ApiKeyCreate


class AdminApiKey(ApiKeyRead):
    display_prefix: str


class AdminApiKeyCreated(AdminApiKey):
    key: str = Field(description="The secret key. It is shown only in this response.")


class ApiKeyList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AdminApiKey]


# ------------------------------------------------------------------------------------------ prices


class PriceCreateRequest(BaseModel):
    """A price row from ``effective_from`` (now when omitted; never in the past) in USD per 1M tokens.
    Omitted optional prices take the defaults: cached input 10% of input, embedding input (what
    ``/v1/embeddings`` charges per prompt token) the input price, the prompt-cache products (charged
    on top of the input prices per prompt token written to the cache, pinned for
    ``prompt_cache_options.ttl``, retained for ``prompt_cache_retention``) 0, batch half. One optional
    field per ``billing.prices.OPTIONAL_PRICE_FIELDS`` name."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True)

    model: str = Field(min_length=1, max_length=128)
    effective_from: datetime | None = None
    input_usd_per_mtok: RequiredUsdPerMtok
    output_usd_per_mtok: RequiredUsdPerMtok
    cached_input_usd_per_mtok: UsdPerMtok = None
    batch_input_usd_per_mtok: UsdPerMtok = None
    batch_cached_input_usd_per_mtok: UsdPerMtok = None
    batch_output_usd_per_mtok: UsdPerMtok = None
    embedding_input_usd_per_mtok: UsdPerMtok = None
    batch_embedding_input_usd_per_mtok: UsdPerMtok = None
    cache_write_usd_per_mtok: UsdPerMtok = None
    cache_pin_usd_per_mtok: UsdPerMtok = None
    cache_retention_usd_per_mtok: UsdPerMtok = None
    batch_cache_write_usd_per_mtok: UsdPerMtok = None
    batch_cache_pin_usd_per_mtok: UsdPerMtok = None
    batch_cache_retention_usd_per_mtok: UsdPerMtok = None

    @field_validator("effective_from")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("effective_from must include a timezone (e.g. 2030-01-01T00:00:00Z)")
        return value


class PriceRowOut(BaseModel):
    model: str
    effective_from: datetime
    effective_until: datetime | None = Field(description="When the next row of this model takes over.")
    in_effect: bool
    pico_usd_per_token: dict[str, int]
    usd_per_mtok: dict[str, str]

    @classmethod
    def of(cls, model: str, start: datetime, until: datetime | None, in_effect: bool,
           price: Any) -> PriceRowOut:
        pico = {name: getattr(price, name) for name in PRICE_FIELDS}
        usd = {name: format(pico_to_usd_per_mtok(value), "f") for name, value in pico.items()}
        return cls(model=model, effective_from=start, effective_until=until, in_effect=in_effect,
                   pico_usd_per_token=pico, usd_per_mtok=usd)


class PriceList(BaseModel):
    object: Literal["list"] = "list"
    data: list[PriceRowOut]


# ------------------------------------------------------------------------------------------ usage

UsageGranularity = Literal["hour", "day"]


# Every token kind's count, by its field name (``engine.usage.KINDS``).
UsageCounts = create_model("UsageCounts", **{  # type: ignore[call-overload]
    spec.field: (int, Field(description=spec.about)) for spec in KINDS.values()})


class UsageTotals(UsageCounts):  # type: ignore[misc,valid-type]  # a model generated from the token kinds
    requests: int
    cost_pico_usd: str = Field(description="Exact integer pico-USD, as a string (sums can exceed 2^53).")
    cost_usd: str


class UsageRow(UsageTotals):
    bucket_start: datetime | None = None
    model: str | None = None
    request_class: str | None = None
    tenant_id: int | None = None
    tier: str | None = None


class UsageReport(BaseModel):
    object: Literal["usage_report"] = "usage_report"
    tenant_id: int | None
    start: datetime
    end: datetime
    group_by: list[str]
    granularity: UsageGranularity | None
    data: list[UsageRow]
    totals: UsageTotals


# ------------------------------------------------------------------------------------------ audit


class AuditEntry(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    actor: str
    action: str
    tenant_id: int | None
    details: dict[str, Any]
    created_at: datetime


class AuditList(BaseModel):
    object: Literal["list"] = "list"
    data: list[AuditEntry]
    has_more: bool
