"""Disaggregated serving (#40), part (a): moving a prompt's KV blocks between replicas against computing them.

Set-up, on the CPU: three engines over one random-weight checkpoint (``benchmarks.common.QWEN3_CPU_SMALL``
shapes by default, float32, ``--threads`` torch threads): a ``prefill`` replica, a ``decode`` replica
and a colocated one (``both``), in one process, the blocks moving over loopback TCP
(``engine.kv.tcp_transport``). For each prompt length of ``--lengths`` (fresh random prompts, so no
prefix hit anywhere), ``--repeat`` times, best kept:

- **recompute**: the colocated engine's prefill of the prompt, from ``add_request`` to its first token
  (``max_tokens=1``): what a decode replica does when it cannot pull;
- **wire**: one pull of the prefill replica's lease (``TCPTransport.pull``: request, chunks, checksums,
  ack), the bytes only;
- **pull + decode**: the decode replica's time from ``add_request`` (naming the lease) to its first
  token: the pull, the copies into its pool, and the last block computed.

Per length: blocks leased, their bytes, wire time per block and rate, recompute time per block, and
the decode replica's time to first token with the pull against recomputing. The table goes to stdout,
everything to ``--out`` (JSON)::

    python benchmarks/disaggregation.py --out benchmarks/out/disaggregation.json
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    QWEN3_CPU_SMALL,
    create_checkpoint,
    format_table,
    machine_description,
    write_json,
)

BLOCK = 16


def _engine(model: Path, role: str, max_len: int) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    blocks = 4 * (max_len // BLOCK + 2)
    return LLMEngine(EngineConfig(model=str(model), role=role, num_kv_blocks=blocks, block_size=BLOCK,
                                  max_num_batched_tokens=max(2048, max_len), speculation="off",
                                  kv_lease_s=600.0))


def _first_token(engine: Any, request_id: str, prompt: list[int], **kwargs: Any) -> tuple[float, Any]:
    """Seconds from ``add_request`` to the request's final delta (one token), and that delta."""
    from engine.sampling_params import SamplingParams

    started = time.perf_counter()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0), **kwargs)
    while True:
        for delta in engine.step():
            if delta.request_id == request_id and delta.finished:
                return time.perf_counter() - started, delta


def _wire(prefill: Any, decode: Any, prompt: list[int], request_id: str) -> tuple[float, int, int]:
    """One pull of a fresh lease on ``prompt``'s blocks: (seconds, blocks, bytes per block)."""
    from engine.kv.block_hash import prefix_block_hashes
    from engine.kv.tcp_transport import PullRequest, TCPTransport

    _, final = _first_token(prefill, request_id, prompt)
    lease = final.kv_transfer
    digests = tuple(prefix_block_hashes(prompt, BLOCK)[:(len(prompt) - 1) // BLOCK])
    request = PullRequest(lease["lease_id"], 0, digests, decode.connector.identity.expect("none", None))
    started = time.perf_counter()
    blocks, block_bytes = TCPTransport().pull(lease["host"], lease["port"], request, timeout_s=60)
    elapsed = time.perf_counter() - started
    prefill.housekeeping()
    return elapsed, len(blocks), block_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="256,1024,2048", help="prompt lengths in tokens")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--model-dir", default=None,
                        help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--out", default="benchmarks/out/disaggregation.json")
    args = parser.parse_args()

    import torch

    from engine.kv.connector import RemoteKV

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    model = create_checkpoint(args.model_dir or Path(tempfile.gettempdir()) / "tollgate-bench-disagg",
                              QWEN3_CPU_SMALL)
    engines = {role: _engine(model, role, max(lengths)) for role in ("both", "prefill", "decode")}
    both, prefill, decode = engines["both"], engines["prefill"], engines["decode"]
    rng = random.Random(0)
    results = []
    for length in lengths:
        best: dict[str, float] = {}
        blocks = block_bytes = 0
        for r in range(args.repeat + 1):  # the first round warms up
            prompt = [rng.randrange(3, 2000) for _ in range(length)]
            recompute, _ = _first_token(both, f"both-{length}-{r}", prompt)
            wire, blocks, block_bytes = _wire(prefill, decode, prompt, f"wire-{length}-{r}")
            _, prefilled = _first_token(prefill, f"p-{length}-{r}", prompt)
            lease = prefilled.kv_transfer
            pulled, final = _first_token(decode, f"d-{length}-{r}", prompt,
                                         kv_source=RemoteKV(lease["host"], lease["port"], lease["lease_id"]))
            assert final.kv_pull == {"pulled_tokens": blocks * BLOCK, "error": None}, final.kv_pull
            prefill.housekeeping()
            if r == 0:
                continue
            for name, value in (("recompute_s", recompute), ("wire_s", wire), ("pull_decode_s", pulled)):
                best[name] = min(best.get(name, value), value)
        results.append({"prompt_tokens": length, "blocks": blocks, "block_bytes": block_bytes, **best,
                        "wire_ms_per_block": 1e3 * best["wire_s"] / blocks,
                        "wire_mb_per_s": blocks * block_bytes / best["wire_s"] / 1e6,
                        "recompute_ms_per_block": 1e3 * best["recompute_s"] / blocks})
    for engine in engines.values():
        engine.close()

    rows = [[r["prompt_tokens"], r["blocks"], f"{r['block_bytes'] / 1024:.0f}",
             f"{r['wire_ms_per_block']:.3f}", f"{r['wire_mb_per_s']:.0f}",
             f"{r['recompute_ms_per_block']:.3f}",
             f"{r['recompute_ms_per_block'] / r['wire_ms_per_block']:.1f}x",
             f"{1e3 * r['recompute_s']:.1f}", f"{1e3 * r['pull_decode_s']:.1f}"] for r in results]
    print(f"KV blocks over loopback TCP against recomputing them ({machine_description('cpu')}, "
          f"{args.threads} torch thread(s), best of {args.repeat})")
    print(format_table(["prompt", "blocks", "KiB/block", "wire ms/block", "wire MB/s", "recompute ms/block",
                        "recompute/wire", "recompute TTFT ms", "pull+decode TTFT ms"], rows))
    write_json(args.out, {"benchmark": "disaggregation", "part": "a",
                          "date": datetime.now(UTC).isoformat(timespec="seconds"),
                          "machine": machine_description("cpu"), "threads": args.threads,
                          "model": QWEN3_CPU_SMALL, "repeat": args.repeat, "results": results})


if __name__ == "__main__":
    main()
