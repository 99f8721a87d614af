"""The adapters an engine has read, in host memory: a request names a bundle (``LoRARequest``), the engine
serves the ``LoRAAdapter`` read from it.

Invariants:
- ``HostAdapters.get`` reads a bundle once and keeps at most ``capacity`` read adapters, least recently
  used out first; a bundle whose files changed since (size or modification time) is read again, so a
  request never runs on an adapter its bundle no longer holds.
- A bundle that does not fit the base, or a LoRA request to an engine with no adapter slots, is a
  ``RequestValidationError`` (param ``lora``): a 400, nothing queued.
- Over HTTP a request names an adapter by id (``ADAPTER_ID``: letters, digits and ``_.:-``, never a path),
  found at ``<lora_dir>/<id>`` (``by_id``); the id never reaches the filesystem unchecked.
- Thread-safe: the server's thread checks a request's adapter before queuing it, the engine's thread
  reads it again when it adds the request (a hit).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterError, LoRAAdapter, load_adapter
from engine.lora.stats import LoadTimes, LoRAStats
from engine.models.config import ModelArgs
from engine.outputs import RequestValidationError
from engine.protocol import ADAPTER_NOT_FOUND_CODE


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter: its name (for logs and metrics) and the PEFT bundle's directory."""

    name: str
    path: str


ADAPTER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def by_id(adapter_id: str, lora_dir: str | None) -> LoRARequest:
    """The request for adapter ``adapter_id`` of the store at ``lora_dir``."""
    if lora_dir is None:
        raise RequestValidationError("this replica has no adapter store (start it with --lora-dir)", "lora")
    if not ADAPTER_ID.fullmatch(adapter_id) or ".." in adapter_id:
        raise RequestValidationError(f"lora {adapter_id!r} is not an adapter id", "lora")
    return LoRARequest(adapter_id, str(Path(lora_dir) / adapter_id))


class LoRASlotsLike(Protocol):
    """What ``stats`` reads of the device slots (``engine.lora.layers.LoRASlots``)."""

    loads: int
    evictions: int
    load_times: LoadTimes

    def resident(self) -> list[str]: ...


class HostAdapters:
    def __init__(self, base: ModelArgs, *, slots: int, max_rank: int, capacity: int) -> None:
        self.base, self.slots, self.max_rank, self.capacity = base, slots, max_rank, max(1, capacity)
        self._read: OrderedDict[str, tuple[tuple[float, ...], LoRAAdapter]] = OrderedDict()
        self._names: dict[str, str] = {}  # a read bundle's resolved path -> the name it was asked by
        self._lock = threading.Lock()
        self.reads = 0
        # Since start (``engine.lora.stats``): bundles dropped by the LRU, the reads' durations, requests
        # accepted per adapter name (``count_request``).
        self.evictions = 0
        self.read_times = LoadTimes()
        self.requests: Counter[str] = Counter()

    def get(self, request: LoRARequest) -> LoRAAdapter:
        with self._lock:
            return self._get(request)

    def _get(self, request: LoRARequest) -> LoRAAdapter:
        if not self.slots:
            raise RequestValidationError("this engine serves no LoRA adapters (its max_loras is 0)", "lora")
        bundle = Path(request.path)
        try:
            stats = [(bundle / name).stat() for name in (CONFIG_FILE, WEIGHTS_FILE)]
        except OSError:
            raise RequestValidationError(f"adapter {request.name!r}: no bundle at {request.path}",
                                         "lora", code=ADAPTER_NOT_FOUND_CODE) from None
        stamp = tuple(float(v) for st in stats for v in (st.st_size, st.st_mtime_ns))
        key = str(bundle.resolve())
        held = self._read.get(key)
        if held is not None and held[0] == stamp:
            self._read.move_to_end(key)
            return held[1]
        started = time.perf_counter()
        try:
            adapter = load_adapter(bundle, self.base, max_rank=self.max_rank)
        except AdapterError as exc:
            raise RequestValidationError(f"adapter {request.name!r}: {exc}", "lora") from exc
        self.read_times.observe(time.perf_counter() - started)
        self.reads += 1
        self._read[key] = (stamp, adapter)
        self._names[key] = request.name
        self._read.move_to_end(key)
        while len(self._read) > self.capacity:
            gone, _ = self._read.popitem(last=False)
            self._names.pop(gone, None)
            self.evictions += 1
        return adapter

    def count_request(self, name: str) -> None:
        """A request for adapter ``name`` was accepted (the engine thread, once per request)."""
        self.requests[name] += 1

    def stats(self, device: LoRASlotsLike | None) -> LoRAStats:
        """A snapshot of both tiers' counters (``device``: the runner's slots; None without any)."""
        with self._lock:
            loads, evictions = {"host": self.reads}, {"host": self.evictions}
            resident, seconds = {"host": len(self._read)}, {"host": self.read_times.snapshot()}
        if device is not None:
            loads["device"], evictions["device"] = device.loads, device.evictions
            resident["device"] = len(device.resident())
            seconds["device"] = device.load_times.snapshot()
        return LoRAStats(loads, evictions, resident, seconds, dict(self.requests))

    def resident(self) -> list[str]:
        """The names of the adapters held read, least recently used first."""
        with self._lock:
            return [self._names[key] for key in self._read]
