"""ORM models of the tables Alembic owns (docs/architecture.md "Data"); the column names are a contract.

Invariants:
- One ``MetaData`` with a naming convention, so every constraint and index has a stable name and
  autogenerate against these models reports no difference from the migrations.
- Money is whole pico-USD (1e-12 USD) in ``BigInteger`` columns, never floats; sums over many rows are
  taken as ``NUMERIC`` by the queries that compute them.
- ``NULL`` in a tenant limit (``tpm_limit``, ``rpm_limit``, ``max_concurrency``, ``batch_tpd_limit``,
  ``monthly_budget_pico_usd``) means "no limit"; ``NULL`` in ``api_keys.scopes`` / ``allowed_models``
  means "unrestricted". An empty list restricts to nothing.
- ``usage_events`` is the append-only ledger: one row per ``request_id``; rows reference tenants and
  keys without cascades, so deleting a tenant with usage fails instead of losing money.
- ``api_keys`` store only the HMAC-SHA256 hash of a key (``key_hash``, hex) and its lookup id
  (``prefix``); the secret is shown once at creation.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    Numeric,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from engine.usage import COST_FIELDS, FIELDS

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# The ranges the columns hold: BIGINT (ids, limits, pico-USD) and INTEGER; past them Postgres refuses the
# value (a request naming one is answered 4xx, or not found).
BIGINT_MAX = 2**63 - 1
INTEGER_MAX = 2**31 - 1
# The latest time a request may name (a price's start, a usage range's end): far enough from Python's and
# Postgres' year 9999 that no time zone or bucket arithmetic carries it past.
LATEST_TIME = datetime(3000, 1, 1, tzinfo=UTC)

TENANT_STATUSES = ("active", "suspended")
SUSPENDED_REASONS = ("admin", "billing")
REQUEST_CLASSES = ("interactive", "batch")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def contains_nul(value: Any) -> bool:
    """Whether a JSON value has a NUL character (U+0000) in a string or a key: Postgres' jsonb and text
    cannot hold one."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, dict):
        return any(contains_nul(k) or contains_nul(v) for k, v in value.items())
    if isinstance(value, list):
        return any(contains_nul(v) for v in value)
    return False


