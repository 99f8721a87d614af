"""An engine replica's front door, on real ``tollgate engine`` processes serving the tiny checkpoint:
the internal token (every endpoint but ``/health`` and ``/metrics`` refused without it, 401 with an
error record), the refusal to run open on a non-loopback address, the drain on SIGTERM (``/health``
503 draining at once, new ``/generate`` refused with ``engine_draining``, the running stream finished,
then exit 0; a stream longer than the drain timeout cut, on a synthetic replica), and the metric names
vLLM's users know."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.gate import check_internal_token
from engine.protocol import DRAINING_CODE, INTERNAL_TOKEN_CODE, ErrorRecord, FinalRecord, parse_record
from tests.gateway.conftest import run_engine
from tests.gateway.gateway_processes import synthetic_engine
from tests.polling import wait_until

TOKEN = "engine-test-internal-token-0123456789"
PROMPT = list(range(10, 30))


def generate_body(request_id: str, max_tokens: int = 4) -> dict:
    return {"request_id": request_id, "prompt_token_ids": PROMPT, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture(scope="module")
def guarded_engine(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("guarded") / "engine.log"
    with run_engine(tiny_llama_dir, log, env={"TOLLGATE_INTERNAL_TOKEN": TOKEN}) as (url, _proc):
        yield url


# ---- internal authentication -------------------------------------------------------------------
def test_without_or_with_a_wrong_token_every_internal_endpoint_is_refused(guarded_engine: str) -> None:
    calls = [("POST", "/generate", generate_body("unauth")), ("POST", "/abort", {"request_id": "x"}),
             ("GET", "/load", None), ("GET", "/info", None), ("GET", "/kv/events?after=0", None),
             ("POST", "/kv/purge", {"cache_salt": "s"}), ("GET", "/no-such-path", None)]
    for headers in ({}, auth("wrong-token-of-the-same-size-0123456"), {"Authorization": TOKEN},
                    {"Authorization": "Bearer"}):
        for method, path, body in calls:
            response = httpx.request(method, f"{guarded_engine}{path}", json=body, headers=headers,
                                     timeout=10)
            assert response.status_code == 401, (path, headers, response.text)
            error = ErrorRecord.model_validate(response.json()).error
            assert error.code == INTERNAL_TOKEN_CODE and error.type == "authentication_error"


def test_health_and_metrics_answer_anyone(guarded_engine: str) -> None:
    assert httpx.get(f"{guarded_engine}/health", timeout=10).json()["status"] == "ok"
    assert httpx.get(f"{guarded_engine}/metrics", timeout=10).status_code == 200


def test_the_right_token_opens_every_endpoint(guarded_engine: str) -> None:
    with httpx.Client(base_url=guarded_engine, headers=auth(), timeout=60) as client:
        with client.stream("POST", "/generate", json=generate_body("authed")) as response:
            assert response.status_code == 200
            records = [parse_record(line) for line in response.iter_lines() if line]
        assert isinstance(records[-1], FinalRecord) and records[-1].usage.completion_tokens == 4
        assert client.get("/load").json()["draining"] is False
        assert client.get("/info").status_code == 200
        assert client.get("/kv/events", params={"after": 0}).json()["snapshot"] is not None
        assert client.post("/kv/purge", json={"cache_salt": None}).status_code == 200
        ended = client.post("/abort", json={"request_id": "authed"}).json()  # ended: its usage, kept
        assert ended["aborted"] is False and ended["usage"] == records[-1].usage.fields()


def test_metrics_carry_vllm_names_beside_tollgate_ones(guarded_engine: str) -> None:
    text = httpx.get(f"{guarded_engine}/metrics", timeout=10).text
    samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    info = httpx.get(f"{guarded_engine}/info", headers=auth(), timeout=10).text
    model = Path(json.loads(info)["model"]).name
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        sample = f'{name}{{model_name="{model}"}}'
        assert sample in samples, (sample, sorted(samples)[:20])
        assert samples[sample] >= 0
    assert 0.0 <= samples[f'vllm:kv_cache_usage_perc{{model_name="{model}"}}'] <= 1.0
    assert any(name.startswith("tollgate_engine_requests_waiting") for name in samples)


def test_a_token_is_required_off_loopback_and_must_be_long() -> None:
    check_internal_token(None, "127.0.0.1")
    check_internal_token(None, "127.0.0.2")
    check_internal_token(None, "localhost")
    check_internal_token(TOKEN, "0.0.0.0")
    for token, host in ((None, "0.0.0.0"), (None, "10.1.2.3"), (None, "::"), ("short", "127.0.0.1"),
                        (f" {TOKEN}", "0.0.0.0")):
        with pytest.raises(ValueError, match="TOLLGATE_INTERNAL_TOKEN"):
            check_internal_token(token, host)


def test_the_cli_refuses_to_serve_open_on_a_shared_address(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TOLLGATE_INTERNAL_TOKEN"}
    result = subprocess.run([sys.executable, "-m", "tollgate", "engine", "--model", "synthetic", "--host",
                             "0.0.0.0", "--port", "1"], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 2
    assert "needs an internal token" in result.stderr and "TOLLGATE_INTERNAL_TOKEN" in result.stderr


# ---- drain on SIGTERM --------------------------------------------------------------------------
class Stream:
    """A ``/generate`` stream read on a thread: how many tokens came, and whether its final record did."""

    def __init__(self, url: str, request_id: str, max_tokens: int) -> None:
        self.tokens = 0
        self.final: FinalRecord | None = None
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._read, args=(url, request_id, max_tokens), daemon=True)
        self._thread.start()

    def _read(self, url: str, request_id: str, max_tokens: int) -> None:
        try:
            with httpx.stream("POST", f"{url}/generate", json=generate_body(request_id, max_tokens),
                              headers=auth(), timeout=120) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    record = parse_record(line)
                    if isinstance(record, FinalRecord):
                        self.final = record
                    else:
                        self.tokens += len(getattr(record, "token_ids", []))
        except Exception as exc:  # the cut stream: recorded, asserted by the test
            self.error = exc

    def join(self) -> None:
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the stream never ended"


@pytest.mark.slow
def test_sigterm_drains_the_running_stream_and_refuses_new_work(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with run_engine(tiny_llama_dir, tmp_path / "engine.log", env={"TOLLGATE_INTERNAL_TOKEN": TOKEN},
                    options=("--num-kv-blocks", "512", "--drain-timeout-s", "120")) as (url, proc):
        stream = Stream(url, "long", max_tokens=1500)
        wait_until(lambda: stream.tokens > 0 or stream.error, "the stream's first tokens")
        proc.send_signal(signal.SIGTERM)

        health = wait_until(lambda: (r := httpx.get(f"{url}/health", timeout=10)).status_code == 503 and r,
                            "/health to say draining", timeout_s=10)
        assert health.json()["status"] == "draining"
        assert stream.final is None, "the stream should still be running while the replica drains"
        assert httpx.get(f"{url}/load", headers=auth(), timeout=10).json()["draining"] is True
        refused = httpx.post(f"{url}/generate", json=generate_body("late"), headers=auth(), timeout=10)
        assert refused.status_code == 503
        assert ErrorRecord.model_validate(refused.json()).error.code == DRAINING_CODE
        # The token check still comes first for a caller without it.
        assert httpx.post(f"{url}/generate", json=generate_body("x"), timeout=10).status_code == 401

        stream.join()
        assert stream.error is None
        assert stream.final is not None and stream.final.finish_reasons == ["length"]
        assert stream.tokens == stream.final.usage.completion_tokens == 1500
        assert proc.wait(timeout=60) == 0


def test_a_stream_longer_than_the_drain_timeout_is_cut(tmp_path: Path) -> None:
    """The cut comes ``CUT_GRACE_S`` after the drain timeout, ~2.6 s after the signal here. The tiny
    checkpoint's whole context (2,048 tokens) can stream faster than that on a quick CPU, so this replica
    is the synthetic one (the same server and gate), paced to need 40 s for its 8,000 tokens."""
    with synthetic_engine(tmp_path / "engine.log", token_interval_s=0.005, ttft_s=0.0, drain_timeout_s=0.5,
                          env={"TOLLGATE_INTERNAL_TOKEN": TOKEN}) as replica:
        stream = Stream(replica.url, "too-long", max_tokens=8000)
        wait_until(lambda: stream.tokens > 0 or stream.error, "the stream's first tokens")
        replica.proc.send_signal(signal.SIGTERM)
        stream.join()
        assert stream.error is not None  # cut: the body ended before its final record
        assert stream.final is None and stream.tokens < 8000
        assert replica.proc.wait(timeout=60) == 0
