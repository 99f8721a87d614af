"""A batch line stopped mid-run (``execute_line``): for good (cancel, expiry) its attempt is billed what it
computed; when another chain runs it again (this chain lost the line's lease) the attempt bills nothing,
so that the ledger's one row for the line's request id is the attempt that answers it."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import BaseModel, ConfigDict

from gateway.batches import lines
from gateway.openai.answers import Answer


class AnyBody(BaseModel):
    model_config = ConfigDict(extra="allow")


class RunningGeneration:
    """What ``collect_until`` calls on a generation, recorded; its body runs until interrupted."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.interrupted = asyncio.Event()
        self.reading = asyncio.Event()
        self.cost_pico_usd = 0
        self.served_pool = "interactive"

    def void(self) -> None:
        self.calls.append("void")

    def cancel(self) -> None:
        self.calls.append("cancel")

    def interrupt(self) -> None:
        self.calls.append("interrupt")
        self.interrupted.set()

    async def finish(self) -> None:
        self.calls.append("finish")

    async def body(self) -> dict:
        self.reading.set()
        await self.interrupted.wait()
        return {}


@pytest.fixture
def generation(monkeypatch: pytest.MonkeyPatch) -> RunningGeneration:
    running = RunningGeneration()

    async def start(runtime: object, principal: object, request_id: str, body: object) -> Answer:
        return Answer(generation=running, body=running.body)  # type: ignore[arg-type]

    monkeypatch.setitem(lines.ENDPOINTS, "/v1/test", (AnyBody, start))
    return running


@pytest.mark.parametrize(("retried", "calls"), [
    (True, ["void", "cancel", "interrupt", "finish"]),  # runs again elsewhere: this attempt bills nothing
    (False, ["cancel", "interrupt", "finish"]),  # cancelled or expired: billed what it computed
])
async def test_a_stopped_line_bills_its_attempt_unless_it_runs_again(generation: RunningGeneration,
                                                                     retried: bool, calls: list[str]) -> None:
    stop = asyncio.Event()
    running = asyncio.create_task(lines.execute_line(
        None, None, "/v1/test", "batch_req_x", {"model": "tiny"}, stop,  # type: ignore[arg-type]
        retried=lambda: retried))
    await asyncio.wait_for(generation.reading.wait(), timeout=10)  # the line is running
    stop.set()
    result = await asyncio.wait_for(running, timeout=10)
    assert result.status_code is None and result.deferred is None  # stopped before an answer
    assert generation.calls == calls
