"""Admission: one Redis Lua script per request decides, atomically across every gateway process and
machine, whether a tenant may start a request now.

Checks, all in ``admit.lua`` against Redis ``TIME`` (so gateways with skewed clocks agree):
- **RPM** and **TPM** are token buckets of capacity ``limit`` refilled continuously at
  ``limit / rate_limit_window_s`` per second (OpenAI describes its limits this way). A request takes one
  request and reserves ``prompt + max_tokens`` tokens (``reservation_tokens``); it is admitted only if
  the bucket holds them, so the tokens admitted in any interval never exceed capacity + refill.
  ``settle`` reconciles the reservation with the real usage: it refunds the unused part (never above
  capacity) and charges an overshoot, which may leave the bucket in debt.
- **Concurrency**: every admitted request holds a lease (a ZSET member scored by its expiry,
  ``stream_lease_ttl_s`` ahead). ``settle`` releases it; a long request calls ``renew_lease`` well within
  the TTL; a lease whose gateway died expires and is pruned inside the next script. ``max_concurrency``
  caps the live leases of a tenant (streaming or not).
- **Monthly budget** (interactive + batch spend, ``billing.spend``): a request is admitted while
  ``spent + held < budget``, where ``held`` sums the estimated (worst-case) cost of the tenant's admitted
  but unsettled requests. So concurrent requests cannot jointly overshoot: the month's spend exceeds the
  budget by at most the cost of the one request admitted last. ``settle`` adds the real cost.
- **Status**: an admin-suspended tenant gets 403 ``account_deactivated``; a tenant suspended for billing
  gets 429 ``insufficient_quota`` with ``x-should-retry: false`` (OpenAI's answer to an account without
  credit). Checked before the script, from the (pub/sub-invalidated) auth cache.

Rejections are ``AdmissionRejected`` (429) with OpenAI's types (``requests``, ``tokens``,
``insufficient_quota``), ``x-ratelimit-*``, ``retry-after``/``retry-after-ms`` when waiting helps, and
``x-should-retry: false`` when it cannot help soon (budget spent, a zero limit, a request larger than
the TPM bucket). Redis unreachable → 503: admission fails closed, because the usage outbox lives in the
same Redis and unmetered traffic would be unbillable.
"""

from __future__ import annotations

import contextlib
import uuid
from datetime import UTC, datetime
from importlib import resources

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord, append_usage
from billing.spend import MONTH_OF_LUA, month_field, spend_key, tenant_tag
from gateway.admission.headers import format_duration_ms, rate_limit_headers, retry_headers
from gateway.admission.limits import STATUS_ACTIVE, STATUS_SUSPENDED_BILLING, Admission, TenantLimits
from gateway.admission.resp import LeanRedis
from gateway.errors import PermissionDeniedError, RateLimitError, ServiceUnavailableError
from tollgate.settings import Settings

QUOTA_MESSAGE = "You exceeded your current quota, please check your plan and billing details."


class AdmissionRejected(RateLimitError):
    """429: a rate limit, the concurrency cap or the monthly budget said no."""


def admission_script(name: str) -> str:
    common = resources.files(__package__).joinpath("common.lua").read_text()
    body = resources.files(__package__).joinpath(name).read_text()
    return MONTH_OF_LUA + common + body


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _prefix(tenant_id: int) -> str:
    return f"tollgate:adm:{tenant_tag(tenant_id)}"  # every key of a tenant in one Redis Cluster slot


def admission_keys(tenant_id: int) -> tuple[str, str, str, str]:
    """(request bucket, token bucket, leases, cost holds) of a tenant."""
    prefix = _prefix(tenant_id)
    return f"{prefix}:rpm", f"{prefix}:tpm", f"{prefix}:leases", f"{prefix}:holds"


def batch_hold_keys(tenant_id: int) -> tuple[str, str]:
    """(batch leases, batch holds) of a tenant: the cost its batch lines in flight may still reach, which
    interactive admission counts against the budget as the batch tier counts interactive holds."""
    prefix = _prefix(tenant_id)
    return f"{prefix}:batch_leases", f"{prefix}:batch_holds"


def _limit_arg(limit: int | None) -> int:
    return -1 if limit is None else limit


