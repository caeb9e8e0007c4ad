"""Where each model tensor lives inside the tensors the optimizer updates (docs/design.md §3),
and the per-tensor sums across the ranks that hold its pieces: shared by every engine that
shards tensors (DeepSpeed ZeRO, megatron-core, FSDP2), below all of them.

Under ZeRO-1/2/3 the optimizer sees one flat fp32 partition per group, under Megatron's
distributed optimizer a range of its buffer, under FSDP2 each tensor's local shard; a model
tensor can be split between ranks. The layout lists, per tensor the optimizer updates, the
pieces ``(start, length, key)`` it holds, and completes per-tensor sums over the ranks in one
small collective (``[num_tensors, k]`` float64) through the engine's communication module
(``deepspeed.comm`` or ``torch.distributed``), so LAMB/LARS trust ratios and the GSNR mean of a
split tensor equal the unsharded ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from vrgd_ds.stats.comm import CommCounters


@dataclass
class ModelTensors:
    """The model's trainable tensors in parameter order: the layout's keys."""

    names: list[str]
    keys: dict[int, int]  # id(parameter) -> key
    numel: list[int]
    shapes: list[tuple[int, ...]]

    @classmethod
    def of(cls, module: torch.nn.Module) -> "ModelTensors":
        """Shared parameters count once; ZeRO-3 empties each parameter, whose ``ds_numel`` and
        ``ds_shape`` are the model's."""
        out = cls([], {}, [], [])
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in out.keys:
                out.keys[id(p)] = len(out.names)
                out.names.append(name)
                out.numel.append(int(getattr(p, "ds_numel", p.numel())))
                out.shapes.append(tuple(getattr(p, "ds_shape", p.shape)))
        return out


def key_mask(keys: dict[int, int], num_keys: int, params: Iterable[Tensor]) -> Tensor | None:
    """A bool per key, true for the keys of ``params`` (``keys``: id(parameter) -> key); None if
    none of them is a key."""
    mask = torch.zeros(num_keys, dtype=torch.bool)
    for p in params:
        if id(p) in keys:
            mask[keys[id(p)]] = True
    return mask if bool(mask.any()) else None


