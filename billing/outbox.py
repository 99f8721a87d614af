"""The durable usage outbox: one Redis stream entry per finished, failed or cancelled request.

A gateway appends a ``UsageRecord`` at settle (``append_usage``: ``XADD tollgate:usage``) and moves on;
``billing.ledger`` copies the stream into ``usage_events`` later. Redis runs with ``appendonly yes``
(``tollgate.redis.check_durability``), so a record survives a Redis restart, a gateway restart and a
Postgres outage.

Invariants:
- A record carries exactly the ``usage_events`` columns; ``request_id`` is the idempotency key, so
  appending the same request twice still yields one ledger row.
- Token counts and cost are non-negative integers, ``cached_tokens <= prompt_tokens``, each cache token
  count (``billing.prices.CACHE_TOKEN_FIELDS``: written to the prefix cache, pinned, retained)
  ``<= prompt_tokens``, ``created_at`` is timezone-aware (UTC on the wire).
- ``cached_host_tokens`` and ``cached_disk_tokens`` (the cached tokens the engine found in host memory
  and on disk, the rest were on the device) add up to at most ``cached_tokens``.
- ``accepted_prediction_tokens`` and ``rejected_prediction_tokens`` (Predicted Outputs: the request's
  prediction tokens that made it into the output, and those thrown away) add up to at most
  ``completion_tokens``: the rejected ones are counted, and billed, as completion tokens (as OpenAI
  bills them), the accepted ones are output tokens. They are details of the output, never priced apart.
- A record without the cache token counts, the tier counts or the prediction counts (``OPTIONAL_COUNTS``,
  appended by a gateway older than them) reads as 0 of each: such a gateway billed none.
- The stream is never trimmed by length: an entry leaves it only after its row is committed
  (``billing.ledger``), so nothing is dropped while Postgres is down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from redis.asyncio import Redis

from billing.prices import CACHE_TOKEN_FIELDS, REQUEST_CLASSES

USAGE_STREAM = "tollgate:usage"
RECORD_FIELD = b"r"
# How the request ended (a batch line that ran out of its window is "expired").
REQUEST_STATUSES = ("completed", "failed", "cancelled", "expired")
CACHED_TIER_FIELDS = ("cached_host_tokens", "cached_disk_tokens")
PREDICTION_TOKEN_FIELDS = ("accepted_prediction_tokens", "rejected_prediction_tokens")
OPTIONAL_COUNTS = (*CACHE_TOKEN_FIELDS, *CACHED_TIER_FIELDS, *PREDICTION_TOKEN_FIELDS)
_COUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "cost_pico_usd", *OPTIONAL_COUNTS)


@dataclass(frozen=True, slots=True)
class UsageRecord:
    request_id: str
    tenant_id: int
    api_key_id: int | None
    model: str
    request_class: str
    tier: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_pico_usd: int
    status: str
    ttft_ms: float | None
    tpot_ms: float | None
    created_at: datetime
    cache_write_tokens: int = 0
    cache_pinned_tokens: int = 0
    cache_retained_tokens: int = 0
    cached_host_tokens: int = 0
    cached_disk_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.request_id or len(self.request_id) > 128:
            raise ValueError("request_id must be 1..128 characters")
        if self.request_class not in REQUEST_CLASSES:
            raise ValueError(f"request_class must be one of {REQUEST_CLASSES}, got {self.request_class!r}")
        if self.status not in REQUEST_STATUSES:
            raise ValueError(f"status must be one of {REQUEST_STATUSES}, got {self.status!r}")
        for name in _COUNTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        for name in ("cached_tokens", *CACHE_TOKEN_FIELDS):
            if getattr(self, name) > self.prompt_tokens:
                raise ValueError(f"{name} exceeds prompt_tokens")
        if self.cached_host_tokens + self.cached_disk_tokens > self.cached_tokens:
            raise ValueError("cached_host_tokens + cached_disk_tokens exceeds cached_tokens")
        if self.accepted_prediction_tokens + self.rejected_prediction_tokens > self.completion_tokens:
            raise ValueError("accepted_prediction_tokens + rejected_prediction_tokens exceeds "
                             "completion_tokens")
        if self.created_at.tzinfo is None:
            raise ValueError("created_at must be timezone-aware")

    def to_json(self) -> bytes:
        # Field by field, not ``asdict`` (which deep-copies every value): this runs once per request.
        data = {name: getattr(self, name) for name in _FIELDS}
        data["created_at"] = self.created_at.astimezone(UTC).isoformat()
        return orjson.dumps(data)

    @classmethod
    def from_json(cls, raw: bytes | str) -> UsageRecord:
        data: dict[str, Any] = orjson.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("a usage record is a JSON object")
        # Fields a newer gateway added are ignored (rolling upgrades); a missing one is an error, except
        # the counts an older gateway does not send.
        values = {name: data[name] for name in _FIELDS if name in data or name not in OPTIONAL_COUNTS}
        values["created_at"] = datetime.fromisoformat(values["created_at"])
        return cls(**values)

    def row(self) -> dict[str, Any]:
        """The ``usage_events`` insert values."""
        return asdict(self)


_FIELDS = tuple(UsageRecord.__dataclass_fields__)


async def append_usage(redis: Redis, record: UsageRecord) -> str:
    """Append ``record`` to the outbox; returns the stream entry id. Raises ``RedisError`` if Redis is
    unreachable (the caller logs the record: it is the last copy)."""
    entry_id = await redis.xadd(USAGE_STREAM, {RECORD_FIELD: record.to_json()})
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id
