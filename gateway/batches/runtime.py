"""The batch tier's runtime: the interactive pipeline's parts, configured for batch work.

``BatchRuntime`` is a ``GatewayRuntime`` (same engine client, tokenizers, price book) whose
- ``request_class`` is ``batch``: ``Generation`` prices lines at the batch prices and meters them in the
  ledger as class ``batch``;
- ``settings.tiers`` has a single tier (``default``, as OpenAI reports batch lines) at
  ``batch_engine_priority``, below every interactive tier (the engine preempts batch lines for
  interactive traffic), with SLOs that never shed;
- ``router`` is a ``BatchRouter``: the model's ``batch`` pool replicas, plus its ``interactive`` replicas
  while they are under the soak watermark;
- ``admission`` is ``BatchAdmission``: the tenant's batch tokens-per-day quota (``batch_tpd_limit``,
  separate from TPM), its status and monthly budget, counting what every request in flight may still
  cost (a line holds its estimate until it settles, and interactive admission counts those holds as
  the line counts interactive ones); a line that does not fit now is *deferred* (``BatchDeferred``),
  never failed. Spend is added to the month (``billing.spend.record_spend``) exactly once per line
  request id.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from redis.asyncio import Redis

from billing.outbox import UsageRecord, append_usage
from billing.spend import month_field, record_spend, spend_key, tenant_tag
from gateway.admission.controller import admission_keys, admission_script, batch_hold_keys
from gateway.admission.limits import Admission, TenantLimits
from gateway.deps import GatewayRuntime
from gateway.engine_client import EngineClient
from gateway.errors import GatewayError, ServiceUnavailableError
from gateway.replicas import Resolver
from gateway.routing import INTERACTIVE_POOL, ModelRoute, Replica, Router
from tollgate.settings import ModelConfig, Settings, TierConfig

logger = logging.getLogger("tollgate.batches")

BATCH_POOL = "batch"
# The one tier of the batch runtime. Named like OpenAI's ``service_tier`` so response bodies stay valid
# (OpenAI answers batch lines with ``default``); the ledger tells batch apart by ``request_class``.
BATCH_TIER = "default"
BATCH_REQUEST_CLASS = "batch"
NEVER_SHED_MS = 10**9
BILLED_TTL_S = 3 * 24 * 3600
TPD_TTL_S = 2 * 24 * 3600

# KEYS[1] = the tenant's TPD hash; ARGV = limit (-1: none), tokens to reserve. The day is Redis's
# (``TIME``), so every worker agrees on it. Returns {day, 1 admitted | 0 refused, used after}.
_TPD_RESERVE_LUA = """
local t = redis.call('TIME')
local day = tostring(math.floor(tonumber(t[1]) / 86400))
local used = tonumber(redis.call('HGET', KEYS[1], day) or '0')
local limit = tonumber(ARGV[1])
local want = tonumber(ARGV[2])
if limit >= 0 and used + want > limit then return {day, 0, used} end
used = redis.call('HINCRBY', KEYS[1], day, want)
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {day, 1, used}
"""


def tpd_key(tenant_id: int) -> str:
    return f"tollgate:batch_tpd:{tenant_tag(tenant_id)}"


def billed_key(request_id: str) -> str:
    return f"tollgate:batch:billed:{request_id}"


class BatchDeferred(GatewayError):
    """The line cannot start now (quota, budget, suspended tenant, no capacity): put it back, retry
    later. Never written to a line's result."""

    status = 429
    type = "batch_deferred"


def batch_priority(settings: Settings) -> int:
    if settings.batch_engine_priority is not None:
        return settings.batch_engine_priority
    return max((t.engine_priority for t in settings.tiers.values()), default=0) + 1


def batch_settings(settings: Settings) -> Settings:
    tier = TierConfig(engine_priority=batch_priority(settings), ttft_slo_ms=NEVER_SHED_MS,
                      tpot_slo_ms=NEVER_SHED_MS, rank=0)
    return settings.model_copy(update={"tiers": {BATCH_TIER: tier}})


class BatchRouter(Router):
    """Routes batch lines: dedicated ``batch`` pool replicas always, ``interactive`` replicas only while
    they are under the soak watermark (a short queue, KV cache not too full, few of our lines there).
    Least loaded first; no prefix affinity (lines are independent)."""

    def __init__(self, settings: Settings, client: EngineClient, resolver: Resolver | None = None) -> None:
        super().__init__(settings, client, resolver)
        self._max_waiting = settings.batch_soak_max_waiting
        self._max_kv = settings.batch_soak_max_kv_usage
        self._max_inflight = settings.batch_soak_max_inflight

    def routed_pools(self, cfg: ModelConfig) -> list[str]:
        """Both pools of the model (found by URL or by DNS, as the gateway finds them)."""
        return [pool for pool in (BATCH_POOL, INTERACTIVE_POOL) if pool in cfg.pools]

    def soakable(self, replica: Replica) -> bool:
        load = replica.load
        return (load is not None and load.waiting <= self._max_waiting and load.kv_usage <= self._max_kv
                and replica.inflight < self._max_inflight)

    def pick(self, model: str, block_hashes: Sequence[bytes], exclude: Sequence[Replica] = (),
             routing_key: bytes | None = None, adapter: str | None = None, *,
             prefill: bool = False) -> Replica:
        """``routing_key`` (a line's ``prompt_cache_key``) is ignored: lines are independent. A line
        for an adapter prefers, at equal pool, a replica holding it read. Lines are never prefilled on
        another replica (no prefill pool here: ``prefill`` finds none)."""
        route: ModelRoute = self.models[model]
        if prefill:
            raise ServiceUnavailableError(f"No prefill replica for batch work on model `{model}`.")
        candidates = [r for r in route.replicas if r.healthy and r not in exclude
                      and (r.pool != INTERACTIVE_POOL or self.soakable(r))]
        if not candidates:
            raise ServiceUnavailableError(f"No capacity for batch work on model `{model}` right now.",
                                          code="batch_no_capacity")
        cold = (lambda r: adapter not in r.adapters) if adapter is not None else (lambda r: False)
        return min(candidates, key=lambda r: (r.pool == INTERACTIVE_POOL, cold(r), r.load_score))

    def remember(self, replica: Replica, block_hashes: Sequence[bytes]) -> None:
        """No prefix affinity to remember for batch lines."""