class AdmissionController:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        if settings.rate_limit_window_s <= 0 or settings.stream_lease_ttl_s <= 0:
            raise ValueError("rate_limit_window_s and stream_lease_ttl_s must be > 0")
        self._redis = redis
        self._window_us = round(settings.rate_limit_window_s * 1_000_000)
        self._lease_ttl_ms = max(1, round(settings.stream_lease_ttl_s * 1000))
        self._admit = redis.register_script(admission_script("admit.lua"))
        self._settle = redis.register_script(admission_script("settle.lua"))
        self._renew = redis.register_script(admission_script("renew.lua"))
        # The two per-request round trips (admit; settle + usage record) go over a lean connection
        # where the client allows it (``gateway.admission.resp``); everything else uses redis-py.
        self._lean = LeanRedis.for_client(redis)

    async def admit(self, limits: TenantLimits, request_id: str, reserved_tokens: int,
                    estimated_cost_pico_usd: int) -> Admission:
        """Admit the request or raise ``AdmissionRejected`` (or ``PermissionDeniedError`` for a suspended
        tenant, ``ServiceUnavailableError`` when Redis cannot be reached)."""
        if reserved_tokens < 0 or estimated_cost_pico_usd < 0:
            raise ValueError("reserved_tokens and estimated_cost_pico_usd must be >= 0")
        if limits.status == STATUS_SUSPENDED_BILLING:
            raise AdmissionRejected(QUOTA_MESSAGE, type="insufficient_quota", code="insufficient_quota",
                                    headers=retry_headers(None, should_retry=False))
        if limits.status != STATUS_ACTIVE:
            raise PermissionDeniedError("This organization has been deactivated; contact your administrator.",
                                        code="account_deactivated")
        lease_id = uuid.uuid4().hex
        rpm_key, tpm_key, leases_key, holds_key = admission_keys(limits.tenant_id)
        keys = [rpm_key, tpm_key, leases_key, holds_key, spend_key(limits.tenant_id),
                *batch_hold_keys(limits.tenant_id)]
        args: list[str | int] = [
            _limit_arg(limits.rpm_limit), _limit_arg(limits.tpm_limit),
            _limit_arg(limits.max_concurrency), _limit_arg(limits.monthly_budget_pico_usd),
            self._window_us, reserved_tokens, lease_id, self._lease_ttl_ms, str(estimated_cost_pico_usd),
        ]
        try:
            raw = None
            if self._lean is not None:
                with contextlib.suppress(NoScriptError):  # not loaded (yet): redis-py's path loads it
                    raw = await self._lean.call("EVALSHA", self._admit.sha, len(keys), *keys, *args)
            if raw is None:
                raw = await self._admit(keys=keys, args=args)
        except RedisError as exc:
            raise ServiceUnavailableError(
                "Rate limiting is temporarily unavailable; please retry.",
                headers=retry_headers(1000, should_retry=True),
            ) from exc
        verdict = _text(raw[0])
        req_left, req_reset, tok_left, tok_reset, retry_ms = (int(v) for v in raw[1:])
        headers = rate_limit_headers(
            rpm_limit=limits.rpm_limit, requests_remaining=req_left, requests_reset_ms=req_reset,
            tpm_limit=limits.tpm_limit, tokens_remaining=tok_left, tokens_reset_ms=tok_reset,
        )
        if verdict == "ok":
            return Admission(request_id=request_id, tenant_id=limits.tenant_id, lease_id=lease_id,
                             reserved_tokens=reserved_tokens, headers=headers, tpm_limit=limits.tpm_limit,
                             month=month_field(datetime.now(UTC)))
        raise _rejection(verdict, limits, reserved_tokens, req_left, tok_left, retry_ms, headers)

    async def settle(self, admission: Admission, used_tokens: int, cost_pico_usd: int) -> None:
        """Release the lease, reconcile the token reservation with ``used_tokens`` (prompt + completion)
        and add ``cost_pico_usd`` to the month's spend. A second call for the same admission does
        nothing. Raises ``RedisError`` if Redis cannot be reached (the caller's outbox append would
        fail the same way; the lease then expires by itself)."""
        if used_tokens < 0 or cost_pico_usd < 0:
            raise ValueError("used_tokens and cost_pico_usd must be >= 0")
        if admission.settled:
            return
        _, tpm_key, leases_key, holds_key = admission_keys(admission.tenant_id)
        await self._settle(
            keys=[tpm_key, leases_key, holds_key, spend_key(admission.tenant_id)],
            args=[_limit_arg(admission.tpm_limit), self._window_us, admission.reserved_tokens - used_tokens,
                  admission.lease_id, str(cost_pico_usd), admission.month or ""],
        )
        admission.settled = True

    async def settle_and_append(self, admission: Admission, used_tokens: int, cost_pico_usd: int,
                                record: UsageRecord) -> tuple[Exception | None, Exception | None]:
        """``settle`` and ``billing.outbox.append_usage(record)`` in one Redis round trip (a pipeline, not
        a transaction: the usage stream is not in the tenant's Cluster slot). Returns the errors of the
        two parts (None: done); the append is attempted even if the settle fails."""
        if used_tokens < 0 or cost_pico_usd < 0:
            raise ValueError("used_tokens and cost_pico_usd must be >= 0")
        if admission.settled:
            try:
                await append_usage(self._redis, record)
            except Exception as exc:
                return None, exc
            return None, None
        _, tpm_key, leases_key, holds_key = admission_keys(admission.tenant_id)
        keys = [tpm_key, leases_key, holds_key, spend_key(admission.tenant_id)]
        args: list[str | int] = [_limit_arg(admission.tpm_limit), self._window_us,
                                 admission.reserved_tokens - used_tokens, admission.lease_id,
                                 str(cost_pico_usd), admission.month or ""]
        try:
            if self._lean is not None:
                settled, appended = await self._lean.pipeline(
                    ("EVALSHA", self._settle.sha, len(keys), *keys, *args),
                    ("XADD", USAGE_STREAM, "*", RECORD_FIELD, record.to_json()))
            else:
                async with self._redis.pipeline(transaction=False) as pipe:
                    pipe.evalsha(self._settle.sha, len(keys), *keys, *args)
                    pipe.xadd(USAGE_STREAM, {RECORD_FIELD: record.to_json()})
                    settled, appended = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # the connection failed: neither part is known to have happened
            settle_error: Exception | None = exc
            try:
                await append_usage(self._redis, record)
            except Exception as append_exc:
                return settle_error, append_exc
            return settle_error, None
        settle_error = settled if isinstance(settled, Exception) else None
        append_error = appended if isinstance(appended, Exception) else None
        if isinstance(settled, NoScriptError):  # Redis restarted or flushed its scripts: load and run
            try:
                await self._settle(keys=keys, args=args)
                settle_error = None
            except Exception as exc:
                settle_error = exc
        if settle_error is None:
            admission.settled = True
        return settle_error, append_error

    async def renew_lease(self, admission: Admission) -> None:
        """Push the lease's expiry ``stream_lease_ttl_s`` ahead. Call it at least every TTL/3 while a
        request runs. A lease that already lapsed is not revived (its slot may have been reused)."""
        if admission.settled:
            return
        _, _, leases_key, holds_key = admission_keys(admission.tenant_id)
        await self._renew(keys=[leases_key, holds_key], args=[admission.lease_id, self._lease_ttl_ms])