def without_nul(value: Any) -> Any:
    """``value`` with every NUL in its strings and keys replaced by U+FFFD (the replacement character)."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    return value


class TextJSONB(TypeDecorator[Any]):
    """JSONB for what clients send and models write (batch lines and their answers, stored responses):
    a NUL character, which a model may generate and JSON allows, is stored as U+FFFD. Postgres refuses
    it, and one such row used to fail its whole transaction again and again (a batch run, every flush of
    stored responses)."""

    impl = JSONB
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Any) -> Any:
        return without_nul(value) if contains_nul(value) else value


def _created_at() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())


def _zero(column_type: type[Integer] = BigInteger) -> Mapped[int]:
    """A NOT NULL count or amount that rows written before the column existed read as 0."""
    return mapped_column(column_type, nullable=False, server_default=text("0"))


def _usage_columns(count_type: type[Integer]) -> dict[str, Mapped[int]]:
    """A column per token kind (its count) and per priced kind (its cost, BIGINT pico-USD), each 0 in rows
    written before it existed: the ledger and the rollups take their usage columns from ``engine.usage``."""
    return {**{name: _zero(count_type) for name in FIELDS}, **{name: _zero() for name in COST_FIELDS}}


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (
        CheckConstraint("status IN ('active', 'suspended')", name="status"),
        CheckConstraint("suspended_reason IS NULL OR suspended_reason IN ('admin', 'billing')",
                        name="suspended_reason"),
        CheckConstraint("(status = 'suspended') = (suspended_reason IS NOT NULL)", name="suspension"),
        CheckConstraint(
            "(tpm_limit IS NULL OR tpm_limit >= 0) AND (rpm_limit IS NULL OR rpm_limit >= 0)"
            " AND (max_concurrency IS NULL OR max_concurrency >= 0)"
            " AND (batch_tpd_limit IS NULL OR batch_tpd_limit >= 0)"
            " AND (monthly_budget_pico_usd IS NULL OR monthly_budget_pico_usd >= 0)",
            name="limits_non_negative",
        ),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    name: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    tier: Mapped[str] = mapped_column(String(32), nullable=False, server_default="default")
    status: Mapped[str] = mapped_column(String(16), nullable=False, server_default="active")
    suspended_reason: Mapped[str | None] = mapped_column(String(16))
    tpm_limit: Mapped[int | None] = mapped_column(BigInteger)
    rpm_limit: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrency: Mapped[int | None] = mapped_column(Integer)
    batch_tpd_limit: Mapped[int | None] = mapped_column(BigInteger)
    monthly_budget_pico_usd: Mapped[int | None] = mapped_column(BigInteger)
    stripe_customer_id: Mapped[str | None] = mapped_column(String(255), unique=True)
    created_at: Mapped[datetime] = _created_at()
    # Billing (revision 0002): where budget alerts are POSTed (signed with the secret), the Stripe
    # subscription ``tollgate billing attach`` created, and when an invoice payment failed (cleared
    # when an invoice is paid).
    alert_webhook_url: Mapped[str | None] = mapped_column(String(2048))
    alert_webhook_secret: Mapped[str | None] = mapped_column(String(128))
    stripe_subscription_id: Mapped[str | None] = mapped_column(String(255))
    payment_failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False, index=True
    )
    name: Mapped[str] = mapped_column(String(128), nullable=False, server_default="")
    prefix: Mapped[str] = mapped_column(String(32), nullable=False, unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    scopes: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    allowed_models: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_used_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _created_at()


class Price(Base):
    """Per-token prices of a model from ``effective_from`` until the next row of the same model."""

    __tablename__ = "prices"
    __table_args__ = (
        CheckConstraint(
            "input >= 0 AND cached_input >= 0 AND output >= 0 AND batch_input >= 0"
            " AND batch_cached_input >= 0 AND batch_output >= 0 AND embedding_input >= 0"
            " AND batch_embedding_input >= 0 AND cache_write >= 0 AND cache_pin >= 0 AND cache_retention >= 0"
            " AND batch_cache_write >= 0 AND batch_cache_pin >= 0 AND batch_cache_retention >= 0",
            name="non_negative",
        ),
    )

    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    effective_from: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    input: Mapped[int] = mapped_column(BigInteger, nullable=False)
    cached_input: Mapped[int] = mapped_column(BigInteger, nullable=False)
    output: Mapped[int] = mapped_column(BigInteger, nullable=False)
    batch_input: Mapped[int] = mapped_column(BigInteger, nullable=False)
    batch_cached_input: Mapped[int] = mapped_column(BigInteger, nullable=False)
    batch_output: Mapped[int] = mapped_column(BigInteger, nullable=False)
    embedding_input: Mapped[int] = mapped_column(BigInteger, nullable=False)
    batch_embedding_input: Mapped[int] = mapped_column(BigInteger, nullable=False)
    # Prompt-cache products; 0 (what rows written before them charged) unless a writer says otherwise.
    cache_write: Mapped[int] = _zero()
    cache_pin: Mapped[int] = _zero()
    cache_retention: Mapped[int] = _zero()
    batch_cache_write: Mapped[int] = _zero()
    batch_cache_pin: Mapped[int] = _zero()
    batch_cache_retention: Mapped[int] = _zero()
    created_at: Mapped[datetime] = _created_at()


class UsageEvent(Base):
    """The ledger, partitioned by month of ``created_at`` (partitions live in the schema
    ``usage_partitions``, managed by ``billing.partitions``). A partitioned table's unique constraints
    must contain the partition key, so ``request_id`` is made unique by ``UsageRequestId``."""

    __tablename__ = "usage_events"
    __table_args__ = (
        CheckConstraint("request_class IN ('interactive', 'batch')", name="request_class"),
        CheckConstraint(
            "prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0"
            " AND cached_tokens <= prompt_tokens",
            name="token_counts",
        ),
        CheckConstraint(
            "cache_write_tokens BETWEEN 0 AND prompt_tokens"
            " AND cache_pinned_tokens BETWEEN 0 AND prompt_tokens"
            " AND cache_retained_tokens BETWEEN 0 AND prompt_tokens",
            name="cache_token_counts",
        ),
        CheckConstraint(
            "cached_host_tokens >= 0 AND cached_disk_tokens >= 0"
            " AND cached_host_tokens + cached_disk_tokens <= cached_tokens",
            name="cached_tier_counts",
        ),
        CheckConstraint(
            "accepted_prediction_tokens >= 0 AND rejected_prediction_tokens >= 0"
            " AND accepted_prediction_tokens + rejected_prediction_tokens <= completion_tokens",
            name="prediction_token_counts",
        ),
        CheckConstraint("cost_pico_usd >= 0", name="cost_non_negative"),
        CheckConstraint(" AND ".join(f"{name} >= 0" for name in COST_FIELDS)
                        + f" AND {' + '.join(COST_FIELDS)} = cost_pico_usd", name="kind_costs"),
        Index("ix_usage_events_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_usage_events_created_at", "created_at"),
        Index("ix_usage_events_request_id", "request_id"),
        {"postgresql_partition_by": "RANGE (created_at)"},
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False)
    tenant_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("tenants.id"), nullable=False)
    api_key_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(128), nullable=False)
    request_class: Mapped[str] = mapped_column(String(16), nullable=False)
    tier: Mapped[str] = mapped_column(String(32), nullable=False)
    cost_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    status: Mapped[str] = mapped_column(String(32), nullable=False)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True,
                                                 server_default=func.now())
    # Every token kind's count and every priced kind's cost (``engine.usage``: ``FIELDS``, ``COST_FIELDS``).
    vars().update(_usage_columns(Integer))
    if TYPE_CHECKING:
        prompt_tokens: Mapped[int]
        cached_tokens: Mapped[int]
        completion_tokens: Mapped[int]


class UsageRequestId(Base):
    """One row per ledger row, inserted in the same transaction: the ledger's idempotency key."""

    __tablename__ = "usage_request_ids"

    request_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class UsageHourly(Base):
    """Hourly rollup of the ledger per tenant × model × class: the number of requests and the sums of the
    ledger's count and cost columns, named as there. Maintained by the ledger flusher in the insert's
    transaction and proved equal to the ledger by ``billing.rollups.reconcile_rollups``."""

    __tablename__ = "usage_hourly"
    __table_args__ = (
        CheckConstraint("request_class IN ('interactive', 'batch')", name="request_class"),
        Index("ix_usage_hourly_hour", "hour"),
    )

    tenant_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("tenants.id"), primary_key=True)
    hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), primary_key=True)
    request_class: Mapped[str] = mapped_column(String(16), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False)
    cost_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    # The sums of the ledger's columns of the same names.
    vars().update(_usage_columns(BigInteger))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                 server_default=func.now())


