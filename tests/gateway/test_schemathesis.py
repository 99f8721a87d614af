"""Property-based API testing with schemathesis 4 over Tollgate's own OpenAPI schema (``app.openapi()``,
fetched from the running gateway), authenticated with a tenant key.

A real ``tollgate gateway`` process in front of a synthetic engine, real Postgres and Redis. For every
operation, a bounded number of schema-valid (positive) and schema-violating (negative) requests, with the
tenant key (``/admin`` operations with an admin token, so the fuzzer reaches their handlers; request
bodies name the served model, or every request would stop at the model lookup):
- never a 5xx, and never a traceback in the gateway's (JSON) log;
- every 4xx carries OpenAI's error body, and schema-valid requests are never refused as unparseable (422
  is FastAPI's default and means a handler skipped the OpenAI error rendering);
- hand-written valid requests for each public operation answer 2xx (a generated "valid" request may
  still be refused for reasons a schema cannot state, e.g. an id that does not exist).
Hypothesis is derandomized (same cases every run) and keeps no example database.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation.modes import GenerationMode

from gateway.admin.auth import generate_admin_token, hash_admin_token
from tests.factories import create_admin, create_api_key, create_price, create_tenant
from tests.gateway.gateway_processes import MODEL, gateway_env, gateway_process, synthetic_engine
from tollgate.db import Database
from tollgate.settings import get_settings

pytestmark = pytest.mark.slow

POSITIVE_EXAMPLES = 8
NEGATIVE_EXAMPLES = 4
LINE = (b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}\n')


async def _seed(database_url: str) -> tuple[str, str]:
    """A tenant key and an admin token."""
    db = Database(database_url, pool_size=1)
    try:
        async with db.session() as session:
            await create_price(session, model=MODEL)
            _, key = await create_api_key(session, await create_tenant(session))
            token = generate_admin_token()
            await create_admin(session, api_token_hash=hash_admin_token(token, get_settings()))
        return key, token
    finally:
        await db.dispose()


def _fuzz(operation: Any, mode: GenerationMode, examples: int, base_url: str, headers: dict[str, str],
          problems: list[str], statuses: Counter[int]) -> int:
    calls = 0

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        nonlocal calls
        calls += 1
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # a random model name would stop every request at the lookup
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        statuses[response.status_code] += 1
        where = f"{mode.value} {operation.label}: {case.method} {case.formatted_path} {case.body!r:.300}"
        if response.status_code >= 500:
            problems.append(f"{where} -> {response.status_code} {response.text[:300]}")
        elif response.status_code >= 400:
            try:
                error = response.json()["error"]
                assert {"message", "type", "param", "code"} <= error.keys()
            except (ValueError, KeyError, TypeError, AssertionError):
                problems.append(f"{where} -> {response.status_code} without OpenAI's error body: "
                                f"{response.text[:300]}")
            if mode is GenerationMode.POSITIVE and response.status_code == 422:
                problems.append(f"{where} -> 422 for a schema-valid request: {response.text[:300]}")

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise  # every operation has valid requests; only "nothing to violate" is expected
    return calls


def _valid_requests(client: httpx.Client) -> list[tuple[str, httpx.Response]]:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
    out = [("chat", client.post("/v1/chat/completions", json=chat)),
           ("chat stream", client.post("/v1/chat/completions", json={**chat, "stream": True})),
           ("completions", client.post("/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                 "max_tokens": 3})),
           ("models", client.get("/v1/models")), ("model", client.get(f"/v1/models/{MODEL}"))]
    upload = client.post("/v1/files", files={"file": ("in.jsonl", LINE, "application/jsonl")},
                         data={"purpose": "batch"})
    out.append(("upload", upload))
    file_id = upload.json()["id"]
    out += [("files", client.get("/v1/files")), ("file", client.get(f"/v1/files/{file_id}")),
            ("content", client.get(f"/v1/files/{file_id}/content"))]
    batch = client.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                             "completion_window": "24h"})
    out.append(("batch", batch))
    batch_id = batch.json()["id"]
    out += [("batches", client.get("/v1/batches")), ("batch get", client.get(f"/v1/batches/{batch_id}")),
            ("batch cancel", client.post(f"/v1/batches/{batch_id}/cancel")),
            ("usage", client.get("/v1/organization/usage/completions", params={"start_time": 1_700_000_000})),
            ("costs", client.get("/v1/organization/costs", params={"start_time": 1_700_000_000}))]
    out.append(("file delete", client.delete(f"/v1/files/{file_id}")))
    return out


async def test_no_server_errors_over_the_whole_schema(new_database: str, redis_url: str, tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    key, admin_token = await _seed(new_database)
    headers = {"Authorization": f"Bearer {key}"}
    admin_headers = {"Authorization": f"Bearer {admin_token}"}
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=0.0, ttft_s=0.0) as engine:
        env = gateway_env(database_url=new_database, redis_url=redis_url, replicas=[engine.url],
                          tokenizer_dir=tiny_model_dir, file_storage_dir=str(tmp_path / "files"))
        with gateway_process(env, tmp_path / "gateway.log", api_key=key) as gw:
            with httpx.Client(base_url=gw.url, headers=headers, timeout=60) as client:
                for name, response in _valid_requests(client):
                    assert 200 <= response.status_code < 300, (name, response.status_code, response.text)
                schema = schemathesis.openapi.from_dict(client.get("/openapi.json").json())
            problems: list[str] = []
            operations = [result.ok() for result in schema.get_all_operations()]
            assert len(operations) >= 20
            calls = 0
            statuses: Counter[int] = Counter()
            for operation in operations:
                for mode, examples in ((GenerationMode.POSITIVE, POSITIVE_EXAMPLES),
                                       (GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES)):
                    auth = admin_headers if operation.path.startswith("/admin/") else headers
                    calls += _fuzz(operation, mode, examples, gw.url, auth, problems, statuses)
            tracebacks = [r for r in gw.log_lines() if "traceback" in r]
    assert calls >= len(operations) * 3
    # The fuzzer reached the handlers: plenty of successes as well as refusals.
    assert sum(n for status, n in statuses.items() if status < 300) >= len(operations), statuses
    assert problems == []
    assert tracebacks == [], tracebacks[:3]
