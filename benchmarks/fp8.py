"""FP8 weights: what they cost in accuracy (CPU) and what they buy in speed (GPU, when one is present).

FP8 KV-cache table (always): tiny Llama, Qwen3 and the copying model (``tollgate model create-copying``:
peaked logits, small K in its first layer) decoding 96-token prompts one token at a time, teacher-forced,
with the cache in e4m3 against float32: top-1 agreement and logit error, with scales of 1.0 and with
scales calibrated on ``engine.quantize.CALIBRATION_TEXT``.

Accuracy table (always): tiny random Llama, Qwen3 and Qwen3-MoE checkpoints (``engine.tiny``, float32)
against themselves quantized to FP8 three ways (``tollgate model quantize --scheme fp8-channel``, ``--scheme
fp8-block`` with 32 x 32 blocks for these tiny widths, and ``--quantization fp8`` at load), through the
engine's CPU path (dequantize, then matmul):

- teacher-forced logits over ``--prompts`` random prompts of 40-160 tokens: the largest and the mean
  absolute logit error against the 16-bit model, and the share of positions whose top-1 token agrees;
- greedy generation of ``--tokens`` tokens per prompt: the share of generated tokens identical to the
  16-bit model's at the same position (a divergence changes everything after it, so this is the
  stricter figure).

Random tiny models have nearly flat logits (top-2 gaps of a few hundredths), so their top-1 flips far
more easily than a trained model's: these figures bound FP8's numeric error, not a real model's quality.

GPU table (when CUDA is present): ``kernels.fp8_linear`` (W8A8 on sm_89+) against a bf16 ``torch.mm`` at
Llama-3-8B's projection shapes, at decode (M = 1, 64) and prefill (M = 2048) token counts: TFLOP/s of
each, side by side in one run.

Trained-model KV table (``--train-seconds N``): ``engine.tiny``'s llama trained N seconds on the
repository's docs and engine sources, then the FP8 KV cache against float32 over held-out text, overall
and at positions whose top-2 probability gap exceeds 0.02 / 0.05 / 0.1.

    python benchmarks/fp8.py [--prompts 8] [--tokens 32] [--train-seconds 240] [--out benchmarks/out/fp8.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402

ARCHS = ("llama", "qwen3", "qwen3_moe")
VARIANTS = ("fp8-channel", "fp8-block", "quantize-at-load")


def _prompts(count: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, vocab - 16, (int(n),), generator=gen).tolist()
        for n in torch.linspace(40, 160, count)
    ]


def accuracy_rows(prompt_count: int, tokens: int) -> list[dict[str, Any]]:
    from engine import LLM, SamplingParams
    from engine.quantize import quantize_checkpoint
    from engine.tiny import create_tiny_checkpoint

    rows = []
    greedy = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ARCHS:
            src = create_tiny_checkpoint(Path(tmp) / arch, arch=arch)
            with LLM(str(src), speculation="off") as base:
                prompts = _prompts(prompt_count, base.engine.runner.vocab_size)
                base_logits = [_logits(base, p) for p in prompts]
                base_out = [o.token_ids for o in base.generate(prompts, greedy)]
            for variant in VARIANTS:
                if variant == "quantize-at-load":
                    model, options = src, {"quantization": "fp8"}
                else:
                    model, options = (
                        quantize_checkpoint(src, Path(tmp) / f"{arch}-{variant}", variant, (32, 32)),
                        {},
                    )
                with LLM(str(model), speculation="off", **options) as llm:  # type: ignore[arg-type]
                    logits = [_logits(llm, p) for p in prompts]
                    out = [o.token_ids for o in llm.generate(prompts, greedy)]
                errors = torch.cat(
                    [(a - b).abs().flatten() for a, b in zip(logits, base_logits, strict=True)]
                )
                top1 = torch.cat(
                    [a.argmax(-1) == b.argmax(-1) for a, b in zip(logits, base_logits, strict=True)]
                )
                same = sum(
                    x == y for o, b in zip(out, base_out, strict=True) for x, y in zip(o, b, strict=True)
                )
                rows.append(
                    {
                        "arch": arch,
                        "variant": variant,
                        "max_abs_logit_error": float(errors.max()),
                        "mean_abs_logit_error": float(errors.mean()),
                        "top1_agreement": float(top1.float().mean()),
                        "identical_greedy_tokens": same / sum(len(o) for o in base_out),
                        "logit_spread": float(torch.cat(base_logits).std()),
                    }
                )
    return rows


def _logits(llm: Any, prompt: list[int]) -> torch.Tensor:
    """Teacher-forced logits of every position of ``prompt`` (one prefill through the runner's model)."""
    from engine.attention import AttentionMetadata

    runner = llm.engine.runner
    args = runner.args
    n = len(prompt)
    block = runner.block_size
    blocks = -(-n // block)
    caches = [
        torch.zeros(2, blocks, block, runner.shard.num_kv_heads, args.head_dim)
        for _ in range(args.num_layers)
    ]
    table = torch.arange(blocks, dtype=torch.int32)[None]
    meta = AttentionMetadata(
        torch.arange(n),
        torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32),
        table,
        n,
        n,
        [n],
        [n],
        block,
    )
    with torch.inference_mode():
        model = runner.model
        return model.compute_logits(model(torch.tensor(prompt), torch.arange(n), caches, meta)).float()


def teacher_forced_logits(
    model_dir: Path, tokens: list[int], kv_dtype: torch.dtype, scales: list[tuple[float, float]] | None = None
) -> torch.Tensor:
    """Logits of each position, decoding ``tokens`` one at a time (float32 model, PyTorch backend) through
    a paged cache of ``kv_dtype`` with per-layer ``scales``: every earlier K/V is read back from it."""
    from engine.attention import AttentionMetadata
    from engine.attention.torch_backend import TorchAttentionBackend
    from engine.loader import load_model
    from engine.models.config import ModelArgs

    args = ModelArgs.from_pretrained(model_dir)
    backend = TorchAttentionBackend(args.num_heads, args.num_kv_heads, args.head_dim, args.head_dim**-0.5)
    model = load_model(model_dir, backend, torch.float32, "cpu")
    for layer, scale in zip(model.model.layers, scales or [(1.0, 1.0)] * args.num_layers, strict=True):
        layer.self_attn.kv_scale = scale
    n, block = len(tokens), 16
    blocks = -(-n // block)
    caches = [
        torch.zeros(2, blocks, block, args.num_kv_heads, args.head_dim).to(kv_dtype)
        for _ in range(args.num_layers)
    ]
    table = torch.arange(blocks, dtype=torch.int32)[None]
    logits = []
    with torch.inference_mode():
        for t in range(n):
            meta = AttentionMetadata(
                torch.tensor([t]),
                torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([t + 1], dtype=torch.int32),
                table,
                1,
                t + 1,
                [1],
                [t + 1],
                block,
            )
            hidden = model(torch.tensor([tokens[t]]), torch.tensor([t]), caches, meta)
            logits.append(model.compute_logits(hidden)[0])
    return torch.stack(logits)


def kv_cache_rows(prompt_count: int) -> list[dict[str, Any]]:
    """An FP8 KV cache against a float32 one, teacher-forced, with scales of 1.0 and calibrated ones."""
    from engine.quantize import CALIBRATION_TEXT, calibrate_kv_scales
    from engine.tiny import create_tiny_checkpoint

    rows = []
    gen = torch.Generator().manual_seed(11)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in ("llama", "qwen3", "copying"):
            if arch == "copying":
                from engine.copying import create_copying_checkpoint

                model_dir = create_copying_checkpoint(Path(tmp) / arch)
            else:
                model_dir = create_tiny_checkpoint(Path(tmp) / arch, arch=arch)
            calibrated = calibrate_kv_scales(model_dir, [CALIBRATION_TEXT])
            prompts = [torch.randint(3, 2900, (96,), generator=gen).tolist() for _ in range(prompt_count)]
            full = [teacher_forced_logits(model_dir, p, torch.float32) for p in prompts]
            for label, scales in (("1.0", None), ("calibrated", calibrated)):
                fp8 = [teacher_forced_logits(model_dir, p, torch.float8_e4m3fn, scales) for p in prompts]
                top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(full, fp8, strict=True)])
                err = torch.cat([(a - b).abs().flatten() for a, b in zip(full, fp8, strict=True)])
                rows.append(
                    {
                        "model": arch,
                        "scales": label,
                        "top1_agreement": float(top1.float().mean()),
                        "mean_abs_logit_error": float(err.mean()),
                        "logit_std": float(torch.cat(full).std()),
                    }
                )
    return rows


