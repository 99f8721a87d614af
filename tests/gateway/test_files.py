"""``/v1/files`` against the real gateway app (uvicorn), Postgres, Redis and a storage directory of its own:
OpenAI's objects, tenant isolation, upload checks, pagination, deletion and retention.

The ``files_gateway`` fixture (``tests/gateway/conftest.py``) is shared with the batches tests.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.batches.dispatch import BatchDispatcher
from gateway.batches.runner import BatchRunner
from gateway.files.storage import LocalFileStorage
from tests.gateway.conftest import (
    MAX_API_BODY_BYTES,
    MAX_FILE_BYTES,
    GatewayUnderTest,
    TenantKey,
    make_tenant_key,
)
from tests.openai_schema import assert_conforms

LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "tiny"}}\n'


@pytest.fixture(name="files_tenant")
async def _files_tenant(files_gateway: GatewayUnderTest) -> TenantKey:
    return await make_tenant_key(files_gateway)


@pytest.fixture(name="api")
async def _api(files_gateway: GatewayUnderTest, files_tenant: TenantKey) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=f"{files_gateway.url}/v1", headers=files_tenant.headers,
                                 timeout=30) as client:
        yield client


async def upload(client: httpx.AsyncClient, content: bytes = LINE, *, filename: str = "in.jsonl",
                 purpose: str | None = "batch", **fields: str) -> httpx.Response:
    data = {"purpose": purpose, **fields} if purpose is not None else dict(fields)
    return await client.post("/files", files={"file": (filename, content, "application/jsonl")}, data=data)


def stored_path(gateway: GatewayUnderTest, tenant: TenantKey, file_id: str) -> Path:
    return Path(gateway.settings.file_storage_dir) / str(tenant.tenant_id) / file_id


async def test_upload_retrieve_download_list_delete(api: httpx.AsyncClient, files_gateway: GatewayUnderTest,
                                                    files_tenant: TenantKey) -> None:
    response = await upload(api, LINE * 3, filename="nightly.jsonl")
    assert response.status_code == 200, response.text
    file = response.json()
    assert_conforms(file, "OpenAIFile")
    assert (file["object"], file["purpose"], file["filename"], file["bytes"], file["status"]) == (
        "file", "batch", "nightly.jsonl", len(LINE) * 3, "processed")
    assert file["expires_at"] - file["created_at"] == 30 * 24 * 3600  # the default retention
    assert stored_path(files_gateway, files_tenant, file["id"]).read_bytes() == LINE * 3

    assert (await api.get(f"/files/{file['id']}")).json() == file
    content = await api.get(f"/files/{file['id']}/content")
    assert content.status_code == 200 and content.content == LINE * 3

    listing = (await api.get("/files")).json()
    assert_conforms(listing, "ListFilesResponse")
    assert [f["id"] for f in listing["data"]] == [file["id"]] and listing["has_more"] is False

    deleted = await api.delete(f"/files/{file['id']}")
    assert deleted.status_code == 200
    assert_conforms(deleted.json(), "DeleteFileResponse")
    assert deleted.json() == {"id": file["id"], "object": "file", "deleted": True}
    assert not stored_path(files_gateway, files_tenant, file["id"]).exists()
    for path in (f"/files/{file['id']}", f"/files/{file['id']}/content"):
        missing = await api.get(path)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    assert (await api.delete(f"/files/{file['id']}")).status_code == 404


async def test_list_pages_with_after_limit_and_order(api: httpx.AsyncClient) -> None:
    ids = [(await upload(api)).json()["id"] for _ in range(5)]
    first = (await api.get("/files", params={"limit": 2})).json()
    assert_conforms(first, "ListFilesResponse")
    assert [f["id"] for f in first["data"]] == ids[::-1][:2] and first["has_more"] is True
    rest = (await api.get("/files", params={"limit": 10, "after": first["last_id"]})).json()
    assert [f["id"] for f in rest["data"]] == ids[::-1][2:] and rest["has_more"] is False
    oldest_first = (await api.get("/files", params={"order": "asc", "purpose": "batch"})).json()
    assert [f["id"] for f in oldest_first["data"]] == ids
    assert (await api.get("/files", params={"purpose": "batch_output"})).json()["data"] == []
    bad = await api.get("/files", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


async def test_files_are_invisible_to_other_tenants(api: httpx.AsyncClient,
                                                    files_gateway: GatewayUnderTest) -> None:
    file_id = (await upload(api)).json()["id"]
    other = await make_tenant_key(files_gateway)
    async with httpx.AsyncClient(base_url=f"{files_gateway.url}/v1", headers=other.headers) as stranger:
        for method, path in (("GET", f"/files/{file_id}"), ("GET", f"/files/{file_id}/content"),
                             ("DELETE", f"/files/{file_id}")):
            assert (await stranger.request(method, path)).status_code == 404
        assert (await stranger.get("/files")).json()["data"] == []
    assert (await api.get(f"/files/{file_id}")).status_code == 200


@pytest.mark.parametrize(("kwargs", "status", "param"), [
    ({"purpose": None}, 400, "purpose"),
    ({"purpose": "assistants"}, 400, "purpose"),
    ({"filename": "requests.txt"}, 400, "file"),
    ({"content": b""}, 400, "file"),
    ({"content": b"\xff\xfe not utf-8\n"}, 400, "file"),
    ({"content": LINE * (MAX_FILE_BYTES // len(LINE) + 1)}, 413, "file"),
    ({"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"}, 400, "expires_after[seconds]"),
    ({"expires_after[anchor]": "last_active_at", "expires_after[seconds]": "3600"}, 400,
     "expires_after[anchor]"),
])
async def test_bad_uploads_are_refused_and_store_nothing(
        api: httpx.AsyncClient, files_gateway: GatewayUnderTest, files_tenant: TenantKey,
        kwargs: dict[str, Any], status: int, param: str) -> None:
    response = await upload(api, **kwargs)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param
    tenant_dir = Path(files_gateway.settings.file_storage_dir) / str(files_tenant.tenant_id)
    assert not tenant_dir.exists() or list(tenant_dir.iterdir()) == []
    assert (await api.get("/files")).json()["data"] == []


async def test_uploads_may_exceed_the_api_body_limit_up_to_the_file_limit(api: httpx.AsyncClient) -> None:
    content = LINE * (MAX_FILE_BYTES // len(LINE))
    assert MAX_API_BODY_BYTES < len(content) <= MAX_FILE_BYTES
    response = await upload(api, content)
    assert response.status_code == 200, response.text
    assert response.json()["bytes"] == len(content)
    too_big_call = await api.post("/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "x" * MAX_API_BODY_BYTES}]})
    assert too_big_call.status_code == 413


async def test_a_request_without_a_file_is_a_400(api: httpx.AsyncClient) -> None:
    response = await api.post("/files", data={"purpose": "batch"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


async def test_expired_files_are_deleted_by_retention(api: httpx.AsyncClient, files_gateway: GatewayUnderTest,
                                                      files_tenant: TenantKey) -> None:
    short = (await upload(api, **{"expires_after[anchor]": "created_at",
                                  "expires_after[seconds]": "3600"})).json()
    kept = (await upload(api)).json()
    assert short["expires_at"] - short["created_at"] == 3600
    settings = files_gateway.settings
    storage = LocalFileStorage(Path(settings.file_storage_dir))
    runner = BatchRunner(settings, files_gateway.db, storage,
                         BatchDispatcher(settings, files_gateway.app.state.redis), runtime=_no_runtime)
    removed, _ = await runner.retention(datetime.now(UTC) + timedelta(hours=2))
    assert removed >= 1
    assert (await api.get(f"/files/{short['id']}")).status_code == 404
    assert not stored_path(files_gateway, files_tenant, short["id"]).exists()
    assert (await api.get(f"/files/{kept['id']}/content")).content == LINE


async def _no_runtime() -> Any:
    raise AssertionError("retention needs no engine runtime")
