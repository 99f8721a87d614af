"""``/v1/completions`` and ``/v1/models`` against a real engine, validated against OpenAI's schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.conftest import MODEL, GatewayUnderTest, make_tenant_key, wait_for_usage
from tests.gateway.test_openai_chat import sse_events
from tests.openai_schema import assert_conforms

pytestmark = pytest.mark.slow


async def test_text_completion(client: httpx.AsyncClient, gateway: GatewayUnderTest) -> None:
    r = await client.post("/completions", json={"model": MODEL, "prompt": "def main():", "max_tokens": 5,
                                                "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert_conforms(body, "CreateCompletionResponse")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert 0 < body["usage"]["completion_tokens"] <= 5
    records = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert len(records) == 1 and records[0]["completion_tokens"] == body["usage"]["completion_tokens"]


async def test_default_max_tokens_is_16(client: httpx.AsyncClient) -> None:
    r = await client.post("/completions", json={"model": MODEL, "prompt": "import os", "temperature": 0,
                                                "stop": None})
    body = r.json()
    assert body["usage"]["completion_tokens"] <= 16


async def test_prompt_shapes_index_choices_per_prompt(client: httpx.AsyncClient) -> None:
    ids = (await client.post("/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})).json()
    assert ids["usage"]["prompt_tokens"] >= 1
    r = await client.post("/completions", json={"model": MODEL, "prompt": ["one", "two words"], "n": 2,
                                                "max_tokens": 3, "seed": 1})
    body = r.json()
    assert_conforms(body, "CreateCompletionResponse")
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]
    r = await client.post("/completions", json={"model": MODEL, "prompt": [[5, 6, 7], [8, 9]],
                                                "max_tokens": 2})
    body = r.json()
    assert_conforms(body, "CreateCompletionResponse")
    assert body["usage"]["prompt_tokens"] == 5 and len(body["choices"]) == 2
    r = await client.post("/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] == 3


async def test_a_list_prompt_whose_second_prompt_cannot_start_is_answered_503_and_billed_nothing(
    client: httpx.AsyncClient, gateway: GatewayUnderTest, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first prompt started on the replica, the second found it busy (and no other): the client gets
    503 and nothing of the request, and the first prompt's work is not billed either."""
    from gateway.engine_client import EngineUnavailable

    engine = gateway.runtime.engine
    generate = engine.generate

    async def second_prompt_busy(url: str, request: Any) -> Any:
        if request.request_id.endswith("-1"):
            raise EngineUnavailable()
        return await generate(url, request)

    monkeypatch.setattr(engine, "generate", second_prompt_busy)
    r = await client.post("/completions", json={"model": MODEL, "prompt": ["one two three four", "five"],
                                                "max_tokens": 3})
    assert r.status_code == 503, r.text
    [record] = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert record["status"] == "failed"
    assert (record["prompt_tokens"], record["completion_tokens"], record["cost_pico_usd"]) == (0, 0, 0)


