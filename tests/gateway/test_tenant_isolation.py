"""Tenant isolation across every endpoint of the app: tenant A, with its own valid API key, can neither
read nor act on anything of tenant B.

The endpoints are enumerated from the app itself (``app.openapi()``: every route of the public and
admin APIs), and each (method, path) must have an entry in ``CHECKS``: an endpoint added without an
isolation check fails ``test_every_endpoint_has_an_isolation_check``. Routes outside the schema are
``/health``, ``/metrics`` (no tenant data) and the admin dashboard (a session login, not API keys; a
tenant key is refused there too, checked below).

Set-up (real processes and servers): a synthetic engine replica, the gateway app under uvicorn, Postgres
and Redis. B owns a file, a batch, ledger rows and a warm prefix-cache entry; A tries to reach each.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from billing.ledger import UsageFlusher
from billing.outbox import UsageRecord, append_usage
from tests.factories import create_api_key, create_price, create_tenant
from tests.gateway.conftest import GatewayUnderTest, run_gateway
from tests.gateway.gateway_processes import LOOSE_TIERS, MODEL, synthetic_engine
from tollgate.db import Database
from tollgate.gateway_app import create_app
from tollgate.settings import ModelConfig, PoolConfig, Settings, TierConfig

pytestmark = pytest.mark.slow

LINE = (b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}\n')
# Long enough for several full 16-token blocks, so a prefix cache hit would show in cached_tokens.
SHARED_PROMPT = "The quarterly report of tenant B, strictly confidential. " * 12
USAGE_DAY = datetime(2026, 10, 1, tzinfo=UTC)


@dataclass
class World:
    gateway: GatewayUnderTest
    a: httpx.AsyncClient
    b: httpx.AsyncClient
    b_tenant: int
    b_key_id: int
    b_file: str
    b_batch: str
    b_response: str
    b_background: str


@pytest.fixture(scope="module")
async def world(new_database_module: str, redis_url: str, tiny_model_dir: Path,
                tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    logs = tmp_path_factory.mktemp("isolation")
    db = Database(new_database_module, pool_size=1)
    async with db.session() as session:
        await create_price(session, model=MODEL)
        tenant_a, tenant_b = await create_tenant(session), await create_tenant(session)
        _, key_a = await create_api_key(session, tenant_a)
        b_key, key_b = await create_api_key(session, tenant_b)
    await db.dispose()
    with synthetic_engine(logs / "engine.log", token_interval_s=0.0, ttft_s=0.0) as engine:
        settings = Settings(
            environment="test", database_url=new_database_module, redis_url=redis_url,
            models=[ModelConfig(name=MODEL, path=str(tiny_model_dir))],
            pools={"interactive": PoolConfig(replicas=[engine.url])}, file_storage_dir=logs / "files",
            tiers={name: TierConfig(**tier) for name, tier in LOOSE_TIERS.items()},
            health_poll_interval_s=0.2, key_cache_ttl_s=5.0)
        async with run_gateway(settings) as gateway:
            async with (httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                          headers={"Authorization": f"Bearer {key_a}"}) as a,
                        httpx.AsyncClient(base_url=gateway.url, timeout=30,
                                          headers={"Authorization": f"Bearer {key_b}"}) as b):
                file = await b.post("/v1/files", files={"file": ("b.jsonl", LINE, "application/jsonl")},
                                    data={"purpose": "batch"})
                assert file.status_code == 200, file.text
                batch = await b.post("/v1/batches", json={"input_file_id": file.json()["id"],
                                                          "endpoint": "/v1/chat/completions",
                                                          "completion_window": "24h"})
                assert batch.status_code == 200, batch.text
                await _ledger_rows_for(gateway, tenant_b.id)
                response = await b.post("/v1/responses", json={"model": MODEL, "input": "B's secret",
                                                               "max_output_tokens": 2})
                background = await b.post("/v1/responses", json={"model": MODEL, "input": "B's job",
                                                                 "max_output_tokens": 2, "background": True})
                assert response.status_code == background.status_code == 200, (response.text, background.text)
                yield World(gateway, a, b, tenant_b.id, b_key.id, file.json()["id"], batch.json()["id"],
                            response.json()["id"], background.json()["id"])


@pytest.fixture(scope="module")
def new_database_module(shared_servers: Any) -> Any:
    import uuid

    from tollgate import schema

    name = f"tollgate_isolation_{uuid.uuid4().hex[:8]}"
    shared_servers.postgres.create_database(name, recreate=True)
    url = shared_servers.postgres.url(name)
    schema.upgrade(url)
    yield url
    shared_servers.postgres.drop_database(name)


async def _ledger_rows_for(gateway: GatewayUnderTest, tenant_id: int) -> None:
    redis = gateway.runtime.redis
    for i in range(3):
        await append_usage(redis, UsageRecord.of(
            request_id=f"isolation-b-{tenant_id}-{i}", tenant_id=tenant_id, api_key_id=None, model=MODEL,
            request_class="interactive", tier="default", prompt_tokens=1000, cached_tokens=0,
            completion_tokens=100, cost_pico_usd=4_500_000_000, status="completed", ttft_ms=None,
            tpot_ms=None, created_at=USAGE_DAY + timedelta(hours=i)))
    await UsageFlusher(redis, gateway.db.session, consumer="isolation").flush()


def _refused(response: httpx.Response, *statuses: int) -> None:
    assert response.status_code in statuses, (response.status_code, response.text)
    assert "error" in response.json()


# ----------------------------------------------------------------------------- one check per endpoint


async def chat(w: World) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": SHARED_PROMPT}], "max_tokens": 2}
    for _ in range(2):  # B warms its prefix cache and then hits it
        usage_b = (await w.b.post("/v1/chat/completions", json=body)).json()["usage"]
    assert usage_b["prompt_tokens_details"]["cached_tokens"] > 0
    usage_a = (await w.a.post("/v1/chat/completions", json=body)).json()["usage"]
    assert usage_a["prompt_tokens_details"]["cached_tokens"] == 0  # B's cache never serves A


async def completions(w: World) -> None:
    body = {"model": MODEL, "prompt": "Completions of B: " + SHARED_PROMPT, "max_tokens": 2}
    for _ in range(2):
        usage_b = (await w.b.post("/v1/completions", json=body)).json()["usage"]
    assert usage_b["prompt_tokens_details"]["cached_tokens"] > 0
    usage_a = (await w.a.post("/v1/completions", json=body)).json()["usage"]
    assert usage_a["prompt_tokens_details"]["cached_tokens"] == 0


async def responses_create(w: World) -> None:
    body = {"model": MODEL, "input": "Responses of B: " + SHARED_PROMPT, "max_output_tokens": 2}
    for _ in range(2):
        usage_b = (await w.b.post("/v1/responses", json=body)).json()["usage"]
    assert usage_b["input_tokens_details"]["cached_tokens"] > 0
    usage_a = (await w.a.post("/v1/responses", json=body)).json()["usage"]
    assert usage_a["input_tokens_details"]["cached_tokens"] == 0
    # Nor can A continue B's conversation: B's response is not found for A.
    continued = await w.a.post("/v1/responses", json={**body, "previous_response_id": w.b_response})
    _refused(continued, 400)
    assert continued.json()["error"]["param"] == "previous_response_id"


async def embeddings(w: World) -> None:
    from tests.gateway.conftest import wait_for_usage

    body = {"model": MODEL, "input": "Embeddings of B: " + SHARED_PROMPT}

    async def cached(client: httpx.AsyncClient) -> int:
        response = await client.post("/v1/embeddings", json=body)
        assert response.status_code == 200, response.text
        [record] = await wait_for_usage(w.gateway.settings.redis_url, response.headers["x-request-id"])
        return record["cached_tokens"]

    # Last-token pooling may use the prefix cache: B's own, never A's.
    assert [await cached(w.b), await cached(w.b)][1] > 0
    assert await cached(w.a) == 0


async def responses_get(w: World) -> None:
    _refused(await w.a.get(f"/v1/responses/{w.b_response}"), 404)


async def responses_delete(w: World) -> None:
    _refused(await w.a.delete(f"/v1/responses/{w.b_response}"), 404)
    assert (await w.b.get(f"/v1/responses/{w.b_response}")).status_code == 200  # still there


async def responses_input_items(w: World) -> None:
    _refused(await w.a.get(f"/v1/responses/{w.b_response}/input_items"), 404)


async def responses_cancel(w: World) -> None:
    _refused(await w.a.post(f"/v1/responses/{w.b_background}/cancel"), 404)
    assert (await w.b.get(f"/v1/responses/{w.b_background}")).json()["status"] == "queued"


async def models_list(w: World) -> None:
    # The served models are the platform's: both see the same; adapter models (ft:) only their owner.
    a_models, b_models = [(await c.get("/v1/models")).json()["data"] for c in (w.a, w.b)]
    assert not [m for m in a_models if m["id"].startswith("ft:")]
    assert a_models == [m for m in b_models if not m["id"].startswith("ft:")]


async def models_get(w: World) -> None:
    assert (await w.a.get(f"/v1/models/{MODEL}")).json()["owned_by"] != str(w.b_tenant)


async def models_create(w: World) -> None:
    # An adapter bundle is registered from the tenant's own files only: B's file does not exist for A.
    refused = await w.a.post("/v1/models", json={"file_id": w.b_file, "name": "stolen", "base_model": MODEL})
    _refused(refused, 404)
    assert refused.json()["error"]["param"] == "file_id"


async def models_delete(w: World) -> None:
    from tollgate.models import Adapter

    model = f"ft:{MODEL}:b:own:{w.b_tenant:012x}"
    async with w.gateway.db.session() as session:
        session.add(Adapter(id=f"{w.b_tenant:012x}", model=model, tenant_id=w.b_tenant, name="own",
                            base_model=MODEL, digest="0" * 64, rank=1, target_modules=["q_proj"], bytes=0))
    _refused(await w.a.delete(f"/v1/models/{model}"), 404)
    _refused(await w.a.get(f"/v1/models/{model}"), 404)
    assert model not in [m["id"] for m in (await w.a.get("/v1/models")).json()["data"]]
    assert (await w.b.get(f"/v1/models/{model}")).status_code == 200  # still there, B's own


async def files_list(w: World) -> None:
    assert w.b_file not in [f["id"] for f in (await w.a.get("/v1/files")).json()["data"]]
    assert w.b_file in [f["id"] for f in (await w.b.get("/v1/files")).json()["data"]]


async def files_upload(w: World) -> None:
    own = await w.a.post("/v1/files", files={"file": ("a.jsonl", LINE, "application/jsonl")},
                         data={"purpose": "batch"})
    assert own.status_code == 200
    assert own.json()["id"] not in [f["id"] for f in (await w.b.get("/v1/files")).json()["data"]]


async def files_get(w: World) -> None:
    _refused(await w.a.get(f"/v1/files/{w.b_file}"), 404)


async def files_delete(w: World) -> None:
    _refused(await w.a.delete(f"/v1/files/{w.b_file}"), 404)
    assert (await w.b.get(f"/v1/files/{w.b_file}")).status_code == 200  # still there


async def files_content(w: World) -> None:
    _refused(await w.a.get(f"/v1/files/{w.b_file}/content"), 404)


async def batches_list(w: World) -> None:
    assert w.b_batch not in [b["id"] for b in (await w.a.get("/v1/batches")).json()["data"]]


async def batches_create(w: World) -> None:
    # A batch over B's input file is refused as if the file did not exist.
    body = {"input_file_id": w.b_file, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    _refused(await w.a.post("/v1/batches", json=body), 400, 404)


async def batches_get(w: World) -> None:
    _refused(await w.a.get(f"/v1/batches/{w.b_batch}"), 404)


async def batches_cancel(w: World) -> None:
    _refused(await w.a.post(f"/v1/batches/{w.b_batch}/cancel"), 404)
    assert (await w.b.get(f"/v1/batches/{w.b_batch}")).json()["status"] not in ("cancelling", "cancelled")


def _usage_params() -> dict[str, int]:
    end = USAGE_DAY + timedelta(days=1)
    return {"start_time": int(USAGE_DAY.timestamp()), "end_time": int(end.timestamp())}


async def usage_completions(w: World) -> None:
    def tokens(body: dict[str, Any]) -> int:
        return sum(r["input_tokens"] for bucket in body["data"] for r in bucket["results"])

    path = "/v1/organization/usage/completions"
    assert tokens((await w.b.get(path, params=_usage_params())).json()) == 3000
    assert tokens((await w.a.get(path, params=_usage_params())).json()) == 0


async def costs(w: World) -> None:
    def amount(body: dict[str, Any]) -> float:
        return sum(r["amount"]["value"] for bucket in body["data"] for r in bucket["results"])

    assert amount((await w.b.get("/v1/organization/costs", params=_usage_params())).json()) > 0
    assert amount((await w.a.get("/v1/organization/costs", params=_usage_params())).json()) == 0


def admin(method: str, path: str, body: dict[str, Any] | None = None) -> Callable[[World], Awaitable[None]]:
    """Admin API: a tenant's API key is never an admin credential, whatever tenant the path names."""

    async def check(w: World) -> None:
        url = path.format(tenant_id=w.b_tenant, key_id=w.b_key_id, tenant=w.b_tenant)
        response = await w.a.request(method, url, json=body, params={"month": "2026-10"})
        _refused(response, 401, 403)

    return check


