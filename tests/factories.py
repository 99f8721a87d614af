"""``create_*`` helpers that insert valid rows with sensible defaults; override any column by keyword.

They flush (so ids are set) and never commit: inside ``db_session`` everything is rolled back after the
test. Names and request ids are unique per call. ``create_api_key`` returns the row and the full secret
key, hashed with ``get_settings().key_hash_secret`` (the secret the gateway under test uses).
"""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from billing.prices import Charge, charge
from billing.prices import Price as PriceBookEntry
from engine.usage import COST_FIELDS, FIELDS, TokenKind, Usage
from gateway.tenants.keys import generate_key, hash_key
from tollgate.models import Admin, ApiKey, AuditLog, Price, Tenant, UsageEvent
from tollgate.settings import Settings, get_settings

_counter = itertools.count(1)

# $3 / $15 per million tokens: 3,000,000 and 15,000,000 pico-USD per token.
DEFAULT_INPUT_PRICE = 3_000_000
DEFAULT_OUTPUT_PRICE = 15_000_000
DEFAULT_PRICE = PriceBookEntry.of(input=DEFAULT_INPUT_PRICE, output=DEFAULT_OUTPUT_PRICE)


def _unique(stem: str) -> str:
    return f"{stem}-{next(_counter)}-{uuid.uuid4().hex[:6]}"


async def _add(session: AsyncSession, row: Any) -> Any:
    session.add(row)
    await session.flush()
    await session.refresh(row)
    return row


async def create_tenant(session: AsyncSession, *, name: str | None = None, tier: str = "default",
                        status: str = "active", suspended_reason: str | None = None,
                        **columns: Any) -> Tenant:
    if status == "suspended" and suspended_reason is None:
        suspended_reason = "admin"
    return await _add(session, Tenant(name=name or _unique("tenant"), tier=tier, status=status,
                                      suspended_reason=suspended_reason, **columns))


async def create_api_key(session: AsyncSession, tenant: Tenant | None = None, *,
                         settings: Settings | None = None, name: str = "test key",
                         revoked_at: datetime | None = None, **columns: Any) -> tuple[ApiKey, str]:
    tenant = tenant or await create_tenant(session)
    secret_key = (settings or get_settings()).key_hash_secret.get_secret_value()
    key_id, _secret, full_key = generate_key()
    key = await _add(session, ApiKey(tenant_id=tenant.id, name=name, prefix=key_id,
                                     key_hash=hash_key(full_key, secret_key), revoked_at=revoked_at,
                                     **columns))
    return key, full_key


async def create_price(session: AsyncSession, *, model: str = "tiny", effective_from: datetime | None = None,
                       input: int = DEFAULT_INPUT_PRICE, output: int = DEFAULT_OUTPUT_PRICE,
                       cached_input: int | None = None, batch_input: int | None = None,
                       batch_cached_input: int | None = None, batch_output: int | None = None,
                       embedding_input: int | None = None, batch_embedding_input: int | None = None,
                       cache_write: int = 0, cache_pin: int = 0, cache_retention: int = 0,
                       batch_cache_write: int | None = None, batch_cache_pin: int | None = None,
                       batch_cache_retention: int | None = None) -> Price:
    """Defaults follow docs/architecture.md: cached input 10% of input, embedding input the input price, the
    prompt-cache products 0, batch prices half, rounded down."""
    cached_input = input // 10 if cached_input is None else cached_input
    embedding_input = input if embedding_input is None else embedding_input
    return await _add(session, Price(
        model=model, effective_from=effective_from or datetime(2020, 1, 1, tzinfo=UTC),
        input=input, cached_input=cached_input, output=output,
        batch_input=input // 2 if batch_input is None else batch_input,
        batch_cached_input=cached_input // 2 if batch_cached_input is None else batch_cached_input,
        batch_output=output // 2 if batch_output is None else batch_output,
        embedding_input=embedding_input,
        batch_embedding_input=(embedding_input // 2 if batch_embedding_input is None
                               else batch_embedding_input),
        cache_write=cache_write, cache_pin=cache_pin, cache_retention=cache_retention,
        batch_cache_write=cache_write // 2 if batch_cache_write is None else batch_cache_write,
        batch_cache_pin=cache_pin // 2 if batch_cache_pin is None else batch_cache_pin,
        batch_cache_retention=(cache_retention // 2 if batch_cache_retention is None
                               else batch_cache_retention),
    ))


async def create_usage_event(session: AsyncSession, tenant: Tenant | None = None, *,
                             api_key: ApiKey | None = None, model: str = "tiny",
                             request_class: str = "interactive", tier: str = "default",
                             prompt_tokens: int = 100, cached_tokens: int = 0, completion_tokens: int = 20,
                             cost_pico_usd: int | None = None, status: str = "completed",
                             **columns: Any) -> UsageEvent:
    """A ledger row; without ``cost_pico_usd``, charged at the default price. Its per-kind costs, unless
    given: what the default price charges when that is its cost, else all of it on input (a hand-made row)."""
    tenant = tenant or await create_tenant(session)
    counts = {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
              "completion_tokens": completion_tokens, **{n: columns[n] for n in FIELDS if n in columns}}
    try:
        at_default: Charge | None = charge(Usage.from_fields(counts), DEFAULT_PRICE, request_class)
    except ValueError:  # counts a test makes the database refuse
        at_default = None
    if cost_pico_usd is None:
        cost_pico_usd = at_default.total if at_default is not None else 0
    if not any(name in columns for name in COST_FIELDS):
        costs = (at_default if at_default is not None and at_default.total == cost_pico_usd
                 else Charge({TokenKind.INPUT: cost_pico_usd}))
        columns |= costs.fields()
    columns.setdefault("request_id", _unique("req"))
    return await _add(session, UsageEvent(
        tenant_id=tenant.id, api_key_id=api_key.id if api_key else None, model=model,
        request_class=request_class, tier=tier, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
        completion_tokens=completion_tokens, cost_pico_usd=cost_pico_usd, status=status, **columns,
    ))


async def create_admin(session: AsyncSession, *, email: str | None = None, **columns: Any) -> Admin:
    return await _add(session, Admin(email=email or f"{_unique('admin')}@example.com", **columns))


async def create_audit_entry(session: AsyncSession, *, actor: str = "test", action: str = "test.action",
                             tenant: Tenant | None = None, details: dict[str, Any] | None = None) -> AuditLog:
    return await _add(session, AuditLog(actor=actor, action=action, tenant_id=tenant.id if tenant else None,
                                        details=details or {}))
