"""Disaggregated serving over the engine's HTTP surface: a prefill replica process (``tollgate engine
--role prefill``) and a decode replica (its FastAPI app over uvicorn), the KV blocks moving over TCP.

The prefill replica's final record says where the prompt's blocks are leased (``kv_transfer``); the
decode request carries it back and its final record says what the pull brought (``kv_pull``). Killing
the prefill replica mid-transfer, or pulling from it once it is gone, makes the decode replica compute
the prompt itself (same tokens) or fail the request cleanly, and leaves nothing held on the decode side.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.protocol import DeltaRecord, FinalRecord, LoadReport, parse_record
from engine.sampling_params import SamplingParams
from engine.server import build_engine, create_app
from tests.engine.test_disagg_serving import _prompt
from tests.engine.test_server import _Server
from tests.gateway.conftest import run_engine
from tests.kv_relay import Relay
from tests.polling import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SETTINGS = {"num_kv_blocks": 96, "max_num_batched_tokens": 48, "speculation": "off"}
BODY = {"max_tokens": 10, "temperature": 0.0, "ignore_eos": True}


@contextlib.contextmanager
def _prefill_replica(model_dir: Path, log: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A prefill replica in its own process (a test may kill it), once it answers /health."""
    options = ("--role", "prefill", "--num-kv-blocks", "96", "--max-num-batched-tokens", "48",
               "--speculation", "off")
    with run_engine(model_dir, log, options=options) as (url, proc):
        yield proc, url


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
