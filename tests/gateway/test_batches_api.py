"""``/v1/batches`` bookkeeping against the real gateway app, Postgres and Redis (no worker runs here, so a
new batch stays ``validating``): OpenAI's objects, pagination, tenant isolation, refused requests and
the cancel state machine. Execution is covered by ``tests/e2e/test_batch_e2e.py``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.gateway.conftest import GatewayUnderTest, make_tenant_key
from tests.gateway.test_files import _api, _files_tenant, upload  # noqa: F401
from tests.openai_schema import assert_conforms


async def create(api: httpx.AsyncClient, file_id: str, **overrides: Any) -> httpx.Response:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
            **overrides}
    return await api.post("/batches", json={k: v for k, v in body.items() if v is not None})


@pytest.fixture
async def file_id(api: httpx.AsyncClient) -> str:
    return (await upload(api)).json()["id"]


async def test_create_retrieve_and_list(api: httpx.AsyncClient, file_id: str) -> None:
    response = await create(api, file_id, metadata={"team": "search"})
    assert response.status_code == 200, response.text
    batch = response.json()
    assert_conforms(batch, "Batch")
    assert batch["id"].startswith("batch_") and batch["object"] == "batch"
    assert (batch["status"], batch["input_file_id"], batch["endpoint"]) == ("validating", file_id,
                                                                            "/v1/chat/completions")
    assert batch["expires_at"] - batch["created_at"] == 24 * 3600
    assert batch["request_counts"] == {"total": 0, "completed": 0, "failed": 0}
    assert batch["metadata"] == {"team": "search"}
    assert (await api.get(f"/batches/{batch['id']}")).json() == batch

    more = [(await create(api, file_id)).json()["id"] for _ in range(2)]
    page = (await api.get("/batches", params={"limit": 2})).json()
    assert_conforms(page, "ListBatchesResponse")
    assert [b["id"] for b in page["data"]] == more[::-1] and page["has_more"] is True
    rest = (await api.get("/batches", params={"after": page["last_id"]})).json()
    assert [b["id"] for b in rest["data"]] == [batch["id"]] and rest["has_more"] is False


@pytest.mark.parametrize(("overrides", "param"), [
    ({"endpoint": "/v1/moderations"}, "endpoint"),
    ({"completion_window": "48h"}, "completion_window"),
    ({"input_file_id": None}, "input_file_id"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"output_expires_after": {"anchor": "created_at", "seconds": 60}}, "output_expires_after.seconds"),
])
async def test_invalid_requests_are_400s_naming_the_parameter(api: httpx.AsyncClient, file_id: str,
                                                              overrides: dict[str, Any], param: str) -> None:
    response = await create(api, file_id, **overrides)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert (await api.get("/batches")).json()["data"] == []


async def test_unknown_or_foreign_files_and_batches_are_404(api: httpx.AsyncClient, file_id: str,
                                                            files_gateway: GatewayUnderTest) -> None:
    assert (await create(api, "file-doesnotexist")).status_code == 404
    assert (await api.post("/batches", content=b"{not json")).status_code == 400
    batch_id = (await create(api, file_id)).json()["id"]
    other = await make_tenant_key(files_gateway)
    async with httpx.AsyncClient(base_url=f"{files_gateway.url}/v1", headers=other.headers) as stranger:
        assert (await create(stranger, file_id)).status_code == 404  # another tenant's file
        assert (await stranger.get(f"/batches/{batch_id}")).status_code == 404
        assert (await stranger.post(f"/batches/{batch_id}/cancel")).status_code == 404
        assert (await stranger.get("/batches")).json()["data"] == []
    assert (await api.get("/batches/batch_missing")).status_code == 404


async def test_cancel_moves_to_cancelling_once(api: httpx.AsyncClient, file_id: str) -> None:
    batch_id = (await create(api, file_id)).json()["id"]
    first = await api.post(f"/batches/{batch_id}/cancel")
    assert first.status_code == 200
    assert_conforms(first.json(), "Batch")
    assert first.json()["status"] == "cancelling" and first.json()["cancelling_at"]
    again = await api.post(f"/batches/{batch_id}/cancel")
    assert again.status_code == 200 and again.json()["cancelling_at"] == first.json()["cancelling_at"]
