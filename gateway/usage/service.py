"""Tenant usage and costs in the shape of OpenAI's Usage API (``UsageResponse`` pages of ``bucket``s with
``organization.usage.completions.result`` / ``organization.costs.result`` results).

Invariants:
- Buckets are whole UTC widths (``1m``, ``1h``, ``1d``) starting at ``start_time`` rounded down to the
  width, up to ``end_time`` (exclusive, now by default); every bucket in the range is listed, empty ones
  with no results, like OpenAI. The page holds ``limit`` buckets; ``next_page`` is an opaque cursor
  (the next bucket's start) while more remain.
- ``1h``/``1d`` read the hourly rollups; ``1m`` reads the ledger. So the numbers are the ledger's, and
  costs are exact pico-USD sums converted to USD once per result (``amount.value``, a JSON number).
- ``group_by`` supports ``model`` and ``batch`` (usage) and ``line_item`` (costs: model × class × token
  kind); Tollgate has no projects or users, so grouping or filtering by them (or by API key, which the
  rollups do not keep) is a 400 naming the parameter rather than a silently wrong answer.
- Every token kind under the prompt or the output is a field ``<input|output>_<field>``
  (``detail_fields``, from ``engine.usage.KINDS``): OpenAI's own and Tollgate's additions alike.
- Prompt-cache products: as in OpenAI's schema, ``input_tokens`` = ``input_cached_tokens`` +
  ``input_cache_write_tokens`` + ``input_uncached_tokens`` (cache writes are prompt tokens the engine
  computed, never cached ones); ``input_cached_host_tokens`` / ``input_cached_disk_tokens`` say which
  of the cached ones came from host memory and disk. Tollgate adds ``input_cache_pinned_tokens`` (pinned
  in host memory for ``prompt_cache_options.ttl``) and ``input_cache_retained_tokens`` (kept on disk for
  ``prompt_cache_retention: "24h"``), prompt tokens counted in ``input_tokens`` too. Their costs are the
  line items ``cache write``, ``cache pin`` and ``cache retention``, listed only when there are some.
- Predicted Outputs: Tollgate adds ``output_accepted_prediction_tokens`` and
  ``output_rejected_prediction_tokens``, output tokens counted in ``output_tokens`` too (the rejected
  ones are billed as output, as OpenAI bills them: no line item of their own).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from engine.usage import KINDS, SURCHARGE_KINDS, TokenKind, Usage, root_of, total
from gateway.errors import InvalidRequestError
from gateway.usage.repository import UsageRepository, UsageRow
from tollgate.models import LATEST_TIME

WIDTH_S = {"1m": 60, "1h": 3600, "1d": 86400}
USAGE_LIMITS = {"1m": (60, 1440), "1h": (24, 168), "1d": (7, 31)}  # (default, max) buckets per page
COSTS_LIMITS = (7, 180)
USAGE_GROUPS = ("model", "batch")
PICO_PER_USD = Decimal(10**12)


@dataclass(frozen=True, slots=True)
class Page:
    starts: list[int]
    width_s: int
    next_page: str | None

    @property
    def start(self) -> datetime:
        return datetime.fromtimestamp(self.starts[0], UTC)

    @property
    def end(self) -> datetime:
        return datetime.fromtimestamp(self.starts[-1] + self.width_s, UTC)


def encode_cursor(bucket_start: int) -> str:
    return base64.urlsafe_b64encode(f"tg1:{bucket_start}".encode()).decode().rstrip("=")


def decode_cursor(page: str) -> int:
    try:
        raw = base64.urlsafe_b64decode(page + "=" * (-len(page) % 4)).decode()
        prefix, value = raw.split(":", 1)
        if prefix != "tg1":
            raise ValueError(prefix)
        return int(value)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise InvalidRequestError("Invalid 'page': not a cursor returned by this API.", param="page",
                                  code="invalid_value") from None


MAX_TIME_S = int(LATEST_TIME.timestamp())  # later times are refused (tollgate.models.LATEST_TIME)


def plan_page(start_time: int, end_time: int | None, width: str, limit: int | None, page: str | None,
              limits: tuple[int, int], *, now: int) -> Page:
    if width not in WIDTH_S:
        raise InvalidRequestError(f"Invalid 'bucket_width': {width!r}.", param="bucket_width",
                                  code="invalid_value")
    default, maximum = limits
    limit = default if limit is None else limit
    if not 1 <= limit <= maximum:
        raise InvalidRequestError(f"Invalid 'limit': must be between 1 and {maximum} for bucket_width "
                                  f"{width}.", param="limit", code="invalid_value")
    for name, value in (("start_time", start_time), ("end_time", end_time)):
        if value is not None and value > MAX_TIME_S:
            raise InvalidRequestError(f"Invalid '{name}': {value} is past the year 3000 (Unix seconds).",
                                      param=name, code="invalid_value")
    end = now if end_time is None else end_time
    if start_time < 0 or end <= start_time:
        raise InvalidRequestError("Invalid 'end_time': it must be after 'start_time'.", param="end_time",
                                  code="invalid_value")
    w = WIDTH_S[width]
    first = start_time - start_time % w
    if page is not None:
        cursor = decode_cursor(page)
        if cursor < first or cursor % w:
            raise InvalidRequestError("Invalid 'page': it does not belong to this query.", param="page",
                                      code="invalid_value")
        first = cursor
    # The page's buckets and whether one follows, never the whole range: a range of decades in minutes
    # would otherwise be listed in memory, one request stalling the worker.
    starts = list(range(first, end, w)[:limit + 1])  # empty only for a cursor at or past end_time
    more = len(starts) > limit
    starts = starts[:limit]
    return Page(starts, w, encode_cursor(starts[-1] + w) if more else None)


def _unsupported(name: str, value: Any) -> None:
    if value:
        raise InvalidRequestError(f"Invalid '{name}': Tollgate has no projects or users and keeps no per-key "
                                  "rollups; this filter is not supported.", param=name, code="invalid_value")


def _bucket_of(row: UsageRow, page: Page) -> int:
    return int(row.at.timestamp()) // page.width_s * page.width_s


def _empty_buckets(page: Page) -> dict[int, dict[Any, list[UsageRow]]]:
    return {s: {} for s in page.starts}


async def completions_usage(repo: UsageRepository, *, start_time: int, end_time: int | None,
                            bucket_width: str, models: Sequence[str] | None, batch: bool | None,
                            group_by: Sequence[str] | None,
                            limit: int | None, page: str | None, project_ids: Sequence[str] | None = None,
                            user_ids: Sequence[str] | None = None, api_key_ids: Sequence[str] | None = None,
                            now: int) -> dict[str, Any]:
    for name, value in (("project_ids", project_ids), ("user_ids", user_ids), ("api_key_ids", api_key_ids)):
        _unsupported(name, value)
    groups = list(dict.fromkeys(group_by or []))
    for group in groups:
        if group not in USAGE_GROUPS:
            raise InvalidRequestError(f"Invalid 'group_by': {group!r} is not supported (use model, batch).",
                                      param="group_by", code="invalid_value")
    plan = plan_page(start_time, end_time, bucket_width, limit, page, USAGE_LIMITS.get(bucket_width, (1, 1)),
                     now=now)
    klass = None if batch is None else ("batch" if batch else "interactive")
    rows: list[UsageRow] = []
    if plan.starts:
        fetch = repo.by_minute if bucket_width == "1m" else repo.hourly
        rows = await fetch(plan.start, plan.end, models=models, request_class=klass)
    buckets = _empty_buckets(plan)
    for row in rows:
        key = (row.model if "model" in groups else None,
               (row.request_class == "batch") if "batch" in groups else None)
        buckets.setdefault(_bucket_of(row, plan), {}).setdefault(key, []).append(row)
    data = []
    for start in plan.starts:
        results = []
        for (model, is_batch), members in sorted(buckets[start].items(), key=lambda kv: (str(kv[0][0]),
                                                                                         str(kv[0][1]))):
            usage = total(r.usage for r in members)
            results.append({
                "object": "organization.usage.completions.result", "input_tokens": usage.prompt_tokens,
                "output_tokens": usage.completion_tokens, **detail_fields(usage),
                "input_uncached_tokens": max(0, usage.billed()[TokenKind.INPUT] - usage.cache_write_tokens),
                "input_audio_tokens": 0,
                "output_audio_tokens": 0, "num_model_requests": sum(r.requests for r in members),
                "project_id": None, "user_id": None, "api_key_id": None, "model": model, "batch": is_batch,
                "service_tier": None})
        data.append({"object": "bucket", "start_time": start, "end_time": start + plan.width_s,
                     "results": results})
    return {"object": "page", "data": data, "has_more": plan.next_page is not None,
            "next_page": plan.next_page}


def detail_fields(usage: Usage) -> dict[str, int]:
    """Every kind but the prompt and the output, as ``<side>_<field>``: OpenAI's ``input_cached_tokens``
    and ``input_cache_write_tokens``, and Tollgate's own (``input_cached_host_tokens``,
    ``output_accepted_prediction_tokens``, ...)."""
    return {f"{root_of(k).value}_{spec.field}": usage[k]
            for k, spec in KINDS.items() if spec.within is not None}


def line_item(row: UsageRow, kind: TokenKind) -> str:
    """``"<model>, [batch ]<price name>"`` (``"m, batch cached input"``)."""
    prefix = "batch " if row.request_class == "batch" else ""
    return f"{row.model}, {prefix}{(KINDS[kind].price or kind.value).replace('_', ' ')}"


def usd(pico: int) -> float:
    return float(Decimal(pico) / PICO_PER_USD)


async def costs(repo: UsageRepository, *, start_time: int, end_time: int | None, bucket_width: str,
                group_by: Sequence[str] | None, limit: int | None, page: str | None,
                project_ids: Sequence[str] | None = None, api_key_ids: Sequence[str] | None = None,
                now: int) -> dict[str, Any]:
    _unsupported("project_ids", project_ids)
    _unsupported("api_key_ids", api_key_ids)
    groups = list(dict.fromkeys(group_by or []))
    for group in groups:
        if group != "line_item":
            raise InvalidRequestError(f"Invalid 'group_by': {group!r} is not supported (use line_item).",
                                      param="group_by", code="invalid_value")
    if bucket_width != "1d":
        raise InvalidRequestError("Invalid 'bucket_width': only 1d is supported for costs.",
                                  param="bucket_width", code="invalid_value")
    plan = plan_page(start_time, end_time, bucket_width, limit, page, COSTS_LIMITS, now=now)
    rows = await repo.hourly(plan.start, plan.end) if plan.starts else []
    per_bucket: dict[int, dict[str, list[int]]] = {s: {} for s in plan.starts}
    for row in rows:
        items = per_bucket.setdefault(_bucket_of(row, plan), {})
        for kind, tokens in row.usage.billed().items():
            amount = row.costs.costs.get(kind, 0)
            if kind in SURCHARGE_KINDS and not (tokens or amount):
                continue
            name = line_item(row, kind) if groups else ""
            acc = items.setdefault(name, [0, 0])
            acc[0] += amount
            acc[1] += tokens
    data = []
    for start in plan.starts:
        results = [{"object": "organization.costs.result",
                    "amount": {"value": usd(amount), "currency": "usd"},
                    "line_item": name or None, "project_id": None, "api_key_id": None,
                    "quantity": tokens if groups else None, "quantity_unit": "tokens" if groups else None}
                   for name, (amount, tokens) in sorted(per_bucket[start].items())]
        data.append({"object": "bucket", "start_time": start, "end_time": start + plan.width_s,
                     "results": results})
    return {"object": "page", "data": data, "has_more": plan.next_page is not None,
            "next_page": plan.next_page}
