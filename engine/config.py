"""Engine configuration: one slotted dataclass whose ``__post_init__`` checks the invariants.

Everything the scheduler, block manager and runner agree on lives here, so that a replica is
described by one value. Invalid values raise ``ValueError`` (never ``assert``): the CLI and the
offline API turn them into clear messages.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(slots=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    # "auto": bfloat16 on CUDA, float32 on the CPU (whose kernels are float32).
    dtype: str = "auto"
    block_size: int = 16
    # None: sized from memory (CPU: kv_cache_memory_gb; CUDA: gpu_memory_utilization of free memory).
    num_kv_blocks: int | None = None
    max_num_seqs: int = 64
    # Per-step token budget shared by decode tokens and prefill chunks.
    max_num_batched_tokens: int = 2048
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # None: "triton" on CUDA, "torch" elsewhere.
    attention_backend: str | None = None
    kv_cache_memory_gb: float = 1.0
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    # "safetensors": the checkpoint's weights; "random": drawn on the device from config.json alone
    # (benchmarks of model shapes without a checkpoint, never serving).
    load_format: str = "safetensors"
    # "fp8": quantize a 16-bit checkpoint's linear layers to FP8 at load (per output channel, dynamic
    # per-token activations; engine.models.fp8). None: as the checkpoint is (an FP8 checkpoint stays FP8).
    quantization: str | None = None
    # "fp8": the KV cache in e4m3 with a scale per layer for K and V (the checkpoint's k_scale / v_scale,
    # else 1.0): about twice the blocks in the same memory. "auto": the model's dtype.
    kv_cache_dtype: str = "auto"
    seed: int = 0
    # LoRA adapters (``engine.lora``): device slots (0: none, the projections stay unwrapped), the highest
    # rank a slot takes, and the adapters kept read in host memory.
    max_loras: int = 0
    max_lora_rank: int = 64
    max_cpu_loras: int = 32
    # Where the replica finds adapters a request names by id (``<lora_dir>/<id>/``, PEFT bundles).
    lora_dir: str | None = None
    # Lower tiers of the prefix cache (``engine.kv.tiers``): host memory for evicted blocks (0: none)
    # and, below it, block files in ``kv_disk_dir`` (0: none; they survive a restart).
    host_kv_gb: float = 0.0
    disk_kv_gb: float = 0.0
    kv_disk_dir: str | None = None
    # Exact tier sizes in blocks, overriding the GiB settings (tests, benchmarks).
    num_host_kv_blocks: int | None = None
    num_disk_kv_blocks: int | None = None
    # Cache lifetimes (``engine.kv.pins``): the blocks one tenant may pin in the host tier for a ttl, and
    # retain on disk (None: a quarter of the tier).
    kv_pin_quota_blocks: int | None = None
    kv_retention_quota_blocks: int | None = None
    # The overlapped step loop (``engine.llm_engine``): the host schedules and prepares step N+1 while
    # the device runs step N, and learns a step's tokens one step later. False: every step's tokens are
    # known before the next step is scheduled (the synchronous loop; same outputs). None: on for CUDA;
    # off on the CPU, where the "device" would be a Python thread contending for the GIL with the engine
    # thread (at 256 sequences of the tiny model the overlapped loop ran at 0.88-0.90x the synchronous
    # one on a 2-core box: benchmarks/host_overhead.py).
    overlap: bool | None = None
    # Speculative decoding (``engine.speculative``): ``auto`` (requests' predictions, and prompt lookup
    # for every request), ``prediction`` (predictions only) or ``off``; how many draft tokens a sequence
    # carries into a step (prompt lookup / a prediction); no speculation above this many sequences.
    speculation: str = "auto"
    num_speculative_tokens: int = 4
    num_prediction_tokens: int = 8
    speculative_max_batch: int = 16
    # Tests and benchmarks: run the device work on a simulated device whose steps take at least this
    # many milliseconds (``engine.device.SimulatedDevice``). None: the real device.
    simulated_step_ms: float | None = None
    # Tensor parallelism (``engine.distributed``): the model's heads, MLP and vocabulary split over this
    # many ranks (GPUs ``cuda:K .. K+N-1``, or N processes sharing the CPU), one replica.
    tensor_parallel_size: int = 1
    # Mixtures of experts over the ranks: each rank holds E / N whole experts (expert parallelism),
    # instead of a slice of every expert's intermediate dimension (the default).
    enable_expert_parallel: bool = False
    # Disaggregated serving (``engine.kv.connector``): ``both`` (prefill and decode here, no transfers),
    # ``prefill`` (answers a request's first token and leases its prompt's blocks for ``kv_lease_s``,
    # served on ``kv_transfer_host:kv_transfer_port``, 0: a free port; advertised as
    # ``kv_transfer_advertise_host`` when the bound address is not reachable as such) or ``decode``
    # (pulls a request's prompt blocks from the prefill replica it names). A failed pull: ``recompute``
    # the prompt here, or ``fail`` the request.
    role: str = "both"
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0
    kv_transfer_advertise_host: str | None = None
    kv_lease_s: float = 30.0
    kv_transfer_failure: str = "recompute"
    kv_transfer_timeout_s: float = 10.0
    kv_transfer_chunk_blocks: int = 16
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}")
        if self.overlap is None:
            self.overlap = self.device.startswith("cuda")
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8, got {self.kv_cache_dtype!r}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be fp8 (or unset), got {self.quantization!r}")
        if self.load_format not in ("safetensors", "random"):
            raise ValueError(f"load_format must be 'safetensors' or 'random', got {self.load_format!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.host_kv_gb < 0 or self.disk_kv_gb < 0:
            raise ValueError("host_kv_gb and disk_kv_gb must be >= 0")
        if (self.num_host_kv_blocks or 0) < 0 or (self.num_disk_kv_blocks or 0) < 0:
            raise ValueError("num_host_kv_blocks and num_disk_kv_blocks must be >= 0")
        if (self.kv_pin_quota_blocks or 0) < 0 or (self.kv_retention_quota_blocks or 0) < 0:
            raise ValueError("kv_pin_quota_blocks and kv_retention_quota_blocks must be >= 0")
        if self.speculation not in ("auto", "prediction", "off"):
            raise ValueError(f"speculation must be auto, prediction or off, got {self.speculation!r}")
        if min(self.num_speculative_tokens, self.num_prediction_tokens, self.speculative_max_batch) < 0:
            raise ValueError("num_speculative_tokens, num_prediction_tokens and speculative_max_batch "
                             "must be >= 0")
        if self.simulated_step_ms is not None and not self.simulated_step_ms >= 0:
            raise ValueError(f"simulated_step_ms must be >= 0, got {self.simulated_step_ms}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.simulated_step_ms is not None:
            raise ValueError("a simulated device (simulated_step_ms) has no tensor parallelism")
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.kv_transfer_failure not in ("recompute", "fail"):
            raise ValueError(f"kv_transfer_failure must be recompute or fail: {self.kv_transfer_failure!r}")
        if self.role == "decode" and not self.enable_prefix_caching:
            raise ValueError("a decode replica puts the blocks it pulls in its prefix cache: it needs one")
        if not self.kv_lease_s > 0 or not self.kv_transfer_timeout_s > 0 or self.kv_transfer_chunk_blocks < 1:
            raise ValueError("kv_lease_s and kv_transfer_timeout_s must be > 0, kv_transfer_chunk_blocks "
                             ">= 1")
        if not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError(f"kv_transfer_port must be a TCP port, got {self.kv_transfer_port}")
        if self.disk_tier and (not self.host_tier or not self.kv_disk_dir):
            raise ValueError("a disk KV tier (disk_kv_gb) needs a host tier (host_kv_gb) and kv_disk_dir")

    @property
    def host_tier(self) -> bool:
        return bool(self.num_host_kv_blocks if self.num_host_kv_blocks is not None else self.host_kv_gb > 0)

    @property
    def disk_tier(self) -> bool:
        return bool(self.num_disk_kv_blocks if self.num_disk_kv_blocks is not None else self.disk_kv_gb > 0)