class StripeProvisioning(Base):
    """The one billing meter, product and metered price ``tollgate billing setup-stripe`` created."""

    __tablename__ = "stripe_provisioning"
    __table_args__ = (CheckConstraint("id = 1", name="singleton"),)

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True, autoincrement=False)
    meter_event_name: Mapped[str] = mapped_column(String(100), nullable=False)
    meter_id: Mapped[str] = mapped_column(String(255), nullable=False)
    product_id: Mapped[str] = mapped_column(String(255), nullable=False)
    price_id: Mapped[str] = mapped_column(String(255), nullable=False)
    created_at: Mapped[datetime] = _created_at()


class StripeExportState(Base):
    """Per exported tenant: the first hour to export and the running totals that carry the sub-micro-USD
    remainder from hour to hour (``sent_micro_usd == floor(covered_pico_usd / 1e6)`` after every plan,
    except while a negative correction smaller than a cent waits to be absorbed)."""

    __tablename__ = "stripe_export_state"

    tenant_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("tenants.id"), primary_key=True)
    since_hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    covered_pico_usd: Mapped[Decimal] = mapped_column(Numeric(38, 0), nullable=False,
                                                      server_default=text("0"))
    sent_micro_usd: Mapped[Decimal] = mapped_column(Numeric(38, 0), nullable=False, server_default=text("0"))
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                 server_default=func.now())


class StripeExport(Base):
    """Outbox of what is reported to Stripe: one row per (tenant, hour, revision), planned and committed
    before it is sent, marked ``sent`` after Stripe accepted it."""

    __tablename__ = "stripe_exports"
    __table_args__ = (
        CheckConstraint("kind IN ('meter_event', 'credit')", name="kind"),
        CheckConstraint("status IN ('pending', 'sent')", name="status"),
        CheckConstraint("revision >= 1", name="revision"),
        UniqueConstraint("tenant_id", "hour", "revision"),
        Index("ix_stripe_exports_status_id", "status", "id"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("tenants.id"), nullable=False)
    hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    revision: Mapped[int] = mapped_column(Integer, nullable=False)
    kind: Mapped[str] = mapped_column(String(16), nullable=False)
    identifier: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    stripe_customer_id: Mapped[str] = mapped_column(String(255), nullable=False)
    amount_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    covered_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    value_micro_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    last_error: Mapped[str | None] = mapped_column(Text)
    stripe_object_id: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = _created_at()
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class StripeEvent(Base):
    """Stripe webhook events already processed (deduplication by event id)."""

    __tablename__ = "stripe_events"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    type: Mapped[str] = mapped_column(String(128), nullable=False)
    event_created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    received_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False,
                                                  server_default=func.now())


