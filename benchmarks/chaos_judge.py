"""The chaos benchmark's judge: after the faults, with everything flushed, does the ledger equal what the
clients were told?

``settle`` waits until the platform is quiet: batches ended, stream leases expired (one one-token request per
tenant then prunes them inside the admission script), the usage outbox drained into Postgres and every usage
spool empty; then runs the spend reconciliation beat runs. ``judge`` reads the chaos tenants' ledger rows and
checks, per request the clients made:
- ``ok`` (the client got the whole answer and its usage): exactly one row, ``completed``, with the client's
  prompt, cached and completion tokens; a missing row is **lost**;
- ``abandoned``: one row, ``cancelled`` (or ``completed``: it ended before the gateway saw the client go;
  or ``failed``, when its replica was killed meanwhile: the stream failed midway before the gateway saw
  the client go), billed at least what the client read; none when the gateway worker serving it was
  killed meanwhile (no process was left to settle it: the platform's loss, counted apart, never the tenant's);
- an error (``http_error``, ``broken``): the status is a documented one (never 500), and its row, if any, is
  ``failed``/``cancelled`` (a non-streamed error bills nothing; a broken stream at most what it computed);
- ``transport`` (no answer): no client-known id; such rows show up as unattributed below. A non-streamed
  answer (or a background response's creation) is recorded before it is sent, so a gateway worker killed
  between the two leaves a ``completed`` row whose client saw only a broken connection: each transport
  error of a non-streamed request that a worker kill cut may explain one such row (counted apart as
  ``billed_undelivered_worker_killed``), and no other request may;
- every row's cost is its tokens at the model's price in effect (``billing.prices``);
- background responses, read back at the end: none still queued or running; each that ended with usage
  has exactly one ``completed`` row of that usage (its row carries the worker's request id); no other
  ``completed`` row exists that no client knows (a request whose connection died must not be billed as
  delivered);
- batches: each ended ``completed``, its output and error files have each ``custom_id`` exactly once, and
  the ledger has exactly one ``completed`` row per line answered 200 (``gateway.batches.lines.
  line_request_id``: no line ran twice) and none billed for a line that failed (its replica died mid-line);
- admission counters back to zero (live concurrency leases, cost holds) and the month's spend counter equal
  to the ledger's sum, per tenant;
- a request id never has two rows (**doubled**; the ledger's unique key makes it impossible, checked anyway).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from datetime import UTC, datetime
from typing import Any

import httpx
import redis.asyncio as aioredis
from sqlalchemy import select

from benchmarks.chaos_faults import FaultRecord
from benchmarks.chaos_load import Load, LoadLog, Outcome, Tenant
from benchmarks.chaos_platform import ChaosPlatform
from billing.outbox import USAGE_STREAM
from billing.price_cache import load_price_book
from billing.prices import cost_pico_usd
from billing.spend import month_field, spend_key
from billing.tasks import reconcile_spend_once
from gateway.admission.controller import admission_keys
from gateway.batches.lines import line_request_id
from tollgate.db import Database
from tollgate.models import Tenant as TenantRow
from tollgate.models import UsageEvent
from tollgate.settings import Settings

# What the API may answer under faults (OpenAI's meanings): rate limits, unavailable / overloaded / shutting
# down / store unavailable, an upstream failure. A 500 is never one of them.
DOCUMENTED_ERRORS = {429, 502, 503, 504}
SETTLE_TIMEOUT_S = 240.0


async def _poll(
    condition: Any, what: str, timeout_s: float = SETTLE_TIMEOUT_S, interval_s: float = 0.5
) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = await condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(interval_s)


async def settle(platform: ChaosPlatform, load: Load, tenants: list[Tenant], last_fault_at: float
                 ) -> dict[str, Any]:  # fmt: skip
    """Wait until the platform is quiet; returns the batches' final objects by id. ``last_fault_at``:
    ``time.monotonic()`` of the last kill."""
    finals: dict[str, Any] = {}
    by_name = {t.name: t for t in tenants}
    async with httpx.AsyncClient(base_url=platform.base_url, timeout=30.0) as client:
        for batch in load.log.batches:

            async def ended(batch: Any = batch) -> bool:
                try:
                    answer = await client.get(
                        f"/v1/batches/{batch.batch_id}", headers=by_name[batch.tenant].headers
                    )
                except httpx.TransportError:
                    return False
                if answer.status_code == 200 and answer.json()["status"] in (
                    "completed",
                    "failed",
                    "expired",
                    "cancelled",
                ):
                    finals[batch.batch_id] = answer.json()
                    return True
                return False

            await _poll(ended, f"batch {batch.batch_id} to end")
        # A lease left behind (its gateway or Celery worker killed, or its release lost with Redis) was
        # last refreshed before that fault: it has expired a TTL after the last kill. One request per
        # tenant then prunes them (admission prunes inside its script). Every other lease was released.
        ttl_s = float(platform.env.get("TOLLGATE_STREAM_LEASE_TTL_S", "6"))
        await asyncio.sleep(max(0.0, last_fault_at + ttl_s + 1.0 - time.monotonic()))
        for tenant in tenants:
            outcome = Outcome(
                op="settle_probe", tenant=tenant.name, kind="transport", started=time.monotonic()
            )
            body = {"model": "tiny", "messages": [{"role": "user", "content": "settle"}], "max_tokens": 1}
            response = await client.post("/v1/chat/completions", json=body, headers=tenant.headers)
            outcome.status, outcome.request_id = response.status_code, response.headers.get("x-request-id")
            if response.status_code == 200:
                usage = response.json()["usage"]
                outcome.kind = "ok"
                outcome.usage = {
                    "prompt_tokens": usage["prompt_tokens"],
                    "completion_tokens": usage["completion_tokens"],
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                }
            else:
                outcome.kind = "http_error"
            outcome.ended = time.monotonic()
            load.log.outcomes.append(outcome)
    redis = aioredis.Redis.from_url(platform.redis_url)
    spool = platform.data_dir / "spool"
    try:

        async def drained() -> bool:
            spooled = any(p.stat().st_size for p in spool.glob("usage-*")) if spool.is_dir() else False
            return not spooled and await redis.xlen(USAGE_STREAM) == 0

        await _poll(drained, "the usage outbox and spools to drain into the ledger")
    finally:
        await redis.aclose()
    settings = Settings(environment="test", database_url=platform.database_url, redis_url=platform.redis_url)
    await reconcile_spend_once(settings)
    return finals


async def _batch_output(
    platform: ChaosPlatform, tenant: Tenant, final: dict[str, Any]
) -> list[dict[str, Any]]:
    """Every line of the batch's output and error files (a failed line is in the error file)."""
    lines: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=platform.base_url, timeout=30.0, headers=tenant.headers) as client:
        for file_id in (final.get("output_file_id"), final.get("error_file_id")):
            if file_id:
                content = await client.get(f"/v1/files/{file_id}/content")
                lines += [json.loads(line) for line in content.text.splitlines() if line.strip()]
    return lines


