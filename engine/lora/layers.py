"""LoRA adapters applied to the base model's projections, several adapters in one batch.

``install(model, args, max_loras, max_rank, shard)`` wraps each decoder layer's ``qkv_proj``, ``o_proj``
and, on a dense base, ``gate_up_proj`` and ``down_proj`` in a ``LoRALinear`` (the projections
``module_shapes`` lets an adapter target, with this rank's widths); every wrapper shares one ``LoRASlots``.

Invariants:
- Slots ``1..max_loras`` hold adapters (slot 0 is the base model: nothing added). Per wrapped projection
  the slots' A are stacked ``[S, parts * max_rank, in]`` and their B ``[S, out, parts * max_rank]``, zero
  where an adapter has a smaller rank or does not target a part; a fused projection's parts sit in its
  output columns (``q | k | v``, ``gate | up``), each with its own rank rows of A, so one product adds
  every part. B holds the adapter's scaling.
- A forward pass adds ``B[s] (A[s] x)`` to the rows of the tokens whose sequence uses slot ``s``
  (``LoRASlots.bind``: each token row's slot, set by the runner for one pass and cleared after); with
  nothing bound the wrappers cost one attribute check. That is PEFT's ``W x + scaling B A x``. On CUDA
  (``use_kernels``) the two products are the grouped Triton kernels of ``kernels.lora`` (tokens sorted by
  slot, the base model's skipped); elsewhere batched ``torch.bmm`` over every bound slot (the reference).
- Tensor parallelism (``engine.distributed``): an adapter is split like the layer it modifies
  (``shard_adapter``, the slices the loader takes of the base weights). Column-parallel ``qkv``/``gate_up``:
  A whole, B's output rows of this rank (q, k and v, gate and up each sliced as the fused base weight).
  Row-parallel ``o``/``down``: A's input columns of this rank, B whole; each rank adds ``B (A_r x_r)`` to
  its partial product *before* the layer's one all-reduce, whose sum is ``B (A x)``; the bias is added
  once after it. No second collective.
- ``plan(adapters)`` (host, rank 0) gives a step's adapters slots: those resident keep theirs (by digest),
  the others take free slots, else the least recently used slots no adapter of this step holds; it
  returns the loads to make. ``load(slot, adapter)`` (device order, every rank its own shard) copies one
  in. Passes run one after another on the device, so a slot rewritten for a step is not read by an
  earlier one still running. More distinct adapters than slots in one step is an error: the scheduler
  caps them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import nn

from engine.device import upload
from engine.distributed import ShardSizes, TensorParallel
from engine.lora.adapter import LoRAAdapter, module_shapes
from engine.lora.stats import LoadTimes
from engine.models.config import ModelArgs

# The projections wrapped, and the adapter modules that are the parts of each (in output-column order).
PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
         "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})


def shard_adapter(adapter: LoRAAdapter, args: ModelArgs, shard: ShardSizes) -> LoRAAdapter:
    """``adapter`` as rank ``shard.rank`` applies it: for each module the slice of B's rows (column-parallel
    projections) or of A's columns (row-parallel ones) that matches this rank's slice of the base weight
    (``engine.loader``'s own slices). The whole adapter in a group of one."""
    if shard.size == 1:
        return adapter
    from engine.loader import _source_slice

    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for layer, modules in adapter.weights.items():
        for module, (a, b) in modules.items():
            owner = "self_attn" if module in PARTS["qkv_proj"] + PARTS["o_proj"] else "mlp"
            part = _source_slice(f"model.layers.{layer}.{owner}.{module}.weight", args, shard)
            if part is not None:
                dim, start, length = part
                if dim == 0:  # the base weight's output rows: B's rows
                    b = b.narrow(0, start, length).clone()
                else:  # its input columns: A's columns
                    a = a.narrow(1, start, length).clone()
            weights.setdefault(layer, {})[module] = (a, b)
    return replace(adapter, weights=weights)


@dataclass(slots=True)
class SlotGroups:
    """One pass's tokens grouped by slot (base-model tokens left out), on the device.

    ``rows [N]``: token rows sorted by slot; ``starts [G + 1]``: each group's first index into ``rows``;
    ``slots [G]``: each group's slot; ``max_rows``: the largest group (host). For the batched torch path,
    ``padded [G * max_rows]`` (each group's rows padded with row 0) and ``valid [N]`` (which of those are
    real)."""

    rows: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor
    max_rows: int
    host_slots: list[int]
    host_starts: list[int]
    padded: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    # Host facts that spare the torch path operations: the pass's token rows (``num_rows``; one adapter
    # on every row needs no gather or scatter), the bound slots being consecutive (``first_slot``: the
    # stacked weights are a view, not a gather) and every group of the same size (no padding to drop).
    num_rows: int = 0
    first_slot: int | None = None
    unpadded: bool = False


class LoRASlots:
    """The device slots' weights of every wrapped projection, which adapter each slot holds, and the
    token groups bound for the current pass."""

    def __init__(self, max_loras: int, max_rank: int, *, use_kernels: bool = False,
                 tp: TensorParallel | None = None) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError("max_loras and max_rank must be >= 1")
        self.max_loras, self.max_rank = max_loras, max_rank
        self.use_kernels = use_kernels
        self.tp = tp or TensorParallel()
        self.wrapped: dict[tuple[int, str], LoRALinear] = {}
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # digest -> slot, least recently used first
        self.bound: SlotGroups | None = None
        self._last_bound: tuple[bytes, SlotGroups | None] | None = None  # the last pass's slots, groups
        self.ranks: torch.Tensor | None = None  # each slot's adapter rank, on the device (``install``)
        self._copying: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # GPU loads in flight
        # Counters since start (``engine.lora.stats``): adapters copied into a slot, resident adapters
        # evicted from their slot for another (rank 0's plan), and how long each copy took.
        self.loads = 0
        self.evictions = 0
        self.load_times = LoadTimes()

    # ---- slots -------------------------------------------------------------------------------------
    def plan(self, adapters: Iterable[LoRAAdapter]) -> tuple[dict[str, int], list[tuple[int, LoRAAdapter]]]:
        """Slots for a step's adapters (by digest), and the ``(slot, adapter)`` copies that puts them there
        (host bookkeeping only: the caller runs ``load`` for each, in device order)."""
        wanted = {a.digest: a for a in adapters}
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step, {self.max_loras} slots")
        for adapter in wanted.values():
            if adapter.rank > self.max_rank:
                raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        for digest in wanted:
            if digest in self._slot_of:
                self._slot_of.move_to_end(digest)
        loads: list[tuple[int, LoRAAdapter]] = []
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
                self.evictions += 1
            loads.append((slot, adapter))
            self._slot_of[digest] = slot
        return {digest: self._slot_of[digest] for digest in wanted}, loads

    def assign(self, adapters: Iterable[LoRAAdapter]) -> dict[str, int]:
        """``plan`` and its copies at once (a single-rank runner; tests)."""
        slot_of, loads = self.plan(adapters)
        for slot, adapter in loads:
            self.load(slot, adapter)
        return slot_of

    def resident(self) -> list[str]:
        return list(self._slot_of)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy ``adapter`` (already this rank's shard: ``shard_adapter``) into ``slot`` of every wrapped
        projection, in device order. On a GPU the copies go through pinned memory without making the host
        wait (a pageable copy would drain the stream), and their duration is the device's, between two
        events, observed once they are done (``settle``); elsewhere the copies' own time."""
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter rank {adapter.rank} exceeds max_lora_rank {self.max_rank}")
        self.settle()
        cuda = self.ranks is not None and self.ranks.device.type == "cuda"
        begin = torch.cuda.Event(enable_timing=True) if cuda else None
        if begin is not None:
            begin.record()
        started = time.perf_counter()
        with torch.no_grad():
            for (layer, name), wrapper in self.wrapped.items():
                wrapper.a[slot].zero_()
                wrapper.b[slot].zero_()
                start = 0
                for index, (part, width) in enumerate(zip(PARTS[name], wrapper.part_widths, strict=True)):
                    pair = adapter.weights.get(layer, {}).get(part)
                    if pair is not None:
                        a = pair[0].to(wrapper.a.dtype)
                        b = (pair[1] * adapter.scaling).to(wrapper.b.dtype)
                        if cuda:
                            a, b = a.pin_memory(), b.pin_memory()
                        rank = a.shape[0]
                        # Each part gets its own rank rows of the stacked A: parts share x, not A.
                        offset = index * self.max_rank
                        wrapper.a[slot, offset:offset + rank].copy_(a, non_blocking=True)
                        wrapper.b[slot, start:start + width, offset:offset + rank].copy_(b, non_blocking=True)
                    start += width
            if self.ranks is not None:
                self.ranks[slot] = adapter.rank
        if begin is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._copying.append((begin, end))
        else:
            self.load_times.observe(time.perf_counter() - started)
        self.loads += 1

    def settle(self) -> None:
        """Observe the durations of the GPU loads whose copies are done."""
        while self._copying and self._copying[0][1].query():
            begin, end = self._copying.pop(0)
            self.load_times.observe(begin.elapsed_time(end) / 1000)

    # ---- a pass ------------------------------------------------------------------------------------
    def bind(self, slots: np.ndarray, device: torch.device) -> None:
        """The slot of each token row of the next pass (``[T]`` on the host, 0: the base model): its groups
        go to the device once, for every wrapped projection. A pass whose rows have the same slots as the
        previous one's (decode steps of an unchanged batch) reuses its groups: they are only read."""
        self.settle()
        key = slots.astype(np.int64, copy=False).tobytes()
        if self._last_bound is not None and self._last_bound[0] == key:
            self.bound = self._last_bound[1]
            return
        self.bound = self._group(slots, device)
        self._last_bound = (key, self.bound)

    def _group(self, slots: np.ndarray, device: torch.device) -> SlotGroups | None:
        order = np.argsort(slots, kind="stable")
        order = order[slots[order] != 0]
        if order.size == 0:
            return None
        ids, first, counts = np.unique(slots[order], return_index=True, return_counts=True)
        starts = np.append(first, order.size).astype(np.int64)
        max_rows = int(counts.max())
        packed = [order.astype(np.int64), starts, ids.astype(np.int64)]
        padded_host = valid_host = None
        if not self.use_kernels and ids.size > 1:  # the batched torch path: groups padded to one length
            offsets = np.arange(max_rows)[None, :]
            real = offsets < counts[:, None]  # [G, M]
            padded_host = np.zeros((ids.size, max_rows), dtype=np.int64)
            padded_host[real] = order
            valid_host = np.flatnonzero(real.reshape(-1)).astype(np.int64)
            packed += [padded_host.reshape(-1), valid_host]
        sizes = [p.size for p in packed]
        parts = torch.split(upload(np.concatenate(packed), device), sizes)
        host_ids = ids.tolist()
        consecutive = host_ids == list(range(host_ids[0], host_ids[0] + len(host_ids)))
        groups = SlotGroups(parts[0], parts[1], parts[2], max_rows, host_ids, starts.tolist(),
                            num_rows=int(slots.size), first_slot=host_ids[0] if consecutive else None,
                            unpadded=bool(counts.min() == counts.max()))
        if padded_host is not None:
            groups.padded, groups.valid = parts[3], parts[4]
        return groups

    def unbind(self) -> None:
        self.bound = None


class LoRALinear(nn.Module):
    """A projection with the bound adapters' low-rank updates added to its output; a row-parallel one
    adds them to its partial product, before its all-reduce."""

    def __init__(self, base: nn.Module, slots: LoRASlots, in_features: int, part_widths: tuple[int, ...],
                 row_parallel: bool, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = base
        self.part_widths = part_widths
        self.part_bounds = tuple(sum(part_widths[:i]) for i in range(1, len(part_widths)))
        self.row_parallel = row_parallel
        self._slots = (slots,)  # shared, not a submodule
        count, rank = slots.max_loras + 1, slots.max_rank * len(part_widths)
        self.register_buffer("a", torch.zeros(count, rank, in_features, device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("b", torch.zeros(count, sum(part_widths), rank, device=device, dtype=dtype),
                             persistent=False)
        self.a: torch.Tensor
        self.b: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slots = self._slots[0]
        groups = slots.bound
        if groups is None:
            return self.base(x)
        if not (self.row_parallel and slots.tp.enabled):
            y = self.base(x)
            self._add(x, y, groups, slots.use_kernels)
            return y
        partial: torch.Tensor = self.base.partial(x)  # type: ignore[operator]  # RowParallelLinear's
        self._add(x, partial, groups, slots.use_kernels)
        y = slots.tp.all_reduce(partial)
        bias: torch.Tensor | None = self.base.bias  # type: ignore[assignment]
        return y if bias is None else y + bias

    def _add(self, x: torch.Tensor, y: torch.Tensor, groups: SlotGroups, use_kernels: bool) -> None:
        """``y[rows of slot s] += B[s] (A[s] x[rows])`` for every bound slot, in place."""
        if use_kernels:
            from kernels.lora import lora_expand, lora_shrink

            # Only each slot's rank rows of its part's block (the rest of A and B is zero).
            ranks, stride = self._slots[0].ranks, self._slots[0].max_rank
            h = lora_shrink(x, self.a, groups.rows, groups.starts, groups.slots, groups.max_rows, ranks=ranks,
                            rank_stride=stride)
            lora_expand(h, self.b, groups.rows, groups.starts, groups.slots, groups.max_rows, y, ranks=ranks,
                        rank_stride=stride, part_bounds=self.part_bounds)
            return
        if groups.padded is not None and groups.valid is not None:  # several adapters: one batched product
            which = groups.slots
            count = len(groups.host_slots)
            first = groups.first_slot
            a = self.a[first:first + count] if first is not None else self.a.index_select(0, which)
            b = self.b[first:first + count] if first is not None else self.b.index_select(0, which)
            xs = x.index_select(0, groups.padded).view(count, -1, x.shape[-1])  # [S, M, in]
            delta = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2)).view(-1, y.shape[-1])
            # Groups of one size: the padded rows are the rows, in order; else drop the padding first.
            y.index_add_(0, groups.rows, delta if groups.unpadded else delta.index_select(0, groups.valid))
            return
        slot = groups.host_slots[0]  # one adapter: a plain product over its rows
        if groups.host_starts[-1] == groups.num_rows:  # on every row: no gather, no scatter
            y.addmm_(x @ self.a[slot].T, self.b[slot].T)
            return
        xs = x.index_select(0, groups.rows)
        y.index_add_(0, groups.rows, (xs @ self.a[slot].T) @ self.b[slot].T)


class HeldShards:
    """The adapter shards a worker rank keeps in host memory (by digest, least recently used out first),
    and rank 0's copy of that bookkeeping without the weights: both see the same loads in the same order,
    so rank 0 sends a shard only to ranks that no longer hold it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._held: OrderedDict[str, LoRAAdapter | None] = OrderedDict()

    def held(self, digest: str) -> bool:
        """Rank 0: whether the workers hold ``digest`` (counted as a use); if not, they will after this
        load (its shards are sent)."""
        if digest in self._held:
            self._held.move_to_end(digest)
            return True
        self._keep(digest, None)
        return False

    def resolve(self, digest: str, shard: LoRAAdapter | None) -> LoRAAdapter:
        """A worker: the shard rank 0 sent, kept; or, when it sent none, the one kept earlier."""
        if shard is None:
            kept = self._held[digest]
            assert kept is not None, "rank 0 sent no shard of an adapter this rank does not hold"
            self._held.move_to_end(digest)
            return kept
        self._keep(digest, shard)
        return shard

    def _keep(self, digest: str, shard: LoRAAdapter | None) -> None:
        self._held[digest] = shard
        while len(self._held) > self.capacity:
            self._held.popitem(last=False)


def local_shapes(args: ModelArgs, shard: ShardSizes) -> dict[str, tuple[int, int]]:
    """``module_shapes`` on this rank: ``(in_features, out_features)`` of each projection's shard."""
    whole = module_shapes(args)
    q, kv = shard.num_heads * args.head_dim, shard.num_kv_heads * args.head_dim
    local = {"q_proj": (args.hidden_size, q), "k_proj": (args.hidden_size, kv),
             "v_proj": (args.hidden_size, kv), "o_proj": (q, args.hidden_size)}
    inter = shard.intermediate_size
    local |= {"gate_proj": (args.hidden_size, inter), "up_proj": (args.hidden_size, inter),
              "down_proj": (inter, args.hidden_size)}
    return {name: local[name] for name in whole}


def install(model: nn.Module, args: ModelArgs, max_loras: int, max_rank: int,
            shard: ShardSizes | None = None, tp: TensorParallel | None = None,
            use_kernels: bool = False) -> LoRASlots:
    """Wrap ``model``'s projections that an adapter may target on this base (``module_shapes``: a
    mixture of experts keeps its MLPs unwrapped), at this rank's widths, and return their shared slots."""
    slots = LoRASlots(max_loras, max_rank, use_kernels=use_kernels, tp=tp)
    parameter = next(model.parameters())
    device, dtype = parameter.device, parameter.dtype
    slots.ranks = torch.zeros(max_loras + 1, dtype=torch.int32, device=device)
    shapes = local_shapes(args, shard or ShardSizes.of(args))
    wrapped = [name for name, parts in PARTS.items() if all(p in shapes for p in parts)]
    for layer, block in enumerate(model.model.layers):  # type: ignore[union-attr, arg-type]
        for name in wrapped:
            owner = block.self_attn if name in ("qkv_proj", "o_proj") else block.mlp
            parts = PARTS[name]
            widths = tuple(shapes[p][1] for p in parts)
            wrapper = LoRALinear(getattr(owner, name), slots, shapes[parts[0]][0], widths,
                                 name in ROW_PARALLEL, device, dtype)
            setattr(owner, name, wrapper)
            slots.wrapped[(layer, name)] = wrapper
    return slots