MARGINS = (0.02, 0.05, 0.1)


def train_tiny(out: Path, seconds: float, seed: int = 0) -> tuple[Path, list[int], dict[str, Any]]:
    """``engine.tiny``'s llama trained for ``seconds`` on the repository's own docs and engine sources
    (next-token loss, AdamW, 128-token windows): a tiny model whose logits are peaked where the text is
    predictable, unlike a random one's. Returns its directory, 4,000 held-out tokens, and the run's
    figures."""
    import random

    import transformers
    from tokenizers import Tokenizer

    from engine.tiny import create_tiny_checkpoint

    model_dir = create_tiny_checkpoint(out, arch="llama", seed=seed)
    sources = sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "engine").glob("*.py"))[:30]
    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(
        "\n".join(p.read_text() for p in sources)).ids
    held, train = ids[-4000:], ids[:-4000]
    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    started, steps, loss = time.perf_counter(), 0, float("nan")
    while time.perf_counter() - started < seconds:
        starts = [rng.randrange(0, len(train) - 129) for _ in range(16)]
        x = torch.tensor([train[i:i + 128] for i in starts])
        step_loss = model(x, labels=x).loss
        opt.zero_grad()
        step_loss.backward()
        opt.step()
        steps, loss = steps + 1, step_loss.item()
    model.save_pretrained(model_dir)
    return model_dir, held, {"steps": steps, "train_tokens": len(train), "final_loss": loss}