async def test_echo_and_logprobs(client: httpx.AsyncClient) -> None:
    r = await client.post("/completions", json={"model": MODEL, "prompt": "Hello there", "echo": True,
                                                "max_tokens": 3})
    body = r.json()
    assert_conforms(body, "CreateCompletionResponse")
    assert body["choices"][0]["text"].startswith("Hello there")
    r = await client.post("/completions", json={"model": MODEL, "prompt": "Hello", "logprobs": 2,
                                                "max_tokens": 3})
    body = r.json()
    assert_conforms(body, "CreateCompletionResponse")
    lp = body["choices"][0]["logprobs"]
    n = body["usage"]["completion_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert all(len(top) <= 2 for top in lp["top_logprobs"])


async def test_an_echoed_prompt_is_scored_as_transformers_scores_it(client: httpx.AsyncClient,
                                                                    tiny_model_dir: Path) -> None:
    """What lm-evaluation-harness's ``local-completions`` sends for a log-likelihood: token-id prompts,
    ``echo``, ``logprobs: 1``, ``max_tokens: 1``. Every prompt token after the first gets its logprob
    given the tokens before it (equal to transformers' on the same checkpoint), the first a null, and the
    top alternative says whether the continuation is greedy; a repeated prompt is computed again (a cached
    position has no logits), a batched and a streamed request answer the same."""
    import torch
    import transformers

    context, continuation = [301, 17, 5, 88, 912, 40], [77, 3, 250]
    prompts = [context + continuation, context[:3] + continuation]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    request = {"model": MODEL, "prompt": prompts[0], "echo": True, "logprobs": 1, "max_tokens": 1,
               "temperature": 0}
    for _ in range(2):
        r = await client.post("/completions", json=request)
        assert r.status_code == 200, r.text
        body = r.json()
        lp = body["choices"][0]["logprobs"]
        # The first prompt token has nothing before it: null, as OpenAI and vLLM answer (the published
        # schema has no place for it; everything else conforms).
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert_conforms(_first_scored(body), "CreateCompletionResponse")
        assert len(lp["tokens"]) == len(prompts[0]) + 1 and lp["text_offset"][0] == 0
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([prompts[0]])).logits[0].float(), dim=-1)
        for i in range(1, len(prompts[0])):
            assert lp["token_logprobs"][i] == pytest.approx(reference[i - 1, prompts[0][i]].item(), abs=1e-4)
            (best,) = lp["top_logprobs"][i].values()
            assert best == pytest.approx(reference[i - 1].max().item(), abs=1e-4)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the second time too

    batched = (await client.post("/completions", json={**request, "prompt": prompts})).json()
    assert [c["logprobs"]["token_logprobs"][:len(p)] for c, p in zip(batched["choices"], prompts,
                                                                      strict=True)][0] == pytest.approx(
        [None, *lp["token_logprobs"][1:len(prompts[0])]], abs=1e-5)
    # vLLM's extension: per prompt token, its id's logprob and rank, and the likeliest ones.
    extension = (await client.post("/completions", json={"model": MODEL, "prompt": prompts[0],
                                                         "max_tokens": 1, "prompt_logprobs": 2})).json()
    entries = extension["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompts[0])
    for i in range(1, len(prompts[0])):
        mine = entries[i][str(prompts[0][i])]
        assert mine["logprob"] == pytest.approx(reference[i - 1, prompts[0][i]].item(), abs=1e-4)
        assert mine["rank"] == 1 + int((reference[i - 1] > reference[i - 1, prompts[0][i]]).sum())
        assert sorted(e["rank"] for e in entries[i].values())[:2] == [1, 2] or mine["rank"] <= 2
    streamed = await client.post("/completions", json={**request, "stream": True})
    events = [json.loads(e) for e in sse_events(streamed.text) if e != "[DONE]"]
    first = events[0]["choices"][0]
    assert first["text"] == body["choices"][0]["text"][:len(first["text"])]
    assert first["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:len(prompts[0])],
                                                                     abs=1e-5)


def _first_scored(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with each choice's logprobs starting at the second prompt token."""
    body = json.loads(json.dumps(body))
    for choice in body["choices"]:
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            choice["logprobs"][name] = choice["logprobs"][name][1:]
    return body


async def test_streamed_completion(client: httpx.AsyncClient, gateway: GatewayUnderTest) -> None:
    r = await client.post("/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                "stream": True, "stream_options": {"include_usage": True},
                                                "temperature": 0})
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        # The one documented deviation from the published schema, shared with OpenAI's own API and its
        # SDKs: a streamed legacy completion chunk has "finish_reason": null until the choice finishes.
        checked = json.loads(json.dumps(chunk))
        for choice in checked["choices"]:
            if choice["finish_reason"] is None:
                choice["finish_reason"] = "stop"
        assert_conforms(checked, "CreateCompletionResponse")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(c["choices"][0]["text"] for c in chunks[:-2])
    records = await wait_for_usage(gateway.settings.redis_url, r.headers["x-request-id"])
    assert [rec["status"] for rec in records] == ["completed"]


async def test_models(client: httpx.AsyncClient) -> None:
    r = await client.get("/models")
    assert r.status_code == 200
    body = r.json()
    assert_conforms(body, "ListModelsResponse")
    assert [m["id"] for m in body["data"]] == [MODEL]
    r = await client.get(f"/models/{MODEL}")
    assert_conforms(r.json(), "Model")
    assert r.json()["id"] == MODEL and r.json()["object"] == "model"
    r = await client.get("/models/gpt-4o")
    assert r.status_code == 404
    assert_conforms(r.json(), "ErrorResponse")
    assert r.json()["error"]["code"] == "model_not_found"


async def test_key_restricted_to_other_models_sees_none(gateway: GatewayUnderTest) -> None:
    tk = await make_tenant_key(gateway, allowed_models=["other-model"])
    async with httpx.AsyncClient(base_url=f"{gateway.url}/v1", headers=tk.headers, timeout=30) as c:
        assert (await c.get("/models")).json()["data"] == []
        assert (await c.get(f"/models/{MODEL}")).status_code == 404
        r = await c.post("/chat/completions",
                         json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_openapi_document_describes_the_request_bodies(gateway: GatewayUnderTest) -> None:
    import re

    async with httpx.AsyncClient(base_url=gateway.url) as c:
        spec = (await c.get("/openapi.json")).json()
    body = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/ChatCompletionRequest"
    refs = set(re.findall(r"#/components/schemas/([A-Za-z0-9_]+)", json.dumps(spec)))
    assert refs <= set(spec["components"]["schemas"])
