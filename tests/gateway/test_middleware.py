"""The request-context middleware and error handlers on a bare app (no engine, no database)."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI, Request

from gateway.errors import install_exception_handlers, validation_error
from gateway.middleware import RequestContextMiddleware
from tests.openai_schema import assert_conforms


@pytest.fixture
def app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(RequestContextMiddleware, max_body_bytes=1000, path_limits={"/echo/big": 5000})
    install_exception_handlers(app)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"size": len(await request.body()), "request_id": request.state.request_id}

    @app.post("/echo/big")
    async def echo_big(request: Request) -> dict:
        return {"size": len(await request.body())}

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("bug")

    @app.get("/items/{item_id}")
    async def item(item_id: int) -> dict:
        return {"id": item_id}

    return app


@pytest.fixture
async def client(app: FastAPI):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


async def test_request_id_on_every_response(client: httpx.AsyncClient) -> None:
    r = await client.post("/echo", content=b"abc")
    assert r.json()["request_id"] == r.headers["x-request-id"]
    assert (await client.get("/missing")).headers["x-request-id"].startswith("req_")


async def test_body_limit_on_declared_and_streamed_bodies(client: httpx.AsyncClient) -> None:
    assert (await client.post("/echo", content=b"x" * 1000)).json()["size"] == 1000
    r = await client.post("/echo", content=b"x" * 1001)
    assert r.status_code == 413
    assert_conforms(r.json(), "ErrorResponse")

    async def body():
        for _ in range(20):
            yield b"y" * 100

    r = await client.post("/echo", content=body())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert (await client.post("/echo/big", content=b"z" * 4000)).json()["size"] == 4000
    assert (await client.post("/echo/big", content=b"z" * 5001)).status_code == 413


async def test_unexpected_exception_is_a_logged_500(client: httpx.AsyncClient,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    r = await client.get("/boom")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert_conforms(r.json(), "ErrorResponse")
    assert "unhandled error" in caplog.text


async def test_path_validation_names_the_param(client: httpx.AsyncClient) -> None:
    r = await client.get("/items/abc")
    assert r.status_code == 400 and r.json()["error"]["param"] == "item_id"
    r = await client.put("/echo")
    assert r.status_code == 405
    assert_conforms(r.json(), "ErrorResponse")


def test_validation_error_without_errors_is_still_a_400() -> None:
    assert validation_error([]).status == 400
