"""Disaggregated serving with tensor parallelism (CPU, gloo, float32 tiny checkpoint): a prefill replica of 2
ranks (``tollgate engine --role prefill --tensor-parallel-size 2``, its rank 1 a spawned process) leases a
prompt's blocks, and a decode replica of 2 ranks (in this process: one tensor-parallel group per process)
pulls them over TCP, every rank's KV heads of each block.

Greedy outputs equal a colocated single-rank engine's for a prompt longer than a prefill chunk and for
n > 1; blocks move whole (every KV head), so a replica of 2 ranks and one of 1 exchange them too, and 4
ranks over 2 KV heads (each head on 2 ranks) send the single rank's blocks; a refused pull recomputes on
the 2 ranks; leases and held blocks return to zero on both sides.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engine.config import EngineConfig
from engine.kv.block_hash import prefix_block_hashes
from engine.kv.connector import RemoteKV
from engine.kv.tcp_transport import PullRequest, TCPTransport
from engine.llm_engine import LLMEngine
from engine.protocol import DeltaRecord, FinalRecord, LoadReport, parse_record
from engine.sampling_params import SamplingParams
from tests.engine.test_disagg_serving import _prompt, _run
from tests.gateway.conftest import run_engine
from tests.polling import wait_until

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # spawned ranks

BLOCK = 16
CHUNK = 48  # max_num_batched_tokens: prompts past it are prefilled in chunks
SETTINGS = dict(num_kv_blocks=96, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                speculation="off")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
N3 = SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True)


def _engine(model: Path, role: str, tp: int = 1) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), role=role, tensor_parallel_size=tp,  # type: ignore[arg-type]
                                  **SETTINGS))


@contextlib.contextmanager
def _prefill_replica(model_dir: Path, log: Path, tp: int = 2) -> Iterator[str]:
    """A prefill replica of ``tp`` ranks in its own process, once it answers /health: its URL."""
    options = ("--role", "prefill", "--tensor-parallel-size", str(tp), "--num-kv-blocks", "96",
               "--max-num-batched-tokens", str(CHUNK), "--speculation", "off")
    with run_engine(model_dir, log, options=options, timeout_s=180) as (url, _):
        yield url


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The colocated single-rank reference, the 2-rank prefill replica (URL), the 2-rank decode replica,
    and a single-rank prefill and decode replica."""
    log = tmp_path_factory.mktemp("prefill-tp2") / "prefill.log"
    engines = {"both": _engine(tiny_llama_dir, "both"), "decode2": _engine(tiny_llama_dir, "decode", tp=2),
               "prefill1": _engine(tiny_llama_dir, "prefill"), "decode1": _engine(tiny_llama_dir, "decode")}
    try:
        with _prefill_replica(tiny_llama_dir, log) as url:
            yield {**engines, "prefill2": url}
    finally:
        for engine in engines.values():
            engine.close()


def _prefill_over_http(url: str, request_id: str, prompt: list[int], params: SamplingParams,
                       **extra: object) -> tuple[list[int], FinalRecord]:
    body = {"request_id": request_id, "prompt_token_ids": prompt, "n": params.n,
            "max_tokens": params.max_tokens, "temperature": 0.0, "ignore_eos": True, **extra}
    with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        records = [parse_record(line) for line in response.iter_lines() if line]
    final = records[-1]
    assert isinstance(final, FinalRecord), final
    return [t for r in records if isinstance(r, DeltaRecord) for t in r.token_ids], final


def _lease(final: Any) -> RemoteKV:
    lease = final.kv_transfer
    assert lease is not None, "the prefill replica leased nothing"
    if not isinstance(lease, dict):
        lease = lease.model_dump()
    return RemoteKV(lease["host"], lease["port"], lease["lease_id"])


def _prefill_settled(url: str) -> bool:
    load = LoadReport.model_validate(httpx.get(f"{url}/load", timeout=10).json())
    counts = load.kv_transfer
    return (counts["active_leases"] == 0 and counts["leased_blocks"] == 0
            and load.free_kv_blocks == load.num_kv_blocks)


