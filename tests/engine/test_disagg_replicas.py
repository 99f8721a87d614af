"""Disaggregated serving over the engine's HTTP surface: a prefill replica process (``tollgate engine
--role prefill``) and a decode replica (its FastAPI app over uvicorn), the KV blocks moving over TCP.

The prefill replica's final record says where the prompt's blocks are leased (``kv_transfer``); the
decode request carries it back and its final record says what the pull brought (``kv_pull``). Killing
the prefill replica mid-transfer, or pulling from it once it is gone, makes the decode replica compute
the prompt itself (same tokens) or fail the request cleanly, and leaves nothing held on the decode side.
"""

from __future__ import annotations

import contextlib
import random
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.protocol import DeltaRecord, FinalRecord, LoadReport, parse_record
from engine.sampling_params import SamplingParams
from engine.server import build_engine, create_app
from tests.kv_relay import Relay
from tests.polling import wait_until
from tollgate.local_services import free_port

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = {"num_kv_blocks": 96, "max_num_batched_tokens": 48, "speculation": "off"}
BODY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}


class _Server:
    """An app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, app: Any) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> _Server:
        self._thread.start()
        wait_until(lambda: self._server.started or not self._thread.is_alive(), "uvicorn to start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


@contextlib.contextmanager
def _prefill_replica(model_dir: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tollgate", "engine", "--model", str(model_dir),
                                 "--port", str(port), "--role", "prefill", "--num-kv-blocks", "96",
                                 "--max-num-batched-tokens", "48", "--speculation", "off"],
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{url}/health", timeout=2).status_code == 200
            return False

        wait_until(healthy, "the prefill replica to answer /health", timeout_s=120, interval_s=0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _generate(url: str, body: dict[str, Any]) -> tuple[list[int], FinalRecord]:
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        records = [parse_record(line) for line in response.iter_lines() if line]
    tokens = [t for r in records if isinstance(r, DeltaRecord) for t in r.token_ids]
    final = records[-1]
    assert isinstance(final, FinalRecord), final
    return tokens, final


def _load(url: str) -> LoadReport:
    return LoadReport.model_validate(httpx.get(f"{url}/load", timeout=10).json())


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


@pytest.mark.slow
def test_prefill_and_decode_replicas_over_http_and_tcp(tiny_llama_dir: Path, tmp_path: Path) -> None:
    reference = LLMEngine(EngineConfig(model=str(tiny_llama_dir), **SETTINGS))  # type: ignore[arg-type]
    decode = build_engine(EngineConfig(model=str(tiny_llama_dir), role="decode", **SETTINGS))  # type: ignore[arg-type]

    def expected(prompt: list[int]) -> list[int]:
        reference.add_request(f"ref-{len(prompt)}-{prompt[0]}", prompt, SamplingParams(**BODY))
        tokens: list[int] = []
        while reference.has_unfinished():
            for delta in reference.step():
                tokens += [t for c in delta.completions for t in c.token_ids]
        return tokens

    with _prefill_replica(tiny_llama_dir, tmp_path / "prefill.log") as (proc, prefill_url), \
            _Server(create_app(decode)) as decode_server:
        assert httpx.get(f"{prefill_url}/info", timeout=10).json()["role"] == "prefill"
        decode_url = decode_server.url

        # The plain path: the lease in the prefill's final record, pulled by the decode request.
        prompt = _prompt(1, 100)
        first, prefilled = _generate(prefill_url, {"request_id": "a", "prompt_token_ids": prompt, **BODY})
        assert first == expected(prompt)[:1] and prefilled.kv_transfer is not None
        assert prefilled.kv_transfer.num_tokens == 96 and prefilled.usage.completion_tokens == 1
        lease = prefilled.kv_transfer.model_dump(exclude_none=True)
        tokens, final = _generate(decode_url, {"request_id": "a", "prompt_token_ids": prompt, **BODY,
                                               "kv_transfer": lease})
        assert tokens == expected(prompt)
        assert final.kv_pull is not None and final.kv_pull.pulled_tokens == 96 and final.kv_pull.error is None
        wait_until(lambda: _load(prefill_url).kv_transfer["active_leases"] == 0, "the lease to be released")
        assert _load(prefill_url).kv_transfer["delivered_leases"] == 1

        # Three more leases, then the prefill replica dies while the first of them is on the wire.
        prompts = [_prompt(2, 120), _prompt(3, 90), _prompt(4, 60)]
        leases = []
        for i, p in enumerate(prompts):
            _, f = _generate(prefill_url, {"request_id": f"b{i}", "prompt_token_ids": p, **BODY})
            assert f.kv_transfer is not None
            leases.append(f.kv_transfer.model_dump(exclude_none=True))
        assert _load(prefill_url).kv_transfer["leased_blocks"] == 7 + 5 + 3
        with Relay((leases[0]["host"], leases[0]["port"]), limit_bytes=1000, hold=True) as relay:
            results: list[tuple[list[int], FinalRecord]] = []
            body = {"request_id": "b0", "prompt_token_ids": prompts[0], **BODY,
                    "kv_transfer": {**leases[0], "host": relay.address[0], "port": relay.address[1]}}
            pulling = threading.Thread(target=lambda: results.append(_generate(decode_url, body)))
            pulling.start()
            wait_until(relay.cut.is_set, "the transfer to be under way")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            relay.release()
            pulling.join(timeout=120)
        tokens, final = results[0]
        assert tokens == expected(prompts[0])  # recomputed on the decode replica
        assert final.kv_pull is not None and final.kv_pull.pulled_tokens == 0
        assert final.kv_pull.error is not None and final.kv_pull.error.startswith("transfer failed")

        # The prefill replica is gone: its other leases cannot be pulled (refused connection).
        body = {"request_id": "b1", "prompt_token_ids": prompts[1], **BODY, "kv_transfer": leases[1]}
        tokens, final = _generate(decode_url, body)
        assert tokens == expected(prompts[1]) and final.kv_pull is not None
        assert final.kv_pull.error is not None and "ConnectionRefusedError" in final.kv_pull.error
        body = {"request_id": "b2", "prompt_token_ids": prompts[2], **BODY,
                "kv_transfer": {**leases[2], "on_failure": "fail"}}
        tokens, final = _generate(decode_url, body)
        assert tokens == [] and final.finish_reasons == ["error"]
        assert final.kv_pull is not None and "ConnectionRefusedError" in (final.kv_pull.error or "")

        load = _load(decode_url)
        assert load.kv_transfer["pulls_in_flight"] == 0 and load.kv_transfer["failed_pulls"] == 3
        assert load.free_kv_blocks == load.num_kv_blocks  # nothing held on the decode side
        metrics = httpx.get(f"{decode_url}/metrics", timeout=10).text.splitlines()
        failed = [m for m in metrics if m.startswith("tollgate_engine_kv_transfer_events_total")
                  and 'kind="failed_pulls"' in m]
        assert len(failed) == 1 and failed[0].endswith(" 3.0"), failed
    reference.close()