class Layout:
    """Pieces of model tensors in flat tensors, keyed by the model's parameter order."""

    def __init__(self, names: list[str], numel: list[int], group: Any | None,
                 device: torch.device | str = "cpu", shapes: list[tuple[int, ...]] | None = None,
                 comm: Any | None = None, drop: list[bool] | None = None) -> None:
        """``comm``: the module the sums travel through (``deepspeed.comm``; default
        ``torch.distributed``). ``drop[key]``: this rank holds a copy of the tensor that another
        rank of ``group`` counts (tensor-parallel replication, HSDP replicas): its rows stay out of
        every sum."""
        self.comm = comm
        self._drop = torch.tensor(drop, dtype=torch.bool) if drop is not None and any(drop) else None
        self.names = names
        #: per key, the whole model tensor's shape (row/column maxima of MERIT); flat if not given
        self.shapes = [tuple(s) for s in shapes] if shapes is not None else [(int(n),) for n in numel]
        self.device = torch.device(device)  # where the collective runs (NCCL: the GPU)
        self.numel = torch.tensor(numel, dtype=torch.float64)
        self.group = group  # None: every rank holds whole, identical tensors (no collective)
        self.stages: Any | None = None  # PipelineEngine: this rank's group across pipeline stages
        #: bool per key, or None: a tied weight's copy that another pipeline stage counts, left out
        #: of whole-model sums (as DeepSpeed's and Megatron's gradient norms leave it out)
        self.replicated: Tensor | None = None
        #: join_stages: this stage's first row, the rows, their names, the rows of this stage's tied copies
        self._joined: tuple[int, int, list[str], Tensor | None] | None = None
        self._pieces: dict[int, list[tuple[int, int, int]]] = {}
        self._offsets: dict[int, list[int]] = {}
        self.counters = CommCounters()  # the small per-tensor tables (they stand for no gradient)

    @property
    def num_keys(self) -> int:
        return len(self.names)

    def add(self, flat: Tensor, pieces: list[tuple[int, ...]]) -> None:
        """``pieces``: ``(start, length, key)`` or ``(start, length, key, offset)``, where
        ``offset`` is the piece's first element inside its model tensor (default 0)."""
        rows = [(*piece, 0)[:4] for piece in pieces]
        for start, length, key, offset in rows:
            if (start < 0 or length < 0 or start + length > flat.numel() or not 0 <= key < self.num_keys
                    or offset < 0 or offset + length > self.numel[key]):
                raise ValueError(f"bad layout piece (start={start}, length={length}, key={key}, offset={offset}) for "
                                 f"a flat tensor of {flat.numel()} elements and {self.num_keys} model tensors")
        kept = [row for row in rows if row[1] > 0]
        self._pieces[id(flat)] = [(s, n, k) for s, n, k, _ in kept]
        self._offsets[id(flat)] = [o for *_, o in kept]

    def segments(self, p: Tensor) -> list[tuple[int, int, int]]:
        try:
            return self._pieces[id(p)]
        except KeyError:
            raise RuntimeError(
                f"the optimizer updates a tensor of shape {tuple(p.shape)} that its layout does not know: it was "
                "frozen (requires_grad False) when the engine laid the model out (deepspeed.initialize, "
                "get_megatron_optimizer, vrgd_ds.fsdp.attach) and is trainable now, or was added to the optimizer "
                "after, or the model was moved or cast (model.to(...)) after vrgd_ds.fsdp.attach, which gives FSDP2 "
                "new local shards; not supported: unfreeze parameters, and move or cast the model, before building "
                "the optimizer, as DDP also asks"
            ) from None

    def offsets(self, p: Tensor) -> list[int]:
        """Where each of ``segments(p)`` starts inside its model tensor."""
        self.segments(p)
        return self._offsets[id(p)]

    def all_reduce(self, t: Tensor, op: str) -> None:
        if self.group is None:
            return
        if op == "sum" and self._drop is not None:
            t[self._drop.to(t.device)] = 0  # another rank adds this tensor
        self._reduce(t, op, self.group)

    def all_reduce_stages(self, t: Tensor, op: str) -> None:
        """Under ``PipelineEngine`` a stage's value (complete over its data-parallel ranks) is
        combined over the stages, as DeepSpeed's gradient norm is; nothing to do otherwise."""
        if self.stages is not None:
            self._reduce(t, op, self.stages)

    def join_stages(self, sums: Tensor, maxs: Tensor) -> tuple[Tensor, Tensor, list[str]]:
        """The whole model's per-tensor tables (``vrgd_ds/optim/metrics.py``) from this stage's, each
        complete over its stage already: under pipeline stages every stage's rows at its place in
        the stages' order, named ``stage<i>.<name>`` (a stage numbers its layers from 0 under
        Megatron), a tied weight's copy left to the stage that counts it (``replicated``); one sum
        and one max over the stages per step. Without stages, this stage's tables and names."""
        if self.stages is None:
            return sums, maxs, self.names
        if self._joined is None:  # once: every stage's names (their count places the rows)
            import torch.distributed as tdist

            every: list[Any] = [None] * tdist.get_world_size(self.stages)
            tdist.all_gather_object(every, self.names, group=self.stages)
            me = tdist.get_rank(self.stages)
            names = [f"stage{i}.{name}" for i, stage in enumerate(every) for name in stage]
            first = sum(len(stage) for stage in every[:me])
            copies = (None if self.replicated is None
                      else torch.nonzero(self.replicated).flatten().to(sums.device) + first)
            self._joined = (first, len(names), names, copies)
        first, rows, names, copies = self._joined
        whole_sums = sums.new_zeros(rows, sums.shape[1])
        whole_maxs = maxs.new_full((rows, maxs.shape[1]), -torch.inf)
        mine = slice(first, first + self.num_keys)
        whole_sums[mine] = sums
        whole_maxs[mine] = maxs
        if copies is not None:
            whole_sums[copies] = 0
            whole_maxs[copies] = -torch.inf
        self._reduce(whole_sums, "sum", self.stages)
        self._reduce(whole_maxs, "max", self.stages)
        return whole_sums, whole_maxs, names

    def _reduce(self, t: Tensor, op: str, group: Any) -> None:
        dist = self.comm
        if dist is None:
            import torch.distributed as dist
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        if t.device == self.device:  # the sync-free kernels keep their tables here: no copies
            dist.all_reduce(t, op=red, group=group)
        else:  # host tables with an NCCL group: through the device and back (blocking)
            on_device = t.to(self.device)
            dist.all_reduce(on_device, op=red, group=group)
            t.copy_(on_device)
        self.counters.add(0, t.numel() * t.element_size())


def complete(layout: Layout | None, keys: Tensor, values: Tensor) -> Tensor:
    """Per-segment sums ``[S, k]`` -> sums over each segment's whole model tensor (float64).
    ``keys``: the model tensor of each segment; no layout (or one without a group): the values
    themselves, every segment being a whole tensor or held whole by every rank."""
    # Per rank a model tensor is mostly one segment (one piece of one flat partition): no colliding
    # rows in index_add_. A tensor cut into several runs on one rank (FSDP2 with a Shard(1) tensor-
    # parallel layout: MERIT's runs per row) collides: in float64, on CUDA in no fixed order (the
    # last bits may differ between runs; every rank gets the same sums from the all-reduce).
    if layout is None or getattr(layout, "group", False) is None:
        return values.double()
    buf = torch.zeros(layout.num_keys, values.shape[1], dtype=torch.float64, device=values.device)
    buf.index_add_(0, keys, values.double())
    layout.all_reduce(buf, "sum")
    return buf.index_select(0, keys)


def total(layout: Layout | None, keys: list[Tensor], values: list[Tensor]) -> Tensor:
    """A float64 sum of per-segment values (``[S]`` per plan, ``keys`` its model tensors) over
    every model tensor the optimizer's model updates, each counted once: all ranks under ZeRO
    and FSDP2, tensor-parallel shards and pipeline stages under Megatron."""
    if layout is None:
        return torch.stack([v.double().sum() for v in values]).sum()
    buf = torch.zeros(layout.num_keys, 1, dtype=torch.float64, device=values[0].device)
    for k, v in zip(keys, values):
        buf.index_add_(0, k, v.double().reshape(-1, 1))
    layout.all_reduce(buf, "sum")
    if layout.replicated is not None:  # a tied weight's copy: the stage that owns it counts it
        buf[layout.replicated.to(buf.device)] = 0
    out = buf.sum().reshape(1)
    layout.all_reduce_stages(out, "sum")
    return out[0]
