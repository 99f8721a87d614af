"""The device seam: where the model runner's device work runs, so the host can run ahead of it.

Everything that reads or writes the KV cache or the model's tensors (tier copies, the forward pass,
sampling) is *submitted* here, in the order the engine means it to happen, and the device runs it in
that order. What ``submit`` returns is a ``Work``; its ``result()`` is the function's return value.

- ``DeviceExecutor`` runs each function on the calling thread. On a GPU that only enqueues kernels on the
  current CUDA stream, so ``submit`` returns while the GPU still computes: the host runs ahead of the
  device by itself, and whatever the host must read back waits on a CUDA event (``engine.model_runner``
  copies sampled ids to pinned memory without blocking, then records one). On the CPU the work is done
  when ``submit`` returns: no overlap, the synchronous engine.
- ``ThreadExecutor`` (the CPU with the overlapped step loop): one thread runs the submitted functions in
  order, so the engine thread schedules and prepares step N+1, and processes step N-1's tokens, while
  step N computes. PyTorch releases the GIL inside its operators, so the two threads truly overlap on
  two cores.
- ``SimulatedDevice`` (tests, ``benchmarks/host_overhead.py``): a ``ThreadExecutor`` whose steps (work
  submitted with ``step=True``: a step's forward pass) each take at least ``step_time_s``, sleeping off
  what the real computation did not use. It stands in for a GPU that is slower than the host, so a CPU
  test can show a step costing max(host, device) instead of their sum.

Invariants: work runs in submission order, one at a time; a failed function's exception is raised by
its ``result()`` and does not stop the work submitted after it; ``close`` runs everything submitted
so far, then stops the thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class Work(Generic[T]):
    """A function submitted to a device; ``result()`` waits for it and returns its value (or raises)."""

    __slots__ = ("_future", "_value", "_error")

    def __init__(self, future: Future[T] | None = None, value: T | None = None,
                 error: BaseException | None = None) -> None:
        self._future = future
        self._value = value
        self._error = error

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self) -> T:
        if self._future is not None:
            return self._future.result()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class DeviceExecutor:
    """Runs device work on the calling thread (CUDA: asynchronous by the stream; CPU: synchronous).

    ``busy_s`` / ``step_busy_s``: seconds spent running submitted work (all of it / the steps'), on the
    host's clock: on the CPU the device's own time; under CUDA only the launches'."""

    def __init__(self) -> None:
        self.busy_s = 0.0
        self.step_busy_s = 0.0

    def submit(self, fn: Callable[..., T], *args: Any, step: bool = False) -> Work[T]:
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                value = fn(*args)
        except Exception as exc:  # reported by result(), like the device thread's
            return Work(error=exc)
        finally:
            self._account(started, step)
        return Work(value=value)

    def _account(self, started: float, step: bool) -> None:
        elapsed = time.perf_counter() - started
        self.busy_s += elapsed
        if step:
            self.step_busy_s += elapsed

    def close(self) -> None:
        pass


class ThreadExecutor(DeviceExecutor):
    """One thread runs the submitted work in order (the CPU's overlapped step loop)."""

    def __init__(self, name: str = "engine-device") -> None:
        super().__init__()
        self._queue: queue.SimpleQueue[tuple[Callable[..., Any], tuple, bool, Future] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., T], *args: Any, step: bool = False) -> Work[T]:
        future: Future[T] = Future()
        self._queue.put((fn, args, step, future))
        return Work(future)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def _run(self) -> None:
        with torch.inference_mode():
            while (item := self._queue.get()) is not None:
                fn, args, step, future = item
                if not future.set_running_or_notify_cancel():
                    continue
                started = time.perf_counter()
                try:
                    value = fn(*args)
                except BaseException as exc:  # reported by result(); the thread serves on
                    self._account(started, step)
                    future.set_exception(exc)
                    continue
                if step:
                    self._stretch(started)
                self._account(started, step)
                future.set_result(value)

    def _stretch(self, started: float) -> None:
        """Hook: a step just ran since ``started`` (``SimulatedDevice`` makes it last longer)."""


class SimulatedDevice(ThreadExecutor):
    """A ``ThreadExecutor`` whose every step takes at least ``step_time_s`` (a slow accelerator)."""

    def __init__(self, step_time_s: float) -> None:
        if step_time_s < 0:
            raise ValueError(f"step_time_s must be >= 0, got {step_time_s}")
        self.step_time_s = step_time_s
        super().__init__("engine-simulated-device")

    def _stretch(self, started: float) -> None:
        left = self.step_time_s - (time.perf_counter() - started)
        if left > 0:
            time.sleep(left)


def upload(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host numbers (a list or numpy array) as a tensor on ``device``, without making the host wait: on a
    GPU through pinned memory and an asynchronous copy. (A plain ``.to(device)`` from pageable memory
    waits for the stream to drain: one such call per step and the host never runs ahead.)"""
    tensor = torch.as_tensor(data, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host: on a GPU copied into pinned memory without waiting, an
    event recorded after the copies; ``get()`` waits for that event (not for the stream) and returns them
    (``None`` entries stay ``None``). On the CPU the tensors themselves."""

    __slots__ = ("_tensors", "_event")

    def __init__(self, tensors: list[torch.Tensor | None]) -> None:
        self._event: torch.cuda.Event | None = None
        if not any(t is not None and t.device.type == "cuda" for t in tensors):
            self._tensors = tensors
            return
        self._tensors = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
        self._event = torch.cuda.Event()
        self._event.record()

    def get(self) -> list[torch.Tensor | None]:
        if self._event is not None:
            self._event.synchronize()
        return self._tensors


def create_executor(kind: str, step_time_s: float = 0.0) -> DeviceExecutor:
    """``inline`` (``DeviceExecutor``), ``thread`` (``ThreadExecutor``) or ``simulated``
    (``SimulatedDevice``)."""
    if kind == "inline":
        return DeviceExecutor()
    if kind == "thread":
        return ThreadExecutor()
    if kind == "simulated":
        return SimulatedDevice(step_time_s)
    raise ValueError(f"unknown device kind {kind!r}: inline, thread or simulated")
