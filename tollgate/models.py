"""ORM models of the tables Alembic owns (ARCHITECTURE.md "Data"); the column names are a contract.

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

from datetime import datetime
from typing import Any

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
    String,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TENANT_STATUSES = ("active", "suspended")
SUSPENDED_REASONS = ("admin", "billing")
REQUEST_CLASSES = ("interactive", "batch")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _created_at() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), nullable=False, server_default=func.now())


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
            " AND batch_cached_input >= 0 AND batch_output >= 0",
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
    created_at: Mapped[datetime] = _created_at()


class UsageEvent(Base):
    __tablename__ = "usage_events"
    __table_args__ = (
        CheckConstraint("request_class IN ('interactive', 'batch')", name="request_class"),
        CheckConstraint(
            "prompt_tokens >= 0 AND completion_tokens >= 0 AND cached_tokens >= 0"
            " AND cached_tokens <= prompt_tokens",
            name="token_counts",
        ),
        CheckConstraint("cost_pico_usd >= 0", name="cost_non_negative"),
        Index("ix_usage_events_tenant_id_created_at", "tenant_id", "created_at"),
        Index("ix_usage_events_created_at", "created_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False, unique=True)
    tenant_id: Mapped[int] = mapped_column(BigInteger, ForeignKey("tenants.id"), nullable=False)
    api_key_id: Mapped[int | None] = mapped_column(BigInteger, ForeignKey("api_keys.id"))
    model: Mapped[str] = mapped_column(String(128), nullable=False)
    request_class: Mapped[str] = mapped_column(String(16), nullable=False)
    tier: Mapped[str] = mapped_column(String(32), nullable=False)
    prompt_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    cached_tokens: Mapped[int] = mapped_column(Integer, nullable=False, server_default=text("0"))
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False)
    cost_pico_usd: Mapped[int] = mapped_column(BigInteger, nullable=False)
    status: Mapped[str] = mapped_column(String(32), nullable=False)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    tpot_ms: Mapped[float | None] = mapped_column(Float)
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