class Verdict:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)

    def fail(self, check: str, example: str) -> None:
        self.counts[check] += 1
        if len(self.examples[check]) < 5:
            self.examples[check].append(example)

    def ok(self, check: str) -> None:
        self.counts[check] += 0


def _row_usage(row: UsageEvent) -> tuple[int, int, int]:
    return row.prompt_tokens, row.cached_tokens, row.completion_tokens


async def _background_finals(platform: ChaosPlatform, log: LoadLog,
                             tenants: list[Tenant]) -> list[tuple[str, tuple[int, int] | None]]:
    """(status, (input tokens, output tokens)) of every background response, read back now."""
    by_name = {t.name: t for t in tenants}
    finals = []
    async with httpx.AsyncClient(base_url=platform.base_url, timeout=30.0) as client:
        for outcome in log.outcomes:
            if outcome.op != "background" or outcome.response_id is None:
                continue
            answer = (await client.get(f"/v1/responses/{outcome.response_id}",
                                       headers=by_name[outcome.tenant].headers)).json()
            usage = answer.get("usage")
            finals.append((answer["status"],
                           (usage["input_tokens"], usage["output_tokens"]) if usage else None))
    return finals


# The load's operations answered in one piece (the background one: its creation), not streamed.
UNSTREAMED = frozenset({"chat", "cached_chat", "embeddings", "response", "background"})


def _during(outcome: Outcome, kills: list[float]) -> bool:
    """Whether one of these kills happened while the request ran (or just after the client left it)."""
    return any(outcome.started <= at <= outcome.ended + 1.0 for at in kills)


def unexplained_completed(
    found: collections.Counter[tuple[int, int]],
    expected: collections.Counter[tuple[int, int]],
    outcomes: list[Outcome],
    worker_kills: list[float],
) -> tuple[collections.Counter[tuple[int, int]], int]:
    """The completed rows no client knows (``found``, by (prompt, completion) tokens) that nothing explains,
    and how many were explained as answers billed and then lost with a killed gateway worker.

    ``expected``: background responses' usage, whose rows carry the worker's request id. Beyond those, one
    row per transport error of an unstreamed request during a gateway worker's kill (see the module's
    docstring); more rows than that are unexplained, all of them reported."""
    extra = found - expected
    cut = sum(1 for o in outcomes
              if o.kind == "transport" and o.op in UNSTREAMED and _during(o, worker_kills))  # fmt: skip
    if extra.total() > cut:
        return extra, 0
    return collections.Counter(), extra.total()


