"""Disaggregated serving, engine side: a prefill engine leases a prompt's KV blocks, a decode engine pulls
them over real TCP sockets (in-process engines, float32 tiny random checkpoint on the CPU).

Greedy (and seeded) outputs equal a colocated engine's for plain prompts, prompts longer than a prefill
chunk, prefix hits on either side, n > 1, a LoRA adapter and an FP8 KV cache; refusals (salt, model, KV
dtype and layout, LoRA adapter) and faults (dropped connection, stalled transfer, abort mid-pull, expired
lease) recompute or fail cleanly, and leases and held blocks return to zero.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.kv.block_hash import prefix_block_hashes
from engine.kv.connector import RemoteKV
from engine.kv.tcp_transport import PullRequest, TCPTransport, TransferRefused
from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta, RequestValidationError
from engine.sampling_params import SamplingParams
from engine.tiny import create_tiny_checkpoint
from tests.kv_relay import Relay
from tests.polling import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
CHUNK = 48  # max_num_batched_tokens: prompts past it are prefilled in chunks
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def _engine(model: Path, role: str, **overrides: object) -> LLMEngine:
    config = dict(num_kv_blocks=96, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_num_seqs=8,
                  speculation="off")
    config.update(overrides)
    return LLMEngine(EngineConfig(model=str(model), role=role, **config))  # type: ignore[arg-type]


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(length)]


def _run(engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams,
         **kwargs: object) -> tuple[dict[int, list[int]], RequestDelta]:
    """Step ``engine`` until the request's final delta: its tokens by completion index, and that delta."""
    engine.add_request(request_id, prompt, params, **kwargs)  # type: ignore[arg-type]
    tokens: dict[int, list[int]] = {}
    while True:
        for delta in engine.step():
            if delta.request_id != request_id:
                continue
            for completion in delta.completions:
                tokens.setdefault(completion.index, []).extend(completion.token_ids)
            if delta.finished:
                return tokens, delta


def _source(final: RequestDelta, on_failure: str | None = None,
            via: tuple[str, int] | None = None) -> RemoteKV:
    lease = final.kv_transfer
    assert lease is not None, "the prefill replica leased nothing"
    host, port = via or (lease["host"], lease["port"])
    return RemoteKV(host, port, lease["lease_id"], on_failure)


def _settled(engine: LLMEngine) -> bool:
    """No lease, no pull, and no block referenced by anything (cached blocks are evictable)."""
    engine.housekeeping()
    stats = engine.stats()
    counts = stats.kv_transfer
    return (counts["active_leases"] == 0 and counts["leased_blocks"] == 0 and counts["pulls_in_flight"] == 0
            and stats.num_free_kv_blocks == stats.num_kv_blocks)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir: Path) -> Iterator[tuple[LLMEngine, LLMEngine, LLMEngine]]:
    """(colocated, prefill, decode) over the same checkpoint. The prefill replica's leases last 8 s, not
    the default 30: a test that leaves one unpulled waits for it to lapse before checking that nothing is
    held, and 8 s still outlasts every transfer here."""
    lease: dict[str, object] = {"kv_lease_s": 8.0}
    both, prefill, decode = (_engine(tiny_llama_dir, role, **(lease if role == "prefill" else {}))
                             for role in ("both", "prefill", "decode"))
    yield both, prefill, decode
    for engine in (both, prefill, decode):
        engine.close()


