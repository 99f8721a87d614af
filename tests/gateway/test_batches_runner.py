"""The batch runner in-process (the code the Celery tasks call) on the real gateway app, Postgres, Redis
and an engine subprocess: line validation details, the window's expiry keeping finished lines, the
batch tokens-per-day quota deferring lines instead of failing them, and Predicted Outputs in chat lines
(their prediction tokens metered; a prediction the run refuses is the line's 400)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update

from billing.outbox import PREDICTION_TOKEN_FIELDS
from gateway.batches.dispatch import BatchDispatcher, chain_key
from gateway.batches.runner import BatchRunner
from gateway.batches.runtime import BatchRuntime, tpd_key
from gateway.files.storage import LocalFileStorage
from tests.factories import create_price
from tests.gateway.conftest import GatewayUnderTest, TenantKey, make_tenant_key, usage_records, wait_for_usage
from tests.gateway.test_files import upload
from tests.openai_schema import assert_conforms
from tollgate.models import Batch, BatchItem
from tollgate.settings import ModelConfig, PoolConfig

pytestmark = pytest.mark.slow


def line(custom_id: str, *, url: str = "/v1/chat/completions", method: str = "POST", **body: Any) -> str:
    payload = {"model": "tiny", "messages": [{"role": "user", "content": f"Hello {custom_id}"}],
               "max_tokens": 4, "temperature": 0, **body}
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": payload})


@pytest.fixture
async def runner(files_gateway: GatewayUnderTest, engine_url: str,
                 tiny_model_dir: Path) -> AsyncIterator[BatchRunner]:
    async with files_gateway.db.session() as session:
        await create_price(session, model="tiny", effective_from=datetime(2020, 1, 1, tzinfo=UTC)
                           + timedelta(seconds=uuid.uuid4().int % 10**6))
    settings = files_gateway.settings.model_copy(update={
        "models": [ModelConfig(name="tiny", path=str(tiny_model_dir))],
        "pools": {"interactive": PoolConfig(replicas=[engine_url])},
        "batch_chunk_size": 3, "batch_soak_max_waiting": 64, "batch_soak_max_inflight": 64,
    })
    redis = files_gateway.app.state.redis
    runtime = BatchRuntime.create(settings, redis, files_gateway.db.sessionmaker)
    await runtime.start()

    async def get_runtime() -> BatchRuntime:
        return runtime

    try:
        yield BatchRunner(settings, files_gateway.db, LocalFileStorage(Path(settings.file_storage_dir)),
                          BatchDispatcher(settings, redis), get_runtime)
    finally:
        await runtime.stop()


def api_client(gateway: GatewayUnderTest, tenant: TenantKey) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tenant.headers, timeout=30)


async def start_batch(client: httpx.AsyncClient, lines: list[str],
                      endpoint: str = "/v1/chat/completions") -> str:
    file_id = (await upload(client, ("\n".join(lines) + "\n").encode())).json()["id"]
    batch = await client.post("/batches", json={"input_file_id": file_id, "endpoint": endpoint,
                                                "completion_window": "24h"})
    return batch.json()["id"]


async def run_chunk(runner: BatchRunner, batch_id: str) -> int:
    """One ``batches.run`` task for chain slot 0 (with the token ``kick`` stored)."""
    token = await runner.dispatch.redis.get(chain_key(batch_id, 0))
    return await runner.run(batch_id, 0, token.decode())


async def test_validation_names_each_bad_line(runner: BatchRunner, files_gateway: GatewayUnderTest) -> None:
    tenant = await make_tenant_key(files_gateway)
    lines = [
        line("ok"),
        json.dumps(["not", "an", "object"]),
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),
        line("get", method="GET"),
        line("streamed", stream=True),
        line("unknown-model", model="gpt-nope"),
        line("bad-temperature", temperature=7),
        json.dumps({"custom_id": "no-messages", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "tiny"}}),
        line("prediction-of-a-file", prediction={"type": "file", "content": "x"}),
        line("prediction-with-n", n=2, prediction={"type": "content", "content": "Hello"}),
    ]
    async with api_client(files_gateway, tenant) as client:
        batch_id = await start_batch(client, lines)
        assert await runner.validate(batch_id) == "failed"
        errors = (await client.get(f"/batches/{batch_id}")).json()["errors"]["data"]
    found = {(e["line"], e["code"], e["param"]) for e in errors}
    assert found == {
        (2, "invalid_json_line", None),
        (3, "missing_required_parameter", "custom_id"),
        (4, "invalid_method", "method"),
        (5, "invalid_request", "body.stream"),
        (6, "model_not_found", "body.model"),
        (7, "invalid_value", "body.temperature"),
        (8, "missing_required_parameter", "body.messages"),
        (9, "invalid_value", "body.prediction.type"),
        (10, "unsupported_parameter", "body.n"),
    }
    assert await runner.validate(batch_id) == "failed"  # idempotent


async def test_expiry_keeps_finished_lines_and_expires_the_rest(runner: BatchRunner,
                                                                files_gateway: GatewayUnderTest) -> None:
    tenant = await make_tenant_key(files_gateway)
    async with api_client(files_gateway, tenant) as client:
        batch_id = await start_batch(client, [line(f"l{i}") for i in range(7)])
        assert await runner.validate(batch_id) == "in_progress"
        assert await run_chunk(runner, batch_id) == 3
        async with files_gateway.db.session() as session:
            await session.execute(update(Batch).where(Batch.id == batch_id)
                                  .values(expires_at=datetime.now(UTC) - timedelta(seconds=1)))
        await runner.sweep()
        batch = (await client.get(f"/batches/{batch_id}")).json()
        assert batch["status"] == "expired" and batch["expired_at"]
        assert batch["request_counts"] == {"total": 7, "completed": 3, "failed": 0}
        output = (await client.get(f"/files/{batch['output_file_id']}/content")).text.splitlines()
        expired = [json.loads(x) for x in (await client.get(f"/files/{batch['error_file_id']}/content"))
                   .text.splitlines()]
    assert [json.loads(x)["custom_id"] for x in output] == ["l0", "l1", "l2"]
    assert [e["custom_id"] for e in expired] == ["l3", "l4", "l5", "l6"]
    assert all(e["response"] is None and e["error"]["code"] == "batch_expired" for e in expired)


async def test_a_line_stopped_while_running_says_it_was_billed(runner: BatchRunner,
                                                                files_gateway: GatewayUnderTest) -> None:
    """A cancelled batch's line that had started keeps what its stopped attempt was billed, and its error
    says so; one that never ran says it never ran (it said so for both)."""
    from gateway.batches import repository as repo
    from gateway.batches.runner import CANCELLED, CANCELLED_RUNNING

    tenant = await make_tenant_key(files_gateway)
    async with api_client(files_gateway, tenant) as client:
        batch_id = await start_batch(client, [line("ran"), line("waited")])
        assert await runner.validate(batch_id) == "in_progress"
    async with files_gateway.db.session() as session:
        items = {i.custom_id: i for i in await session.scalars(
            select(BatchItem).where(BatchItem.batch_id == batch_id))}
        ran = items["ran"]
        await session.execute(update(BatchItem).where(BatchItem.id == ran.id).values(
            status="running", lease_owner="me"))
        await repo.release_line(session, ran.id, "me", refund_attempt=False, cost_pico_usd=1_234)
        await repo.stop_pending_lines(session, batch_id, "cancelled", CANCELLED, datetime.now(UTC),
                                      CANCELLED_RUNNING)
    async with files_gateway.db.session() as session:
        stopped = {i.custom_id: i for i in await session.scalars(
            select(BatchItem).where(BatchItem.batch_id == batch_id))}
    assert stopped["ran"].cost_pico_usd == 1_234 and stopped["ran"].error == CANCELLED_RUNNING
    assert not stopped["waited"].cost_pico_usd and stopped["waited"].error == CANCELLED
    assert {i.status for i in stopped.values()} == {"cancelled"}


async def test_the_batch_token_quota_defers_lines_instead_of_failing_them(
        runner: BatchRunner, files_gateway: GatewayUnderTest) -> None:
    # A line reserves its prompt (over 10 tokens) + max_tokens (30): a quota of 60 admits one line a day.
    tenant = await make_tenant_key(files_gateway, batch_tpd_limit=60)
    async with api_client(files_gateway, tenant) as client:
        batch_id = await start_batch(client, [line(f"q{i}", max_tokens=30) for i in range(4)])
        assert await runner.validate(batch_id) == "in_progress"
        await run_chunk(runner, batch_id)
        batch = (await client.get(f"/batches/{batch_id}")).json()
    assert batch["status"] == "in_progress"
    assert batch["request_counts"] == {"total": 4, "completed": 1, "failed": 0}
    async with files_gateway.db.session() as session:
        items = list(await session.scalars(select(BatchItem).where(BatchItem.batch_id == batch_id)
                                           .order_by(BatchItem.line)))
    done = [i for i in items if i.status == "completed"]
    waiting = [i for i in items if i.status == "pending"]
    assert len(done) == 1 and len(waiting) == 3
    assert all(i.attempts == 0 for i in waiting)  # a deferred line was never started
    used = await runner.dispatch.redis.hgetall(tpd_key(tenant.tenant_id))
    assert sum(int(v) for v in used.values()) == done[0].prompt_tokens + done[0].completion_tokens


async def run_whole_batch(runner: BatchRunner, gateway: GatewayUnderTest, endpoint: str,
                          lines: list[str]) -> tuple[dict[str, Any], list[dict[str, Any]], list[BatchItem]]:
    """A batch of ``lines`` validated, run in one chunk and finalized: its object, its output file's
    records and its items."""
    tenant = await make_tenant_key(gateway)
    async with api_client(gateway, tenant) as client:
        batch_id = await start_batch(client, lines, endpoint=endpoint)
        assert await runner.validate(batch_id) == "in_progress"
        assert await run_chunk(runner, batch_id) == len(lines)
        assert await runner.finalize(batch_id) == "completed"
        batch = (await client.get(f"/batches/{batch_id}")).json()
        output = [json.loads(x) for x in
                  (await client.get(f"/files/{batch['output_file_id']}/content")).text.splitlines()]
    async with gateway.db.session() as session:
        items = list(await session.scalars(select(BatchItem).where(BatchItem.batch_id == batch_id)))
    return batch, output, items


async def test_responses_lines_run_through_the_same_generation_service(
        runner: BatchRunner, files_gateway: GatewayUnderTest) -> None:
    lines = [json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses", "body": {
        "model": "tiny", "input": f"Hello {i}", "max_output_tokens": 4, "temperature": 0}}) for i in range(2)]
    batch, output, items = await run_whole_batch(runner, files_gateway, "/v1/responses", lines)
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert [o["custom_id"] for o in output] == ["r0", "r1"]
    for record in output:
        assert record["response"]["status_code"] == 200
        assert_conforms(record["response"]["body"], "Response")
    # What the generation billed and where it ran, recorded per line.
    assert all(i.cost_pico_usd and i.cost_pico_usd > 0 and i.served_pool == "interactive" for i in items)
    # The batch's usage adds up its lines' (Responses name them input/output tokens).
    bodies = [record["response"]["body"]["usage"] for record in output]
    assert [(i.prompt_tokens, i.completion_tokens) for i in sorted(items, key=lambda i: i.custom_id)] == [
        (u["input_tokens"], u["output_tokens"]) for u in bodies]
    assert batch["usage"]["input_tokens"] == sum(u["input_tokens"] for u in bodies) > 0
    assert batch["usage"]["output_tokens"] == sum(u["output_tokens"] for u in bodies) > 0


async def test_completions_lines_score_an_echoed_prompt(runner: BatchRunner,
                                                       files_gateway: GatewayUnderTest) -> None:
    """An evaluation run as a batch: completions lines with token-id prompts, ``echo`` and ``logprobs``
    get every prompt token's logprob (the first null), as the interactive endpoint answers."""
    prompts = [[301, 17, 5, 88, 912], [40, 77, 3]]
    lines = [json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/completions", "body": {
        "model": "tiny", "prompt": p, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}})
        for i, p in enumerate(prompts)]
    batch, output, _ = await run_whole_batch(runner, files_gateway, "/v1/completions", lines)
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    for record, prompt in zip(sorted(output, key=lambda o: o["custom_id"]), prompts, strict=True):
        assert record["response"]["status_code"] == 200
        logprobs = record["response"]["body"]["choices"][0]["logprobs"]
        assert len(logprobs["token_logprobs"]) == len(prompt) + 1 and logprobs["token_logprobs"][0] is None
        assert all(lp < 0 for lp in logprobs["token_logprobs"][1:])


