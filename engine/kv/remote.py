"""The device side of disaggregated serving: leased blocks out of the KV pool, pulled blocks into it.

``RemoteKVWorker`` is the connector's worker side (``engine.kv.connector``):

- ``save_kv_layer(layer, blocks)`` / ``read_blocks(blocks)`` (prefill; transfer threads): the K/V of
  leased blocks as the wire carries them, one block after the other, each
  ``[layers, 2, block_size, kv_heads, head_dim]`` raw (the disk tier's block format). Leased blocks are
  never written while the lease lives, so reading them beside the engine's steps is safe.
- ``start_load_kv(loads)`` / ``wait_for_layer_load(layer)`` (decode; device order, before the forward
  pass of the step that admitted them): pulled payloads into their device blocks. On a GPU the copies run
  on a side stream with an event per layer, and ``wait_for_layer_load`` makes the compute stream wait
  for that layer only (a layer-by-layer forward pass can start on layer 0 while later layers land); on
  the CPU the copies are done when ``start_load_kv`` returns.

``kv_identity`` names what a block's bytes mean (weights, layout, KV dtype, block shape): a pull is
refused unless both replicas' identities are equal.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

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


def kv_identity(model_dir: Path, fingerprint: str, kv_caches: list[torch.Tensor]) -> KVIdentity:
    layout = kv_caches[0].shape  # [2, blocks, block_size, kv_heads, head_dim]
    block_shape = (len(kv_caches), 2, *layout[2:])
    return KVIdentity(model_digest(model_dir), fingerprint, str(kv_caches[0].dtype).removeprefix("torch."),
                      tuple(int(d) for d in block_shape))


class RemoteKVWorker:
    def __init__(self, kv_caches: list[torch.Tensor], identity: KVIdentity) -> None:
        self.kv_caches = kv_caches
        self.identity = identity
        self.device = kv_caches[0].device
        self.dtype = kv_caches[0].dtype
        self.block_shape = identity.block_shape  # [layers, 2, block_size, kv_heads, head_dim]
        self.block_bytes = self.dtype.itemsize * int(torch.Size(self.block_shape).numel())
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._layer_events: list[torch.cuda.Event] = []
        self._keep: torch.Tensor | None = None

    # ---- prefill: leased blocks out -------------------------------------------------------------------
    def save_kv_layer(self, layer: int, blocks: list[int]) -> torch.Tensor:
        """One layer's K/V of ``blocks`` on the host: ``[2, len(blocks), block_size, kv_heads, head_dim]``."""
        index = torch.tensor(blocks, device=self.device)
        return self.kv_caches[layer].index_select(1, index).to("cpu")

    def read_blocks(self, blocks: list[int]) -> bytes:
        """The wire payload of ``blocks``: each block's ``[layers, 2, ...]``, one after the other."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a transfer thread's current device
        layers = torch.stack([self.save_kv_layer(i, blocks) for i in range(len(self.kv_caches))])
        per_block = layers.permute(2, 0, 1, 3, 4, 5).contiguous()  # [n, layers, 2, bs, heads, dim]
        return per_block.view(torch.uint8).numpy().tobytes()

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
        host = torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(len(loads), *self.block_shape)
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
