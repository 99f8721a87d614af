"""The device seam (``engine.device``): work runs in submission order, failures are reported by the work
that failed and stop nothing else, a simulated device's step lasts at least its set time, and ``close``
runs what was submitted before it."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.device import DeviceExecutor, SimulatedDevice, ThreadExecutor, create_executor


def _boom() -> None:
    raise RuntimeError("device lost")


@pytest.mark.parametrize("kind", ["inline", "thread", "simulated"])
def test_work_runs_in_order_and_a_failure_stops_nothing_else(kind: str) -> None:
    executor = create_executor(kind, step_time_s=0.0)
    seen: list[int] = []
    works = [executor.submit(seen.append, i) for i in range(3)]
    failed = executor.submit(_boom, step=True)
    after = executor.submit(lambda: len(seen))
    assert after.result() == 3 and seen == [0, 1, 2]
    assert all(w.result() is None for w in works)
    with pytest.raises(RuntimeError, match="device lost"):
        failed.result()
    executor.close()


def test_the_device_thread_runs_in_inference_mode_off_the_callers_thread() -> None:
    executor = ThreadExecutor()
    caller = threading.get_ident()
    where = executor.submit(lambda: (threading.get_ident(), torch.is_inference_mode_enabled())).result()
    assert where[0] != caller and where[1] is True
    assert DeviceExecutor().submit(threading.get_ident).result() == caller
    executor.close()


def test_a_simulated_step_lasts_at_least_its_set_time_and_other_work_does_not() -> None:
    device = SimulatedDevice(step_time_s=0.05)
    device.submit(lambda: None, step=True).result()
    assert device.step_busy_s >= 0.05 and device.busy_s >= device.step_busy_s
    before = device.busy_s
    device.submit(lambda: None).result()
    assert device.busy_s - before < 0.05  # only steps are stretched
    device.close()


def test_close_runs_everything_submitted_before_it() -> None:
    executor = ThreadExecutor()
    gate = threading.Event()
    seen: list[int] = []
    executor.submit(gate.wait, 30)
    for i in range(5):
        executor.submit(seen.append, i)
    gate.set()
    executor.close()
    assert seen == [0, 1, 2, 3, 4]


def test_unknown_kinds_and_negative_times_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown device kind"):
        create_executor("tpu")
    with pytest.raises(ValueError, match="step_time_s"):
        SimulatedDevice(-1.0)
