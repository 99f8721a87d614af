"""A gateway that starts while Postgres is unreachable comes up, refuses with 503 meanwhile, and serves once
Postgres is back, without a restart.

Found by the chaos benchmark's combined faults: a gateway worker killed while Postgres was restarting was
started again by uvicorn, its start-up (the first price-book load) failed, and uvicorn then stopped every
worker, taking the whole gateway down for seconds. Real processes: ``tollgate gateway --workers 2`` and a
synthetic engine; Postgres is reached through a TCP proxy of the test's own that refuses connections
until it is opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from tests.gateway.gateway_processes import MODEL, gateway_env, synthetic_engine
from tests.gateway.test_drain import _seed
from tests.polling import eventually
from tollgate.local_services import free_port
from tollgate.processes import spawn, stop

pytestmark = pytest.mark.slow


class _Proxy:
    """A TCP proxy to ``target`` on ``port``, refusing connections until ``open()``."""

    def __init__(self, port: int, target: tuple[str, int]) -> None:
        self.port, self.target = port, target
        self.server: asyncio.Server | None = None

    async def open(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


@contextlib.asynccontextmanager
async def _proxy(database_url: str) -> AsyncIterator[tuple[_Proxy, str]]:
    url = make_url(database_url)
    proxy = _Proxy(free_port(), (url.host or "127.0.0.1", url.port or 5432))
    try:
        yield proxy, url.set(port=proxy.port).render_as_string(hide_password=False)
    finally:
        await proxy.close()


async def test_a_gateway_started_in_a_postgres_outage_serves_once_postgres_is_back(
        new_database: str, redis_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    _, key = await _seed(new_database)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "after the outage"}], "max_tokens": 4}
    headers = {"Authorization": f"Bearer {key}"}
    async with _proxy(new_database) as (proxy, proxied_url):
        with synthetic_engine(tmp_path / "engine.log") as engine:
            env = gateway_env(database_url=proxied_url, redis_url=redis_url, replicas=[engine.url],
                              tokenizer_dir=tiny_model_dir)
            port = free_port()
            log = tmp_path / "gateway.log"
            proc = spawn([sys.executable, "-m", "tollgate", "gateway", "--port", str(port), "--workers", "2"],
                         log_path=log, env=env)
            url = f"http://127.0.0.1:{port}"
            try:
                async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:

                    async def answers(path: str, expected: int) -> bool:
                        assert proc.poll() is None, f"the gateway exited:\n{log.read_text()[-4000:]}"
                        try:
                            if path == "/health":
                                answer = await client.get(path)
                            else:
                                answer = await client.post(path, json=body, headers=headers)
                        except httpx.TransportError:
                            return False
                        return answer.status_code == expected

                    # Both workers started (their start-up did not fail) and answer: unavailable, not down.
                    await eventually(lambda: answers("/health", 503), "the gateway to answer /health")
                    health = (await client.get("/health")).json()
                    assert health["failing"] == ["postgres"]
                    refused = await client.post("/v1/chat/completions", json=body, headers=headers)
                    assert refused.status_code == 503, refused.text
                    assert refused.json()["error"]["type"]  # OpenAI's error body
                    await proxy.open()  # Postgres is back
                    await eventually(lambda: answers("/v1/chat/completions", 200),
                                     "a chat completion served after the outage")
                    # Soon every worker serves (fresh connections land on both; each retries its price
                    # load every second on its own), none was restarted.
                    async def every_fresh_connection_served() -> bool:
                        for _ in range(8):
                            async with httpx.AsyncClient(base_url=url, timeout=10.0) as fresh:
                                answer = await fresh.post("/v1/chat/completions", json=body, headers=headers)
                                if answer.status_code != 200:
                                    assert answer.json()["error"]["code"] == "prices_unavailable", answer.text
                                    return False
                        return True

                    await eventually(every_fresh_connection_served, "every worker to serve", interval_s=0.2)
                assert proc.poll() is None
                assert "failed to start" not in log.read_text()
            finally:  # in a thread: the proxy's connections live in this loop, and the gateway closes them
                await asyncio.to_thread(stop, proc, timeout=30)
