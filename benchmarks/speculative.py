"""Speculative decoding in the engine: a code-edit workload with and without Predicted Outputs, and a
saturated replica with automatic speculation on and off.

Engine-level (``engine.LLMEngine`` on the CPU, one torch thread, the tiny test model: Qwen3 shape of
``engine.tiny``; through the whole platform is the next step). Every sequence decodes greedily with
``ignore_eos``:

- **code edit**: the "file" is the model's own greedy output of ``--file-tokens`` tokens for a prompt;
  the request regenerates it, its prediction that file with about ``--edit-share`` of its lines (16-token
  stretches) edited (a token replaced, a stretch deleted or inserted, in turn). At 1 and ``--concurrent``
  requests at once: output tok/s and forward passes (engine steps) per output token, with the
  prediction and without, in one run.
- **saturated**: ``--saturated`` requests of random prompts at once with speculation ``auto`` against
  ``off`` (the policy stops speculating above ``speculative_max_batch`` sequences).

    python benchmarks/speculative.py --out benchmarks/out/speculative.json
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

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402


def _engine(model: Path, speculation: str, seqs: int) -> Any:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(model),
            max_num_seqs=max(seqs, 1),
            num_kv_blocks=max(seqs, 1) * 64,
            max_num_batched_tokens=4096,
            speculation=speculation,
        )
    )


def _run(engine: Any, requests: list[tuple[list[int], int, list[int] | None]]) -> dict[str, float]:
    from engine.sampling_params import SamplingParams

    steps_before = engine.stats().num_steps
    started = time.perf_counter()
    for i, (prompt, n, prediction) in enumerate(requests):
        engine.add_request(
            f"b{i}-{time.monotonic_ns()}",
            prompt,
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
            prediction=prediction,
        )
    produced = 0
    while engine.has_unfinished():
        for delta in engine.step():
            produced += sum(len(c.token_ids) for c in delta.completions)
    wall = time.perf_counter() - started
    steps = engine.stats().num_steps - steps_before
    return {
        "output_tokens": produced,
        "seconds": wall,
        "tok_s": produced / wall,
        "steps": steps,
        "steps_per_token": steps / produced,
    }


def _edit(tokens: list[int], share: float, seed: int) -> list[int]:
    """The file with about ``share`` of its 16-token lines edited: replaced, deleted or inserted."""
    rng = random.Random(seed)
    out: list[int] = []
    for i, start in enumerate(range(0, len(tokens), 16)):
        line = tokens[start : start + 16]
        if rng.random() < share:
            kind = i % 3
            if kind == 0:
                line = line[:5] + [(line[5] + 1) % 2000] + line[6:] if len(line) > 6 else line
            elif kind == 1:
                line = line[: len(line) // 2]
            else:
                line = line + [rng.randrange(100, 2000) for _ in range(4)]
        out.extend(line)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--file-tokens", type=int, default=256)
    parser.add_argument("--edit-share", type=float, default=0.1)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--saturated", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/out/speculative.json")
    args = parser.parse_args()
    import torch

    from engine.tiny import create_tiny_checkpoint

    torch.set_num_threads(1)
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = create_tiny_checkpoint(Path(tmp) / "tiny", arch="qwen3", seed=0)
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 2000) for _ in range(40)] for _ in range(max(args.concurrent, 1))]
        from engine.sampling_params import SamplingParams

        plain = _engine(model, "off", args.concurrent)
        for i, prompt in enumerate(prompts):  # each request's "file": the model's own greedy output
            plain.add_request(
                f"file-{i}",
                prompt,
                SamplingParams(temperature=0.0, max_tokens=args.file_tokens, ignore_eos=True),
            )
        outputs: dict[str, list[int]] = {}
        while plain.has_unfinished():
            for delta in plain.step():
                for c in delta.completions:
                    outputs.setdefault(delta.request_id, []).extend(c.token_ids)
        files = [outputs[f"file-{i}"] for i in range(len(prompts))]
        predictions = [_edit(f, args.edit_share, i) for i, f in enumerate(files)]
        plain.close()
        engines = {
            name: _engine(model, name, max(args.concurrent, args.saturated)) for name in ("off", "auto")
        }
        for engine in engines.values():  # warm-up: first-use allocations and compiles out of the timings
            _run(engine, [(p, 32, files[i][:32]) for i, p in enumerate(prompts)])
        for concurrent in (1, args.concurrent):
            best: dict[str, dict[str, float]] = {}
            for _ in range(args.repeat):
                for name, with_prediction in (("off", False), ("auto", True)):
                    requests = [
                        (prompts[i], args.file_tokens, predictions[i] if with_prediction else None)
                        for i in range(concurrent)
                    ]
                    run = _run(engines[name], requests)
                    key = "prediction" if with_prediction else "plain"
                    if key not in best or run["seconds"] < best[key]["seconds"]:
                        best[key] = run
            speedup = best["prediction"]["tok_s"] / best["plain"]["tok_s"]
            rows.append(
                [
                    f"code edit, {concurrent} at once",
                    f"{best['plain']['tok_s']:.0f}",
                    f"{best['prediction']['tok_s']:.0f}",
                    f"{speedup:.2f}x",
                    f"{best['plain']['steps_per_token'] * concurrent:.2f}",
                    f"{best['prediction']['steps_per_token'] * concurrent:.2f}",
                ]
            )
            results.append(
                {
                    "workload": "code_edit",
                    "concurrent": concurrent,
                    **{k: v for k, v in best.items()},
                    "speedup": speedup,
                }
            )
        saturated_prompts = [[rng.randrange(100, 2000) for _ in range(40)] for _ in range(args.saturated)]
        best = {}
        for _ in range(args.repeat):
            for name in ("off", "auto"):
                run = _run(engines[name], [(p, 64, None) for p in saturated_prompts])
                if name not in best or run["seconds"] < best[name]["seconds"]:
                    best[name] = run
        ratio = best["auto"]["tok_s"] / best["off"]["tok_s"]
        rows.append(
            [
                f"saturated, {args.saturated} at once (auto vs off)",
                f"{best['off']['tok_s']:.0f}",
                f"{best['auto']['tok_s']:.0f}",
                f"{ratio:.3f}x",
                f"{best['off']['steps_per_token'] * args.saturated:.2f}",
                f"{best['auto']['steps_per_token'] * args.saturated:.2f}",
            ]
        )
        results.append({"workload": "saturated", "concurrent": args.saturated, **best, "ratio": ratio})
        for engine in engines.values():
            engine.close()
    print(
        f"Speculative decoding, engine-level, tiny Qwen3-shaped model, {machine_description('cpu')}, "
        f"file {args.file_tokens} tokens, {args.edit_share:.0%} of lines edited, best of {args.repeat}"
    )
    print(
        format_table(
            [
                "workload",
                "tok/s without",
                "tok/s with",
                "speed-up",
                "steps per token/request without",
                "with",
            ],
            rows,
        )
    )
    write_json(
        args.out,
        {
            "benchmark": "speculative",
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": machine_description("cpu"),
            "file_tokens": args.file_tokens,
            "edit_share": args.edit_share,
            "repeat": args.repeat,
            "results": results,
        },
    )


if __name__ == "__main__":
    main()