async def judge(
    platform: ChaosPlatform,
    log: LoadLog,
    tenants: list[Tenant],
    batch_finals: dict[str, Any],
    faults: list[FaultRecord],
) -> dict[str, Any]:
    verdict = Verdict()
    for check in (
        "lost",
        "doubled",
        "mismatched",
        "status_500",
        "undocumented_status",
        "abandoned_underbilled",
        "abandoned_status",
        "error_billed_completed",
        "unattributed_completed",
        "cost_wrong",
        "batch_not_completed",
        "batch_line_missing_or_repeated",
        "batch_line_rows_wrong",
        "leases_left",
        "holds_left",
        "background_stuck",
        "spend_differs",
    ):
        verdict.ok(check)
    db = Database(platform.database_url, pool_size=1)
    try:
        async with db.session() as session:
            names = [t.name for t in tenants]
            tenant_rows = (await session.scalars(select(TenantRow).where(TenantRow.name.in_(names)))).all()
            tenant_ids = {row.name: row.id for row in tenant_rows}
            rows = (
                await session.scalars(select(UsageEvent).where(UsageEvent.tenant_id.in_(tenant_ids.values())))
            ).all()
            book = await load_price_book(session)
    finally:
        await db.dispose()
    by_id: dict[str, list[UsageEvent]] = collections.defaultdict(list)
    for row in rows:
        by_id[row.request_id].append(row)
    for request_id, same in by_id.items():
        if len(same) > 1:
            verdict.fail("doubled", request_id)
    for row in rows:
        price = book.price_for(row.model, row.created_at)
        costs = set()
        for embedding in (False, True):
            try:
                costs.add(
                    cost_pico_usd(
                        price,
                        row.prompt_tokens,
                        row.cached_tokens,
                        row.completion_tokens,
                        row.request_class,
                        embedding=embedding,
                        cache_write_tokens=0 if embedding else row.cache_write_tokens,
                        cache_pinned_tokens=0 if embedding else row.cache_pinned_tokens,
                        cache_retained_tokens=0 if embedding else row.cache_retained_tokens,
                    )
                )
            except ValueError:
                pass
        if row.cost_pico_usd not in costs:
            verdict.fail("cost_wrong", f"{row.request_id}: {row.cost_pico_usd} not in {sorted(costs)}")

    known: set[str] = set()
    outcomes_by_kind: collections.Counter[tuple[str, str]] = collections.Counter()
    statuses: collections.Counter[str] = collections.Counter()
    unbilled_by_worker_kill = 0
    worker_kills = [f.killed_at for f in faults if f.kind == "gateway_worker"]
    engine_kills = [f.killed_at for f in faults if f.kind == "engine"]
    for outcome in log.outcomes:
        outcomes_by_kind[(outcome.op, outcome.kind)] += 1
        if outcome.status is not None and outcome.status != 200:
            statuses[f"{outcome.status} {outcome.code or ''}".strip()] += 1
            if outcome.status == 500:
                verdict.fail("status_500", f"{outcome.op} {outcome.request_id}")
            elif outcome.status not in DOCUMENTED_ERRORS:
                verdict.fail("undocumented_status", f"{outcome.op} {outcome.status} {outcome.code}")
        if outcome.op == "background":
            continue  # its ledger row carries the worker's request id: counted among the unattributed
        if outcome.request_id is None:
            continue
        known.add(outcome.request_id)
        mine = by_id.get(outcome.request_id, [])
        if outcome.kind == "ok":
            if not mine:
                verdict.fail("lost", f"{outcome.op} {outcome.request_id}")
                continue
            row = mine[0]
            usage = outcome.usage or {}
            told = (usage.get("prompt_tokens"), usage.get("cached_tokens"), usage.get("completion_tokens"))
            if row.status != "completed" or _row_usage(row) != told:
                verdict.fail(
                    "mismatched",
                    f"{outcome.op} {outcome.request_id}: row {row.status} {_row_usage(row)} told {told}",
                )
        elif outcome.kind == "abandoned":
            if not mine and _during(outcome, worker_kills):
                unbilled_by_worker_kill += 1  # the platform's loss: nothing settled it
            elif not mine:
                verdict.fail("lost", f"abandoned {outcome.request_id}")
            elif mine[0].completion_tokens < outcome.read:
                verdict.fail(
                    "abandoned_underbilled",
                    f"{outcome.request_id}: {mine[0].status}, billed {mine[0].completion_tokens} "
                    f"< read {outcome.read}",
                )
            elif mine[0].status not in ("cancelled", "completed") and not (
                mine[0].status == "failed" and _during(outcome, engine_kills)
            ):
                verdict.fail("abandoned_status", f"{outcome.request_id}: {mine[0].status}")
        elif mine and mine[0].status == "completed":
            verdict.fail("error_billed_completed", f"{outcome.op} {outcome.kind} {outcome.request_id}")

    unattributed = [r for r in rows if r.request_id not in known and r.request_class == "interactive"]
    unattributed_statuses = collections.Counter(r.status for r in unattributed)
    # Background responses, as their stored objects finally say: each one that ended with usage has one
    # completed row of that usage; none may still be queued or running now that the platform is quiet.
    background = await _background_finals(platform, log, tenants)
    background_statuses = collections.Counter(status for status, _ in background)
    for status in ("queued", "in_progress"):
        if background_statuses[status]:
            verdict.fail("background_stuck", f"{background_statuses[status]} still {status}")
    expected = collections.Counter(usage for status, usage in background
                                   if status in ("completed", "incomplete") and usage is not None)
    found = collections.Counter((r.prompt_tokens, r.completion_tokens) for r in unattributed
                                if r.status == "completed")
    if expected - found:
        verdict.fail("lost", f"background responses without their row: {dict(expected - found)}")
    extra, billed_undelivered = unexplained_completed(found, expected, log.outcomes, worker_kills)
    if extra:
        verdict.fail("unattributed_completed", f"completed rows no client knows: {dict(extra)}")

    by_name = {t.name: t for t in tenants}
    batch_lines = 0
    for batch in log.batches:
        final = batch_finals.get(batch.batch_id, {})
        if final.get("status") != "completed":
            verdict.fail("batch_not_completed", f"{batch.batch_id}: {final.get('status')}")
        output = await _batch_output(platform, by_name[batch.tenant], final)
        seen = collections.Counter(line["custom_id"] for line in output)
        if sorted(seen) != sorted(batch.custom_ids) or any(n != 1 for n in seen.values()):
            verdict.fail("batch_line_missing_or_repeated", f"{batch.batch_id}: {dict(seen)}")
        answered = {line["custom_id"]: (line.get("response") or {}).get("status_code") for line in output}
        for custom_id in batch.custom_ids:
            batch_lines += 1
            line_rows = by_id.get(line_request_id(batch.batch_id, custom_id), [])
            rows_seen = [(r.status, r.request_class, r.cost_pico_usd) for r in line_rows]
            if answered.get(custom_id) == 200:
                wrong = len(line_rows) != 1 or line_rows[0].status != "completed"
            else:  # the line failed (e.g. its replica died mid-line: 502): billed nothing, if metered at all
                billed = any(r.status == "completed" or r.cost_pico_usd for r in line_rows)
                wrong = len(line_rows) > 1 or billed
            if wrong or any(r.request_class != "batch" for r in line_rows):
                verdict.fail("batch_line_rows_wrong", f"{batch.batch_id} {custom_id}: answered "
                                                      f"{answered.get(custom_id)}, rows {rows_seen}")

    redis = aioredis.Redis.from_url(platform.redis_url)
    month = month_field(datetime.now(UTC))
    spend_rows: collections.Counter[int] = collections.Counter()
    for row in rows:
        if month_field(row.created_at) == month:
            spend_rows[row.tenant_id] += row.cost_pico_usd
    try:
        now_ms = int(time.time() * 1000)
        for name, tenant_id in tenant_ids.items():
            _, _, leases, holds = admission_keys(tenant_id)
            live = await redis.zcount(leases, now_ms, "+inf")
            if live:
                verdict.fail("leases_left", f"{name}: {live} live leases")
            held = int(await redis.hget(holds, "_total") or 0)
            if held:
                verdict.fail("holds_left", f"{name}: {held} pico-USD held")
            spent = int(await redis.hget(spend_key(tenant_id), month) or 0)
            if spent != spend_rows[tenant_id]:
                verdict.fail("spend_differs", f"{name}: counter {spent}, ledger {spend_rows[tenant_id]}")
    finally:
        await redis.aclose()

    return {
        "requests": len([o for o in log.outcomes if o.op != "settle_probe"]),
        "outcomes": {f"{op}/{kind}": n for (op, kind), n in sorted(outcomes_by_kind.items())},
        "error_statuses": dict(statuses),
        "ledger_rows": len(rows),
        "ledger_rows_checked": len([r for r in rows if r.request_id in known]),
        "unattributed_rows": dict(unattributed_statuses),
        "background_final_statuses": dict(background_statuses),
        "abandoned_unbilled_worker_killed": unbilled_by_worker_kill,
        "billed_undelivered_worker_killed": billed_undelivered,
        "batches": len(log.batches),
        "batch_lines": batch_lines,
        "batch_submit_errors": len(log.batch_errors),
        "checks": dict(verdict.counts),
        "examples": {k: v for k, v in verdict.examples.items() if v},
        "passed": not any(verdict.counts.values()),
    }