def _settled(engine: LLMEngine) -> bool:
    """No lease, no pull, and no block referenced by anything (cached blocks are evictable)."""
    engine.housekeeping()
    stats = engine.stats()
    counts = stats.kv_transfer
    return (counts["active_leases"] == 0 and counts["leased_blocks"] == 0 and counts["pulls_in_flight"] == 0
            and stats.num_free_kv_blocks == stats.num_kv_blocks)


@pytest.mark.parametrize(("case", "seed", "length", "params"), [("chunked", 1, 150, GREEDY),
                                                                 ("n3", 2, 70, N3)])
def test_two_ranks_each_side_decode_exactly_as_a_colocated_single_rank_engine(
    replicas: dict[str, Any], case: str, seed: int, length: int, params: SamplingParams
) -> None:
    prompt = _prompt(seed, length)
    expected, _ = _run(replicas["both"], f"ref-{case}", prompt, params)
    first, prefilled = _prefill_over_http(replicas["prefill2"], f"p-{case}", prompt, params)
    assert first == expected[0][:1]  # one token of completion 0: the rest is the decode replica's
    leased = (length - 1) // BLOCK * BLOCK
    assert prefilled.kv_transfer is not None and prefilled.kv_transfer.num_tokens == leased
    decode = replicas["decode2"]
    got, final = _run(decode, f"d-{case}", prompt, params, kv_source=_lease(prefilled))
    assert got == expected
    assert final.kv_pull == {"pulled_tokens": leased, "error": None}
    assert final.usage is not None and final.usage.cached_tokens == leased
    wait_until(lambda: _prefill_settled(replicas["prefill2"]), "the delivered lease to be released")
    assert _settled(decode)