CHECKS: dict[tuple[str, str], Callable[[World], Awaitable[None]]] = {
    ("post", "/v1/chat/completions"): chat,
    ("post", "/v1/completions"): completions,
    ("post", "/v1/responses"): responses_create,
    ("post", "/v1/embeddings"): embeddings,
    ("get", "/v1/responses/{response_id}"): responses_get,
    ("delete", "/v1/responses/{response_id}"): responses_delete,
    ("get", "/v1/responses/{response_id}/input_items"): responses_input_items,
    ("post", "/v1/responses/{response_id}/cancel"): responses_cancel,
    ("get", "/v1/models"): models_list,
    ("get", "/v1/models/{model}"): models_get,
    ("post", "/v1/models"): models_create,
    ("delete", "/v1/models/{model}"): models_delete,
    ("get", "/v1/files"): files_list,
    ("post", "/v1/files"): files_upload,
    ("get", "/v1/files/{file_id}"): files_get,
    ("delete", "/v1/files/{file_id}"): files_delete,
    ("get", "/v1/files/{file_id}/content"): files_content,
    ("get", "/v1/batches"): batches_list,
    ("post", "/v1/batches"): batches_create,
    ("get", "/v1/batches/{batch_id}"): batches_get,
    ("post", "/v1/batches/{batch_id}/cancel"): batches_cancel,
    ("get", "/v1/organization/usage/completions"): usage_completions,
    ("get", "/v1/organization/costs"): costs,
    **{(m, p): admin(m, p, b) for m, p, b in [
        ("get", "/admin/v1/tenants", None), ("post", "/admin/v1/tenants", {"name": "evil"}),
        ("get", "/admin/v1/tenants/{tenant_id}", None),
        ("patch", "/admin/v1/tenants/{tenant_id}", {"tpm_limit": 1}),
        ("post", "/admin/v1/tenants/{tenant_id}/suspend", {"reason": "x"}),
        ("post", "/admin/v1/tenants/{tenant_id}/reactivate", {}),
        ("post", "/admin/v1/tenants/{tenant_id}/purge-cache", {}),
        ("get", "/admin/v1/tenants/{tenant_id}/keys", None),
        ("post", "/admin/v1/tenants/{tenant_id}/keys", {"name": "stolen"}),
        ("post", "/admin/v1/tenants/{tenant_id}/keys/{key_id}/revoke", {}),
        ("get", "/admin/v1/prices", None), ("post", "/admin/v1/prices", {"model": MODEL}),
        ("get", "/admin/v1/usage", None), ("get", "/admin/v1/tenants/{tenant_id}/usage", None),
        ("get", "/admin/v1/audit", None), ("get", "/admin/v1/statements/{tenant}", None),
        ("get", "/admin/v1/statements/{tenant}.csv", None),
    ]},
}


def app_endpoints() -> set[tuple[str, str]]:
    app = create_app(Settings(environment="test"))
    return {(method, path) for path, ops in app.openapi()["paths"].items() for method in ops}


def test_every_endpoint_has_an_isolation_check() -> None:
    endpoints = app_endpoints()
    assert endpoints - CHECKS.keys() == set(), "endpoints without a tenant isolation check"
    assert CHECKS.keys() - endpoints == set(), "checks for endpoints the app no longer has"


@pytest.mark.parametrize("endpoint", sorted(CHECKS), ids=lambda e: f"{e[0].upper()} {e[1]}")
async def test_tenant_a_cannot_reach_tenant_b(world: World, endpoint: tuple[str, str]) -> None:
    await CHECKS[endpoint](world)


async def test_b_is_untouched_and_the_dashboard_refuses_api_keys(world: World) -> None:
    b_key_still_works = await world.b.get("/v1/models")
    assert b_key_still_works.status_code == 200
    dashboard = await world.a.get("/admin/", follow_redirects=False)
    assert dashboard.status_code in (302, 303, 307, 401, 403, 404)
