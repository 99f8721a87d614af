"""The engine replica's internal HTTP server: NDJSON stream shape, 400s before streaming, abort on
disconnect, /health /info /load /metrics — over the synthetic engine (no model) and over the real
engine on a tiny random-weight checkpoint."""

from __future__ import annotations

import gc
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
import uvicorn

from engine.protocol import DeltaRecord, ErrorRecord, FinalRecord, InfoResponse, LoadReport, parse_record
from engine.server import build_engine, create_app
from engine.synthetic import FIRST_WORD_ID
from tests.polling import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Server:
    def __init__(self, app) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> _Server:
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), "uvicorn to start")
        if not self._server.started:
            raise RuntimeError("uvicorn did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def _records(response: httpx.Response) -> list:
    return [parse_record(line) for line in response.iter_lines() if line]


# ---- synthetic engine (no model) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def synthetic_server() -> Iterator[_Server]:
    engine = build_engine("synthetic", pool="loadtest",
                          extra={"token_interval_s": 0.001, "ttft_s": 0.0}, max_model_len=256)
    with _Server(create_app(engine)) as server:
        yield server


def test_synthetic_stream_shape_and_usage(synthetic_server: _Server) -> None:
    body = {"request_id": "s1", "prompt_token_ids": list(range(40)), "max_tokens": 3, "n": 2,
            "stop_token_ids": [FIRST_WORD_ID + (40 + 3) % 16]}
    with httpx.Client(base_url=synthetic_server.url) as client:
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("application/x-ndjson")
            records = _records(r)
        assert isinstance(records[-1], FinalRecord)
        assert all(isinstance(rec, DeltaRecord) for rec in records[:-1])
        final = records[-1]
        by_index = {i: [t for rec in records[:-1] if rec.index == i for t in rec.token_ids] for i in (0, 1)}
        # Index 1 (one word ahead) reaches the stop token as its 3rd token; index 0 hits max_tokens first.
        assert final.finish_reasons == ["length", "stop"]
        assert len(by_index[0]) == 3 and len(by_index[1]) == 3
        assert final.usage.prompt_tokens == 40 and final.usage.cached_tokens == 0
        assert final.usage.completion_tokens == 6
        assert final.timings.e2e >= final.timings.ttft >= 0
        # The same prompt again: the full blocks of its first len-1 tokens are "cached".
        body["request_id"] = "s2"
        with client.stream("POST", "/generate", json=body) as r:
            assert _records(r)[-1].usage.cached_tokens == 32
        health = client.get("/health").json()
        assert health == {"status": "ok", "model": "synthetic", "pool": "loadtest"}
        info = InfoResponse(**client.get("/info").json())
        assert info.synthetic and info.max_model_len == 256
        load = LoadReport(**client.get("/load").json())
        assert load.prefix_hit_rate > 0
        assert "tollgate_engine_time_to_first_token_seconds_bucket" in client.get("/metrics").text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt_token_ids": [1], "temperature": 5}, "temperature"),
        ({"prompt_token_ids": [1], "top_p": 0}, "top_p"),
        ({"prompt_token_ids": list(range(200)), "max_tokens": 100}, "max_tokens"),
        ({"prompt_token_ids": [1], "response_format": {"type": "json_schema"}}, "response_format"),
        ({"prompt_token_ids": [1], "surprise": True}, "surprise"),
    ],
)
def test_bad_input_is_a_400_before_streaming(synthetic_server: _Server, body: dict, param: str) -> None:
    with httpx.Client(base_url=synthetic_server.url) as client:
        r = client.post("/generate", json={"request_id": "bad", **body})
        assert r.status_code == 400, r.text
        error = ErrorRecord(**r.json())
        assert error.error.type == "invalid_request_error"
        assert error.error.param and error.error.param.startswith(param)
        assert client.post("/generate", content=b"{not json").status_code == 400


# ---- real engine on a tiny checkpoint ---------------------------------------------------------
@pytest.fixture(scope="module")
def model_server(tiny_llama_dir: Path) -> Iterator[tuple[_Server, object]]:
    engine = build_engine(str(tiny_llama_dir), pool="interactive", num_kv_blocks=64, max_num_seqs=8,
                          max_num_batched_tokens=128)
    with _Server(create_app(engine)) as server:
        yield server, engine


