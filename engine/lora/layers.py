"""LoRA adapters applied to the base model's projections, several adapters in one batch (the torch path).

``install(model, args, max_loras, max_rank)`` wraps each decoder layer's ``qkv_proj``, ``o_proj`` and, on a
dense base, ``gate_up_proj`` and ``down_proj`` in a ``LoRALinear`` (the projections ``module_shapes`` lets an
adapter target, with its widths); every wrapper shares one ``LoRASlots``.

Invariants:
- Slots ``1..max_loras`` hold adapters (slot 0 is the base model: nothing added). Per wrapped projection
  the slots' A are stacked ``[S, max_rank, in]`` and their B ``[S, out, max_rank]``, zero where an adapter
  has a smaller rank or does not target a part; a fused projection's parts sit in its output columns
  (``q | k | v``, ``gate | up``), so one product adds every part. B holds the adapter's scaling.
- A forward pass adds ``B[s] (A[s] x)`` to the rows of the tokens whose sequence uses slot ``s``
  (``LoRASlots.bind``: the token rows of each slot, set by the runner for one pass and cleared after);
  with nothing bound the wrappers cost one attribute check. That is PEFT's ``W x + scaling B A x``.
- ``assign(adapters)`` gives a step's adapters slots before its pass: those resident keep theirs (by
  digest), the others take free slots, else the least recently used slots no adapter of this step holds.
  Passes run one after another on the device, so a slot rewritten for this step is not read by an earlier
  one still running. More distinct adapters than slots in one step is an error: the scheduler caps them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter, module_shapes
from engine.models.config import ModelArgs

# The projections wrapped, and the adapter modules that are the parts of each (in output-column order).
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class LoRASlots:
    """The device slots' weights of every wrapped projection, which adapter each slot holds, and the
    token rows bound for the current pass."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be >= 1")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.wrapped: dict[tuple[int, str], LoRALinear] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recently used first
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, token rows) for the bound pass
        # Several slots bound: (their slots [S], each slot's token rows padded to the longest [S * M],
        # which of those are real [N], the real ones' token rows [N]) for one batched product per part.
        self.batched: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.loads = 0

    # ---- slots -------------------------------------------------------------------------------------
    def assign(self, adapters: Iterable[LoRAAdapter]) -> dict[str, int]:
        """Slots for a step's adapters (by digest), loading those not resident."""
        wanted = {a.digest: a for a in adapters}
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step, {self.max_loras} slots")
        for digest in wanted:
            if digest in self._slot_of:
                self._slot_of.move_to_end(digest)
        for digest, adapter in wanted.items():
            if digest in self._slot_of:
                continue
            used = set(self._slot_of.values())
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(d for d in self._slot_of if d not in wanted)
                slot = self._slot_of.pop(victim)
            self._load(slot, adapter)
            self._slot_of[digest] = slot
        return {digest: self._slot_of[digest] for digest in wanted}

    def resident(self) -> list[str]:
        return list(self._slot_of)

    def _load(self, slot: int, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        with torch.no_grad():
            for (layer, name), wrapper in self.wrapped.items():
                wrapper.a[slot].zero_()
                wrapper.b[slot].zero_()
                start = 0
                for part, width in zip(PARTS[name], wrapper.part_widths, strict=True):
                    pair = adapter.weights.get(layer, {}).get(part)
                    if pair is not None:
                        a, b = pair
                        rank = a.shape[0]
                        # Each part gets its own rank columns of the stacked A: parts share x, not A.
                        offset = PARTS[name].index(part) * self.max_rank
                        wrapper.a[slot, offset:offset + rank].copy_(a)
                        wrapper.b[slot, start:start + width, offset:offset + rank].copy_(b * adapter.scaling)
                    start += width
        self.loads += 1

    # ---- a pass ------------------------------------------------------------------------------------
    def bind(self, slots: torch.Tensor) -> None:
        """The slot of each token row of the next pass (``[T]``, 0: the base model)."""
        self.groups = [(int(s), (slots == s).nonzero().squeeze(1)) for s in torch.unique(slots).tolist() if s]
        self.batched = None
        if len(self.groups) > 1:
            longest = max(rows.numel() for _, rows in self.groups)
            padded = torch.zeros(len(self.groups), longest, dtype=torch.int64, device=slots.device)
            valid = torch.zeros(len(self.groups), longest, dtype=torch.bool, device=slots.device)
            for i, (_, rows) in enumerate(self.groups):
                padded[i, :rows.numel()] = rows
                valid[i, :rows.numel()] = True
            flat_valid = valid.view(-1).nonzero().squeeze(1)
            which = torch.tensor([s for s, _ in self.groups], dtype=torch.int64, device=slots.device)
            self.batched = (which, padded.view(-1), flat_valid, padded.view(-1).index_select(0, flat_valid))

    def unbind(self) -> None:
        self.groups = []
        self.batched = None


class LoRALinear(nn.Module):
    """A projection with the bound adapters' low-rank updates added to its output."""

    def __init__(self, base: nn.Module, slots: LoRASlots, in_features: int, part_widths: tuple[int, ...],
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.part_widths = part_widths
        self._slots = (slots,)  # shared, not a submodule
        count, rank = slots.max_loras + 1, slots.max_rank * len(part_widths)
        self.register_buffer("a", torch.zeros(count, rank, in_features, device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("b", torch.zeros(count, sum(part_widths), rank, device=device, dtype=dtype),
                             persistent=False)
        self.a: torch.Tensor
        self.b: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self._slots[0]
        if slots.batched is not None:  # several adapters: one batched product over every slot's rows
            which, padded, valid, rows = slots.batched
            xs = x.index_select(0, padded).view(which.numel(), -1, x.shape[-1])  # [S, M, in]
            h = torch.bmm(xs, self.a.index_select(0, which).transpose(1, 2))  # [S, M, R]
            delta = torch.bmm(h, self.b.index_select(0, which).transpose(1, 2))  # [S, M, out]
            y.index_add_(0, rows, delta.view(-1, y.shape[-1]).index_select(0, valid))
            return y
        for slot, token_rows in slots.groups:
            xs = x.index_select(0, token_rows)
            y.index_add_(0, token_rows, (xs @ self.a[slot].T) @ self.b[slot].T)
        return y


def install(model: nn.Module, args: ModelArgs, max_loras: int, max_rank: int) -> LoRASlots:
    """Wrap ``model``'s projections that an adapter may target on this base (``module_shapes``: a
    mixture of experts keeps its MLPs unwrapped) and return their shared slots."""
    slots = LoRASlots(max_loras, max_rank)
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    shapes = module_shapes(args)
    wrapped = [name for name, parts in PARTS.items() if all(p in shapes for p in parts)]
    for layer, block in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
        for name in wrapped:
            owner = block.self_attn if name in ("qkv_proj", "o_proj") else block.mlp
            parts = PARTS[name]
            widths = tuple(shapes[p][1] for p in parts)
            wrapper = LoRALinear(getattr(owner, name), slots, shapes[parts[0]][0], widths, device, dtype)
            setattr(owner, name, wrapper)
            slots.wrapped[(layer, name)] = wrapper
    return slots