async def test_a_nul_character_in_a_line_is_stored_and_the_line_runs(
        runner: BatchRunner, files_gateway: GatewayUnderTest) -> None:
    """Postgres' jsonb refuses U+0000 (JSON allows it, and a model may write one): the line's body used to
    fail the validation on every try (the batch stuck validating), and an answer with one failed its
    whole run until the line's attempts were spent, billed and never delivered. Stored as U+FFFD."""
    nul = line("nul", messages=[{"role": "user", "content": "before\u0000after"}])
    batch, output, items = await run_whole_batch(runner, files_gateway, "/v1/chat/completions", [nul])
    assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert output[0]["response"]["status_code"] == 200
    [item] = items
    assert item.request_body["messages"][0]["content"] == "before\ufffdafter"
    async with files_gateway.db.session() as session:
        await session.execute(update(BatchItem).where(BatchItem.id == item.id).values(
            response={"choices": [{"message": {"content": "x\x00y"}}]}))
    async with files_gateway.db.session() as session:
        stored = await session.scalar(select(BatchItem.response).where(BatchItem.id == item.id))
    assert stored == {"choices": [{"message": {"content": "x\ufffdy"}}]}


async def test_embeddings_lines(runner: BatchRunner, files_gateway: GatewayUnderTest) -> None:
    lines = [json.dumps({"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "tiny", "input": [f"Hello {i}", "again"]}}) for i in range(2)]
    _, output, items = await run_whole_batch(runner, files_gateway, "/v1/embeddings", lines)
    for record in output:
        assert record["response"]["status_code"] == 200
        assert_conforms(record["response"]["body"], "CreateEmbeddingResponse")
        assert len(record["response"]["body"]["data"]) == 2
    assert all(i.completion_tokens == 0 and i.prompt_tokens and i.cost_pico_usd for i in items)


async def test_prediction_lines_bill_their_prediction_tokens_and_a_bad_one_is_its_lines_400(
        runner: BatchRunner, files_gateway: GatewayUnderTest) -> None:
    """A chat line's ``prediction`` reaches the engine as the interactive API's does: its accepted and
    rejected prediction tokens are in the line's usage and in its ledger record (class ``batch``). A
    prediction only the run can refuse (longer than the model's context) is that line's 400 in the error
    file; the other lines complete."""
    plain = line("plain", max_tokens=16)
    body = json.loads(plain)["body"]
    tenant = await make_tenant_key(files_gateway)
    async with api_client(files_gateway, tenant) as client:
        first = await start_batch(client, [plain])
        assert await runner.validate(first) == "in_progress" and await run_chunk(runner, first) == 1
        await runner.finalize(first)
        done = (await client.get(f"/batches/{first}")).json()
        text = json.loads((await client.get(f"/files/{done['output_file_id']}/content")).text)[
            "response"]["body"]["choices"][0]["message"]["content"]
        prediction = {"type": "content", "content": text[: len(text) // 2] + "~" + text[len(text) // 2 + 1:]}
        lines = [json.dumps({"custom_id": "predicted", "method": "POST", "url": "/v1/chat/completions",
                             "body": {**body, "prediction": prediction}}),
                 # 2,100 tokens of the byte-level tokenizer: more than the tiny model's 2,048 of context.
                 line("too-long", prediction={"type": "content", "content": "x" * 2100})]
        batch_id = await start_batch(client, lines)
        assert await runner.validate(batch_id) == "in_progress"
        assert await run_chunk(runner, batch_id) == 2
        assert await runner.finalize(batch_id) == "completed"
        batch = (await client.get(f"/batches/{batch_id}")).json()
        output = [json.loads(x) for x in
                  (await client.get(f"/files/{batch['output_file_id']}/content")).text.splitlines()]
        errors = [json.loads(x) for x in
                  (await client.get(f"/files/{batch['error_file_id']}/content")).text.splitlines()]
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    [predicted] = output
    assert predicted["custom_id"] == "predicted" and predicted["response"]["status_code"] == 200
    answer = predicted["response"]["body"]
    assert_conforms(answer, "CreateChatCompletionResponse")
    assert answer["choices"][0]["message"]["content"] == text  # a prediction changes no answer
    details = answer["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    [record] = await wait_for_usage(files_gateway.settings.redis_url, predicted["id"])
    assert record["request_class"] == "batch"
    assert record["completion_tokens"] == answer["usage"]["completion_tokens"]
    assert {name: record[name] for name in PREDICTION_TOKEN_FIELDS} == {
        name: details[name] for name in PREDICTION_TOKEN_FIELDS}
    [refused] = errors
    assert refused["custom_id"] == "too-long" and refused["response"]["status_code"] == 400
    error = refused["response"]["body"]["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "prediction")
    assert await usage_records(files_gateway.app.state.redis, refused["id"]) == []  # nothing billed