def trained_kv_rows(seconds: float, windows: int = 8) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The FP8 KV cache on a trained tiny model (``train_tiny``), teacher-forced over ``windows`` 96-token
    held-out windows: top-1 agreement overall and where the float32 cache's top two probabilities differ
    by more than each of ``MARGINS`` (the flips sit at near-ties)."""
    from engine.quantize import CALIBRATION_TEXT, calibrate_kv_scales

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, held, training = train_tiny(Path(tmp) / "trained", seconds)
        prompts = [held[i * 100:i * 100 + 96] for i in range(windows)]
        full = [teacher_forced_logits(model_dir, p, torch.float32) for p in prompts]
        top_prob = torch.cat([torch.softmax(a, -1).max(-1).values for a in full])
        training["mean_top1_probability"] = float(top_prob.mean())
        calibrated = calibrate_kv_scales(model_dir, [CALIBRATION_TEXT])
        for label, scales in (("1.0", None), ("calibrated", calibrated)):
            fp8 = [teacher_forced_logits(model_dir, p, torch.float8_e4m3fn, scales) for p in prompts]
            agree = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(full, fp8, strict=True)])
            top2 = torch.cat([torch.softmax(a, -1).topk(2, -1).values for a in full])
            gap = top2[:, 0] - top2[:, 1]
            row: dict[str, Any] = {"model": "llama (trained)", "scales": label, "positions": agree.numel(),
                                   "top1_agreement": float(agree.float().mean())}
            for margin in MARGINS:
                keep = gap > margin
                row[f"agreement_margin_{margin}"] = float(agree[keep].float().mean())
                row[f"share_margin_{margin}"] = float(keep.float().mean())
            rows.append(row)
    return rows, training


def gpu_rows(repeat: int) -> list[dict[str, Any]]:
    import kernels
    from engine.models.fp8 import quantize_fp8

    device = torch.device("cuda")
    rows = []
    for name, n, k in (("qkv", 6144, 4096), ("down", 4096, 14336), ("gate_up", 28672, 4096)):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * k**-0.5
        q, scale = quantize_fp8(w, k)
        for m in (1, 64, 2048):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            fp8_s = _cuda_time(lambda x=x, q=q, scale=scale: kernels.fp8_linear(x, q, scale), repeat)
            bf16_s = _cuda_time(lambda x=x, w=w: torch.mm(x, w.T), repeat)
            flops = 2 * m * n * k
            rows.append(
                {
                    "layer": name,
                    "m": m,
                    "n": n,
                    "k": k,
                    "fp8_us": 1e6 * fp8_s,
                    "bf16_us": 1e6 * bf16_s,
                    "fp8_tflops": flops / fp8_s / 1e12,
                    "bf16_tflops": flops / bf16_s / 1e12,
                    "speedup": bf16_s / fp8_s,
                }
            )
    return rows


def _cuda_time(fn: Any, repeat: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--train-seconds", type=float, default=0.0,
                        help="also train engine.tiny's llama this long on the repository's text (CPU) and "
                             "measure the FP8 KV cache on it")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "fp8.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = accuracy_rows(args.prompts, args.tokens)
    print(
        f"FP8 against the float32 original, CPU reference path ({machine_description('cpu')}); "
        f"{args.prompts} prompts of 40-160 tokens, {args.tokens} greedy tokens each"
    )
    print(
        format_table(
            [
                "model",
                "variant",
                "max |logit err|",
                "mean |logit err|",
                "logit std",
                "top-1 agreement",
                "identical greedy tokens",
            ],
            [
                [
                    r["arch"],
                    r["variant"],
                    f"{r['max_abs_logit_error']:.4f}",
                    f"{r['mean_abs_logit_error']:.5f}",
                    f"{r['logit_spread']:.3f}",
                    f"{100 * r['top1_agreement']:.1f}%",
                    f"{100 * r['identical_greedy_tokens']:.1f}%",
                ]
                for r in rows
            ],
        )
    )
    kv = kv_cache_rows(max(1, args.prompts // 2))
    print("\nFP8 KV cache against a float32 one, teacher-forced over 96-token prompts (float32 model)")
    print(
        format_table(
            ["model", "k/v scales", "top-1 agreement", "mean |logit err|", "logit std"],
            [
                [
                    r["model"],
                    r["scales"],
                    f"{100 * r['top1_agreement']:.1f}%",
                    f"{r['mean_abs_logit_error']:.4f}",
                    f"{r['logit_std']:.3f}",
                ]
                for r in kv
            ],
        )
    )
    payload: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine_description("cpu"),
        "accuracy": rows,
        "kv_cache": kv,
    }
    if args.train_seconds > 0:
        trained, training = trained_kv_rows(args.train_seconds)
        print(f"\nFP8 KV cache on a trained tiny llama ({training['steps']} steps in "
              f"{args.train_seconds:.0f} s, final loss {training['final_loss']:.2f}, mean top-1 probability "
              f"{training['mean_top1_probability']:.2f}), teacher-forced over 8 held-out 96-token windows")
        print(format_table(
            ["k/v scales", "top-1 agreement", *(f"top-2 gap > {m}" for m in MARGINS)],
            [[r["scales"], f"{100 * r['top1_agreement']:.2f}%",
              *(f"{100 * r[f'agreement_margin_{m}']:.2f}% ({100 * r[f'share_margin_{m}']:.0f}% of positions)"
                for m in MARGINS)] for r in trained]))
        payload["kv_cache_trained"] = {"training": training, "rows": trained}
    if torch.cuda.is_available():
        gpu = gpu_rows(args.repeat)
        print(f"\nFP8 GEMM against bf16 on {machine_description('cuda')} (Llama-3-8B projections)")
        print(
            format_table(
                ["layer", "M", "fp8 us", "bf16 us", "fp8 TFLOP/s", "bf16 TFLOP/s", "fp8 speed-up"],
                [
                    [
                        r["layer"],
                        r["m"],
                        f"{r['fp8_us']:.1f}",
                        f"{r['bf16_us']:.1f}",
                        f"{r['fp8_tflops']:.1f}",
                        f"{r['bf16_tflops']:.1f}",
                        f"{r['speedup']:.2f}x",
                    ]
                    for r in gpu
                ],
            )
        )
        payload |= {"gpu": gpu, "gpu_machine": machine_description("cuda")}
    else:
        print("\nno GPU here: the FP8 GEMM speed table needs one")
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
