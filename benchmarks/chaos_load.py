"""The chaos benchmark's load: several tenants' clients doing what tenants do, each call's outcome written
down as the client saw it (what the judge later compares with the ledger).

Operations (``OPERATIONS``, picked by weight): chat completions non-streamed and streamed (with
``include_usage``), streams the client abandons after a few tokens, chat with cache lifetimes on a long
shared system prompt (``prompt_cache_retention`` 24h, ``prompt_cache_options`` ttl), Responses stored and
streamed, background Responses polled to their end, embeddings. Batches are submitted by ``submit_batch``
(the fault schedule submits one before each worker kill, so a worker dies mid-batch).

No client retries: every attempt is one outcome. ``Outcome.kind``:
- ``ok``: the answer arrived whole, with its usage (a background response: its final object, ``completed``
  or ``incomplete``);
- ``abandoned``: the client left a stream after ``read`` content tokens (on purpose);
- ``http_error``: an error status before any content (``status``, OpenAI's error ``code``);
- ``broken``: a stream that started and then failed (an error frame, or the connection broke);
- ``transport``: no HTTP answer at all (the connection was refused or reset: a gateway worker died);
- ``failed_background``: a background response that ended ``failed`` or ``cancelled``, or never ended
  within its poll budget.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

MODEL = "tiny"
SYSTEM_PROMPT_WORDS = 220  # a shared prefix of several KV blocks per tenant: prefix-cache hits and pins
BACKGROUND_POLL_S = 90.0


@dataclass
class Outcome:
    op: str
    tenant: str
    kind: str
    request_id: str | None = None
    response_id: str | None = None  # a background response's id (its ledger row has the worker's request id)
    status: int | None = None
    code: str | None = None
    usage: dict[str, Any] | None = None  # chat-shaped: prompt_tokens, completion_tokens, cached_tokens
    read: int = 0
    started: float = 0.0
    ended: float = 0.0
    error: str | None = None


@dataclass
class Tenant:
    name: str
    key: str
    system_prompt: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@dataclass
class Batch:
    tenant: str
    batch_id: str
    custom_ids: list[str]
    submitted: float


@dataclass
class LoadLog:
    outcomes: list[Outcome] = field(default_factory=list)
    batches: list[Batch] = field(default_factory=list)
    batch_errors: list[str] = field(default_factory=list)


def system_prompt(tenant: str) -> str:
    rng = random.Random(tenant)
    words = [
        "ledger",
        "token",
        "replica",
        "gateway",
        "invoice",
        "stream",
        "cache",
        "tenant",
        "batch",
        "price",
    ]
    return f"You are {tenant}'s assistant. " + " ".join(rng.choice(words) for _ in range(SYSTEM_PROMPT_WORDS))


def _chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def _responses_usage(usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": usage["input_tokens"],
        "completion_tokens": usage["output_tokens"],
        "cached_tokens": (usage.get("input_tokens_details") or {}).get("cached_tokens", 0),
    }


def _error_code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


class Load:
    def __init__(self, base_url: str, tenants: list[Tenant], *, seed: int, concurrency: int) -> None:
        self.base_url = base_url
        self.tenants = tenants
        self.rng = random.Random(seed)
        self.concurrency = concurrency
        self.log = LoadLog()
        self._stop = asyncio.Event()
        self._serial = 0

    def stop(self) -> None:
        self._stop.set()

    def _tag(self) -> str:
        self._serial += 1
        return f"q{self._serial}"

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.concurrency * 2, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=self.base_url, timeout=120.0, limits=limits) as client:
            await asyncio.gather(*(self._client_loop(client) for _ in range(self.concurrency)))

    async def _client_loop(self, client: httpx.AsyncClient) -> None:
        names = [name for name, _ in OPERATIONS]
        weights = [weight for _, weight in OPERATIONS]
        while not self._stop.is_set():
            tenant = self.rng.choice(self.tenants)
            op = self.rng.choices(names, weights)[0]
            outcome = Outcome(op=op, tenant=tenant.name, kind="transport", started=time.monotonic())
            try:
                await getattr(self, f"_{op}")(client, tenant, outcome)
            except httpx.TransportError as exc:
                # No answer, or the stream broke after it started (then it is "broken").
                if outcome.kind != "broken" and outcome.request_id is None:
                    outcome.kind = "transport"
                else:
                    outcome.kind = "broken"
                outcome.error = type(exc).__name__
            outcome.ended = time.monotonic()
            self.log.outcomes.append(outcome)

    # ---- operations ----------------------------------------------------------------------------
    def _messages(self, tenant: Tenant, cached: bool = False) -> list[dict[str, str]]:
        question = f"Question {self._tag()}: what happened to the ledger?"
        if cached:
            return [
                {"role": "system", "content": tenant.system_prompt},
                {"role": "user", "content": question},
            ]
        return [{"role": "user", "content": question}]

    async def _post(
        self,
        client: httpx.AsyncClient,
        path: str,
        tenant: Tenant,
        body: dict[str, Any],
        outcome: Outcome,
        usage_of: Any = _chat_usage,
    ) -> dict[str, Any] | None:
        response = await client.post(path, json=body, headers=tenant.headers)
        outcome.status = response.status_code
        outcome.request_id = response.headers.get("x-request-id")
        if response.status_code != 200:
            outcome.kind, outcome.code = "http_error", _error_code(response)
            return None
        answer = response.json()
        outcome.kind, outcome.usage = "ok", usage_of(answer["usage"])
        return answer

    async def _chat(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body = {"model": MODEL, "messages": self._messages(tenant), "max_tokens": self.rng.randint(2, 24)}
        await self._post(client, "/v1/chat/completions", tenant, body, outcome)

    async def _cached_chat(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": self._messages(tenant, cached=True),
            "max_tokens": self.rng.randint(2, 12),
        }
        if self.rng.random() < 0.5:
            body["prompt_cache_retention"] = "24h"
        else:
            body["prompt_cache_options"] = {"ttl": "30m"}
        await self._post(client, "/v1/chat/completions", tenant, body, outcome)

    async def _embeddings(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body = {"model": MODEL, "input": [f"embed {self._tag()} one", f"embed {self._tag()} two"]}
        await self._post(
            client,
            "/v1/embeddings",
            tenant,
            body,
            outcome,
            usage_of=lambda u: {
                "prompt_tokens": u["prompt_tokens"],
                "completion_tokens": 0,
                "cached_tokens": 0,
            },
        )

    async def _response(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body = {
            "model": MODEL,
            "input": f"Respond {self._tag()}",
            "max_output_tokens": self.rng.randint(2, 16),
        }
        await self._post(client, "/v1/responses", tenant, body, outcome, usage_of=_responses_usage)

    async def _stream(
        self,
        client: httpx.AsyncClient,
        tenant: Tenant,
        outcome: Outcome,
        path: str,
        body: dict[str, Any],
        abandon_after: int | None = None,
    ) -> None:
        async with client.stream("POST", path, json=body, headers=tenant.headers) as response:
            outcome.status = response.status_code
            outcome.request_id = response.headers.get("x-request-id")
            if response.status_code != 200:
                await response.aread()
                outcome.kind, outcome.code = "http_error", _error_code(response)
                return
            outcome.kind = "broken"  # until the end is seen
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcome.kind = "ok" if outcome.usage is not None else "broken"
                    return
                event = json.loads(line[6:])
                if "error" in event and "type" not in event:
                    outcome.code = event["error"].get("code")
                    return  # an error frame: the stream failed
                if path == "/v1/chat/completions":
                    outcome.read += sum(1 for c in event.get("choices", []) if c["delta"].get("content"))
                    if event.get("usage"):
                        outcome.usage = _chat_usage(event["usage"])
                else:
                    kind = event.get("type")
                    if kind == "response.output_text.delta":
                        outcome.read += 1
                    elif kind in ("response.completed", "response.incomplete"):
                        outcome.usage = _responses_usage(event["response"]["usage"])
                        outcome.kind = "ok"
                        return
                    elif kind in ("response.failed", "error"):
                        return
                if abandon_after is not None and outcome.read >= abandon_after:
                    outcome.kind = "abandoned"
                    return  # leaving the block closes the connection mid-stream

    async def _chat_stream(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body = {
            "model": MODEL,
            "messages": self._messages(tenant),
            "max_tokens": self.rng.randint(2, 24),
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        await self._stream(client, tenant, outcome, "/v1/chat/completions", body)

    async def _abandoned_stream(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body = {
            "model": MODEL,
            "messages": self._messages(tenant),
            "max_tokens": 200,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        await self._stream(
            client, tenant, outcome, "/v1/chat/completions", body, abandon_after=self.rng.randint(1, 6)
        )

    async def _response_stream(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body = {
            "model": MODEL,
            "input": f"Stream {self._tag()}",
            "max_output_tokens": self.rng.randint(2, 16),
            "stream": True,
        }
        await self._stream(client, tenant, outcome, "/v1/responses", body)

    async def _background(self, client: httpx.AsyncClient, tenant: Tenant, outcome: Outcome) -> None:
        body = {
            "model": MODEL,
            "input": f"Later {self._tag()}",
            "max_output_tokens": self.rng.randint(2, 12),
            "background": True,
        }
        queued = await client.post("/v1/responses", json=body, headers=tenant.headers)
        outcome.status = queued.status_code
        if queued.status_code != 200:
            outcome.kind, outcome.code = "http_error", _error_code(queued)
            return
        response_id = outcome.response_id = queued.json()["id"]
        outcome.kind = "failed_background"
        deadline = time.monotonic() + BACKGROUND_POLL_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            try:
                polled = await client.get(f"/v1/responses/{response_id}", headers=tenant.headers)
            except httpx.TransportError:
                continue  # a gateway worker died under the poll: poll again
            if polled.status_code != 200:
                continue  # 503 store_unavailable while Postgres is down: poll again
            answer = polled.json()
            if answer["status"] in ("completed", "incomplete"):  # incomplete: it reached max_output_tokens
                outcome.kind, outcome.usage = "ok", _responses_usage(answer["usage"])
                return
            if answer["status"] in ("failed", "cancelled"):
                outcome.code = answer["status"]
                if answer.get("usage"):
                    outcome.usage = _responses_usage(answer["usage"])
                return

    # ---- batches -------------------------------------------------------------------------------
    async def submit_batch(self, tenant: Tenant, lines: int) -> Batch | None:
        tag = self._tag()
        custom_ids = [f"{tag}-line-{i}" for i in range(lines)]
        jsonl = (
            "\n".join(
                json.dumps(
                    {
                        "custom_id": custom_id,
                        "method": "POST",
                        "url": "/v1/chat/completions",
                        "body": {
                            "model": MODEL,
                            "messages": [{"role": "user", "content": f"Batch {custom_id}"}],
                            "max_tokens": 12,
                        },
                    }
                )
                for custom_id in custom_ids
            )
            + "\n"
        )
        async with httpx.AsyncClient(base_url=self.base_url, timeout=60.0, headers=tenant.headers) as client:
            for _attempt in range(20):  # an operator's script retries its submission through faults
                try:
                    uploaded = await client.post(
                        "/v1/files",
                        data={"purpose": "batch"},
                        files={"file": (f"{tag}.jsonl", jsonl.encode())},
                    )
                    if uploaded.status_code != 200:
                        raise RuntimeError(f"upload {uploaded.status_code}: {uploaded.text[:200]}")
                    created = await client.post(
                        "/v1/batches",
                        json={
                            "input_file_id": uploaded.json()["id"],
                            "endpoint": "/v1/chat/completions",
                            "completion_window": "24h",
                        },
                    )
                    if created.status_code != 200:
                        raise RuntimeError(f"create {created.status_code}: {created.text[:200]}")
                except (httpx.TransportError, RuntimeError) as exc:
                    self.log.batch_errors.append(f"{tenant.name} {tag}: {exc}")
                    await asyncio.sleep(1.0)
                    continue
                batch = Batch(tenant.name, created.json()["id"], custom_ids, time.monotonic())
                self.log.batches.append(batch)
                return batch
        return None


OPERATIONS: list[tuple[str, int]] = [
    ("chat", 24),
    ("chat_stream", 20),
    ("abandoned_stream", 10),
    ("cached_chat", 14),
    ("embeddings", 10),
    ("response", 10),
    ("response_stream", 6),
    ("background", 6),
]
