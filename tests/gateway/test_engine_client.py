"""The gateway's own HTTP/1.1 engine client against a scripted server: keep-alive reuse, a server that
closed an idle connection, error mapping, chunked NDJSON streams, interrupting a stream, purges."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest

from engine.protocol import DeltaRecord, FinalRecord, GenerateRequest
from gateway.engine_client import EngineClient, EngineStreamError, EngineUnavailable
from gateway.errors import InvalidRequestError
from tests.polling import DEFAULT_TIMEOUT_S, eventually
from tollgate.local_services import free_port

STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
Handler = Callable[[bytes, bytes, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]


class ScriptedServer:
    """An HTTP/1.1 server whose answers a test writes by hand. ``handler(request_line, body, reader,
    writer)`` answers one request and returns whether to keep the connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                length = 0
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                self.requests.append(lines[0])
                if not await self.handler(lines[0], body, reader, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


@contextlib.asynccontextmanager
async def scripted(handler: Handler) -> AsyncIterator[tuple[str, ScriptedServer]]:
    server = ScriptedServer(handler)
    port = free_port()
    srv = await asyncio.start_server(server.serve, "127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        srv.close()
        await srv.wait_closed()


def respond(writer: asyncio.StreamWriter, status: int, body: bytes, *, close: bool = False) -> None:
    extra = b"connection: close\r\n" if close else b""
    writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
                 % (status, len(body), extra) + body)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def delta(request_id: str, i: int) -> bytes:
    return orjson.dumps({"type": "delta", "request_id": request_id, "index": 0, "token_ids": [i],
                         "text": f"t{i}"}) + b"\n"


def final(request_id: str, n: int) -> bytes:
    return orjson.dumps({"type": "final", "request_id": request_id, "finish_reasons": ["length"],
                         "usage": {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": n},
                         "timings": {"queued": 0, "ttft": 0.001, "tpot": 0.001, "e2e": 0.01}}) + b"\n"


def generate_request(request_id: str = "r1") -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], max_tokens=4)


async def stream_answer(writer: asyncio.StreamWriter, body: bytes, tokens: int = 4) -> None:
    request_id = orjson.loads(body)["request_id"]
    writer.write(STREAM_HEAD)
    # Lines split across chunks, several lines in one chunk: the client must reassemble them.
    data = b"".join(delta(request_id, i) for i in range(tokens)) + final(request_id, tokens)
    writer.write(chunk(data[:7]) + chunk(data[7:60]))
    await writer.drain()
    await asyncio.sleep(0.01)  # not a wait: the fake engine's pacing (the rest mostly in a later read)
    writer.write(chunk(data[60:]) + b"0\r\n\r\n")
    await writer.drain()


