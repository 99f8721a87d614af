"""The host tier's copies on a GPU: offload and load bandwidth against the measured PCIe copy rate, and a
decode step's time with offloads in flight against without.

Set-up: Llama-3-8B's shapes (``benchmarks.decode_step``), bfloat16, random weights drawn on the device,
a device pool for ``--batch`` sequences of ``--context`` tokens plus the blocks to move, and a host tier
(``engine.kv.transfer.KVTransfer``, pinned memory) of ``--blocks`` slots.

1. PCIe rate: one pinned host buffer of ``--blocks`` blocks' bytes copied to and from the device
   (the best of several copies, synchronised).
2. Offload and load: ``KVTransfer.execute`` of a plan moving ``--blocks`` device blocks to host slots, and
   back; bytes moved / time, and as a fraction of the PCIe rate of the same direction.
3. Step time: a decode step of the batch alone; with a plan of ``--step-offloads`` offloads issued
   before it as the engine does (the copies to the host run on a side stream during the forward pass
   and land after it: ``execute``, the step, ``poll``); and with the same offloads waited for before the
   step (``complete``: how the copies ran before they overlapped). The median of ``--steps`` steps each,
   side by side in one run.

``python benchmarks/kv_tiers.py --out benchmarks/out/kv_tiers.json`` (needs a CUDA GPU; run by
``scripts/gpu-check``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, machine_description, write_json  # noqa: E402
from benchmarks.decode_step import decode_batch, write_config  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """The median wall time of ``fn`` (synchronised), seconds."""
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_rates(total: int, device: str) -> tuple[float, float]:
    """Bytes per second of one pinned host buffer copied to the device, and back."""
    host = torch.empty(total, dtype=torch.uint8, pin_memory=device == "cuda")
    dev = torch.empty(total, dtype=torch.uint8, device=device)
    return (total / timed(lambda: dev.copy_(host, non_blocking=True), 5),
            total / timed(lambda: host.copy_(dev, non_blocking=True), 5))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="llama3-8b (default on cuda) or qwen3-0.6b (on cpu)")
    parser.add_argument("--blocks", type=int, default=512, help="blocks moved per offload / load measurement")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--step-offloads", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    args.model = args.model or ("llama3-8b" if cuda else "qwen3-0.6b")
    if cuda and not torch.cuda.is_available():
        print("kv_tiers needs a CUDA GPU (--device cpu: a dry run of the same steps)", file=sys.stderr)
        return 2

    from engine.config import EngineConfig
    from engine.kv.tiers import TransferPlan
    from engine.kv.transfer import KVTransfer
    from engine.model_runner import ModelRunner

    per_seq = -(-args.context // 16)
    in_use = args.batch * per_seq
    config = EngineConfig(model=str(write_config(args.model)), device=args.device,
                          dtype="bfloat16" if cuda else "float32",
                          num_kv_blocks=in_use + args.blocks, max_num_seqs=args.batch,
                          max_model_len=per_seq * 16, load_format="random")  # fmt: skip
    runner = ModelRunner(config)
    for cache in runner.kv_caches:
        cache.normal_()
    transfer = KVTransfer(runner.kv_caches, args.blocks, None, "bench")
    block_bytes = transfer.block_bytes
    total = args.blocks * block_bytes

    h2d, d2h = copy_rates(total, args.device)

    spare = list(range(in_use, in_use + args.blocks))  # device blocks no sequence of the batch uses
    offload = TransferPlan(offload=list(zip(spare, range(args.blocks), strict=True)))
    load = TransferPlan(load=list(zip(range(args.blocks), spare, strict=True)))
    offload_s = timed(lambda: (transfer.execute(offload), transfer.complete()), 5)
    load_s = timed(lambda: (transfer.execute(load), transfer.complete()), 5)

    batch = decode_batch(runner, args.batch, args.context, seed=0)
    for _ in range(3):
        runner.run(batch)
    few = TransferPlan(offload=list(zip(spare[:args.step_offloads], range(args.step_offloads), strict=True)))
    alone_s = timed(lambda: runner.run(batch), args.steps)
    overlapped_s = timed(lambda: (transfer.execute(few), runner.run(batch), transfer.poll()), args.steps)
    waited_s = timed(lambda: (transfer.execute(few), transfer.complete(), runner.run(batch)), args.steps)
    transfer.complete()

    gb = 1e9
    rows = [
        ["PCIe copy, pinned host -> device / device -> host", f"{h2d / gb:.1f} / {d2h / gb:.1f} GB/s", "-"],
        [f"offload {args.blocks} blocks (device -> host tier)", f"{total / offload_s / gb:.1f} GB/s",
         f"{total / offload_s / d2h:.0%} of device -> host"],
        [f"load {args.blocks} blocks (host tier -> device)", f"{total / load_s / gb:.1f} GB/s",
         f"{total / load_s / h2d:.0%} of host -> device"],
        [f"decode step, batch {args.batch} x {args.context} tokens", f"{alone_s * 1e3:.2f} ms", "-"],
        [f"  with {args.step_offloads} offloads overlapping it", f"{overlapped_s * 1e3:.2f} ms",
         f"+{(overlapped_s - alone_s) * 1e3:.2f} ms"],
        [f"  with {args.step_offloads} offloads waited for before it", f"{waited_s * 1e3:.2f} ms",
         f"+{(waited_s - alone_s) * 1e3:.2f} ms"],
    ]
    print(format_table(["measurement", "value", "against"], rows))
    if args.out:
        write_json(args.out, {
            "device": machine_description(args.device),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "model": args.model, "block_bytes": block_bytes, "blocks": args.blocks,
            "pcie_h2d_bytes_per_s": h2d, "pcie_d2h_bytes_per_s": d2h,
            "offload_bytes_per_s": total / offload_s, "load_bytes_per_s": total / load_s,
            "step_ms": alone_s * 1e3, "step_with_offloads_ms": overlapped_s * 1e3,
            "step_with_offloads_waited_ms": waited_s * 1e3,
            "step_offloads": args.step_offloads, "batch": args.batch, "context": args.context})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
