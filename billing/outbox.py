"""The durable usage outbox: one Redis stream entry per finished, failed or cancelled request.

A gateway appends a ``UsageRecord`` at settle (``append_usage``: ``XADD tollgate:usage``) and moves on;
``billing.ledger`` copies the stream into ``usage_events`` later. Redis runs with ``appendonly yes``
(``tollgate.redis.check_durability``), so a record survives a Redis restart, a gateway restart and a
Postgres outage.

Invariants:
- A record carries exactly the ``usage_events`` columns: the request's metadata, its ``Usage`` (every
  ``engine.usage.TokenKind`` by its field name, within the kinds' bounds: ``Usage.check``), and what it
  was charged per priced kind (``costs``, a ``billing.prices.Charge``) with their sum ``cost_pico_usd``.
  ``request_id`` is the idempotency key, so appending the same request twice still yields one ledger row.
- ``created_at`` is timezone-aware (UTC on the wire).
- A count a gateway older than its kind did not send reads as 0 (that gateway billed none). A record
  without per-kind costs (appended by a gateway older than them) has ``costs`` None; the ledger flusher
  charges it at the price in effect when it was created, which is what that gateway charged
  (``billing.ledger``).
- The stream is never trimmed by length: an entry leaves it only after its row is committed
  (``billing.ledger``), so nothing is dropped while Postgres is down.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import orjson
from redis.asyncio import Redis

from billing.prices import REQUEST_CLASSES, Charge
from engine.usage import COST_FIELDS, FIELDS, KINDS, TokenKind, Usage, parts_of

USAGE_STREAM = "tollgate:usage"
RECORD_FIELD = b"r"
# How the request ended (a batch line that ran out of its window is "expired").
REQUEST_STATUSES = ("completed", "failed", "cancelled", "expired")
# The counts every record has had; the others (``OPTIONAL_COUNTS``) may be missing from an older
# gateway's record.
_REQUIRED_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens")
OPTIONAL_COUNTS = tuple(name for name in FIELDS if name not in _REQUIRED_COUNTS)
# Of the output, the Predicted Outputs counts (details, never priced apart).
PREDICTION_TOKEN_FIELDS = tuple(KINDS[k].field for k in parts_of(TokenKind.OUTPUT))


@dataclass(frozen=True, slots=True)
class UsageRecord:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    model: str
    request_class: str
    tier: str
    usage: Usage
    cost_pico_usd: int
    status: str
    ttft_ms: float | None
    tpot_ms: float | None
    created_at: datetime
    costs: Charge | None = None

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 128:
            raise ValueError("request_id must be 1..128 characters")
        if self.request_class not in REQUEST_CLASSES:
            raise ValueError(f"request_class must be one of {REQUEST_CLASSES}, got {self.request_class!r}")
        if self.status not in REQUEST_STATUSES:
            raise ValueError(f"status must be one of {REQUEST_STATUSES}, got {self.status!r}")
        cost = self.cost_pico_usd
        if not isinstance(cost, int) or isinstance(cost, bool) or cost < 0:
            raise ValueError(f"cost_pico_usd must be a non-negative integer, got {cost!r}")
        self.usage.check()
        if self.costs is not None:
            if any(v < 0 for v in self.costs.costs.values()):
                raise ValueError("a kind's cost must be >= 0")
            if self.costs.total != cost:
                raise ValueError(f"the kinds' costs add up to {self.costs.total}, not cost_pico_usd ({cost})")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")

    @classmethod
    def of(cls, **fields: Any) -> UsageRecord:
        """From the flat form (the wire's and the ledger's): the metadata, every count by its field name
        (missing: 0), ``cost_pico_usd`` and, when known, each priced kind's cost (``COST_FIELDS``)."""
        counts = {name: fields.pop(name) for name in FIELDS if name in fields}
        given = {name: fields.pop(name) for name in COST_FIELDS if name in fields}
        costs = Charge.from_fields(given) if given else None
        return cls(usage=Usage.from_fields(counts, strict=True), costs=costs, **fields)

    @classmethod
    def charged(cls, *, costs: Charge, **fields: Any) -> UsageRecord:
        """A record of a request charged ``costs`` (its ``cost_pico_usd`` is their sum)."""
        return cls(costs=costs, cost_pico_usd=costs.total, **fields)

    def __getattr__(self, name: str) -> int:
        """A count by its field name (``record.cached_tokens``), or a kind's cost by its column name."""
        if name in COST_FIELDS and self.costs is not None:
            return self.costs.fields()[name]
        return getattr(self.usage, name)  # type: ignore[no-any-return]

    def fields(self) -> dict[str, Any]:
        """The flat form (``UsageRecord.of`` reads it back): metadata, counts, total and per-kind costs."""
        flat = {name: getattr(self, name) for name in _METADATA} | self.usage.fields()
        flat["cost_pico_usd"] = self.cost_pico_usd
        return flat | (self.costs.fields() if self.costs is not None else {})

    def to_json(self) -> bytes:
        data = self.fields()
        data["created_at"] = self.created_at.astimezone(UTC).isoformat()
        return orjson.dumps(data)

    @classmethod
    def from_json(cls, raw: bytes | str) -> UsageRecord:
        data: dict[str, Any] = orjson.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a usage record is a JSON object")
        # Fields a newer gateway added are ignored (rolling upgrades); a missing one is an error, except
        # the counts and costs an older gateway does not send.
        values = {name: data[name] for name in (*_METADATA, *_REQUIRED_COUNTS, "cost_pico_usd")}
        values["created_at"] = datetime.fromisoformat(values["created_at"])
        values |= {name: data[name] for name in (*OPTIONAL_COUNTS, *COST_FIELDS) if name in data}
        return cls.of(**values)

    def with_costs(self, costs: Charge) -> UsageRecord:
        return replace(self, costs=costs)

    def row(self) -> dict[str, Any]:
        """The ``usage_events`` insert values (of a record whose ``costs`` are known)."""
        if self.costs is None:
            raise ValueError(f"record {self.request_id} has no per-kind costs yet")
        return self.fields()


_METADATA = ("request_id", "tenant_id", "api_key_id", "model", "request_class", "tier", "status", "ttft_ms",
             "tpot_ms", "created_at")


async def append_usage(redis: Redis, record: UsageRecord) -> str:
    """Append ``record`` to the outbox; returns the stream entry id. Raises ``RedisError`` if Redis is
    unreachable (the caller logs the record: it is the last copy)."""
    entry_id = await redis.xadd(USAGE_STREAM, {RECORD_FIELD: record.to_json()})
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
