"""Gradient statistics with the engine's own gradient reduction untouched (DeepSpeed, torch
DDP): each rank sums its micro-steps' squares locally, and one collective per optimizer step
brings the sums into the partition this rank's optimizer owns (docs/design.md §3; DeepSpeed:
``"vrgd": {"squares": "per_step"}``, each engine path's set-up in ``vrgd_ds/ds/stage0.py``,
``zero12.py`` and ``zero3.py``; DDP: ``vrgd_ds.ddp.attach``). The collectives go through the
``comm`` module given (``deepspeed.comm`` or ``torch.distributed``) and
``vrgd_ds/stats/comm.py``.

Why it is exact: Σ over ranks and micro-steps of g² equals the sum over ranks of each rank's
local Σ over its micro-steps (associativity), so ``n = ranks × micro-steps`` on every ZeRO stage.

* **Squares, locally.** A tensor hook on every model parameter sees each micro-step's local
  gradient ``x = S·g/GAS`` before DeepSpeed accumulates or reduces it; one pass
  (``Kernels.pack_squares``) adds ``(c·x)²`` with ``c = GAS/S`` (the loss scale removed before
  squaring, in fp32) into a full-size fp32 buffer laid out like the rank's flat gradient
  buffers: 4 bytes per parameter per rank. The first micro-step after a step writes.
* **One collective per optimizer step**, when the engine's step begins: a reduce-scatter of
  each flat buffer into this rank's partition (ZeRO-1/2: DeepSpeed's ``bit16_groups_flat``
  layout, padding included; ZeRO-3: a coalesced reduce-scatter of per-parameter buffers, as
  DeepSpeed partitions them), an all-reduce on stage 0. It runs asynchronously; the optimizer
  waits for it when it asks for the moments.
* **The mean gradient ḡ** (``gbar``): ``"engine"`` takes the gradient DeepSpeed reduced and hands
  the optimizer, read *before* DeepSpeed unscales and clips it (so it carries the same scale
  as the squares): no extra bytes, but in bf16/fp16 training it went through DeepSpeed's
  low-precision reduction and accumulation; ``"local"`` sums ``c·x`` in fp32 beside the squares
  and reduces both in the same collective (twice the bytes).

Extra traffic per optimizer step, whatever the accumulation: the fp32 gradient's bytes
(``gbar="engine"``), half of them with bf16 squares, twice with ``gbar="local"``.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from vrgd_ds.stats.comm import CommCounters, launch

logger = logging.getLogger(__name__)


def moment_buffers(targets: list[Tensor]) -> dict[int, tuple[Tensor, Tensor]]:
    """The ``(Σg, Σg²)`` fp32 buffers of each flat tensor the basic optimizer updates, by id."""
    return {id(t): (torch.zeros(t.numel(), dtype=torch.float32, device=t.device),
                    torch.zeros(t.numel(), dtype=torch.float32, device=t.device)) for t in targets}


def moment_views(bufs: dict[int, tuple[Tensor, Tensor]], params) -> tuple[list[Tensor], list[Tensor]]:
    """``moments()``'s answer: each tensor's buffers viewed in its shape; a tensor without
    statistics is an error naming its shape (it was added after the engine was built)."""
    sum_g, sum_sq = [], []
    for p in params:
        pair = bufs.get(id(p))
        if pair is None:
            raise RuntimeError(f"no VRGD statistics for a flat tensor of shape {tuple(p.shape)}: it was not "
                               "in the optimizer when DeepSpeed built its partitions")
        sum_g.append(pair[0].view(p.shape))
        sum_sq.append(pair[1].view(p.shape))
    return sum_g, sum_sq


@dataclass
class Flat:
    """One flat local buffer and where its reduction goes."""

    sq: Tensor  # fp32, the local Σ (c·x)², full size
    g: Tensor | None  # fp32, the local Σ x (gbar="local")
    reduce: Callable[["Flat"], list[Any]]  # launches the collective(s), returns their work handles
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (param id, start, length) in sq
    both: Tensor | None = None  # [g | sq] as one tensor (g present) or sq


class LocalStats:
    """``Σg`` and ``Σg²`` per flat tensor the basic optimizer updates, from per-rank local sums
    reduced once per step (a ``StatisticsSource``).

    ``targets``: the optimizer's flat tensors; ``sum_sq``/``sum_g`` buffers shaped like them
    receive the reductions. The path-specific parts (the local layout, the collective, where
    the engine's gradient is read) are set up by each engine path: ``vrgd_ds/ds/stage0.py``,
    ``zero12.py``, ``zero3.py`` and ``vrgd_ds/ddp.py``.
    """

    def __init__(self, comm: Any, kernels: Any, world: int, targets: list[Tensor], gbar: str,
                 squares_dtype: torch.dtype, loss_scale: Callable[[], float],
                 accumulation: Callable[[], int], engine_factor: Callable[[], float] | None = None) -> None:
        self.comm = comm  # deepspeed.comm or torch.distributed: all_reduce, reduce_scatter_tensor
        self._accumulation = accumulation
        #: ``gbar="engine"``: Σg = factor · engine gradient; default n / loss scale (DeepSpeed: the
        #: engine's gradient is the mean over ranks and micro-steps, loss-scaled)
        self._engine_factor = engine_factor
        self.kernels = kernels
        self.world = world
        self.gbar = gbar
        self.squares_dtype = squares_dtype
        self._loss_scale = loss_scale
        self._bufs = moment_buffers(targets)
        self._targets = {id(t): t for t in targets}
        self.flats: list[Flat] = []
        self._where: dict[int, tuple[Flat, int]] = {}  # param id -> (flat, offset)
        self._counts: dict[int, int] = {}
        self._stale = False
        self._works: list[Any] = []
        self._started = False
        self._finished = False
        self._captured: set[int] = set()
        self._c = 1.0
        self._scale = 1.0
        self._n_local = 0
        self._handles: list[Any] = []
        self.counters = CommCounters()

    # -- set-up --------------------------------------------------------------------------------

    def add_flat(self, numel: int, device: torch.device, reduce: Callable[[Flat], list[Any]]) -> Flat:
        """A local buffer; with ``gbar="local"`` ``[Σx | Σ(c x)²]`` in one tensor (``Flat.both``), so an
        all-reduce of both is one collective."""
        local = self.gbar == "local"
        both = torch.zeros((2 if local else 1) * numel, dtype=torch.float32, device=device)
        flat = Flat(both[numel:] if local else both, both[:numel] if local else None, reduce, both=both)
        self.flats.append(flat)
        return flat

    def watch(self, p: Tensor, flat: Flat, offset: int, numel: int) -> None:
        """Adds ``p``'s micro-step squares at ``offset`` of ``flat``."""
        self._where[id(p)] = (flat, offset)
        flat.pieces.append((id(p), offset, numel))
        me, pid = weakref.ref(self), id(p)

        def hook(grad: Tensor, me=me, pid=pid) -> None:
            stats = me()
            if stats is not None:
                stats._record(pid, grad)

        self._handles.append(p.register_hook(hook))

    # -- hooks -----------------------------------------------------------------------------------

    def _record(self, pid: int, grad: Tensor) -> None:
        if self._stale:  # the first backward after a step
            self._counts.clear()
            self._stale = False
            self._started = self._finished = False
            self._captured.clear()
        flat, off = self._where[pid]
        count = self._counts.get(pid, 0)
        if count == 0:
            self._scale = float(self._loss_scale())
            self._c = float(self._accumulation()) / self._scale
        n = grad.numel()
        self.kernels.pack_squares(grad.detach().reshape(-1), None if flat.g is None else flat.g.narrow(0, off, n),
                                  flat.sq.narrow(0, off, n), self._c, accumulate=count > 0)
        self._counts[pid] = count + 1

    # -- engine side -----------------------------------------------------------------------------

    @property
    def n(self) -> int:
        return self.world * (self._n_local if self._started else max(self._counts.values(), default=0))

    def start(self) -> None:
        """The engine's step begins: every micro-step is in; launch the step's collective(s)."""
        if self._started or self._stale:
            return
        self._n_local = max(self._counts.values(), default=0)
        for flat in self.flats:
            for pid, off, num in flat.pieces:  # a parameter no backward reached: its old sums must not count
                if pid not in self._counts:
                    flat.sq.narrow(0, off, num).zero_()
                    if flat.g is not None:
                        flat.g.narrow(0, off, num).zero_()
        self._works = [w for flat in self.flats for w in flat.reduce(flat)]
        self._started = True

    def capture(self, target: Tensor, grad: Tensor) -> None:
        """``gbar="engine"``: the gradient DeepSpeed reduced for ``target``, still loss-scaled and
        unclipped (read just before DeepSpeed unscales and clips it), as ``Σg = n · g / S`` (or
        ``engine_factor() · g`` where the engine's gradient is another multiple of the sum)."""
        if self.gbar != "engine" or id(target) not in self._bufs:
            return
        if self._engine_factor is not None:
            factor = self._engine_factor()
        else:
            factor = self.world * max(self._counts.values(), default=0) / self._scale
        torch.mul(grad.reshape(-1), factor, out=self._bufs[id(target)][0])
        self._captured.add(id(target))

    def moments(self, params) -> tuple[list[Tensor], list[Tensor]]:
        self.start()  # a caller that steps the optimizer directly
        if not self._finished:
            for w in self._works:
                if callable(w):
                    w()  # a completion step of the reduce function (e.g. bf16 squares back to fp32)
                elif w is not None:
                    w.wait()
            self._works = []
            if self.gbar == "local":
                for gb, _ in self._bufs.values():
                    gb.mul_(self._c)  # the local sums were of x; the squares already carry c
            self._finished = True
        if self.gbar == "engine":
            for p in params:  # DeepSpeed did not unscale or clip (loss scale 1, no clipping): as reduced
                if id(p) not in self._captured:
                    self.capture(p, p.grad)
        return moment_views(self._bufs, params)

    #: True where no engine wraps the step (DDP): the optimizer's reset ends the step
    reset_ends_step = False

    def reset(self) -> None:
        """The optimizer's end of step (and ``zero_grad``). Under DeepSpeed nothing (ZeRO calls it
        once per group or sub-group; the engine's step wrapper calls ``end_step``)."""
        if self.reset_ends_step:
            self.end_step()

    def end_step(self) -> None:
        """The engine's step is over (taken or skipped): the next backward starts afresh."""
        self._stale = True
        self._started = self._finished = False

    def target_bufs(self, target: Tensor) -> tuple[Tensor, Tensor]:
        return self._bufs[id(target)]

    def alias(self, target: Tensor, sum_g: Tensor, sum_sq: Tensor) -> None:
        """The statistics of ``target`` are these views (stage 0: of the reduced local buffer)."""
        self._bufs[id(target)] = (sum_g, sum_sq)

    def buffer_bytes(self) -> int:
        local = sum(f.sq.numel() * 4 + (f.g.numel() * 4 if f.g is not None else 0) for f in self.flats)
        return local + sum(2 * g.numel() * 4 for g, _ in self._bufs.values())

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def reduce(stats: LocalStats, local: Tensor, out: Tensor, group: Any, scatter: bool, dtype: torch.dtype,
           squares: bool = True) -> list[Any]:
    """``vrgd_ds.stats.comm.launch`` through ``stats``' communication module and counters: what
    ``moments()`` waits on or runs, in order."""
    return launch(stats.comm, stats.counters, local, out, group, scatter, dtype, squares)