class BudgetAlert(Base):
    """A tenant's month-to-date spend crossed ``threshold_percent`` (80 or 100) of its monthly budget:
    the dashboard's flag, and the outbox of the signed webhook to ``tenants.alert_webhook_url``."""

    __tablename__ = "budget_alerts"
    __table_args__ = (
        CheckConstraint("webhook_status IN ('none', 'pending', 'delivered', 'failed')",
                        name="webhook_status"),
        UniqueConstraint("tenant_id", "month", "threshold_percent"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"),
                                           nullable=False)
    month: Mapped[str] = mapped_column(String(7), nullable=False)
    threshold_percent: Mapped[int] = mapped_column(SmallInteger, nullable=False)
    spend_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    budget_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    webhook_status: Mapped[str] = mapped_column(String(16), nullable=False)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    last_error: Mapped[str | None] = mapped_column(Text)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _created_at()


class Admin(Base):
    __tablename__ = "admins"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    email: Mapped[str] = mapped_column(String(320), nullable=False, unique=True)
    password_hash: Mapped[str | None] = mapped_column(String(255))
    api_token_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = _created_at()


class AuditLog(Base):
    __tablename__ = "audit_log"
    __table_args__ = (Index("ix_audit_log_created_at", "created_at"),)

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    actor: Mapped[str] = mapped_column(String(320), nullable=False)
    action: Mapped[str] = mapped_column(String(64), nullable=False)
    tenant_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("tenants.id", ondelete="SET NULL"), index=True
    )
    details: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, server_default=text("'{}'::jsonb"))
    created_at: Mapped[datetime] = _created_at()


# --------------------------------------------------------------------------- files and batches (issue #6)
# Public ids are strings (``file-…``, ``batch_…``) as OpenAI's API shows them; listing pages by
# ``(created_at, id)``. Batch statuses are OpenAI's; ``batch_items`` holds one row per input line with its
# lease (``lease_owner``, ``lease_expires_at``), attempts and result, so a line completes at most once.

FILE_PURPOSES = ("batch", "batch_output")
BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
BATCH_ITEM_STATUSES = ("pending", "running", "completed", "failed", "cancelled", "expired")