CASES = {
    "one-block": (1, 20, GREEDY),  # one full block leased (the block of the last token is recomputed)
    "chunked": (2, 150, GREEDY),  # 150 tokens, prefilled in chunks of 48 on both sides
    "block-aligned": (3, 96, GREEDY),
    "n3-greedy": (4, 70, SamplingParams(n=3, max_tokens=8, temperature=0.0, ignore_eos=True)),
    "n2-seeded": (5, 70, SamplingParams(n=2, max_tokens=8, temperature=0.9, seed=7, ignore_eos=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_decode_continues_the_pulled_prompt_exactly_as_a_colocated_engine(engines, case: str) -> None:
    both, prefill, decode = engines
    seed, length, params = CASES[case]
    prompt = _prompt(seed, length)
    expected, _ = _run(both, f"ref-{case}", prompt, params)
    first, prefilled = _run(prefill, f"p-{case}", prompt, params)
    assert first == {0: expected[0][:1]}  # one token of completion 0: the rest is the decode replica's
    assert prefilled.usage is not None and prefilled.usage.completion_tokens == 1
    leased = (length - 1) // BLOCK * BLOCK
    assert prefilled.kv_transfer is not None and prefilled.kv_transfer["num_tokens"] == leased
    got, final = _run(decode, f"d-{case}", prompt, params, kv_source=_source(prefilled))
    assert got == expected
    assert final.kv_pull == {"pulled_tokens": leased, "error": None}
    assert final.usage is not None and final.usage.cached_tokens == leased  # computed (and metered) once
    wait_until(lambda: _settled(prefill), "the delivered lease to be released")
    assert _settled(decode)


def test_a_prompt_shorter_than_a_block_leases_nothing(engines) -> None:
    both, prefill, decode = engines
    prompt = _prompt(6, 12)
    expected, _ = _run(both, "ref-short", prompt, GREEDY)
    _, prefilled = _run(prefill, "p-short", prompt, GREEDY)
    assert prefilled.kv_transfer is None  # nothing to move: the decode replica computes the prompt
    got, final = _run(decode, "d-short", prompt, GREEDY)
    assert got == expected and final.kv_pull is None
    assert _settled(prefill)


def test_decode_side_prefix_hits_pull_only_the_rest(engines) -> None:
    both, prefill, decode = engines
    shared = _prompt(7, 64)
    prompt = shared + _prompt(8, 50)
    _run(decode, "d-warm", shared + _prompt(9, 5), GREEDY)  # the decode replica caches 4 shared blocks
    expected, _ = _run(both, "ref-hit", prompt, GREEDY)
    _, prefilled = _run(prefill, "p-hit", prompt, GREEDY)
    pulls = decode.stats().kv_transfer["pulled_blocks"]
    got, final = _run(decode, "d-hit", prompt, GREEDY, kv_source=_source(prefilled))
    assert got == expected
    assert final.kv_pull == {"pulled_tokens": 112 - 64, "error": None}
    assert decode.stats().kv_transfer["pulled_blocks"] - pulls == 3
    assert final.usage is not None and final.usage.cached_tokens == 112
    # The pulled blocks are in the decode replica's prefix cache now: the same prompt pulls nothing.
    _, again = _run(prefill, "p-hit-again", prompt, GREEDY)
    got, final = _run(decode, "d-hit-again", prompt, GREEDY, kv_source=_source(again))
    assert got == expected and final.kv_pull == {"pulled_tokens": 0, "error": None}
    assert final.usage is not None and final.usage.cached_tokens == 112
    wait_until(lambda: _settled(decode), "the decode replica to settle")


def test_prefill_side_prefix_hits_are_leased_like_computed_blocks(engines) -> None:
    both, prefill, decode = engines
    shared = _prompt(10, 80)
    prompt = shared + _prompt(11, 30)
    _run(prefill, "p-warm", shared + _prompt(12, 3), GREEDY)
    expected, _ = _run(both, "ref-phit", prompt, GREEDY)
    _, prefilled = _run(prefill, "p-phit", prompt, GREEDY)
    assert prefilled.usage is not None and prefilled.usage.cached_tokens == 80
    got, final = _run(decode, "d-phit", prompt, GREEDY, kv_source=_source(prefilled))
    assert got == expected and final.kv_pull == {"pulled_tokens": 96, "error": None}
    wait_until(lambda: _settled(prefill), "the delivered lease to be released")


def test_a_lease_of_another_tenant_is_refused_and_the_prompt_recomputed(engines) -> None:
    both, prefill, decode = engines
    prompt = _prompt(13, 60)
    expected, _ = _run(both, "ref-salt", prompt, GREEDY, cache_salt="tenant-b")
    _, prefilled = _run(prefill, "p-salt", prompt, GREEDY, cache_salt="tenant-a")
    got, final = _run(decode, "d-salt", prompt, GREEDY, cache_salt="tenant-b", kv_source=_source(prefilled))
    assert got == expected
    assert final.kv_pull is not None and final.kv_pull["pulled_tokens"] == 0
    assert final.kv_pull["error"].startswith("refused: salt does not match")
    assert final.usage is not None and final.usage.cached_tokens == 0
    # Refused, not consumed: the lease stays for its owner until delivered or expired.
    got, final = _run(decode, "d-salt-a", prompt, GREEDY, cache_salt="tenant-a", kv_source=_source(prefilled))
    assert got == expected and final.kv_pull == {"pulled_tokens": 48, "error": None}
    wait_until(lambda: _settled(prefill), "the delivered lease to be released")


@pytest.mark.parametrize(("field", "value"), [("model", "0123456789abcdef"), ("kv_dtype", "float8_e4m3fn"),
                                              ("block_shape", [2, 2, 32, 2, 16]), ("lora", "f" * 16)])
def test_blocks_that_do_not_match_are_refused_on_the_wire(engines, field: str, value: object) -> None:
    _, prefill, decode = engines
    prompt = _prompt(14, 40)
    _, prefilled = _run(prefill, f"p-wire-{field}", prompt, GREEDY)
    lease = prefilled.kv_transfer
    assert lease is not None
    seq_hashes = prefix_block_hashes(prompt, BLOCK)[:(len(prompt) - 1) // BLOCK]
    expect = decode.connector.identity.expect("none", None)  # type: ignore[union-attr]
    expect[field] = value
    request = PullRequest(lease["lease_id"], 0, tuple(seq_hashes), expect)
    with pytest.raises(TransferRefused, match=f"{field} does not match"):
        TCPTransport().pull(lease["host"], lease["port"], request, timeout_s=10)
    expect[field] = decode.connector.identity.expect("none", None)[field]  # type: ignore[union-attr]
    request = PullRequest(lease["lease_id"], 0, tuple(seq_hashes), expect)
    blocks, block_bytes = TCPTransport().pull(lease["host"], lease["port"], request, timeout_s=10)
    assert len(blocks) == 2 and {len(b) for b in blocks} == {block_bytes}
    wait_until(lambda: _settled(prefill), "the delivered lease to be released")


def test_another_checkpoint_is_refused(engines, tmp_path: Path) -> None:
    _, prefill, decode = engines
    other_dir = create_tiny_checkpoint(tmp_path / "other", arch="llama", seed=1)  # same config, other weights
    other = _engine(other_dir, "decode")
    reference = _engine(other_dir, "both")
    try:
        prompt = _prompt(15, 50)
        expected, _ = _run(reference, "ref-model", prompt, GREEDY)
        _, prefilled = _run(prefill, "p-model", prompt, GREEDY)
        got, final = _run(other, "d-model", prompt, GREEDY, kv_source=_source(prefilled))
        assert got == expected
        assert final.kv_pull is not None
        assert final.kv_pull["error"].startswith("refused: model does not match")
        # Refused, the lease stays: a replica of the same model still takes it.
        _, final = _run(decode, "d-model-same", prompt, GREEDY, kv_source=_source(prefilled))
        assert final.kv_pull == {"pulled_tokens": 48, "error": None}
    finally:
        other.close()
        reference.close()
    wait_until(lambda: _settled(prefill), "the delivered lease to be released")


# ---- faults -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
def test_a_dropped_connection_recomputes_or_fails_and_the_lease_expires(tiny_llama_dir: Path, engines,
                                                                        on_failure: str) -> None:
    both, _, decode = engines
    prefill = _engine(tiny_llama_dir, "prefill", kv_lease_s=2.0, kv_transfer_chunk_blocks=1)
    try:
        prompt = _prompt(16 + len(on_failure), 120)  # (a prompt of its own: no prefix hit)
        expected, _ = _run(both, f"ref-drop-{on_failure}", prompt, GREEDY)
        _, prefilled = _run(prefill, f"p-drop-{on_failure}", prompt, GREEDY)
        lease = prefilled.kv_transfer
        assert lease is not None
        with Relay((lease["host"], lease["port"]), limit_bytes=1000) as relay:  # mid-way through block 0
            got, final = _run(decode, f"d-drop-{on_failure}", prompt, GREEDY,
                              kv_source=_source(prefilled, on_failure, via=relay.address))
            assert relay.cut.is_set(), final.kv_pull
        assert final.kv_pull is not None and final.kv_pull["pulled_tokens"] == 0
        assert final.kv_pull["error"].startswith("transfer failed: connection closed")
        if on_failure == "recompute":
            assert got == expected and final.finish_reasons == ["length"]
        else:
            assert got.get(0, []) == [] and final.finish_reasons == ["error"]
        assert prefill.stats().kv_transfer["active_leases"] == 1  # never delivered: held until it expires
        wait_until(lambda: _settled(prefill), "the undelivered lease to expire", timeout_s=30)
        assert prefill.stats().kv_transfer["expired_leases"] == 1
        assert _settled(decode)
    finally:
        prefill.close()


@pytest.mark.parametrize("on_failure", ["recompute", "fail"])
def test_an_expired_lease_recomputes_or_fails(tiny_llama_dir: Path, engines, on_failure: str) -> None:
    both, _, decode = engines
    prefill = _engine(tiny_llama_dir, "prefill", kv_lease_s=0.2)
    try:
        prompt = _prompt(30 + len(on_failure), 70)
        expected, _ = _run(both, f"ref-exp-{on_failure}", prompt, GREEDY)
        _, prefilled = _run(prefill, f"p-exp-{on_failure}", prompt, GREEDY)
        wait_until(lambda: _settled(prefill), "the lease to expire and its blocks to be freed")
        got, final = _run(decode, f"d-exp-{on_failure}", prompt, GREEDY,
                          kv_source=_source(prefilled, on_failure))
        assert final.kv_pull is not None and final.kv_pull["pulled_tokens"] == 0
        assert final.kv_pull["error"].startswith("refused: lease")
        if on_failure == "recompute":
            assert got == expected and final.finish_reasons == ["length"]
        else:
            assert got.get(0, []) == [] and final.finish_reasons == ["error"]
        assert _settled(decode)
    finally:
        prefill.close()


def test_only_a_decode_replica_takes_a_lease(engines) -> None:
    both, prefill, _ = engines
    source = RemoteKV("127.0.0.1", 1, "x")
    for engine in (both, prefill):
        with pytest.raises(RequestValidationError, match="only a decode replica pulls"):
            engine.add_request("not-here", [5, 6, 7], GREEDY, kv_source=source)


def test_a_stalled_transfer_holds_up_none_of_the_decode_replicas_other_requests(tiny_llama_dir: Path,
                                                                                engines) -> None:
    both, _, decode = engines
    prefill = _engine(tiny_llama_dir, "prefill", kv_lease_s=1.0)
    try:
        prompt, other = _prompt(40, 100), _prompt(41, 40)
        expected, _ = _run(both, "ref-stall", prompt, GREEDY)
        expected_other, _ = _run(both, "ref-stall-other", other, GREEDY)
        _, prefilled = _run(prefill, "p-stall", prompt, GREEDY)
        lease = prefilled.kv_transfer
        assert lease is not None
        with Relay((lease["host"], lease["port"]), limit_bytes=1000, hold=True) as relay:
            decode.add_request("d-stall", prompt, GREEDY, kv_source=_source(prefilled, via=relay.address))
            wait_until(relay.cut.is_set, "the transfer to stall")
            # Meanwhile another request is admitted, decoded and finished; the stalled one waits, unadmitted.
            got, _ = _run(decode, "d-stall-other", other, GREEDY)
            assert got == expected_other
            assert decode.stats().kv_transfer["pulls_in_flight"] == 1 and decode.scheduler.num_waiting == 1
            relay.release()
            tokens: list[int] = []
            final = None
            while final is None:
                for delta in decode.step():
                    tokens += [t for c in delta.completions for t in c.token_ids]
                    if delta.finished:
                        final = delta
        assert {0: tokens} == expected
        assert final.kv_pull is not None and final.kv_pull["error"].startswith("transfer failed")
        assert _settled(decode)
        # Never delivered, the lease expires on the prefill replica.
        wait_until(lambda: _settled(prefill), "the undelivered lease to expire")
    finally:
        prefill.close()


def test_aborting_a_request_while_its_blocks_are_on_the_wire_leaves_nothing(engines) -> None:
    _, prefill, decode = engines
    prompt = _prompt(42, 90)
    _, prefilled = _run(prefill, "p-abort", prompt, GREEDY)
    lease = prefilled.kv_transfer
    assert lease is not None
    with Relay((lease["host"], lease["port"]), limit_bytes=1000, hold=True) as relay:
        decode.add_request("d-abort", prompt, GREEDY, kv_source=_source(prefilled, via=relay.address))
        wait_until(relay.cut.is_set, "the transfer to be under way")
        assert decode.abort("d-abort")
        finals = [d for d in decode.step() if d.request_id == "d-abort" and d.finished]
        assert finals and finals[0].finish_reasons == ["abort"]
        relay.release()
    wait_until(lambda: _settled(decode), "the decode replica to settle")
    assert prefill.connector is not None
    wait_until(lambda: prefill.connector.leases.sending() == 0, "the prefill side to notice the cut")
    # The late result of the cut pull is dropped: the same lease is still the prefill replica's to give.
    got, final = _run(decode, "d-abort-again", prompt, GREEDY, kv_source=_source(prefilled))
    assert final.kv_pull == {"pulled_tokens": 80, "error": None}
    assert got == _run(engines[0], "ref-abort", prompt, GREEDY)[0]
    wait_until(lambda: _settled(prefill), "the delivered lease to be released")


def test_a_lease_under_a_lora_adapter_is_pulled_only_under_the_same_adapter(tiny_llama_dir: Path,
                                                                            tmp_path: Path) -> None:
    from engine.lora.registry import LoRARequest
    from tests.engine.test_lora_serving import ALL, strong_bundle

    adapter = LoRARequest("a", str(strong_bundle(tiny_llama_dir, tmp_path / "a", 1, ALL, 8)))
    both, prefill, decode = (_engine(tiny_llama_dir, role, max_loras=1)
                             for role in ("both", "prefill", "decode"))
    try:
        prompt = _prompt(43, 70)
        expected, _ = _run(both, "ref-lora", prompt, GREEDY, lora=adapter)
        base, _ = _run(both, "ref-base", prompt, GREEDY)
        assert expected != base  # the adapter changes the tokens: its K/V differ from the base model's
        _, prefilled = _run(prefill, "p-lora", prompt, GREEDY, lora=adapter)
        got, final = _run(decode, "d-base", prompt, GREEDY, kv_source=_source(prefilled))
        assert got == base
        assert final.kv_pull is not None and final.kv_pull["error"].startswith("refused: lora does not match")
        got, final = _run(decode, "d-lora", prompt, GREEDY, lora=adapter, kv_source=_source(prefilled))
        assert got == expected and final.kv_pull == {"pulled_tokens": 64, "error": None}
        wait_until(lambda: _settled(prefill), "the delivered lease to be released")
    finally:
        for engine in (both, prefill, decode):
            engine.close()


def test_fp8_kv_blocks_move_between_fp8_replicas_only(tiny_llama_dir: Path, engines) -> None:
    _, _, float32_decode = engines
    both, prefill, decode = (_engine(tiny_llama_dir, role, kv_cache_dtype="fp8")
                             for role in ("both", "prefill", "decode"))
    try:
        prompt = _prompt(44, 90)
        expected, _ = _run(both, "ref-fp8", prompt, GREEDY)
        _, prefilled = _run(prefill, "p-fp8", prompt, GREEDY)
        _, final = _run(float32_decode, "d-fp8-f32", prompt, GREEDY, kv_source=_source(prefilled))
        assert final.kv_pull is not None and final.kv_pull["pulled_tokens"] == 0
        assert final.kv_pull["error"].startswith("refused: fingerprint does not match")  # KV dtype and scales
        got, final = _run(decode, "d-fp8", prompt, GREEDY, kv_source=_source(prefilled))
        assert got == expected and final.kv_pull == {"pulled_tokens": 80, "error": None}
        wait_until(lambda: _settled(prefill), "the delivered lease to be released")
    finally:
        for engine in (both, prefill, decode):
            engine.close()
