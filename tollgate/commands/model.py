"""``tollgate model ...`` (checkpoint tools) and ``tollgate engine`` (one engine replica).

Heavy imports (torch, the engine) happen inside the commands so that ``tollgate --help`` stays fast.
Invalid engine settings raise ``ValueError`` in ``EngineConfig``; they are shown as usage errors.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

# engine.tiny.ARCHS, spelled out so that `tollgate --help` imports no torch.
_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "gpt_oss")


@click.group()
def model() -> None:
    """Model checkpoint tools."""


@model.command("create-tiny")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--arch", "--family", "arch", type=click.Choice(_ARCHS), default="llama", show_default=True,
              help="Model family to write: a dense decoder or a mixture of experts.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the random weights (same seed, same files).")
@click.option("--mxfp4", is_flag=True, default=False,
              help="gpt_oss only: store the experts in MXFP4, as the released gpt-oss checkpoints do.")
def create_tiny(directory: Path, arch: str, seed: int, mxfp4: bool) -> None:
    """Write a tiny random-weight HF checkpoint (real BPE tokenizer + chat template) into DIRECTORY."""
    from engine.tiny import create_tiny_checkpoint

    if mxfp4 and arch != "gpt_oss":
        raise click.UsageError("--mxfp4 needs --family gpt_oss")
    out = create_tiny_checkpoint(directory, arch=arch, seed=seed, mxfp4=mxfp4)
    click.echo(f"wrote tiny {arch} checkpoint (seed {seed}) to {out}")


@model.command("quantize")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option("--scheme", type=click.Choice(["fp8-channel", "fp8-block"]), default="fp8-channel",
              show_default=True,
              help="fp8-channel: compressed-tensors, a scale per output channel; fp8-block: 128x128 blocks.")
@click.option("--block-size", type=click.IntRange(min=1), default=128, show_default=True,
              help="fp8-block: rows and columns of a block.")
@click.option("--kv-cache-scales", is_flag=True, default=False,
              help="Also calibrate per-layer FP8 KV-cache scales (for --kv-cache-dtype fp8) on a built-in "
                   "text, or on --calibration-file.")
@click.option("--calibration-file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None,
              help="Text to calibrate the KV-cache scales on (paragraphs apart by blank lines).")
def quantize(src: Path, dst: Path, scheme: str, block_size: int, kv_cache_scales: bool,
             calibration_file: Path | None) -> None:
    """Write an FP8 checkpoint DST from the 16-bit checkpoint SRC (see docs/operations.md, "FP8")."""
    from engine.quantize import CALIBRATION_TEXT, quantize_checkpoint

    texts = None
    if kv_cache_scales or calibration_file is not None:
        raw = calibration_file.read_text(encoding="utf-8") if calibration_file else CALIBRATION_TEXT
        texts = [p for p in raw.split("\n\n") if p.strip()] or [raw]
    try:
        out = quantize_checkpoint(src, dst, scheme, (block_size, block_size), kv_cache_texts=texts)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    click.echo(f"wrote {scheme} checkpoint to {out}")


@model.command("create-copying")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="Seed of the token embeddings (same seed, same files).")
def create_copying(directory: Path, seed: int) -> None:
    """Write a tiny Llama checkpoint that quotes its context (an induction circuit; same tokenizer as
    create-tiny) into DIRECTORY: the model automatic speculation is measured with."""
    from engine.copying import create_copying_checkpoint

    out = create_copying_checkpoint(directory, seed=seed)
    click.echo(f"wrote copying checkpoint (seed {seed}) to {out}")


@click.command()
@click.option("--model", "model_path", required=True,
              help='Hugging Face checkpoint directory, or "synthetic" (a model-less stand-in for '
                   'gateway load tests).')
@click.option("--model-name", default=None, help="Name served to the gateway. Default: the directory name.")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(1, 65535), default=8100, show_default=True)
@click.option("--pool", default="interactive", show_default=True, help="Pool this replica serves.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--dtype", type=click.Choice(["auto", "float32", "float16", "bfloat16"]), default="auto",
              show_default=True, help="auto: bfloat16 on CUDA, float32 on the CPU.")
@click.option("--attention-backend", type=click.Choice(["torch", "triton"]), default=None,
              help="Default: triton on CUDA, torch elsewhere.")
@click.option("--num-kv-blocks", type=click.IntRange(min=1), default=None,
              help="Default: sized from --kv-cache-memory-gb (CPU) or --gpu-memory-utilization (CUDA).")
@click.option("--kv-cache-memory-gb", type=click.FloatRange(min=0, min_open=True), default=1.0,
              show_default=True)
@click.option("--gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True), default=0.9,
              show_default=True)
@click.option("--max-model-len", type=click.IntRange(min=1), default=None,
              help="Default: the model's max_position_embeddings.")
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--no-prefix-caching", is_flag=True, help="Disable the prefix cache.")
@click.option("--host-kv-gb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Host memory for prefix-cache blocks evicted from the device (0: no host tier).")
@click.option("--disk-kv-gb", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Disk for prefix-cache blocks below the host tier, kept across restarts (0: none).")
@click.option("--kv-disk-dir", type=click.Path(file_okay=False), default=None,
              help="Directory of the disk tier's block files (needed with --disk-kv-gb).")
@click.option("--kv-pin-quota-blocks", type=click.IntRange(min=0), default=None,
              help="Blocks one tenant may pin in the host tier for a prompt_cache_options.ttl "
                   "(default: a quarter of the host tier).")
@click.option("--kv-retention-quota-blocks", type=click.IntRange(min=0), default=None,
              help="Blocks one tenant may keep on disk for prompt_cache_retention=24h "
                   "(default: a quarter of the disk tier).")
@click.option("--enforce-eager", is_flag=True, help="Never capture CUDA graphs.")
@click.option("--speculation", type=click.Choice(["auto", "prediction", "off"]), default="auto",
              show_default=True, help="Speculative decoding: requests' predictions and prompt lookup (auto), "
                                      "predictions only, or none.")
@click.option("--num-speculative-tokens", type=click.IntRange(min=0), default=4, show_default=True,
              help="Draft tokens per sequence and step from prompt lookup (a prediction: twice as many).")
@click.option("--speculative-max-batch", type=click.IntRange(min=0), default=16, show_default=True,
              help="No speculation while more sequences than this run.")
@click.option("--tensor-parallel-size", "-tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Split the model over this many GPUs (cuda:K.. from --device) or CPU processes; one "
                   "replica, rank 0 serving.")
@click.option("--quantization", type=click.Choice(["fp8"]), default=None,
              help="Quantize a 16-bit checkpoint's linear layers to FP8 at load (per channel). FP8 "
                   "checkpoints (compressed-tensors, block FP8) are read as they are without it.")
@click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default="auto", show_default=True,
              help="fp8: keep the KV cache in e4m3 (scales from the checkpoint, else 1.0): about twice the "
                   "blocks in the same memory.")
@click.option("--enable-expert-parallel", is_flag=True, default=False,
              help="Mixtures of experts: give each rank a subset of the experts, whole, instead of a slice "
                   "of every expert (the default). Measure both: either can be faster.")
@click.option("--overlap/--no-overlap", default=None,
              help="Schedule step N+1 while the device runs step N (default: on for CUDA, off on the CPU).")
@click.option("--max-loras", type=click.IntRange(min=0), default=0, show_default=True,
              help="LoRA adapters one step may run (device slots); 0: the replica serves no adapters.")
@click.option("--max-lora-rank", type=click.IntRange(min=1), default=64, show_default=True,
              help="The highest adapter rank a slot takes.")
@click.option("--max-cpu-loras", type=click.IntRange(min=1), default=32, show_default=True,
              help="Adapters kept read in host memory.")
@click.option("--lora-dir", type=click.Path(file_okay=False), default=None,
              help="The adapter store: a request's adapter id is the PEFT bundle at DIR/<id>.")
@click.option("--role", type=click.Choice(["both", "prefill", "decode"]), default="both", show_default=True,
              help="Disaggregated serving: prefill (first token, prompt blocks leased), decode (pulls them), "
                   "or both (no transfers).")
@click.option("--kv-transfer-host", default="127.0.0.1", show_default=True,
              help="Prefill role: the address the KV transfer server listens on.")
@click.option("--kv-transfer-port", type=click.IntRange(0, 65535), default=0, show_default=True,
              help="Prefill role: the KV transfer server's port (0: a free one).")
@click.option("--kv-transfer-advertise-host", default=None,
              help="Prefill role: the host decode replicas reach the transfer server at (default: "
                   "--kv-transfer-host).")
@click.option("--kv-lease-s", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              help="Prefill role: how long a prompt's blocks stay leased when no decode replica pulls them.")
@click.option("--kv-transfer-failure", type=click.Choice(["recompute", "fail"]), default="recompute",
              show_default=True, help="Decode role: when a pull fails, compute the prompt here or fail the "
                                      "request.")
@click.option("--kv-transfer-timeout-s", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, help="Socket timeout of one KV transfer.")
@click.option("--drain-timeout-s", type=click.FloatRange(min=0), default=120.0, show_default=True,
              help="On SIGTERM: how long running streams may take to finish before the replica exits "
                   "(it refuses new requests and reports draining meanwhile).")
def engine(
    model_path: str,
    model_name: str | None,
    host: str,
    port: int,
    pool: str,
    device: str,
    dtype: str,
    attention_backend: str | None,
    num_kv_blocks: int | None,
    kv_cache_memory_gb: float,
    gpu_memory_utilization: float,
    max_model_len: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    no_prefix_caching: bool,
    host_kv_gb: float,
    disk_kv_gb: float,
    kv_disk_dir: str | None,
    kv_pin_quota_blocks: int | None,
    kv_retention_quota_blocks: int | None,
    enforce_eager: bool,
    speculation: str,
    num_speculative_tokens: int,
    speculative_max_batch: int,
    tensor_parallel_size: int,
    quantization: str | None,
    kv_cache_dtype: str,
    enable_expert_parallel: bool,
    overlap: bool | None,
    max_loras: int,
    max_lora_rank: int,
    max_cpu_loras: int,
    lora_dir: str | None,
    role: str,
    kv_transfer_host: str,
    kv_transfer_port: int,
    kv_transfer_advertise_host: str | None,
    kv_lease_s: float,
    kv_transfer_failure: str,
    kv_transfer_timeout_s: float,
    drain_timeout_s: float,
) -> None:
    """Run one engine replica: the internal HTTP server over the paged-KV engine.

    Every endpoint but /health and /metrics needs the internal token from TOLLGATE_INTERNAL_TOKEN
    (required unless --host is a loopback address)."""
    from engine.gate import check_internal_token
    from engine.protocol import INTERNAL_TOKEN_ENV
    from engine.server import serve

    token = os.environ.get(INTERNAL_TOKEN_ENV) or None
    try:
        check_internal_token(token, host)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if model_path == "synthetic":
        serve("synthetic", host=host, port=port, pool=pool, model_name=model_name, internal_token=token,
              drain_timeout_s=drain_timeout_s, max_model_len=max_model_len)
        return
    if not Path(model_path).is_dir():
        raise click.BadParameter(f"{model_path} is not a directory", param_hint="--model")

    from engine.config import EngineConfig

    try:
        config = EngineConfig(
            model=model_path,
            device=device,
            dtype=dtype,
            attention_backend=attention_backend,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=not no_prefix_caching,
            host_kv_gb=host_kv_gb,
            disk_kv_gb=disk_kv_gb,
            kv_disk_dir=kv_disk_dir,
            kv_pin_quota_blocks=kv_pin_quota_blocks,
            kv_retention_quota_blocks=kv_retention_quota_blocks,
            enforce_eager=enforce_eager,
            overlap=overlap,
            speculation=speculation,
            num_speculative_tokens=num_speculative_tokens,
            num_prediction_tokens=2 * num_speculative_tokens,
            speculative_max_batch=speculative_max_batch,
            tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras,
            lora_dir=lora_dir,
            role=role,
            kv_transfer_host=kv_transfer_host,
            kv_transfer_port=kv_transfer_port,
            kv_transfer_advertise_host=kv_transfer_advertise_host,
            kv_lease_s=kv_lease_s,
            kv_transfer_failure=kv_transfer_failure,
            kv_transfer_timeout_s=kv_transfer_timeout_s,
        )
        if tensor_parallel_size > 1 or enable_expert_parallel:
            from engine.distributed import check_divisible
            from engine.models.config import ModelArgs

            check_divisible(ModelArgs.from_pretrained(model_path), tensor_parallel_size,
                            enable_expert_parallel)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    serve(config, host=host, port=port, pool=pool, model_name=model_name, internal_token=token,
          drain_timeout_s=drain_timeout_s)
