"""Monthly statements: per tenant and UTC month, line items by model, class and token kind.

Invariants:
- Built from the hourly rollups (``usage_hourly``), which ``billing.rollups`` keeps equal to the ledger:
  each line's ``amount_pico_usd`` is exact, and the statement's ``total_pico_usd`` is exactly the sum of
  the month's ledger costs (the token-kind amounts of a rollup add up to its ledger cost).
- Money leaves as cents here, rounded once: line ``i`` shows
  ``round(cumulative_i) - round(cumulative_{i-1})`` cents (half up), so every line's rounding is carried
  into the next and the shown lines add up to the shown total, ``round(total)``; no cent is made or lost.
- Line order is fixed (model, class interactive then batch, kind in ``TOKEN_KINDS`` order), so the
  carried rounding, and so the document, is reproducible. A kind with neither tokens nor amount has no
  line.
- Token kinds: ``input`` is prompt tokens not served from the prompt cache, ``cached_input`` those
  served from it, ``output`` completion tokens. The prompt-cache products are charged on top of those
  prompt tokens: ``cache_write`` is prompt tokens newly written to the prompt cache, ``cache_pinned``
  those pinned in host memory (``prompt_cache_options.ttl``), ``cache_retained`` those kept on disk
  (``prompt_cache_retention: "24h"``).
- Predicted Outputs: an ``output`` line also says how many of its tokens were accepted and rejected
  prediction tokens (``accepted_prediction_tokens``, ``rejected_prediction_tokens``: the output's parts,
  ``DETAIL_FIELDS``; in the JSON of that line and in the CSV's last columns, empty on other lines). They
  are part of the line's tokens and amount, never lines of their own: rejected prediction tokens are
  billed as output, as OpenAI bills them. The statement's totals of both are the sums over its lines.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass, field
from datetime import datetime
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

from sqlalchemy import Numeric, cast, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from billing.outbox import PREDICTION_TOKEN_FIELDS
from billing.prices import Charge
from billing.rollups import SUMMED
from billing.spend import month_bounds
from engine.usage import PRICED_KINDS, TokenKind, Usage
from tollgate.models import BIGINT_MAX, Tenant, UsageHourly

PICO_PER_CENT = 10**10
PICO_PER_USD = 10**12
TOKEN_KINDS = tuple(k.value for k in PRICED_KINDS)
OUTPUT_KIND = TokenKind.OUTPUT  # the kind whose lines carry its parts' counts
# The output's parts (``engine.usage``): today the Predicted Outputs counts, accepted and rejected.
DETAIL_FIELDS = PREDICTION_TOKEN_FIELDS
_CLASS_ORDER = {"interactive": 0, "batch": 1}
_MONTH = re.compile(r"\d{4}-(0[1-9]|1[0-2])")


def cents_half_up(pico: int) -> int:
    return int((Decimal(pico) / PICO_PER_CENT).quantize(Decimal(1), rounding=ROUND_HALF_UP))


def usd_exact(pico: int) -> str:
    """``1234567`` pico-USD → ``"0.000001234567"`` (exact, 12 decimals)."""
    # format(..., "f"): str() of a zero Decimal at 12 places is "0E-12".
    return format((Decimal(pico) / PICO_PER_USD).quantize(Decimal("0.000000000001")), "f")


def format_cents(cents: int) -> str:
    sign = "-" if cents < 0 else ""
    return f"{sign}{abs(cents) // 100}.{abs(cents) % 100:02d}"


@dataclass(frozen=True, slots=True)
class StatementLine:
    model: str
    request_class: str
    token_kind: str
    tokens: int
    amount_pico_usd: int
    amount_cents: int
    # Of an ``output`` line's tokens, the output's parts by field name (``DETAIL_FIELDS``; none elsewhere).
    details: dict[str, int] = field(default_factory=dict)

    def __getattr__(self, name: str) -> int:
        """A detail count by its field name (0 on a line that has none)."""
        if name not in DETAIL_FIELDS:
            raise AttributeError(f"'StatementLine' object has no attribute {name!r}")
        return self.details.get(name, 0)

    @property
    def has_details(self) -> bool:
        return self.token_kind == OUTPUT_KIND

    def as_dict(self) -> dict[str, Any]:
        out = {"model": self.model, "request_class": self.request_class, "token_kind": self.token_kind,
               "tokens": self.tokens, "amount_pico_usd": self.amount_pico_usd,
               "amount_usd_exact": usd_exact(self.amount_pico_usd), "amount_cents": self.amount_cents,
               "amount": format_cents(self.amount_cents)}
        if self.has_details:
            out.update({name: self.details.get(name, 0) for name in DETAIL_FIELDS})
        return out


@dataclass(slots=True)
class Statement:
    tenant_id: int
    tenant_name: str
    month: str
    period_start: datetime
    period_end: datetime
    requests: int = 0
    lines: list[StatementLine] = field(default_factory=list)
    total_pico_usd: int = 0
    total_cents: int = 0

    def detail_totals(self) -> dict[str, int]:
        return {name: sum(line.details.get(name, 0) for line in self.lines) for name in DETAIL_FIELDS}

    def as_dict(self) -> dict[str, Any]:
        return {"object": "statement", "tenant_id": self.tenant_id, "tenant_name": self.tenant_name,
                "month": self.month, "period_start": self.period_start.isoformat(),
                "period_end": self.period_end.isoformat(), "currency": "usd", "requests": self.requests,
                "lines": [line.as_dict() for line in self.lines], "total_pico_usd": self.total_pico_usd,
                "total_usd_exact": usd_exact(self.total_pico_usd), "total_cents": self.total_cents,
                "total": format_cents(self.total_cents), **self.detail_totals()}

    def to_csv(self) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["tenant", "month", "model", "request_class", "token_kind", "tokens",
                         "amount_pico_usd", "amount_usd", *DETAIL_FIELDS])
        for line in self.lines:
            details = [line.details.get(name, 0) if line.has_details else "" for name in DETAIL_FIELDS]
            writer.writerow([self.tenant_name, self.month, line.model, line.request_class, line.token_kind,
                             line.tokens, line.amount_pico_usd, format_cents(line.amount_cents), *details])
        writer.writerow([self.tenant_name, self.month, "TOTAL", "", "", "", self.total_pico_usd,
                         format_cents(self.total_cents), *self.detail_totals().values()])
        return out.getvalue()


def carry_rounding(amounts: list[int]) -> list[int]:
    """Cents per amount with each rounding carried into the next; they sum to the total's cents."""
    cents: list[int] = []
    cumulative = 0
    shown = 0
    for amount in amounts:
        cumulative += amount
        now = cents_half_up(cumulative)
        cents.append(now - shown)
        shown = now
    return cents