def _rejection(verdict: str, limits: TenantLimits, reserved: int, req_left: int, tok_left: int,
               retry_ms: int, headers: dict[str, str]) -> AdmissionRejected:
    if verdict == "quota":
        return AdmissionRejected(QUOTA_MESSAGE, type="insufficient_quota", code="insufficient_quota",
                                 headers={**headers, **retry_headers(None, should_retry=False)})
    if verdict == "blocked":
        return AdmissionRejected(
            "This organization's rate limit is 0 for this API; contact your administrator.",
            type="requests", headers={**headers, **retry_headers(None, should_retry=False)})
    if verdict == "too_large":
        return AdmissionRejected(
            f"Request too large for tokens per min (TPM): Limit {limits.tpm_limit}, Requested {reserved}. "
            "The input or output tokens must be reduced in order to run successfully.",
            type="tokens", headers={**headers, **retry_headers(None, should_retry=False)})
    wait = f"Please try again in {format_duration_ms(max(1, retry_ms))}."
    if verdict == "requests":
        message = (f"Rate limit reached for requests per min (RPM): Limit {limits.rpm_limit}, "
                   f"Used {(limits.rpm_limit or 0) - max(0, req_left)}, Requested 1. {wait}")
        kind = "requests"
    elif verdict == "tokens":
        message = (f"Rate limit reached for tokens per min (TPM): Limit {limits.tpm_limit}, "
                   f"Used {(limits.tpm_limit or 0) - tok_left}, Requested {reserved}. {wait}")
        kind = "tokens"
    elif verdict == "concurrency":
        message = f"Too many concurrent requests: Limit {limits.max_concurrency}. {wait}"
        kind = "requests"
    else:
        raise RuntimeError(f"unknown admission verdict {verdict!r}")
    return AdmissionRejected(message, type=kind,
                             headers={**headers, **retry_headers(retry_ms, should_retry=True)})