async def test_stream_records_and_keep_alive_reuse() -> None:
    async def handler(line: bytes, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        await stream_answer(writer, body)
        return True

    async with scripted(handler) as (url, server):
        client = EngineClient(request_timeout_s=5)
        try:
            for i in range(3):
                stream = await client.generate(url, generate_request(f"r{i}"))
                records = [r async for r in stream]
                assert [type(r) for r in records] == [DeltaRecord] * 4 + [FinalRecord]
                assert "".join(r.text for r in records if isinstance(r, DeltaRecord)) == "t0t1t2t3"
                assert stream.closed and stream.buffered()
            assert server.connections == 1  # one keep-alive connection served all three
        finally:
            await client.aclose()


async def test_a_reused_connection_the_server_closed_is_retried_once() -> None:
    async def handler(line: bytes, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        respond(writer, 200, b'{"status": "ok", "model": "m", "pool": "interactive"}')
        await writer.drain()
        return False  # close after answering, without saying so (as a keep-alive timeout does)

    async with scripted(handler) as (url, server):
        client = EngineClient(request_timeout_s=5)
        try:
            assert (await client.health(url)).model == "m"
            await server.closed.wait()
            assert (await client.health(url)).model == "m"
            assert server.connections == 2
        finally:
            await client.aclose()


async def test_error_mapping() -> None:
    async def handler(line: bytes, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        request_id = orjson.loads(body)["request_id"]
        if request_id == "bad":
            respond(writer, 400, orjson.dumps({"type": "error", "error": {
                "message": "max_tokens too large", "type": "invalid_request_error", "param": "max_tokens"}}))
        elif request_id == "busy":
            respond(writer, 503, b'{"error": {"message": "queue full"}}')
        elif request_id == "odd":
            respond(writer, 500, b"not json")
        else:  # a stream that breaks off mid-way
            writer.write(STREAM_HEAD + chunk(delta(request_id, 0)))
            await writer.drain()
            return False
        return True

    async with scripted(handler) as (url, _):
        client = EngineClient(request_timeout_s=5)
        try:
            with pytest.raises(InvalidRequestError) as bad:
                await client.generate(url, generate_request("bad"))
            assert bad.value.param == "max_tokens" and "too large" in bad.value.message
            with pytest.raises(EngineUnavailable) as busy:
                await client.generate(url, generate_request("busy"))
            assert not busy.value.refused
            with pytest.raises(EngineStreamError):
                await client.generate(url, generate_request("odd"))
            stream = await client.generate(url, generate_request("broken"))
            seen = []
            with pytest.raises(EngineStreamError):
                async for record in stream:
                    seen.append(record)
            assert len(seen) == 1
        finally:
            await client.aclose()


async def test_nothing_listening_is_refused() -> None:
    client = EngineClient(request_timeout_s=5, connect_timeout_s=1)
    try:
        with pytest.raises(EngineUnavailable) as exc:
            await client.generate(f"http://127.0.0.1:{free_port()}", generate_request())
        assert exc.value.refused
        with pytest.raises(EngineUnavailable) as probe:
            await client.load(f"http://127.0.0.1:{free_port()}")
        assert probe.value.refused
    finally:
        await client.aclose()


async def test_interrupt_closes_the_connection_and_ends_the_stream_quietly() -> None:
    async def handler(line: bytes, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        request_id = orjson.loads(body)["request_id"]
        writer.write(STREAM_HEAD + chunk(delta(request_id, 0)))
        await writer.drain()
        await reader.read(1)  # wait until the client hangs up (the engine's abort)
        return False

    async with scripted(handler) as (url, server):
        client = EngineClient(request_timeout_s=5)
        try:
            stream = await client.generate(url, generate_request())
            records = []

            async def consume() -> None:
                async for record in stream:
                    records.append(record)

            task = asyncio.create_task(consume())
            await eventually(lambda: records, "the first record")
            assert not stream.buffered()  # waiting on the engine
            stream.interrupt()
            await asyncio.wait_for(task, DEFAULT_TIMEOUT_S)  # no error
            await asyncio.wait_for(server.closed.wait(), DEFAULT_TIMEOUT_S)
            assert stream.closed
        finally:
            await client.aclose()


async def test_purge_sends_the_salt_and_reads_the_count() -> None:
    answers = iter([(200, b'{"purged_blocks": 7}'), (500, b"boom"), (200, b'{"purged": 7}'),
                    (200, b'{"purged_blocks": true}')])
    bodies: list[bytes] = []

    async def handler(line: bytes, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        bodies.append(body)
        respond(writer, *next(answers))
        return True

    async with scripted(handler) as (url, server):
        client = EngineClient(request_timeout_s=5)
        try:
            assert await client.purge(url, "salt-a") == 7
            for _ in range(3):  # an error status, then answers that do not say how many went
                with pytest.raises(EngineUnavailable) as odd:
                    await client.purge(url, "salt-a")
                assert odd.value.message.startswith(f"{url}/kv/purge: ")
        finally:
            await client.aclose()
    assert server.requests[0] == b"POST /kv/purge HTTP/1.1"
    assert orjson.loads(bodies[0]) == {"cache_salt": "salt-a"}


async def test_a_draining_or_token_refusal_is_unavailable_and_says_which() -> None:
    def error(message: str, type_: str, code: str | None = None) -> bytes:
        return orjson.dumps({"type": "error", "error": {"message": message, "type": type_, "code": code}})

    answers = {b"draining": (503, error("draining", "server_error", "engine_draining")),
               b"busy": (503, error("busy", "server_error")),
               b"token": (401, error("no", "authentication_error", "invalid_internal_token"))}

    async def handler(line: bytes, body: bytes, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        status, answer = answers[orjson.loads(body)["request_id"].encode()]
        respond(writer, status, answer)
        return True

    async with scripted(handler) as (url, _server):
        client = EngineClient(request_timeout_s=5, internal_token="a-token-of-sixteen-chars")
        try:
            outcomes = {}
            for request_id in ("draining", "busy", "token"):
                with pytest.raises(EngineUnavailable) as caught:
                    await client.generate(url, generate_request(request_id))
                outcomes[request_id] = caught.value
        finally:
            await client.aclose()
    assert outcomes["draining"].draining and not outcomes["draining"].refused
    assert not outcomes["busy"].draining
    token = outcomes["token"]
    assert not token.draining and not token.refused and "token" not in token.message  # nothing for tenants