class StatementTenantNotFound(LookupError):
    pass


async def build_statement(session: AsyncSession, tenant_id: int, month: str) -> Statement:
    """The statement of ``tenant_id`` for ``month`` (``YYYY-MM``, UTC)."""
    if not _MONTH.fullmatch(month):
        raise ValueError(f"month must be YYYY-MM, got {month!r}")
    start, end = month_bounds(month)
    tenant = await session.get(Tenant, tenant_id)
    if tenant is None:
        raise StatementTenantNotFound(f"no tenant {tenant_id}")
    sums = [func.sum(cast(getattr(UsageHourly, name), Numeric)) for name in ("requests", *SUMMED)]
    stmt = (select(UsageHourly.model, UsageHourly.request_class, *sums)
            .where(UsageHourly.tenant_id == tenant_id, UsageHourly.hour >= start, UsageHourly.hour < end)
            .group_by(UsageHourly.model, UsageHourly.request_class))
    rows = sorted((await session.execute(stmt)).all(),
                  key=lambda r: (r[0], _CLASS_ORDER.get(r[1], 9), r[1]))
    statement = Statement(tenant_id=tenant.id, tenant_name=tenant.name, month=month, period_start=start,
                          period_end=end)
    raw: list[tuple[str, str, str, int, int, dict[str, int]]] = []
    for model, klass, requests, *sums_of_row in rows:
        statement.requests += int(requests)
        totals = {name: int(v) for name, v in zip(SUMMED, sums_of_row, strict=True)}
        usage, costs = Usage.from_fields(totals), Charge.from_fields(totals)
        details = {name: totals[name] for name in DETAIL_FIELDS}
        for kind, tokens in usage.billed().items():
            amount = costs.costs[kind]
            if tokens or amount:
                raw.append((model, klass, kind.value, tokens, amount, details if kind == OUTPUT_KIND else {}))
    cents = carry_rounding([r[4] for r in raw])
    statement.lines = [StatementLine(m, c, k, t, a, cent, d)
                       for (m, c, k, t, a, d), cent in zip(raw, cents, strict=True)]
    statement.total_pico_usd = sum(line.amount_pico_usd for line in statement.lines)
    statement.total_cents = cents_half_up(statement.total_pico_usd)
    return statement


async def find_tenant_id(session: AsyncSession, ref: str | int) -> int:
    """A tenant id from an id or a name."""
    if (isinstance(ref, int) or ref.isdigit()) and 0 <= int(ref) <= BIGINT_MAX:  # beyond: no such id
        tenant = await session.get(Tenant, int(ref))
        if tenant is not None:
            return tenant.id
    tenant_id = await session.scalar(select(Tenant.id).where(Tenant.name == str(ref)))
    if tenant_id is None:
        raise StatementTenantNotFound(f"no tenant {ref!r}")
    return int(tenant_id)