def test_generate_streams_the_offline_engines_tokens(model_server) -> None:
    server, engine = model_server
    prompt = list(range(5, 45))
    body = {"request_id": "g1", "prompt_token_ids": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            records = _records(r)
        final = records[-1]
        assert isinstance(final, FinalRecord) and final.finish_reasons == ["length"]
        deltas = records[:-1]
        tokens = [t for d in deltas for t in d.token_ids]
        assert len(tokens) == 12 == final.usage.completion_tokens
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
        assert all(len(lp.top_logprobs) == 2 for d in deltas for lp in d.logprobs)
        text = "".join(d.text for d in deltas)
        assert text == engine.engine.tokenizer.decode(tokens)
        # Greedy decoding is deterministic: the same request again gives the same tokens, from cache.
        body["request_id"] = "g2"
        with client.stream("POST", "/generate", json=body) as r:
            again = _records(r)
        assert [t for d in again[:-1] for t in d.token_ids] == tokens
        assert again[-1].usage.cached_tokens == 32
        metrics = client.get("/metrics").text
        assert "tollgate_engine_prefix_cache_hits_total" in metrics
        assert "tollgate_engine_time_per_output_token_seconds_count" in metrics


def test_a_prediction_is_drafted_and_its_tokens_counted(model_server) -> None:
    """Predicted Outputs through the wire: the same tokens as without, the accepted and rejected
    prediction tokens in the final usage; a prediction outside the vocabulary is a 400."""
    server, _ = model_server
    body = {"request_id": "p0", "prompt_token_ids": list(range(50, 80)), "max_tokens": 20, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json=body) as r:
            plain = _records(r)
        tokens = [t for d in plain[:-1] for t in d.token_ids]
        assert plain[-1].usage.accepted_prediction_tokens == plain[-1].usage.rejected_prediction_tokens == 0
        predicted = tokens[:12] + [(tokens[12] + 1) % 1000] + tokens[13:]
        with client.stream("POST", "/generate",
                           json={**body, "request_id": "p1", "prediction_token_ids": predicted}) as r:
            speculated = _records(r)
        assert [t for d in speculated[:-1] for t in d.token_ids] == tokens
        usage = speculated[-1].usage
        assert usage.completion_tokens == 20 and usage.accepted_prediction_tokens >= 10
        assert usage.rejected_prediction_tokens >= 1
        bad = client.post("/generate", json={**body, "request_id": "p2", "prediction_token_ids": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction"


def test_an_embedding_request_ends_with_its_vector_and_no_tokens(model_server, tiny_llama_dir: Path) -> None:
    from engine import LLM
    from engine.pooling import PoolingParams

    server, engine = model_server
    prompt = list(range(5, 45))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        info = client.get("/info").json()
        assert info["embedding_dimensions"] == 128 and info["pooling"] == "last"
        records = {}
        for mode in ("last", "mean"):
            body = {"request_id": f"e-{mode}", "prompt_token_ids": prompt, "pooling": {"mode": mode}}
            with client.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                records[mode] = _records(r)
        bad = client.post("/generate", json={"request_id": "e-bad", "prompt_token_ids": prompt,
                                             "pooling": {"mode": "max"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("pooling")
    offline = LLM(str(tiny_llama_dir))
    for mode, lines in records.items():
        [final] = lines  # one final record, no deltas
        assert isinstance(final, FinalRecord) and final.finish_reasons == ["stop"]
        assert final.usage.prompt_tokens == 40 and final.usage.completion_tokens == 0
        expected = offline.embed([prompt], pooling=PoolingParams(mode))[0]
        assert final.embedding == pytest.approx(expected, abs=1e-5)


def test_disconnect_aborts_and_frees_blocks_while_others_are_served(model_server) -> None:
    server, _ = model_server
    with httpx.Client(base_url=server.url, timeout=60) as client:
        total = client.get("/info").json()["num_kv_blocks"]
        long_body = {"request_id": "long", "prompt_token_ids": list(range(3, 60)), "max_tokens": 900,
                     "ignore_eos": True}
        with client.stream("POST", "/generate", json=long_body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = parse_record(next(lines))
            assert isinstance(first, DeltaRecord)
            assert client.get("/load").json()["running"] >= 1
            # Over-long prompt for someone else: a 400, and the running stream is unaffected.
            bad = client.post("/generate", json={"request_id": "x", "prompt_token_ids": [1] * 5000})
            assert bad.status_code == 400 and bad.json()["error"]["param"]
            second = parse_record(next(lines))
            assert isinstance(second, DeltaRecord)
        # Leaving the `with` closed the connection: the engine aborts and frees every block.
        wait_until(lambda: LoadReport(**client.get("/load").json()).running == 0, "the abort")
        load = LoadReport(**client.get("/load").json())
        assert load.free_kv_blocks == total and load.kv_usage == 0.0
        assert 'reason="abort"' in client.get("/metrics").text
        # What the engine computed for the abandoned stream stays known (the gateway bills by it): the
        # prompt, and at least the two tokens this client read.
        after = client.post("/abort", json={"request_id": "long"}).json()
        assert after["aborted"] is False
        assert after["usage"]["prompt_tokens"] == 57 and 2 <= after["usage"]["completion_tokens"] < 900
        # Explicit /abort of something never seen says so.
        assert client.post("/abort", json={"request_id": "nope"}).json() == {"aborted": False, "usage": None}
        short = client.post("/generate", json={"request_id": "after", "prompt_token_ids": [5, 6, 7],
                                                "max_tokens": 3, "ignore_eos": True})
        assert [orjson.loads(x)["type"] for x in short.text.splitlines()][-1] == "final"


def test_abort_answers_with_the_usage_of_the_final_record(model_server) -> None:
    """``/abort`` of a running stream stops it and answers with the engine's own count, the same usage the
    stream's final record carries, at least the tokens already streamed."""
    server, _ = model_server
    body = {"request_id": "to-abort", "prompt_token_ids": list(range(3, 40)), "max_tokens": 900,
            "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=60) as client, client.stream("POST", "/generate",
                                                                               json=body) as r:
        records = (parse_record(line) for line in r.iter_lines() if line)
        streamed = sum(len(next(records).token_ids) for _ in range(3))
        with httpx.Client(base_url=server.url, timeout=60) as other:
            answer = other.post("/abort", json={"request_id": "to-abort"}).json()
        rest = list(records)
    final = rest[-1]
    assert isinstance(final, FinalRecord) and final.finish_reasons == ["abort"]
    assert answer["aborted"] is True and answer["usage"] == final.usage.fields()
    assert final.usage.completion_tokens == streamed + sum(len(x.token_ids) for x in rest[:-1])
    assert streamed >= 3 and final.usage.completion_tokens < 900


def test_generate_request_maps_onto_sampling_params() -> None:
    from engine.protocol import GenerateRequest
    from engine.sampling_params import SamplingParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    request = GenerateRequest(request_id="r", prompt_token_ids=[1, 2], n=2, temperature=0.5, top_k=0,
                              stop="END", logprobs=True, top_logprobs=3, seed=7,
                              response_format={"type": "json_schema", "json_schema": schema})
    params = SamplingParams(**request.sampling_kwargs())
    assert (params.n, params.temperature, params.top_k, params.seed) == (2, 0.5, -1, 7)
    assert params.stop == ["END"] and params.logprobs == 3 and params.json_schema == schema
    assert params.max_tokens == SamplingParams().max_tokens  # omitted: the server fills in the context
    plain = GenerateRequest(request_id="r", prompt_token_ids=[1], max_tokens=9).sampling_kwargs()
    assert SamplingParams(**plain).logprobs is None and plain["max_tokens"] == 9
    assert SamplingParams(**GenerateRequest(request_id="r", prompt_token_ids=[1], response_format={
        "type": "json_object"}).sampling_kwargs()).json_object


def test_startup_moves_the_loaded_heap_out_of_the_collectors_sight() -> None:
    """A full collection over the model's and the imports' objects would stall every stream (~130 ms on
    the dev box); the server freezes what exists at startup, so later collections walk only new
    objects."""
    gc.unfreeze()
    engine = build_engine("synthetic", pool="loadtest")
    with _Server(create_app(engine)):
        assert gc.get_freeze_count() > 0


def test_live_reports_a_stalled_or_failing_loop_and_health_stays_for_routing(tiny_llama_dir: Path) -> None:
    """``/live`` (the liveness probe) answers 503 ``stalled`` when the step loop has work but finishes no
    step (here: a step that blocks, as a hung kernel or a collective waiting on a dead rank would), and
    when steps keep failing (a poisoned device); 200 while idle or busy and progressing."""
    import engine.server as server_module

    engine = build_engine(str(tiny_llama_dir), pool="interactive", num_kv_blocks=64, max_num_seqs=4,
                          max_num_batched_tokens=64)
    release = threading.Event()
    real_step = engine.engine.step
    mode = {"hang": False, "fail": False}

    def step():  # type: ignore[no-untyped-def]
        if mode["hang"]:
            release.wait(30)
        if mode["fail"]:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_step()

    engine.engine.step = step  # type: ignore[method-assign]
    body = {"request_id": "s1", "prompt_token_ids": list(range(5, 25)), "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    original = server_module.LIVENESS_STALL_S
    server_module.LIVENESS_STALL_S = 0.5
    try:
        with _Server(create_app(engine)) as server:
            assert httpx.get(f"{server.url}/live", timeout=5).json()["status"] == "ok"  # idle
            assert httpx.post(f"{server.url}/generate", json=body, timeout=30).status_code == 200
            mode["hang"] = True
            request = threading.Thread(target=lambda: httpx.post(
                f"{server.url}/generate", json=body | {"request_id": "s2"}, timeout=60), daemon=True)
            request.start()
            wait_until(lambda: httpx.get(f"{server.url}/live", timeout=5).status_code == 503,
                       "/live to report the stalled loop", timeout_s=20)
            stalled = httpx.get(f"{server.url}/live", timeout=5).json()
            assert stalled["status"] == "stalled" and "one is stuck" in stalled["reason"]
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200  # routing is /health's
            mode["hang"] = False
            release.set()
            request.join(30)
            wait_until(lambda: httpx.get(f"{server.url}/live", timeout=5).status_code == 200,
                       "/live to recover")
            mode["fail"] = True
            for i in range(3):
                httpx.post(f"{server.url}/generate", json=body | {"request_id": f"f{i}"}, timeout=30)
            failing = httpx.get(f"{server.url}/live", timeout=5)
            assert failing.status_code == 503 and "engine steps failed" in failing.json()["reason"]
    finally:
        server_module.LIVENESS_STALL_S = original
        release.set()
        engine.shutdown()
