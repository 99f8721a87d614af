"""The tiers' copies (``KVTransfer``) on the CPU: offloads land in their host slots after the step (as on a
GPU, where they overlap the forward pass), and everything that reads those slots waits for them: a
load in the same step, the write-through to disk, a read of the file queued later. Retained device
blocks reach their files, and a pin's expiry becomes the file's modification time."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.kv.tiers import TransferPlan
from engine.kv.transfer import KVTransfer

LAYERS, BLOCKS, SLOTS = 2, 4, 3
SHAPE = (2, BLOCKS, 4, 1, 2)  # [k/v, blocks, block_size, kv_heads, head_dim]


def caches() -> list[torch.Tensor]:
    return [torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).view(SHAPE) + 1000 * layer
            for layer in range(LAYERS)]


def block(kv: list[torch.Tensor], index: int) -> torch.Tensor:
    return torch.stack([layer[:, index] for layer in kv])


def test_an_offload_lands_after_the_step_and_a_load_in_the_same_step_waits_for_it() -> None:
    kv = caches()
    original = block(kv, 0).clone()
    transfer = KVTransfer(kv, SLOTS, None, "fp")
    transfer.execute(TransferPlan(offload=[(0, 2)]))
    assert not torch.equal(torch.stack([h[:, 2] for h in transfer.host]), original)  # still in flight
    transfer.poll()
    assert torch.equal(torch.stack([h[:, 2] for h in transfer.host]), original)
    transfer.execute(TransferPlan(offload=[(1, 0)], load=[(0, 3)]))  # block 1 evicted and loaded into 3
    assert torch.equal(block(kv, 3), block(kv, 1))


def test_write_through_pins_and_reads_follow_the_landed_copies(tmp_path: Path) -> None:
    kv = caches()
    transfer = KVTransfer(kv, SLOTS, tmp_path, "fp")
    digest, saved = bytes(range(32)), bytes(range(1, 33))
    transfer.execute(TransferPlan(offload=[(1, 0)], persist=[(0, digest, "a")], save=[(2, saved, "a")],
                                  pin=[(saved, "a", 4_000_000_000.0)]))
    transfer.execute(TransferPlan(read=[(digest, "a")]))  # queued after the write it needs: it lands first
    transfer.flush()
    [(read_digest, _, data)] = transfer.finished_reads()
    assert read_digest == digest
    assert data == block(kv, 1).contiguous().view(torch.uint8).numpy().tobytes()
    saved_file = transfer.path(saved, "a")
    assert saved_file.read_bytes().endswith(block(kv, 2).contiguous().view(torch.uint8).numpy().tobytes())
    assert saved_file.stat().st_mtime == 4_000_000_000.0
    files, pins = transfer.scan(now=2_000_000_000.0)  # after the writes, before the pin ends
    assert {d for d, _ in files} == {digest, saved} and pins == {saved: 4_000_000_000.0}
    transfer.close()


class _Copy:
    """A side stream's event that says it is done only when told (a GPU copy still running)."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_only_a_plan_that_touches_host_slots_waits_for_earlier_copies() -> None:
    """With copies to the host still running, a plan that only offloads does not wait for them (the host
    would wait for the previous forward pass); a load waits, and what it reads is what landed."""
    kv = caches()
    original = block(kv, 0).clone()
    transfer = KVTransfer(kv, SLOTS, None, "fp")
    copies: list[_Copy] = []
    transfer._record = lambda keep: copies.append(_Copy()) or [copies[-1]]  # type: ignore[method-assign]
    transfer.execute(TransferPlan(offload=[(0, 2)]))
    transfer.execute(TransferPlan(offload=[(1, 1)]))
    assert not copies[0].waited  # not waited for, not landed
    assert not torch.equal(torch.stack([h[:, 2] for h in transfer.host]), original)
    copies[0].done = True
    transfer.execute(TransferPlan(offload=[(2, 0)]))  # lands what has finished, in order
    assert torch.equal(torch.stack([h[:, 2] for h in transfer.host]), original)
    assert not copies[1].waited
    transfer.execute(TransferPlan(load=[(2, 3)]))
    assert copies[1].waited and copies[2].waited  # everything issued earlier landed before the load
    assert torch.equal(block(kv, 3), original)
