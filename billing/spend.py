"""Month-to-date spend per tenant, in Redis: what the monthly budget check reads on every admission.

Layout: one hash per tenant, ``tollgate:spend:{t<tenant_id>}``, field ``YYYY-MM`` (UTC month) → spent
pico-USD (interactive and batch together). The ``{t<id>}`` hash tag puts it in the same Redis Cluster
slot as the tenant's admission keys, so one Lua script can read both.

Invariants:
- The month is taken from Redis ``TIME`` inside a script (``MONTH_OF_LUA``), never from a gateway's
  clock, so gateways with skewed clocks agree on which month a request is charged to.
- Amounts only ever go up: ``HINCRBY`` with a whole non-negative number of pico-USD (int64 in Redis,
  exact up to ~9.2 million USD per tenant and month).
- Reconciliation from the ledger (``raise_spend_to``) only raises the counter to the ledger's sum,
  never lowers it: usage still waiting in the outbox is counted in Redis but not yet in the ledger, and
  a Redis that lost writes is repaired by the ledger.
"""

from __future__ import annotations

from datetime import UTC, datetime

from redis.asyncio import Redis

# Civil (proleptic Gregorian) "YYYY-MM" of a UNIX time in seconds, in integer arithmetic
# (H. Hinnant's days-to-civil algorithm). Prepended to the scripts that need the month.
MONTH_OF_LUA = """
local function month_of(sec)
  local z = math.floor(sec / 86400) + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local y = yoe + era * 400
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp + 3
  if mp >= 10 then m = mp - 9 end
  if m <= 2 then y = y + 1 end
  return string.format('%04d-%02d', y, m)
end
local function redis_month()
  return month_of(tonumber(redis.call('TIME')[1]))
end
"""

_RECORD_LUA = MONTH_OF_LUA + """
local month = ARGV[2]
if month == nil or month == '' then month = redis_month() end
return {month, redis.call('HINCRBY', KEYS[1], month, ARGV[1])}
"""

_RAISE_LUA = """
local current = redis.call('HGET', KEYS[1], ARGV[1]) or '0'
local target = ARGV[2]
local function lt(a, b)  -- exact comparison of non-negative decimal integers given as strings
  if #a ~= #b then return #a < #b end
  return a < b
end
if lt(current, target) then
  redis.call('HSET', KEYS[1], ARGV[1], target)
  return target
end
return current
"""


def tenant_tag(tenant_id: int) -> str:
    """The Redis Cluster hash tag shared by every per-tenant key."""
    return f"{{t{tenant_id}}}"


def spend_key(tenant_id: int) -> str:
    return f"tollgate:spend:{tenant_tag(tenant_id)}"


def month_field(at: datetime) -> str:
    """``"2026-11"`` for any aware datetime in November 2026 UTC."""
    if at.tzinfo is None:
        raise ValueError("month_field needs an aware datetime")
    at = at.astimezone(UTC)
    return f"{at.year:04d}-{at.month:02d}"


def month_bounds(month: str) -> tuple[datetime, datetime]:
    """``"2026-11"`` → (2026-11-01T00:00Z, 2026-12-01T00:00Z)."""
    year, mon = (int(part) for part in month.split("-"))
    start = datetime(year, mon, 1, tzinfo=UTC)
    end = datetime(year + (mon == 12), mon % 12 + 1, 1, tzinfo=UTC)
    return start, end


async def month_to_date_spend(redis: Redis, tenant_id: int, month: str) -> int:
    value = await redis.hget(spend_key(tenant_id), month)
    return int(value) if value is not None else 0


async def record_spend(redis: Redis, tenant_id: int, cost_pico_usd: int,
                       month: str | None = None) -> tuple[str, int]:
    """Add spend outside interactive admission (the batch tier) to ``month`` ("2026-11"; None: the
    current one); returns (month, new total). Interactive requests are charged by
    ``AdmissionController.settle`` in the same script that releases their lease."""
    if cost_pico_usd < 0:
        raise ValueError(f"cost must be >= 0, got {cost_pico_usd}")
    month, total = await redis.eval(_RECORD_LUA, 1, spend_key(tenant_id), str(cost_pico_usd), month or "")
    return (month.decode() if isinstance(month, bytes) else month), int(total)


async def raise_spend_to(redis: Redis, tenant_id: int, month: str, ledger_total: int) -> int:
    """Raise the month's counter to at least ``ledger_total`` (the ledger's sum); returns the value."""
    if ledger_total < 0:
        raise ValueError("ledger_total must be >= 0")
    value = await redis.eval(_RAISE_LUA, 1, spend_key(tenant_id), month, str(ledger_total))
    return int(value)


async def drop_months_before(redis: Redis, tenant_id: int, month: str) -> int:
    """Forget the counters of months before ``month`` (the ledger keeps the history)."""
    key = spend_key(tenant_id)
    old = [f for f in await redis.hkeys(key) if (f.decode() if isinstance(f, bytes) else f) < month]
    return await redis.hdel(key, *old) if old else 0
