"""``ModelRunner``: the model, its paged KV cache and the per-step inputs (see docs/engine-internals.md).

One runner per engine replica, driven from the engine thread; its device work runs through an
``engine.device`` executor, in submission order. Invariants:

- The KV cache is one zero-initialised tensor per layer, ``[2, num_kv_blocks, block_size, num_kv_heads,
  head_dim]`` in the model dtype (layout documented in ``engine.attention.base``). Its size is fixed at
  start-up: ``config.num_kv_blocks`` if given, else ``kv_cache_memory_gb`` on the CPU, else
  ``gpu_memory_utilization`` of the free device memory after loading the weights, minus an estimate
  of the step's activations. On a Linux CPU it is advised onto transparent huge pages.
- On the CPU the runner raises glibc's mmap/trim thresholds for the process, so that each step's
  multi-MB activations reuse heap memory instead of page-faulting fresh mappings.
- A step is ``forward(batch)`` then ``sample(forward, sampler)``. ``forward`` builds the inputs on the
  host from the persistent batch (``engine.input_batch``) and submits, in device order: the batch's tier
  copies (``batch.transfers``), then the forward pass, which computes K/V for ``token_ids[start : start +
  num_tokens]`` of every scheduled sequence, at positions ``start ..``, into the slots its
  ``block_table`` maps, and leaves float32 logits ``[num_sampled, vocab]`` on the device: one row per
  ``ScheduledSeq`` whose chunk reaches the end of its tokens, in batch order, except embedding sequences
  (``seq.pooling``), whose chunks' final hidden states are pooled instead (``engine.pooling``; the
  finished vector comes back with the step). ``sample`` submits the draw; its ids stay on the device,
  where the next step's pending decode inputs read them, and start one copy to the host. Nothing on
  the host waits for the device until the engine reads a step's tokens (``Step.result``).
- A malformed batch (a chunk past the known tokens or ``max_model_len``, too few or out-of-range
  blocks) raises ``ValueError`` in ``forward``, before anything is submitted.
- CUDA graphs (CUDA + ``triton`` backend, unless ``enforce_eager``): ``engine.cuda_graphs``.
- Tensor parallelism (``config.tensor_parallel_size`` N > 1, ``engine.distributed``): the runner of rank 0
  (the engine's) starts ranks 1..N-1 (``engine.rank_workers``), each a ``ModelRunner`` over its shard
  driven by ``run_on_worker``; every step's inputs and tier copies go down to them in submission
  order, the input ids are broadcast from rank 0's device inside the forward pass, and every rank ends
  the pass with the whole logits (only rank 0 samples). The KV pool holds this rank's KV heads; every
  rank has the same number of blocks (the smallest any rank has memory for). Disaggregated serving moves
  whole blocks (``engine.kv.remote``): rank 0 asks the workers for their heads of leased blocks
  (``answer``) and sends them pulled payloads with the step (``kv_load``), each copying in its own heads.
- ``max_model_len`` is the model's limit (``config.max_model_len`` or ``max_position_embeddings``; a
  sliding-window layer masks its window in attention and caps nothing); the engine further caps it at
  the KV pool's capacity.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import torch

from engine.attention import AttentionMetadata, get_backend
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.device import DeviceExecutor, HostCopy, Work, create_executor, upload
from engine.distributed import ShardSizes, TensorParallel
from engine.input_batch import InputBatch, StepInputs
from engine.kv.remote import RemoteKVWorker, kv_identity
from engine.kv.tiers import TransferPlan
from engine.kv.transfer import KVTransfer, cache_fingerprint
from engine.loader import load_model, quantized_args, read_kv_scales
from engine.lora.adapter import LoRAAdapter
from engine.lora.layers import HeldShards, LoRASlots, install, shard_adapter
from engine.models.config import ModelArgs
from engine.rank_workers import RankWorkers, serve, start_rank
from engine.sampler import HostSampled, Sampled, Sampler, SamplingInputs
from engine.sequence import ScheduledBatch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _checkpoint_eos_ids(model_dir: Path) -> tuple[int, ...]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            ids += [value] if isinstance(value, int) else list(value or [])
    return tuple(dict.fromkeys(ids))


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _keep_large_allocations_on_the_heap() -> None:
    """glibc serves allocations above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh
    ``mmap``s and trims freed heap tops, so the multi-MB activations that every CPU step allocates again
    page-fault on every first touch (~45k minor faults per engine_throughput run). Raising both
    thresholds keeps those blocks on the heap for reuse; the heap then holds on to at most about one
    step's peak activations. Process-wide; skipped off glibc or with ``TOLLGATE_MALLOC_TUNING=0``."""
    if os.environ.get("TOLLGATE_MALLOC_TUNING") == "0":
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc
        return
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    mallopt(_M_TRIM_THRESHOLD, 256 << 20)


