"""The prefix cache's host and disk tiers in a real engine (tiny random-weight Llama, CPU, float32):
greedy outputs are identical with the tiers on and off while blocks are evicted to the host and loaded
back; a replica restarted on the same disk directory serves its first requests from disk; another
tenant's salt never hits in any tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv.block_hash import prefix_block_hashes
from engine.kv.pins import CachePolicy
from engine.metrics import EngineMetrics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Four prompts of 3 full blocks (+ 2 tokens) each: the 8-block device pool holds about two of them.
PROMPTS = [[(31 * i + 7 * j) % 250 + 3 for j in range(50)] for i in range(4)]


def engine(model_dir: Path, **tiers: object) -> LLM:
    return LLM(str(model_dir), num_kv_blocks=8, max_num_seqs=2, **tiers)  # type: ignore[arg-type]


def rounds(llm: LLM, salt: str | None = None, times: int = 2) -> list[tuple[list[int], int]]:
    """Each prompt alone, ``times`` rounds: its tokens and cached prompt tokens."""
    results = []
    for _ in range(times):
        for prompt in PROMPTS:
            out = llm.generate([prompt], GREEDY, cache_salt=salt)[0]
            results.append((out.token_ids, out.num_cached_tokens))
    return results


def test_outputs_are_identical_with_blocks_offloaded_and_loaded_back(tiny_llama_dir: Path) -> None:
    plain = rounds(engine(tiny_llama_dir))
    with engine(tiny_llama_dir, num_host_kv_blocks=32) as tiered:
        with_tiers = rounds(tiered)
        stats = tiered.stats
    assert [tokens for tokens, _ in with_tiers] == [tokens for tokens, _ in plain]
    # The second round finds every prompt's 3 full blocks: on the device or loaded back from the host.
    assert [cached for _, cached in with_tiers[4:]] == [48] * 4
    assert sum(cached for _, cached in plain[4:]) < 4 * 48  # without the tier, evictions cost hits
    assert stats.prefix_hit_tokens_by_tier["host"] > 0
    assert stats.kv_tier_moves["offloaded_blocks"] > 0 and stats.kv_tier_moves["loaded_blocks"] > 0
    assert stats.prefix_hit_tokens == sum(stats.prefix_hit_tokens_by_tier.values())
    scraped = EngineMetrics(lambda: stats, "tiny", "interactive").render().decode()
    host_hits = float(stats.prefix_hit_tokens_by_tier["host"])
    assert f'by_tier_total{{model="tiny",pool="interactive",tier="host"}} {host_hits}' in scraped
    assert 'tollgate_engine_kv_tier_moved_bytes_total{kind="offloaded"' in scraped


def test_a_restarted_replica_serves_hits_from_disk(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tiers = {"num_host_kv_blocks": 8, "num_disk_kv_blocks": 64, "kv_disk_dir": str(tmp_path)}
    with engine(tiny_llama_dir, **tiers) as first:
        before = rounds(first, times=1)
        assert first.stats.kv_tier_moves["persisted_blocks"] > 0
    assert list(tmp_path.rglob("*.kv"))
    with engine(tiny_llama_dir, **tiers) as restarted:
        assert restarted.stats.kv_tier_blocks["disk"] > 0
        after = rounds(restarted, times=1)
        stats = restarted.stats
    assert [tokens for tokens, _ in after] == [tokens for tokens, _ in before]
    # The first prompt's blocks were all evicted (so written) before the restart: read back, not computed.
    assert after[0][1] == 48
    assert stats.prefix_hit_tokens_by_tier["disk"] >= 48 and stats.kv_tier_moves["disk_read_blocks"] >= 3


def test_another_tenant_never_hits_anothers_blocks_in_any_tier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tiers = {"num_host_kv_blocks": 8, "num_disk_kv_blocks": 64, "kv_disk_dir": str(tmp_path)}
    with engine(tiny_llama_dir, **tiers) as llm:
        rounds(llm, salt="tenant-a", times=1)
    with engine(tiny_llama_dir, **tiers) as restarted:
        theirs = rounds(restarted, salt="tenant-b", times=1)
        assert [cached for _, cached in theirs] == [0] * 4
        assert restarted.stats.prefix_hit_tokens_by_tier.get("disk", 0) == 0
    # Each tenant's files live under its own salt's key (what a purge of the tenant deletes).
    assert len({path.parent.name for path in tmp_path.rglob("*.kv")} - {"none"}) == 2


def test_purging_a_tenant_drops_its_blocks_from_every_tier(tiny_llama_dir: Path, tmp_path: Path) -> None:
    tiers = {"num_host_kv_blocks": 4, "num_disk_kv_blocks": 64, "kv_disk_dir": str(tmp_path)}
    with engine(tiny_llama_dir, **tiers) as llm:
        rounds(llm, salt="tenant-a", times=1)
        rounds(llm, salt="tenant-b", times=1)
        dirs = {path.parent.name for path in tmp_path.rglob("*.kv")}
        hashes_a = {d for p in PROMPTS for d in prefix_block_hashes(p, 16, "tenant-a")}
        assert hashes_a & llm.engine.kv_events.holdings().keys()
        assert llm.engine.purge_cache("tenant-a") > 0
        assert not hashes_a & llm.engine.kv_events.holdings().keys()  # in no tier, as the router sees it
        llm.engine.flush_kv()
        assert len({path.parent.name for path in tmp_path.rglob("*.kv")}) == len(dirs) - 1
        # Tenant A's prompts compute everything again; B's still hit.
        assert all(cached == 0 for _, cached in rounds(llm, salt="tenant-a", times=1))
        assert rounds(llm, salt="tenant-b", times=1)[-1][1] == 48


def test_cache_write_tokens_count_the_prompt_blocks_a_request_newly_wrote(tiny_llama_dir: Path) -> None:
    llm = engine(tiny_llama_dir)
    prompt = PROMPTS[0]  # 50 tokens: 3 full blocks
    first = llm.generate([prompt], GREEDY)[0].usage
    again = llm.generate([prompt + [7] * 20], GREEDY)[0].usage  # 70 tokens: 4 full blocks, 3 cached
    other = llm.generate([prompt], GREEDY, cache_salt="tenant-b")[0].usage
    assert (first.cached_tokens, first.cache_write_tokens) == (0, 48)
    assert (again.cached_tokens, again.cache_write_tokens) == (48, 16)
    assert (other.cached_tokens, other.cache_write_tokens) == (0, 48)


def test_each_request_says_which_tier_its_cached_tokens_came_from(tiny_llama_dir: Path,
                                                                   tmp_path: Path) -> None:
    tiers = {"num_host_kv_blocks": 32, "num_disk_kv_blocks": 64, "kv_disk_dir": str(tmp_path)}
    with engine(tiny_llama_dir, **tiers) as llm:
        llm.generate(PROMPTS, GREEDY)  # the last prompts push the first one's blocks out to the host
        usage = llm.generate([PROMPTS[0]], GREEDY)[0].usage
        assert (usage.cached_tokens, usage.cached_host_tokens, usage.cached_disk_tokens) == (48, 48, 0)
        on_device = llm.generate([PROMPTS[0]], GREEDY)[0].usage
        assert (on_device.cached_tokens, on_device.cached_host_tokens) == (48, 0)
    with engine(tiny_llama_dir, **tiers) as restarted:
        usage = restarted.generate([PROMPTS[0]], GREEDY)[0].usage
    assert (usage.cached_tokens, usage.cached_host_tokens, usage.cached_disk_tokens) == (48, 0, 48)


def test_retained_blocks_are_on_disk_at_once_and_stay_pinned_across_a_restart(tiny_llama_dir: Path,
                                                                                tmp_path: Path) -> None:
    # A 6-file disk tier with retention for one tenant: its 3 blocks are written as soon as the prompt is
    # computed (no eviction needed), and four other prompts' 12 blocks later go through the disk's LRU
    # without dropping them, before and after a restart.
    tiers = {"num_host_kv_blocks": 4, "num_disk_kv_blocks": 6, "kv_disk_dir": str(tmp_path),
             "kv_retention_quota_blocks": 3}
    retained = prefix_block_hashes(PROMPTS[0], 16, "tenant-a")
    with engine(tiny_llama_dir, **tiers) as llm:
        usage = llm.generate([PROMPTS[0]], GREEDY, cache_salt="tenant-a",
                             cache_policy=CachePolicy(retention_s=86_400))[0].usage
        assert (usage.cache_retained_tokens, usage.cache_pinned_tokens) == (48, 0)
        llm.engine.flush_kv()
        files = {bytes.fromhex(p.stem): p for p in tmp_path.rglob("*.kv")}
        assert set(retained) <= files.keys()
        pins = llm.engine.kv.tiers.disk.pins
        assert all(abs(files[d].stat().st_mtime - pins.expiry(d)) < 1 for d in retained)  # the pin's expiry
        rounds(llm, salt="tenant-b", times=1)
    with engine(tiny_llama_dir, **tiers) as restarted:
        manager = restarted.engine.kv.blocks
        assert manager.tiers.disk.pins.count(manager.salt_key("tenant-a")) == 3
        rounds(restarted, salt="tenant-b", times=1)
        out = restarted.generate([PROMPTS[0]], GREEDY, cache_salt="tenant-a")[0]
    assert out.num_cached_tokens == 48


def test_in_memory_blocks_never_reach_the_disk_and_ttl_pins_are_reported(tiny_llama_dir: Path,
                                                                         tmp_path: Path) -> None:
    tiers = {"num_host_kv_blocks": 8, "num_disk_kv_blocks": 64, "kv_disk_dir": str(tmp_path),
             "kv_pin_quota_blocks": 2}
    with engine(tiny_llama_dir, **tiers) as llm:
        outs = llm.generate(PROMPTS, GREEDY, cache_salt="tenant-a",
                            cache_policy=CachePolicy(persist=False, ttl_s=1800))
        rounds(llm, salt="tenant-a", times=1)  # evicts the first round's blocks to the host and beyond
        llm.engine.flush_kv()
    in_memory = {d for p in PROMPTS for d in prefix_block_hashes(p, 16, "tenant-a")}
    assert not in_memory & {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kv")}
    # The tenant's quota of 2 pinned blocks went to the first prompt; the others got none.
    assert [o.usage.cache_pinned_tokens for o in outs] == [32, 0, 0, 0]


# Exact equality across two runs whose batches differ (another graph size, split count or GEMM shape
# rounds each row differently) holds in float32 only: in half precision the random tiny model's near-tied
# logits flip (test_llm_greedy.py compares bf16 with a tie gap instead). The half-precision kernels and the
# GPU path in bf16 are covered there and in tests/kernels.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32"])
def test_tiers_on_the_gpu_change_no_output(tiny_llama_dir: Path, tmp_path: Path, dtype: str) -> None:
    """The host tier in pinned memory, the disk tier, and copies to and from the device pool, on a GPU
    (the CUDA graphs and triton kernels read blocks that were loaded back)."""
    def gpu(**tiers: object) -> LLM:
        return LLM(str(tiny_llama_dir), device="cuda", dtype=dtype, num_kv_blocks=8, max_num_seqs=2,
                   **tiers)  # type: ignore[arg-type]

    plain = rounds(gpu())
    with gpu(num_host_kv_blocks=32, num_disk_kv_blocks=64, kv_disk_dir=str(tmp_path)) as tiered:
        assert tiered.engine.runner.kv_transfer.host[0].is_pinned()
        with_tiers = rounds(tiered)
        stats = tiered.stats
    assert [tokens for tokens, _ in with_tiers] == [tokens for tokens, _ in plain]
    assert [cached for _, cached in with_tiers[4:]] == [48] * 4
    assert stats.kv_tier_moves["loaded_blocks"] > 0


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_mixtures_of_experts_and_sliding_windows_keep_their_outputs_through_the_tiers(
    family: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The tiers hold a MoE's blocks as a dense model's, and a sliding-window layer's blocks (gpt-oss's
    16-token window is shorter than these prompts) are offloaded, loaded back and read from disk unchanged."""
    model_dir: Path = request.getfixturevalue(f"tiny_{family}_dir")
    plain = rounds(engine(model_dir))
    tiers = {"num_host_kv_blocks": 8, "num_disk_kv_blocks": 64, "kv_disk_dir": str(tmp_path)}
    with engine(model_dir, **tiers) as tiered:
        with_tiers = rounds(tiered)
        assert tiered.stats.kv_tier_moves["loaded_blocks"] > 0
    with engine(model_dir, **tiers) as restarted:
        from_disk = rounds(restarted, times=1)
        assert restarted.stats.prefix_hit_tokens_by_tier["disk"] > 0
    assert [tokens for tokens, _ in with_tiers] == [tokens for tokens, _ in plain]
    assert [tokens for tokens, _ in from_disk] == [tokens for tokens, _ in plain[:4]]
    assert [cached for _, cached in with_tiers[4:]] == [48] * 4
