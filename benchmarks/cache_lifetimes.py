"""Cache lifetimes as a product: does a tenant that asks for a ttl (host memory) or a 24h retention (disk)
keep its prefix-cache hits while other tenants flood the cache, and what does the flood pay for it?

Set-up: one engine (``engine.LLM``, CPU, a tiny random-weight Llama), a device KV pool of
``--device-blocks`` blocks of 16 tokens, a host tier of ``--host-blocks`` slots and, for the disk rows, a
disk tier of ``--disk-blocks`` files; per-tenant quotas are the engine's defaults (a quarter of a tier).

Workload, ``--rounds`` rounds: the "paying" tenant's ``--sessions`` agent sessions each send their whole
transcript plus a new message (a long system prompt, then every earlier turn); then ``--flood``
prompts of other tenants, each new (nothing to hit) and long enough together to push every unpinned
block out of the device pool and the host tier, and through the disk tier. Greedy decoding, 4 tokens.

Configurations, each on a fresh engine: host tier only, the paying tenant without lifetimes and with
``prompt_cache_options.ttl`` 30m (``CachePolicy(ttl_s=1800)``); host and disk tiers, without lifetimes
and with ``prompt_cache_retention`` 24h (``CachePolicy(retention_s=86400)``). The clock does not move:
every pin is live for the whole run.

Reported per configuration: the paying tenant's hit rate on returning turns (cached / prompt tokens,
round >= 2) and where its hits came from (device / host / disk), the prompt tokens its pins held, the
flood's hit rate (nothing to hit: 0 either way; a pin takes capacity the flood cannot use, which shows
in the engine's prefill work) and the prefill tokens the engine computed.

``python benchmarks/cache_lifetimes.py --out benchmarks/out/cache_lifetimes.json`` prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402

CONFIGS = ("host", "host+ttl", "host+disk", "host+disk+24h")


def words(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(count)]


def run_config(name: str, model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from engine.kv.pins import DEFAULT_POLICY, CachePolicy

    tiers: dict[str, Any] = {"num_host_kv_blocks": args.host_blocks}
    if "disk" in name:
        tiers |= {"num_disk_kv_blocks": args.disk_blocks, "kv_disk_dir": tempfile.mkdtemp(prefix="tg-kv-")}
    policy = {"host+ttl": CachePolicy(ttl_s=1800), "host+disk+24h": CachePolicy(retention_s=86_400)}.get(
        name, DEFAULT_POLICY)
    rng = random.Random(args.seed)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    transcripts = [words(rng, args.system_tokens) for _ in range(args.sessions)]
    paying = {"prompt": 0, "cached": 0, "device": 0, "host": 0, "disk": 0, "pinned": 0, "retained": 0}
    flood = {"prompt": 0, "cached": 0}
    with LLM(str(model_dir), num_kv_blocks=args.device_blocks, max_num_seqs=4, **tiers) as llm:
        for round_ in range(args.rounds):
            for t in transcripts:
                t.extend(words(rng, args.message_tokens))
            outs = llm.generate([list(t) for t in transcripts], greedy, cache_salt="paying",
                                cache_policy=policy)
            for t, out in zip(transcripts, outs, strict=True):
                t.extend(out.outputs[0].token_ids)
                usage = out.usage
                paying["pinned"] += usage.cache_pinned_tokens
                paying["retained"] += usage.cache_retained_tokens
                if round_ > 0:
                    paying["prompt"] += usage.prompt_tokens
                    paying["cached"] += usage.cached_tokens
                    paying["host"] += usage.cached_host_tokens
                    paying["disk"] += usage.cached_disk_tokens
                    lower = usage.cached_host_tokens + usage.cached_disk_tokens
                    paying["device"] += usage.cached_tokens - lower
            others = [words(rng, args.flood_tokens) for _ in range(args.flood)]
            salts = [f"flood-{i % 3}" for i in range(args.flood)]
            for out in llm.generate(others, greedy, cache_salt=salts):
                flood["prompt"] += out.usage.prompt_tokens
                flood["cached"] += out.usage.cached_tokens
        computed = llm.stats.prompt_tokens - llm.stats.prefix_hit_tokens
    return {"config": name, "paying": paying, "flood": flood, "prefill_tokens_computed": computed,
            "paying_hit_rate": paying["cached"] / paying["prompt"] if paying["prompt"] else 0.0,
            "flood_hit_rate": flood["cached"] / flood["prompt"] if flood["prompt"] else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device-blocks", type=int, default=64)
    parser.add_argument("--host-blocks", type=int, default=96)
    parser.add_argument("--disk-blocks", type=int, default=192)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--system-tokens", type=int, default=120)
    parser.add_argument("--message-tokens", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flood", type=int, default=24)
    parser.add_argument("--flood-tokens", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from engine.tiny import create_tiny_checkpoint

    model_dir = create_tiny_checkpoint(Path(tempfile.gettempdir()) / "tollgate-lifetimes-tiny", seed=0)
    results = [run_config(name, model_dir, args) for name in args.configs.split(",")]
    rows = []
    for r in results:
        p = r["paying"]
        cached = p["cached"] or 1
        rows.append([r["config"], f"{r['paying_hit_rate']:.1%}",
                     f"{p['device'] / cached:.0%} / {p['host'] / cached:.0%} / {p['disk'] / cached:.0%}",
                     f"{p['pinned']:,} / {p['retained']:,}", f"{r['flood_hit_rate']:.1%}",
                     f"{r['prefill_tokens_computed']:,}"])
    print(format_table(["config", "paying tenant hit rate (rounds 2+)", "its hits: device / host / disk",
                        "tokens pinned / retained", "flood hit rate", "prefill tokens computed"], rows))
    if args.out:
        write_json(args.out, {"date": datetime.now(UTC).isoformat(timespec="seconds"),
                              "machine": machine_description("cpu"),
                              "args": vars(args) | {"out": str(args.out)},
                              "results": results})


if __name__ == "__main__":
    main()