_MADV_HUGEPAGE = 14
_HUGE_PAGE = 2 << 20


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros``; on a Linux CPU the buffer is advised onto transparent huge pages first. Decode
    attention reads blocks scattered over the whole cache (hundreds of MB per layer): with 4 KiB pages
    nearly every block misses the TLB (paged decode of 64 sequences: 2.6 -> 2.25 ms per layer). Advisory:
    where THP is off the kernel ignores it. ``TOLLGATE_KV_HUGEPAGES=0`` skips it.

    On a CPU the zeros come from ``calloc`` (numpy's ``zeros``), which maps fresh pages the kernel zeroes
    as they are first written: a block costs memory and time only once it is used. Writing 1 GiB of
    zeros up front took 1.9-2.9 s of every engine start here. The tensor starts on a huge-page boundary
    (the over-allocated lead is never touched)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = torch.from_numpy(np.zeros(nbytes + _HUGE_PAGE, dtype=np.uint8))
    offset = -raw.data_ptr() % _HUGE_PAGE
    tensor = raw[offset:offset + nbytes].view(dtype).view(shape)
    if sys.platform.startswith("linux") and os.environ.get("TOLLGATE_KV_HUGEPAGES") != "0":
        try:
            madvise = ctypes.CDLL(None).madvise
        except (OSError, AttributeError):
            madvise = None
        if madvise is not None:
            madvise(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(nbytes // _HUGE_PAGE * _HUGE_PAGE),
                    _MADV_HUGEPAGE)
    return tensor


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, init_method: str | None = None) -> None:
        """``rank``/``init_method``: a worker rank of a tensor-parallel replica (``engine.rank_workers``);
        rank 0 starts the other ranks itself."""
        self.config = config
        self.block_size = config.block_size
        size = config.tensor_parallel_size
        self.device = self._rank_device(config.device, rank, size)
        self.dtype = _DTYPES[config.dtype]
        # The KV cache's element type: the model's, or e4m3 with per-layer scales (--kv-cache-dtype fp8).
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        if self.device.type == "cpu":
            _keep_large_allocations_on_the_heap()
        model_dir = Path(config.model)
        self.args = args = quantized_args(ModelArgs.from_pretrained(model_dir), config.quantization)
        expert_parallel = config.enable_expert_parallel
        # ValueError before any rank starts
        self.shard = shard = ShardSizes.of(args, rank, size, expert_parallel)
        self.max_model_len = self._resolve_max_model_len(args, config.max_model_len)
        self.vocab_size: int = args.vocab_size
        self.tp = TensorParallel(rank, size, expert_parallel)
        self.workers: RankWorkers | None = None
        if size > 1:
            if self.device.type == "cpu":  # the ranks share the host's cores
                torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
            if rank == 0:
                self.workers = RankWorkers(config, _run_rank)
                init_method = self.workers.init_method
            assert init_method is not None
            self.tp.start(init_method, "nccl" if self.device.type == "cuda" else "gloo")

        backend_cls = get_backend(config.attention_backend or "torch")
        self.attention_backend = backend_cls(
            shard.num_heads, shard.num_kv_heads, args.head_dim, scale=args.head_dim**-0.5
        )
        # The fused elementwise kernels only pay off (and are only needed) on the GPU; under the CPU
        # interpreter they would just slow the triton backend's tests down.
        fused = self.device.type == "cuda" and self.attention_backend.name == "triton"
        self.model = load_model(model_dir, self.attention_backend, self.dtype, self.device,
                                max_positions=self.max_model_len, args=args, fused_kernels=fused,
                                load_format=config.load_format, seed=config.seed, tp=self.tp)

        if (model_dir / "tokenizer.json").is_file():
            from engine.tokenizer import Tokenizer

            self.eos_token_ids: tuple[int, ...] = Tokenizer.from_pretrained(model_dir).eos_token_ids
        else:
            self.eos_token_ids = _checkpoint_eos_ids(model_dir)

        self.kv_scales: list[tuple[float, float]] = [(1.0, 1.0)] * args.num_layers
        if self.kv_dtype == torch.float8_e4m3fn:
            if config.load_format == "safetensors":
                self.kv_scales = read_kv_scales(model_dir, args.num_layers)
            for layer, scale in zip(self.model.model.layers, self.kv_scales, strict=True):
                layer.self_attn.kv_scale = scale  # type: ignore[union-attr]  # nn.Module.__getattr__: Tensor | Module
        self.num_kv_blocks: int = config.num_kv_blocks or self.tp.min_int(self._num_blocks_from_memory(),
                                                                          self.device)
        self.kv_caches: list[torch.Tensor] = [
            _zeros_on_huge_pages((2, self.num_kv_blocks, self.block_size, shard.num_kv_heads, args.head_dim),
                                 self.kv_dtype, self.device)
            for _ in range(args.num_layers)
        ]
        self.kv_transfer: KVTransfer | None = None
        if config.host_tier and config.enable_prefix_caching:
            disk_dir = Path(config.kv_disk_dir) if config.disk_tier and config.kv_disk_dir else None
            block_shape = tuple(self.kv_caches[0].shape[2:])
            slots = config.num_host_kv_blocks
            if slots is None:
                slots = int(config.host_kv_gb * 2**30) // (self.block_size * self.kv_bytes_per_token)
            # The KV dtype and its scales are part of what a stored block means: a replica restarted with
            # another --kv-cache-dtype (or other scales) reads none of these blocks.
            layout = f"{self.kv_dtype}|{self.kv_scales}" if self.kv_dtype != self.dtype else self.dtype
            fingerprint = cache_fingerprint(model_dir, layout, block_shape, rank, size)
            peers = [cache_fingerprint(model_dir, layout, block_shape, r, size) for r in range(1, size)]
            self.kv_transfer = KVTransfer(self.kv_caches, max(1, slots), disk_dir, fingerprint,
                                          peers if rank == 0 else None)
        # Disaggregated serving: leased blocks out, pulled blocks in (``engine.kv.remote``).
        self.kv_remote: RemoteKVWorker | None = None
        self._kv_peers: list[tuple[int, range]] = []  # rank 0: where the KV heads it lacks are read
        if config.role != "both":  # blocks move whole (every KV head): the layout of a single rank's
            kv_layout = f"{self.kv_dtype}|{self.kv_scales}" if self.kv_dtype != self.dtype else self.dtype
            fingerprint = cache_fingerprint(model_dir, kv_layout, (self.block_size, args.num_kv_heads,
                                                                   args.head_dim))
            identity = kv_identity(model_dir, fingerprint, self.kv_caches, args.num_kv_heads)
            heads = range(shard.first_kv_head, shard.first_kv_head + shard.num_kv_heads)
            if self.workers is not None:
                self._kv_peers = self._kv_peer_ranks()
            self.kv_remote = RemoteKVWorker(self.kv_caches, identity, heads,
                                            self._peer_kv_shards if self.workers is not None else None)
        self.lora: LoRASlots | None = None
        if config.max_loras:
            self.lora = install(self.model, args, config.max_loras, config.max_lora_rank, shard, self.tp,
                                use_kernels=self.device.type == "cuda")
        # Tensor parallel: the adapter shards the worker ranks hold (rank 0: which ones, to send each once).
        self._held_shards = HeldShards(max(config.max_cpu_loras, config.max_loras))
        self._graphs: DecodeGraphs | None = None
        use_graphs = self.device.type == "cuda" and self.attention_backend.name == "triton"
        if use_graphs and not config.enforce_eager:
            self._graphs = DecodeGraphs.capture(self)
        self.input_batch = InputBatch(config.max_num_seqs, self.max_model_len, self.block_size,
                                      self.num_kv_blocks)
        self.executor = self._executor(config)
        # The previous step's sampling (its ids feed pending decode inputs) and its rows by seq_id.
        self._previous_sample: Work[Sampled] | None = None
        self._previous_rows: dict[int, int] = {}
        self._transfers: list[Work[None]] = []  # tier copies submitted, not checked yet
        logger.info("model %s (%s, %s on %s): %d KV blocks of %d tokens in %s (%.2f GiB), max_model_len %d",
                    model_dir.name, args.architecture, config.dtype, self.device, self.num_kv_blocks,
                    self.block_size, str(self.kv_dtype).removeprefix("torch."),
                    self.num_kv_blocks * self.block_size * self.kv_bytes_per_token / 2**30,
                    self.max_model_len)

    def _kv_peer_ranks(self) -> list[tuple[int, range]]:
        """The worker ranks rank 0 reads a leased block's other KV heads from, and their heads: the first
        rank to hold each head rank 0 lacks (a head replicated over ranks is read once)."""
        held = set(range(self.shard.first_kv_head, self.shard.first_kv_head + self.shard.num_kv_heads))
        peers = []
        for rank in range(1, self.tp.size):
            shard = ShardSizes.of(self.args, rank, self.tp.size, self.tp.expert_parallel)
            heads = range(shard.first_kv_head, shard.first_kv_head + shard.num_kv_heads)
            if not held.issuperset(heads):
                peers.append((rank, heads))
                held.update(heads)
        return peers

    def _peer_kv_shards(self, blocks: list[int]) -> list[tuple[range, bytes]]:
        """The other ranks' heads of leased ``blocks`` (a transfer thread; each worker reads them after the
        steps sent to it before)."""
        assert self.workers is not None
        answers = self.workers.ask([rank for rank, _ in self._kv_peers], ("kv_read", blocks))
        return [(heads, data) for (_, heads), data in zip(self._kv_peers, answers, strict=True)]

    def _executor(self, config: EngineConfig) -> DeviceExecutor:
        """Where device work runs (``engine.device``): a simulated device if asked; on a GPU the calling
        thread (CUDA runs ahead by itself); on the CPU a device thread when the step loop overlaps."""
        if config.simulated_step_ms is not None:
            return create_executor("simulated", config.simulated_step_ms / 1e3)
        if self.device.type == "cuda" or not config.overlap:
            return create_executor("inline")
        return create_executor("thread")

    @staticmethod
    def _rank_device(device: str, rank: int, size: int) -> torch.device:
        """Rank ``rank``'s device: ``cuda`` or ``cuda:K`` gives ranks consecutive GPUs from K; the CPU is
        shared."""
        base = torch.device(device)
        if base.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {device!r} requested but CUDA is not available")
            first = base.index or 0
            if first + size > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {size} from {device!r} needs GPUs {first}.."
                                 f"{first + size - 1}, this host has {torch.cuda.device_count()}")
            if size > 1 or base.index is not None:
                torch.cuda.set_device(first + rank)
                return torch.device("cuda", first + rank)
        return base

    @staticmethod
    def _resolve_max_model_len(args: ModelArgs, requested: int | None) -> int:
        limit = args.max_position_embeddings
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len {requested} exceeds the model's max_position_embeddings {limit}")
        return requested or limit

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x layers x this rank's kv_heads x head_dim x bytes per element."""
        a = self.args
        return 2 * a.num_layers * self.shard.num_kv_heads * a.head_dim * self.kv_dtype.itemsize

    def _activation_bytes(self) -> int:
        """Upper estimate of one step's activation memory: the largest live tensors of a forward over
        ``max_num_batched_tokens`` tokens; per sampled row and vocabulary entry, float32 logits twice
        (the sampler's working copy), the penalty state kept per slot (float32 counts, bool seen: 5
        bytes) and the seeded rows' int64 noise temporaries (three alive at once: 24 bytes)."""
        a, c = self.args, self.config
        per_token = a.hidden_size * 4 + a.q_size + 2 * a.kv_size + 3 * a.intermediate_size
        return (c.max_num_batched_tokens * per_token * self.dtype.itemsize
                + c.max_num_seqs * a.vocab_size * (2 * 4 + 5 + 24))

    def _num_blocks_from_memory(self) -> int:
        bytes_per_block = self.block_size * self.kv_bytes_per_token
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.config.gpu_memory_utilization) - self._activation_bytes()
            source = f"{self.config.gpu_memory_utilization:.0%} of {free / 2**30:.1f} GiB free device memory"
        else:
            budget = int(self.config.kv_cache_memory_gb * 2**30)
            source = f"kv_cache_memory_gb={self.config.kv_cache_memory_gb}"
        num_blocks = budget // bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache ({source}, {bytes_per_block} bytes per block)")
        return num_blocks

    # ---- the step, in device order -----------------------------------------------------------------
    def forward(self, batch: ScheduledBatch) -> Forward:
        """Build the batch's inputs (host, now: raises ``ValueError`` for a malformed batch before
        anything reaches the device) and submit its tier copies and forward pass. Decode inputs still
        pending on the host are read from the previous step's sampled ids on the device."""
        self._check_transfers()
        self.transfer(batch.transfers)  # before the forward pass overwrites an evicted block
        self.load_pulled(batch.kv_loads)
        inputs = self.input_batch.build(batch, self._previous_rows)
        lora = self._lora_step(inputs)
        if self.workers is not None:
            worker_inputs = _worker_inputs(inputs)
            if lora is None or not lora.loads:
                self.workers.send(("forward", (worker_inputs, lora)))
            else:  # each rank loads its own shard of an adapter, sent unless it holds it already
                send = [not self._held_shards.held(digest) for _, digest, _ in lora.loads]
                self.workers.send_each([("forward", (worker_inputs, self._lora_for_rank(lora, rank, send)))
                                        for rank in range(1, self.tp.size)])
        if lora is not None and lora.loads:
            lora = self._lora_for_rank(lora, self.tp.rank, [True] * len(lora.loads))
        previous = self._previous_sample if inputs.pending_rows.size else None
        work = self.executor.submit(self._forward, inputs, previous, lora, step=True)
        self._previous_rows = {seq.seq_id: row for row, seq in enumerate(inputs.sampled)}
        self._previous_sample = None
        return Forward(inputs, work)

    def _lora_step(self, inputs: StepInputs) -> LoRAStep | None:
        """The step's adapters in slots (host bookkeeping, rank 0) and each token row's slot."""
        if self.lora is None or not inputs.lora_rows:
            return None
        slot_of, loads = self.lora.plan(adapter for adapter, _, _ in inputs.lora_rows)
        slots = np.zeros(inputs.num_tokens, dtype=np.int64)
        for adapter, first, n in inputs.lora_rows:
            slots[first:first + n] = slot_of[adapter.digest]
        return LoRAStep(slots, [(slot, adapter.digest, adapter) for slot, adapter in loads])

    def _lora_for_rank(self, step: LoRAStep, rank: int, send: list[bool]) -> LoRAStep:
        """``step`` with the adapters it loads cut to rank ``rank``'s shard (``shard_adapter``), or None
        where ``send`` says the rank holds that shard already."""
        shard = self.shard if rank == self.tp.rank else ShardSizes.of(self.args, rank, self.tp.size,
                                                                      self.tp.expert_parallel)
        loads = [(slot, digest, shard_adapter(a, self.args, shard) if a is not None and sent else None)
                 for (slot, digest, a), sent in zip(step.loads, send, strict=True)]
        return LoRAStep(step.slots, loads)

    def sample(self, forward: Forward, sampler: Sampler) -> Step:
        """Submit the sampling of a submitted forward pass (its ``inputs.sampling`` complete: grammar
        masks filled); the ids stay on the device for the next step, and start their copy to the host."""
        work = None
        if forward.inputs.sampling is not None:
            work = self.executor.submit(self._sample, forward.work, forward.inputs.sampling, sampler)
            self._previous_sample = work
        return Step(forward.inputs, forward.work, work)

    def transfer(self, plan: TransferPlan | None) -> None:
        """Submit the copies between KV tiers a plan asks for (None: none), after everything submitted so
        far, and land those that are done (their disk writes, pins and reads are queued then: an idle
        engine waiting for a disk read calls this with None until it lands)."""
        if self.kv_transfer is not None:
            if self.workers is not None:
                self.workers.send_plan(plan)
            self._transfers.append(self.executor.submit(self._transfer, self.kv_transfer, plan))

    def load_pulled(self, loads: list[tuple[int, bytes]]) -> None:
        """Submit the copies of blocks pulled from a prefill replica into their device blocks (before the
        forward pass that reads them)."""
        if loads:
            assert self.kv_remote is not None
            if self.workers is not None:  # every rank copies in its own heads of the whole blocks
                self.workers.send(("kv_load", loads))
            self._transfers.append(self.executor.submit(self.kv_remote.load, loads))

    def _check_transfers(self) -> None:
        """Raise the error of a tier copy that failed (the step after it fails, not silently)."""
        while self._transfers and self._transfers[0].done():
            self._transfers.pop(0).result()

    @staticmethod
    def _transfer(transfer: KVTransfer, plan: TransferPlan | None) -> None:
        if plan is not None:
            transfer.execute(plan)
        transfer.poll()

    def bind_thread(self) -> None:
        """Make this runner's GPU the calling thread's current device. CUDA's current device is per
        thread, and Triton launches, events and streams go to the current one: a thread that steps an
        engine built on another thread (the async engine's loop) calls this first. No-op on the CPU."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def flush_transfers(self) -> None:
        """Land every copy and finish every queued disk job (tests, shutdown)."""
        if self.kv_transfer is not None:
            self.executor.submit(self.kv_transfer.flush).result()

    def close(self) -> None:
        """Finish the device's work and the disk tier's queued writes (a restart finds every block
        demoted so far); stop the other ranks."""
        if self.kv_transfer is not None:
            self.executor.submit(self.kv_transfer.flush).result()
            self.executor.submit(self.kv_transfer.close).result()
        self.executor.close()
        if self.workers is not None:
            self.workers.close()
        self.tp.close()

    def run_on_worker(self, kind: str, payload: object) -> None:
        """A worker rank runs what rank 0 sent (``engine.rank_workers``), in order."""
        if kind == "forward":
            assert isinstance(payload, tuple)
            inputs, lora = payload
            assert isinstance(inputs, StepInputs)
            if lora is not None:  # the shards sent now kept, those not sent taken from what is kept
                lora.loads = [(slot, digest, self._held_shards.resolve(digest, shard))
                              for slot, digest, shard in lora.loads]
            self.executor.submit(self._forward, inputs, None, lora).result()
        elif kind == "transfer":  # its reads are rank 0's to do (``engine.kv.transfer``)
            self.transfer(payload)  # type: ignore[arg-type]
            self._check_transfers()
        elif kind == "kv_load":  # blocks pulled from a prefill replica
            assert self.kv_remote is not None
            self.executor.submit(self.kv_remote.load, payload).result()
        else:
            raise ValueError(f"unknown message from rank 0: {kind!r}")

    def answer(self, kind: str, payload: object) -> object:
        """A worker rank answers rank 0 (``RankWorkers.ask``): its heads of leased blocks."""
        if kind != "kv_read" or self.kv_remote is None:
            raise ValueError(f"rank {self.tp.rank} does not answer {kind!r}")
        return self.executor.submit(self.kv_remote.read_shard, payload).result()

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward ``batch`` and wait: its float32 logits ``[num_sampled, vocab]`` (tests, benchmarks)."""
        return self.forward(batch).work.result().logits

    # ---- device side --------------------------------------------------------------------------------
    def _forward(self, inputs: StepInputs, previous: Work[Sampled] | None,
                 lora_step: LoRAStep | None = None) -> Forwarded:
        input_ids, positions, meta, logits_indices = self._device_inputs(inputs)
        if previous is not None:  # decode inputs sampled by the previous step, never seen by the host
            rows = upload(inputs.pending_rows, self.device)
            sources = upload(inputs.pending_sources, self.device)
            input_ids[rows] = previous.result().token_ids[sources]
        if self.tp.enabled:  # rank 0's ids (pending ones resolved on its device) to every rank
            self.tp.broadcast(input_ids)
        lora = self.lora if lora_step is not None else None
        if lora is not None and lora_step is not None:  # new adapters copied in; each token row bound
            for slot, _, adapter in lora_step.loads:
                assert adapter is not None
                lora.load(slot, adapter)
            lora.bind(lora_step.slots, self.device)
        try:
            if self._graphs is not None and lora is None and self._graphs.covers(meta):
                hidden = self._graphs.replay(input_ids, positions, meta)  # [T, hidden]
            else:
                hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        finally:
            if lora is not None:
                lora.unbind()
        embeddings = self._pool(inputs, hidden) if inputs.pooled else {}
        finished = HostCopy(list(embeddings.values())) if embeddings else None
        if logits_indices.numel() == 0:
            logits = torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        else:
            logits = self.model.compute_logits(hidden[logits_indices]).float()  # [N (+ prompt rows), vocab]
        prompt = None
        if inputs.prompt_rows:  # rank 0 only: the rows after the sampled ones score the prompt
            sampled = len(inputs.sampled)
            prompt = self._score_prompt(inputs, logits[sampled:])
            logits = logits[:sampled]
        if self.kv_transfer is not None:
            self.kv_transfer.poll()  # land the copies the forward pass hid
        return Forwarded(logits, list(embeddings), finished, prompt)

    def _score_prompt(self, inputs: StepInputs, logits: torch.Tensor) -> HostCopy:
        """Each prompt row's logprob of the next prompt token and, to the largest ``prompt_logprobs`` of the
        step, the most likely tokens there, from the raw distribution, on their way to the host."""
        assert inputs.prompt_targets is not None
        logprobs = torch.log_softmax(logits, dim=-1)
        targets = upload(inputs.prompt_targets, self.device)
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
        k = max(chunk.seq.params.prompt_logprobs or 0 for chunk, _, _ in inputs.prompt_rows)
        if k == 0:
            return HostCopy([chosen, ranks, None, None])
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        return HostCopy([chosen, ranks, values, ids])

    @staticmethod
    def _sample(forward: Work, sampling: SamplingInputs, sampler: Sampler) -> Sampled:
        sampled = sampler.draw(forward.result().logits, sampling)
        sampled.to_host()
        return sampled

    def _device_inputs(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``(input_ids [T], positions [T], metadata, logits_indices [N])`` on the device: views of the
        host arrays on the CPU; on a GPU one pinned buffer and one asynchronous copy."""
        arrays = (inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.logits_indices,
                  inputs.query_start_loc, inputs.seq_lens, inputs.block_tables.reshape(-1))
        if self.device.type == "cpu":
            ids, pos, slots, logits_indices = (torch.from_numpy(a) for a in arrays[:4])
            query_start_loc, seq_lens = torch.from_numpy(arrays[4]), torch.from_numpy(arrays[5])
            block_tables = torch.from_numpy(inputs.block_tables)
        else:
            packed = upload(np.concatenate([a.astype(np.int64, copy=False) for a in arrays]), self.device)
            parts = list(torch.split(packed, [a.shape[0] for a in arrays]))
            ids, pos, slots, logits_indices = parts[:4]
            query_start_loc, seq_lens = parts[4].to(torch.int32), parts[5].to(torch.int32)
            block_tables = parts[6].to(torch.int32).view(inputs.block_tables.shape)
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            max_query_len=max(inputs.query_lens),
            max_seq_len=max(inputs.context_lens),
            query_lens_cpu=inputs.query_lens,
            seq_lens_cpu=inputs.context_lens,
            block_size=self.block_size,
        )
        meta.plan = self.attention_backend.plan(meta, self.dtype)
        return ids, pos, meta, logits_indices

    @staticmethod
    def _pool(inputs: StepInputs, hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """Fold each embedding sequence's chunk of final hidden states into its pooled state (a chunk
        from position 0 starts it afresh: a preempted sequence's recompute); returns the finished
        embeddings by ``seq_id``."""
        finished: dict[int, torch.Tensor] = {}
        for chunk, first, n in inputs.pooled:
            seq, pooling = chunk.seq, chunk.seq.pooling
            assert pooling is not None
            rows = hidden[first:first + n]
            if chunk.start == 0:
                seq.pooled = None
            if pooling.mode == "mean":
                total = rows.float().sum(0)
                seq.pooled = total if seq.pooled is None else seq.pooled + total
            elif pooling.mode == "first" and chunk.start == 0:
                seq.pooled = rows[0].float().clone()  # hidden may be a CUDA graph's buffer, reused
            elif pooling.mode == "last" and chunk.samples:
                seq.pooled = rows[-1].float().clone()
            if chunk.samples:
                vector = seq.pooled / seq.num_prompt_tokens if pooling.mode == "mean" else seq.pooled
                if pooling.normalize:
                    vector = torch.nn.functional.normalize(vector, dim=0)
                finished[seq.seq_id] = vector
                seq.pooled = None
        return finished


def _run_rank(config: EngineConfig, rank: int, init_method: str, conn: Connection) -> None:
    """A worker process of a tensor-parallel replica (``engine.rank_workers``): its runner, serving rank 0."""
    start_rank(rank)
    serve(ModelRunner(config, rank=rank, init_method=init_method), conn)


def _worker_inputs(inputs: StepInputs) -> StepInputs:
    """What the other ranks need of a step: its arrays, without the sequences (they neither sample nor
    pool)."""
    return StepInputs(inputs.input_ids, inputs.positions, inputs.slot_mapping, inputs.query_start_loc,
                      inputs.seq_lens, inputs.block_tables, inputs.logits_indices, inputs.pending_rows,
                      inputs.pending_sources, inputs.query_lens, inputs.context_lens, [], None)


@dataclass(slots=True)
class LoRAStep:
    """A step's LoRA work, decided on rank 0's host: the adapters to copy into slots first, as ``(slot,
    digest, this rank's shard)`` (the shard None in a message to a worker rank that holds it already:
    ``HeldShards``), and each token row's slot (``[T]``, 0: the base model)."""

    slots: np.ndarray
    loads: list[tuple[int, str, LoRAAdapter | None]]


# Per prompt row: the logprob of the next prompt token, its rank, and the top values and ids (or None).
PromptScores = tuple[list[float], list[int], list[list[float]] | None, list[list[int]] | None]


@dataclass(slots=True)
class Forwarded:
    """What a forward pass left on the device: logits of the sampled rows; the ``seq_id``s of the finished
    embeddings and their vectors on their way to the host."""

    logits: torch.Tensor
    embedded: list[int]
    embeddings: HostCopy | None
    # The prompt rows' (chosen logprobs [R], their ranks [R], top values [R, k] and ids [R, k]: None without
    # alternatives).
    prompt: HostCopy | None = None


@dataclass(slots=True)
class Forward:
    """A submitted forward pass: its host inputs and its device work."""

    inputs: StepInputs
    work: Work[Forwarded]


@dataclass(slots=True)
class Step:
    """A submitted step (forward pass and sampling); ``result()`` waits for its tokens on the host."""

    inputs: StepInputs
    forward: Work[Forwarded]
    sampling: Work[Sampled] | None

    def prompt_scores(self) -> PromptScores | None:
        """The prompt rows' logprobs, ranks and top alternatives on the host (``StepInputs.prompt_rows``)."""
        prompt = self.forward.result().prompt
        if prompt is None:
            return None
        chosen, ranks, values, ids = prompt.get()
        assert chosen is not None and ranks is not None
        return (chosen.tolist(), ranks.tolist(), None if values is None else values.tolist(),
                None if ids is None else ids.tolist())

    def result(self) -> tuple[HostSampled | None, dict[int, list[float]]]:
        """(the sampled ids and logprobs, the finished embeddings by ``seq_id``), on the host."""
        forwarded = self.forward.result()
        embeddings = {}
        if forwarded.embeddings is not None:
            vectors = forwarded.embeddings.get()
            embeddings = {seq_id: v.tolist() for seq_id, v in zip(forwarded.embedded, vectors, strict=True)
                          if v is not None}
        host = self.sampling.result().host() if self.sampling is not None else None
        return host, embeddings