class File(Base):
    __tablename__ = "files"
    __table_args__ = (
        CheckConstraint("purpose IN ('batch', 'batch_output', 'fine-tune')", name="purpose"),
        CheckConstraint("bytes >= 0", name="bytes_non_negative"),
        Index("ix_files_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_files_expires_at", "expires_at"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
    )
    purpose: Mapped[str] = mapped_column(String(32), nullable=False)
    filename: Mapped[str] = mapped_column(String(512), nullable=False)
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    storage_key: Mapped[str] = mapped_column(String(512), nullable=False)
    created_at: Mapped[datetime] = _created_at()
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Adapter(Base):
    """A tenant's LoRA adapter, served as the model ``model`` (``ft:<base>:<tenant>:<name>:<id>``) on
    ``base_model`` (``gateway.adapters``). Its bundle is ``<adapter store>/<id>/``; ``digest`` is the
    engine's digest of its contents (the prefix cache's key). A deleted adapter keeps its row (the
    ledger names its model) with ``deleted_at`` set; its name is free again for a new registration."""

    __tablename__ = "adapters"
    __table_args__ = (
        CheckConstraint("rank > 0 AND bytes >= 0", name="sizes"),
        Index("ix_adapters_tenant_id_name_live", "tenant_id", "name", unique=True,
              postgresql_where=text("deleted_at IS NULL")),
        Index("ix_adapters_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    model: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    tenant_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
    )
    name: Mapped[str] = mapped_column(String(64), nullable=False)
    base_model: Mapped[str] = mapped_column(String(128), nullable=False)
    digest: Mapped[str] = mapped_column(String(64), nullable=False)
    rank: Mapped[int] = mapped_column(Integer, nullable=False)
    target_modules: Mapped[list[str]] = mapped_column(ARRAY(Text), nullable=False)
    bytes: Mapped[int] = mapped_column(BigInteger, nullable=False)
    file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        CheckConstraint(
            "status IN ('validating', 'failed', 'in_progress', 'finalizing', 'completed', 'expired',"
            " 'cancelling', 'cancelled')",
            name="status",
        ),
        CheckConstraint(
            "request_total >= 0 AND request_completed >= 0 AND request_failed >= 0"
            " AND request_completed + request_failed <= request_total",
            name="request_counts",
        ),
        Index("ix_batches_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
    )
    api_key_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("api_keys.id", ondelete="SET NULL")
    )
    endpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    model: Mapped[str | None] = mapped_column(String(128))
    input_file_id: Mapped[str] = mapped_column(String(64), nullable=False)
    completion_window: Mapped[str] = mapped_column(String(16), nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, server_default="validating")
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    # ``metadata`` is reserved on declarative classes: the attribute is ``batch_metadata``.
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONB)
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)
    request_total: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    request_completed: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    request_failed: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    cached_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    completion_tokens: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    cost_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False, server_default=text("0"))
    created_at: Mapped[datetime] = _created_at()
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class BatchItem(Base):
    """One input line. ``request_id`` is derived from the batch id and ``custom_id`` (the ledger's
    idempotency key); ``served_pool`` records which engine pool ran it (``interactive`` = soaked)."""

    __tablename__ = "batch_items"
    __table_args__ = (
        CheckConstraint(
            "status IN ('pending', 'running', 'completed', 'failed', 'cancelled', 'expired')", name="status"
        ),
        CheckConstraint("(status = 'running') = (lease_owner IS NOT NULL)", name="lease"),
        UniqueConstraint("batch_id", "custom_id", name="uq_batch_items_batch_id_custom_id"),
        UniqueConstraint("batch_id", "line", name="uq_batch_items_batch_id_line"),
        Index("ix_batch_items_batch_id_status", "batch_id", "status"),
        Index("ix_batch_items_status_lease_expires_at", "status", "lease_expires_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    batch_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("batches.id", ondelete="CASCADE"), nullable=False
    )
    line: Mapped[int] = mapped_column(Integer, nullable=False)
    custom_id: Mapped[str] = mapped_column(Text, nullable=False)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    request_body: Mapped[dict[str, Any]] = mapped_column(TextJSONB, nullable=False)
    status: Mapped[str] = mapped_column(String(16), nullable=False, server_default="pending")
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    response_status: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[dict[str, Any] | None] = mapped_column(TextJSONB)
    error: Mapped[dict[str, Any] | None] = mapped_column(TextJSONB)
    served_pool: Mapped[str | None] = mapped_column(String(32))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    cached_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    cost_pico_usd: Mapped[int | None] = mapped_column(BigInteger)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _created_at()


RESPONSE_STATUSES = ("completed", "incomplete", "failed", "cancelled", "in_progress", "queued")


class StoredResponse(Base):
    """A ``/v1/responses`` result kept for ``GET``, ``input_items`` and ``previous_response_id`` (``store``,
    true by default as OpenAI's): the ``Response`` object as the client received it (``body``) and the
    request's own input items, with their ids (``input_items``). A follow-up's conversation is the chain of
    ``previous_response_id``s within one tenant (no foreign key: a deleted or expired link ends it).
    Rows past ``expires_at`` are gone to every query and deleted by beat. A ``background`` response is
    stored ``queued`` with the ``request`` a worker runs (as the key ``api_key_id``); its worker stores
    its final state with the usage record it meters next (``usage_pending``), and clears it once metered:
    a record still there after its worker's lease expired is metered by the requeue sweep."""

    __tablename__ = "responses"
    __table_args__ = (
        CheckConstraint(f"status IN {RESPONSE_STATUSES!r}", name="status"),
        Index("ix_responses_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_responses_expires_at", "expires_at"),
        # The requeue sweep looks for left-behind usage records every few seconds: only those rows.
        Index("ix_responses_usage_pending", "id", postgresql_where=text("usage_pending IS NOT NULL")),
    )

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant_id: Mapped[int] = mapped_column(
        BigInteger, ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False
    )
    api_key_id: Mapped[int | None] = mapped_column(
        BigInteger, ForeignKey("api_keys.id", ondelete="SET NULL")
    )
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    model: Mapped[str] = mapped_column(String(256), nullable=False)
    request: Mapped[dict[str, Any] | None] = mapped_column(TextJSONB)
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(TextJSONB, nullable=False)
    body: Mapped[dict[str, Any]] = mapped_column(TextJSONB, nullable=False)
    usage_pending: Mapped[dict[str, Any] | None] = mapped_column(JSONB(none_as_null=True))
    created_at: Mapped[datetime] = _created_at()
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
