"""Where the engine thread's time goes, step by step: cumulative seconds per phase of ``LLMEngine.step``.

- ``schedule``: ``Scheduler.schedule`` (with the KV cache's bookkeeping);
- ``prepare``: building the step's inputs from the persistent batch, submitting its forward pass, and
  advancing the sequences (``update_after_step``: pending tokens, block hashes);
- ``sample``: grammar masks and submitting the sampling (on an inline CPU device: the sampling itself);
- ``wait``: waiting for a step's tokens to reach the host (the device was still busy);
- ``postprocess``: appending tokens, detokenizing, stop checks, finishing, building deltas.

Everything but ``wait`` is host work. In the overlapped loop it runs while the device computes, so only
what exceeds the device's time is on the critical path. Always on: a handful of ``perf_counter`` calls
per step. ``benchmarks/host_overhead.py`` reads it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class StepProfile:
    num_steps: int = 0
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    sample_s: float = 0.0
    wait_s: float = 0.0
    postprocess_s: float = 0.0

    @property
    def host_s(self) -> float:
        """Host work so far (every phase but waiting for the device)."""
        return self.schedule_s + self.prepare_s + self.sample_s + self.postprocess_s

    def snapshot(self) -> StepProfile:
        return StepProfile(**asdict(self))

    def since(self, earlier: StepProfile) -> StepProfile:
        """The time spent between ``earlier`` (a snapshot) and now."""
        now, then = asdict(self), asdict(earlier)
        return StepProfile(**{k: now[k] - then[k] for k in now})
