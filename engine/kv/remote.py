"""The device side of disaggregated serving: leased blocks out of the KV pool, pulled blocks into it.

``RemoteKVWorker`` is the connector's worker side (``engine.kv.connector``):

- ``save_kv_layer(layer, blocks)`` / ``read_blocks(blocks)`` (prefill; transfer threads): the K/V of
  leased blocks as the wire carries them, one block after the other, each
  ``[layers, 2, block_size, kv_heads, head_dim]`` raw (the disk tier's block format) with *every* KV head
  of the model, in the checkpoint's order. Leased blocks are never written while the lease lives, so
  reading them beside the engine's steps is safe.
- ``start_load_kv(loads)`` / ``wait_for_layer_load(layer)`` (decode; device order, before the forward
  pass of the step that admitted them): pulled payloads into their device blocks. On a GPU the copies run
  on a side stream with an event per layer, and ``wait_for_layer_load`` makes the compute stream wait
  for that layer only (a layer-by-layer forward pass can start on layer 0 while later layers land); on
  the CPU the copies are done when ``start_load_kv`` returns.

Tensor parallelism: each rank's pool holds its own KV heads (``heads``). A block on the wire is whole
whatever either replica's ``tensor_parallel_size``: rank 0 of a prefill replica reads its heads and gets
the others from the ranks that hold them (``peers``: the rank workers' pipes, ``RankWorkers.ask``), and
every rank of a decode replica is sent the pulled payloads and copies in its own heads. So a block's
meaning, and the layout check, do not depend on how either side splits the model: a replica of 2 ranks
and one of 1 exchange blocks as two of 2 ranks do.

``kv_identity`` names what a block's bytes mean (weights, layout, KV dtype, whole block shape): a pull is
refused unless both replicas' identities are equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from engine.kv.connector import KVIdentity

_SAMPLE = 1 << 20  # bytes hashed at each end of a weight file


def model_digest(model_dir: Path) -> str:
    """16 hex digits naming a checkpoint's weights: its config and, per weight file, its name, size and
    first and last MiB (reading whole files of a large model would take minutes at start)."""
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    for path in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        size = path.stat().st_size
        digest.update(f"|{path.name}|{size}|".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            digest.update(f.read(_SAMPLE))
    return digest.hexdigest()[:16]


def kv_identity(model_dir: Path, fingerprint: str, kv_caches: list[torch.Tensor],
                num_kv_heads: int) -> KVIdentity:
    """The identity of blocks of the pool ``kv_caches`` (this rank's heads) of a model of ``num_kv_heads``
    KV heads: the block shape is the whole block's, as the wire carries it."""
    layout = kv_caches[0].shape  # [2, blocks, block_size, kv_heads on this rank, head_dim]
    block_shape = (len(kv_caches), 2, layout[2], num_kv_heads, layout[4])
    return KVIdentity(model_digest(model_dir), fingerprint, str(kv_caches[0].dtype).removeprefix("torch."),
                      tuple(int(d) for d in block_shape))


# The other ranks' shards of blocks: (their global KV heads, their payload of the blocks) per rank asked.
PeerShards = Callable[[list[int]], list[tuple[range, bytes]]]


class RemoteKVWorker:
    def __init__(self, kv_caches: list[torch.Tensor], identity: KVIdentity, heads: range | None = None,
                 peers: PeerShards | None = None) -> None:
        """``heads``: the model's KV heads this rank's pool holds (None: all); ``peers``: rank 0 of a
        tensor-parallel replica, where the heads it lacks are read."""
        self.kv_caches = kv_caches
        self.identity = identity
        self.device = kv_caches[0].device
        self.dtype = kv_caches[0].dtype
        self.block_shape = identity.block_shape  # [layers, 2, block_size, kv_heads, head_dim], whole
        self.block_bytes = self.dtype.itemsize * int(torch.Size(self.block_shape).numel())
        self.heads = range(self.block_shape[3]) if heads is None else heads
        self.peers = peers
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._layer_events: list[torch.cuda.Event] = []
        self._keep: torch.Tensor | None = None

    # ---- prefill: leased blocks out -------------------------------------------------------------------
    def save_kv_layer(self, layer: int, blocks: list[int]) -> torch.Tensor:
        """One layer's K/V of ``blocks`` on the host: ``[2, len(blocks), block_size, kv_heads, head_dim]``."""
        index = torch.tensor(blocks, device=self.device)
        return self.kv_caches[layer].index_select(1, index).to("cpu")

    def read_shard(self, blocks: list[int]) -> bytes:
        """This rank's heads of ``blocks``: each block's ``[layers, 2, block_size, len(heads), head_dim]``,
        one after the other."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a transfer thread's current device
        layers = torch.stack([self.save_kv_layer(i, blocks) for i in range(len(self.kv_caches))])
        per_block = layers.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, layers, 2, bs, heads, dim]
        return per_block.view(torch.uint8).numpy().tobytes()

    def read_blocks(self, blocks: list[int]) -> bytes:
        """The wire payload of ``blocks``: each whole block's ``[layers, 2, ...]``, one after the other."""
        layers, _, block_size, num_heads, head_dim = self.block_shape
        if len(self.heads) == num_heads:
            return self.read_shard(blocks)
        if self.peers is None:
            raise ValueError(f"this rank holds KV heads {self.heads.start}..{self.heads.stop - 1} of "
                             f"{num_heads}: only rank 0 reads whole blocks")
        row = head_dim * self.dtype.itemsize  # a head's bytes at one position
        whole = np.empty((len(blocks), layers, 2, block_size, num_heads, row), dtype=np.uint8)
        for heads, data in [(self.heads, self.read_shard(blocks)), *self.peers(blocks)]:
            shard = np.frombuffer(data, dtype=np.uint8)
            whole[..., heads.start:heads.stop, :] = shard.reshape(*whole.shape[:4], len(heads), row)
        return whole.tobytes()

    # ---- decode: pulled blocks in ---------------------------------------------------------------------
    def start_load_kv(self, loads: list[tuple[int, bytes]]) -> None:
        """Copy pulled payloads into their device blocks, layer by layer."""
        self._layer_events = []
        if not loads:
            return
        data = bytearray(b"".join(payload for _, payload in loads))
        if len(data) != len(loads) * self.block_bytes:
            raise ValueError(f"{len(loads)} pulled blocks carry {len(data)} bytes, not "
                             f"{len(loads) * self.block_bytes}")
        layers, _, block_size, num_heads, head_dim = self.block_shape
        whole = torch.frombuffer(data, dtype=torch.uint8).view(len(loads), layers, 2, block_size, num_heads,
                                                                head_dim * self.dtype.itemsize)
        mine = whole if len(self.heads) == num_heads else whole[..., self.heads.start:self.heads.stop, :]
        host = mine.contiguous().view(self.dtype)  # [n, layers, 2, block_size, len(heads), head_dim]
        blocks = torch.tensor([block for block, _ in loads], device=self.device)
        if self.stream is None:
            for layer, kv in enumerate(self.kv_caches):
                kv[:, blocks] = host[:, layer].transpose(0, 1)
            return
        staged = host.pin_memory()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for layer, kv in enumerate(self.kv_caches):
                kv[:, blocks] = staged[:, layer].to(self.device, non_blocking=True).transpose(0, 1)
                event = torch.cuda.Event()
                event.record(self.stream)
                self._layer_events.append(event)
        self._keep = staged  # alive until the copies ran: the next load replaces it after waiting

    def wait_for_layer_load(self, layer: int) -> None:
        """Make the compute stream wait until ``layer``'s pulled blocks are in (the CPU: they are)."""
        if layer < len(self._layer_events):
            torch.cuda.current_stream(self.device).wait_event(self._layer_events[layer])

    def load(self, loads: list[tuple[int, bytes]]) -> None:
        """``start_load_kv`` and wait for every layer (the runner's forward pass runs all layers)."""
        self.start_load_kv(loads)
        for layer in range(len(self.kv_caches)):
            self.wait_for_layer_load(layer)