def test_blocks_move_whole_between_replicas_of_two_ranks_and_of_one(replicas: dict[str, Any]) -> None:
    """Each rank holds half the KV heads; the wire carries whole blocks: the 2-rank prefill replica's equal
    (to float32 rounding) the single-rank one's, and either decode replica continues either's lease."""
    both, prefill1 = replicas["both"], replicas["prefill1"]
    decode1, decode2 = replicas["decode1"], replicas["decode2"]
    assert decode1.connector.identity == decode2.connector.identity  # type: ignore[union-attr]
    prompt = _prompt(3, 100)
    expected, _ = _run(both, "ref-mixed", prompt, GREEDY)
    hashes = tuple(prefix_block_hashes(prompt, BLOCK)[:(len(prompt) - 1) // BLOCK])
    expect = decode2.connector.identity.expect("none", None)  # type: ignore[union-attr]
    payloads = []
    for name, request_id in (("prefill2", "p-raw-2"), ("prefill1", "p-raw-1")):
        if name == "prefill2":
            _, prefilled = _prefill_over_http(replicas[name], request_id, prompt, GREEDY)
        else:
            _, prefilled = _run(replicas[name], request_id, prompt, GREEDY)
        lease = _lease(prefilled)
        request = PullRequest(lease.lease_id, 0, hashes, expect)
        blocks, _ = TCPTransport().pull(lease.host, lease.port, request, timeout_s=30)
        payloads.append(np.frombuffer(b"".join(blocks), dtype=np.float32))
    np.testing.assert_allclose(payloads[0], payloads[1], rtol=1e-4, atol=1e-5)
    # 2 ranks -> 1 and 1 -> 2: served, the same tokens.
    _, prefilled = _prefill_over_http(replicas["prefill2"], "p-2to1", prompt, GREEDY)
    got, final = _run(decode1, "d-2to1", prompt, GREEDY, kv_source=_lease(prefilled))
    assert got == expected and final.kv_pull == {"pulled_tokens": 96, "error": None}
    _, prefilled = _run(prefill1, "p-1to2", prompt, GREEDY)
    got, final = _run(decode2, "d-1to2", prompt, GREEDY, kv_source=_lease(prefilled))
    assert got == expected and final.kv_pull == {"pulled_tokens": 96, "error": None}
    wait_until(lambda: _prefill_settled(replicas["prefill2"]) and _settled(prefill1),
               "the delivered leases to be released")
    assert _settled(decode1) and _settled(decode2)


def test_a_refused_pull_is_recomputed_on_both_ranks(replicas: dict[str, Any]) -> None:
    decode = replicas["decode2"]
    prompt = _prompt(4, 80)
    expected, _ = _run(replicas["both"], "ref-salt", prompt, GREEDY, cache_salt="tenant-b")
    _, prefilled = _prefill_over_http(replicas["prefill2"], "p-salt", prompt, GREEDY, cache_salt="tenant-a")
    got, final = _run(decode, "d-salt", prompt, GREEDY, cache_salt="tenant-b", kv_source=_lease(prefilled))
    assert got == expected
    assert final.kv_pull["pulled_tokens"] == 0 and final.kv_pull["error"].startswith("refused: salt")
    assert final.usage is not None and final.usage.cached_tokens == 0
    # Refused, not consumed: its owner still pulls it.
    got, final = _run(decode, "d-salt-a", prompt, GREEDY, cache_salt="tenant-a", kv_source=_lease(prefilled))
    assert final.kv_pull == {"pulled_tokens": 64, "error": None}
    assert got == _run(replicas["both"], "ref-salt-a", prompt, GREEDY, cache_salt="tenant-a")[0]
    wait_until(lambda: _prefill_settled(replicas["prefill2"]), "the delivered lease to be released")
    assert _settled(decode)


def test_four_ranks_over_two_kv_heads_send_the_single_rank_blocks(
    replicas: dict[str, Any], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """4 ranks over the model's 2 KV heads (each head on 2 ranks, read from one): the blocks are the
    single-rank replica's, and the 2-rank decode replica continues them."""
    prompt = _prompt(5, 70)
    hashes = tuple(prefix_block_hashes(prompt, BLOCK)[:(len(prompt) - 1) // BLOCK])
    expect = replicas["decode2"].connector.identity.expect("none", None)
    _, prefilled = _run(replicas["prefill1"], "p-raw-4-ref", prompt, GREEDY)
    lease = _lease(prefilled)
    request = PullRequest(lease.lease_id, 0, hashes, expect)
    reference = np.frombuffer(b"".join(TCPTransport().pull(lease.host, lease.port, request, 30)[0]),
                              dtype=np.float32)
    expected, _ = _run(replicas["both"], "ref-tp4", prompt, GREEDY)
    with _prefill_replica(tiny_llama_dir, tmp_path / "prefill4.log", tp=4) as url:
        _, prefilled = _prefill_over_http(url, "p-raw-4", prompt, GREEDY)
        lease = _lease(prefilled)
        request = PullRequest(lease.lease_id, 0, hashes, expect)
        blocks, _ = TCPTransport().pull(lease.host, lease.port, request, timeout_s=30)
        got_blocks = np.frombuffer(b"".join(blocks), dtype=np.float32)
        np.testing.assert_allclose(got_blocks, reference, rtol=1e-4, atol=1e-5)
        _, prefilled = _prefill_over_http(url, "p-tp4", prompt, GREEDY)
        got, final = _run(replicas["decode2"], "d-tp4", prompt, GREEDY, kv_source=_lease(prefilled))
        assert got == expected and final.kv_pull == {"pulled_tokens": 64, "error": None}
        wait_until(lambda: _prefill_settled(url), "the delivered leases to be released")
    wait_until(lambda: _settled(replicas["prefill1"]), "the delivered lease to be released")


def test_a_rank_that_cannot_read_blocks_answers_why_and_goes_on(replicas: dict[str, Any]) -> None:
    """A worker's failed read ends that pull only (the prefill side keeps the lease): it answers the error,
    and the replica serves on."""
    decode = replicas["decode2"]
    workers = decode.runner.workers
    assert workers is not None
    with pytest.raises(RuntimeError, match="rank 1 failed 'kv_read'"):
        workers.ask([1], ("kv_read", [10**6]))
    (shard,) = workers.ask([1], ("kv_read", [0, 1]))
    remote = decode.runner.kv_remote
    assert remote is not None and len(shard) == remote.block_bytes  # two blocks, one of their 2 KV heads
    prompt = _prompt(6, 60)
    expected, _ = _run(replicas["both"], "ref-after", prompt, GREEDY)
    assert _run(decode, "d-after", prompt, GREEDY)[0] == expected