class BatchAdmission:
    """The ``AdmissionPolicy`` of batch lines (see the module docstring). A line admitted holds its
    estimated cost against the monthly budget until it settles (or ``hold_ttl_s`` passes: its worker
    died), as an interactive request does, and each side counts the other's holds: concurrent lines
    cannot overshoot the budget by more than one request's cost either."""

    def __init__(self, redis: Redis, hold_ttl_s: float = 660.0) -> None:
        self.redis = redis
        self._hold_ttl_ms = round(hold_ttl_s * 1000)
        self._admit = redis.register_script(admission_script("batch_admit.lua"))
        self._release_hold = redis.register_script(admission_script("release.lua"))

    async def admit(self, limits: TenantLimits, request_id: str, reserved_tokens: int,
                    estimated_cost_pico_usd: int) -> Admission:
        if limits.status != "active":
            raise BatchDeferred(f"tenant {limits.tenant_id} is {limits.status}")
        budget = -1 if limits.monthly_budget_pico_usd is None else limits.monthly_budget_pico_usd
        _, _, leases, holds = admission_keys(limits.tenant_id)
        if not await self._admit(keys=[spend_key(limits.tenant_id), leases, holds,
                                       *batch_hold_keys(limits.tenant_id)],
                                 args=[budget, request_id, self._hold_ttl_ms, str(estimated_cost_pico_usd)]):
            raise BatchDeferred(f"tenant {limits.tenant_id} is over its monthly budget")
        limit = -1 if limits.batch_tpd_limit is None else limits.batch_tpd_limit
        day, admitted, _used = await self.redis.eval(
            _TPD_RESERVE_LUA, 1, tpd_key(limits.tenant_id), str(limit), str(reserved_tokens), str(TPD_TTL_S))
        day = day.decode() if isinstance(day, bytes) else str(day)
        if not admitted:
            await self._release(limits.tenant_id, request_id)
            raise BatchDeferred(f"tenant {limits.tenant_id} has used its batch tokens for today")
        return Admission(request_id=request_id, tenant_id=limits.tenant_id, lease_id=day,
                         reserved_tokens=reserved_tokens, headers={}, month=month_field(datetime.now(UTC)))

    async def _release(self, tenant_id: int, request_id: str) -> None:
        await self._release_hold(keys=list(batch_hold_keys(tenant_id)), args=[request_id])

    async def settle(self, admission: Admission, used_tokens: int, cost_pico_usd: int) -> None:
        if admission.settled:
            return
        admission.settled = True
        await self._release(admission.tenant_id, admission.request_id)
        await self.redis.hincrby(tpd_key(admission.tenant_id), admission.lease_id,
                                 used_tokens - admission.reserved_tokens)
        # Month-to-date spend once per line, however often the line was generated.
        if await self.redis.set(billed_key(admission.request_id), 1, nx=True, ex=BILLED_TTL_S):
            await record_spend(self.redis, admission.tenant_id, cost_pico_usd, admission.month)

    async def settle_and_append(self, admission: Admission, used_tokens: int, cost_pico_usd: int,
                                record: UsageRecord) -> tuple[Exception | None, Exception | None]:
        settle_error = append_error = None
        try:
            await self.settle(admission, used_tokens, cost_pico_usd)
        except Exception as exc:
            settle_error = exc
        try:
            await append_usage(self.redis, record)
        except Exception as exc:
            append_error = exc
        return settle_error, append_error

    async def renew_lease(self, admission: Admission) -> None:
        """Batch lines hold no concurrency lease."""


@dataclass(eq=False)
class BatchRuntime(GatewayRuntime):
    request_class: str = BATCH_REQUEST_CLASS
    authenticates: bool = False  # lines carry their tenant: no key cache

    @classmethod
    def configure(cls, settings: Settings) -> Settings:
        return batch_settings(settings)

    @classmethod
    def router_for(cls, settings: Settings, engine: EngineClient, resolver: Resolver | None = None) -> Router:
        return BatchRouter(settings, engine, resolver)

    @classmethod
    def admission_for(cls, redis: Redis, settings: Settings) -> BatchAdmission:  # type: ignore[override]
        # A line's hold outlives the longest it may run (its worker died: the hold lapses after that).
        return BatchAdmission(redis, hold_ttl_s=settings.request_timeout_s + 60)

