"""The per-micro-step scheme: gradient statistics taken inside DeepSpeed's own gradient
reduction (docs/design.md §3), written once here against the engine paths
(``vrgd_ds/ds/stage0.py``, ``zero12.py``, ``zero3.py``, each owning its DeepSpeed internals).

Each path replaces the reduction of one bucket by a single fused fp32 all-reduce (ZeRO-3: one
coalesced reduce-scatter) of ``[g | (c·g)²]``, where ``c`` turns the local, loss-scaled
gradient into one group's gradient:

===============  ============================  ==========================  ====================
path             DeepSpeed function replaced   groups n                     c
===============  ============================  ==========================  ====================
stage 0          ``engine.allreduce_bucket``   ranks                        1/S
ZeRO-1           ``gradient_reduction_w_...``  ranks                        1/S
ZeRO-2           ``gradient_reduction_w_...``  ranks × micro-steps          GAS/S
ZeRO-3           ``__avg_scatter_grads``       ranks × micro-steps          GAS/S
===============  ============================  ==========================  ====================

(``engine.backward`` divides the loss by GAS and the loss scaler multiplies by S: a local
micro-batch gradient is ``S·g/GAS``; stage 0 and ZeRO-1 reduce the sum over the micro-steps
once, at the boundary.) Squares are taken in fp32 after removing the loss scale. The reduced
``g`` half goes back to DeepSpeed exactly where its own reduction would have put it, so
everything after (accumulation, overflow check, clipping) is DeepSpeed's; ``Σg`` and ``Σg²``
go into fp32 buffers shaped like the flat partition this rank's optimizer updates.

Passes over memory: one kernel reads the local bucket and writes both halves of the fused
buffer (``Kernels.pack_squares``: cast, unscale and square together); the first reduction of
a piece after a step *writes* its ``Σg``/``Σg²`` (scaled in the same pass), later ones add,
so the buffers are never zeroed (a piece no reduction reached this step is zeroed when the
optimizer asks for the moments).

Statistics are cleared when the engine's optimizer step ends, also when DeepSpeed skipped the
step (fp16 overflow): the wrapper's ``step`` is wrapped, not the basic optimizer's.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vrgd_ds.ds.internals import UnsupportedConfiguration
from vrgd_ds.optim.base import MIN_GROUPS
from vrgd_ds.stats.comm import CommCounters
from vrgd_ds.ds.local import scaling
from vrgd_ds.stats.scaling import Scaling
from vrgd_ds.stats.local import moment_buffers, moment_views
from vrgd_ds.optim._impl import select_for


class ReductionStats:
    """``Σg`` and ``Σg²`` per flat tensor the basic optimizer updates (a ``StatisticsSource``).

    ``groups_per_round`` is the number of ranks; ``per_micro_step`` tells whether every
    micro-step is a round (ZeRO-2/3) or only the accumulation boundary (stage 0, ZeRO-1).
    """

    def __init__(self, engine: Any, flats: list[Tensor], scaling: Scaling, per_micro_step: bool, kernels: Any) -> None:
        self.engine = engine
        self.scaling = scaling
        self.world = scaling.world
        self.per_micro_step = per_micro_step
        self.kernels = kernels  # pack_squares, through the selection rule
        self._bufs = moment_buffers(flats)
        self._shapes = {id(f): f.shape for f in flats}
        self._counts: dict[int, int] = {}  # reductions of each model tensor since the last step
        self._pieces: list[tuple[int, int, int, int]] = []  # (model tensor id, flat id, start, length)
        self._stale = False
        self.counters = CommCounters()
        self.squares_dtype = torch.float32  # set from the config's "vrgd" block at attach

    def piece(self, tensor: Tensor, flat: Tensor, start: int, length: int) -> None:
        """Registers where a model tensor's statistics live (to zero it if a step misses it)."""
        self._pieces.append((id(tensor), id(flat), start, length))

    # -- StatisticsSource --------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Ranks × reductions per tensor: every micro-step reduces each gradient once under
        ZeRO-2/3, however the caller drives backward and step (per micro-batch or per cycle)."""
        return self.world * max(self._counts.values(), default=0)

    def moments(self, params) -> tuple[list[Tensor], list[Tensor]]:
        if not self._stale:
            for tid, fid, start, length in self._pieces:  # written fresh by the first reduction, or not at all
                if tid not in self._counts:
                    g, s = self._bufs[fid]
                    g.narrow(0, start, length).zero_()
                    s.narrow(0, start, length).zero_()
        return moment_views(self._bufs, params)

    def reset(self) -> None:
        """The optimizer's own end-of-step reset: nothing to do, ``end_step`` clears instead
        (ZeRO-3 calls the optimizer once per sub-group within one step)."""

    # -- engine side -------------------------------------------------------------------------

    def end_step(self) -> None:
        """The engine's step is over (taken or skipped): the next reduction starts afresh."""
        self._stale = True

    def multiplier(self) -> float:
        """``c``: local reduced-bucket values -> one group's gradient."""
        return self.scaling.group_multiplier(float(self.scaling.loss_scale()))

    def begin_round(self, tensors) -> None:
        """A bucket of ``tensors`` (model parameters) is about to be reduced."""
        if self._stale:
            self._counts.clear()
            self._stale = False
        for t in tensors:
            self._counts[id(t)] = self._counts.get(id(t), 0) + 1

    def first(self, tensor: Tensor) -> bool:
        """True in the first reduction of ``tensor`` since the last step: its pieces are written."""
        return self._counts.get(id(tensor), 0) == 1

    def add(self, flat_id: int, dst: int, sum_g: Tensor, sum_sq: Tensor, c: float, first: bool) -> None:
        """``Σg += c · sum_g`` and ``Σg² += sum_sq`` at ``dst`` (``first``: ``=``), one pass each."""
        g, s = self._bufs[flat_id]
        n = sum_g.numel()
        dg, ds = g.narrow(0, dst, n), s.narrow(0, dst, n)
        if first:
            torch.mul(sum_g, c, out=dg)
            ds.copy_(sum_sq)
        else:
            dg.add_(sum_g, alpha=c)
            ds.add_(sum_sq)

    def buffer_bytes(self) -> int:
        return sum(2 * g.numel() * g.element_size() for g, _ in self._bufs.values())


def attach(engine: Any, path: Any, world: int, squares_dtype: torch.dtype) -> ReductionStats:
    """The per-micro-step scheme on one engine path (``vrgd_ds/ds/paths.py``): the path replaces
    DeepSpeed's bucket reduction and feeds the returned source."""
    stats = ReductionStats(engine, path.targets(), scaling(engine, path, world, path.per_micro_step),
                           per_micro_step=path.per_micro_step, kernels=select_for(engine.basic_optimizer))
    stats.squares_dtype = squares_dtype
    path.hook_reduction(stats)
    return stats


def expected_groups(world: int, gas: int, stage: int, scheme: str = "per_micro_step") -> int:
    """n at every step of a run (docs/design.md §3): ranks × micro-steps, but only ranks on stage 0 /
    ZeRO-1 with the per-micro-step fused reduction (DeepSpeed reduces there once per step)."""
    return world * (gas if stage >= 2 or scheme != "per_micro_step" else 1)


def check_groups(name: str, world: int, gas: int, stage: int, scheme: str = "per_micro_step") -> None:
    """Refuses, before training, a run whose steps would have fewer than ``MIN_GROUPS`` groups
    (``expected_groups``), naming the setting that gives it more."""
    n = expected_groups(world, gas, stage, scheme)
    if n >= MIN_GROUPS:
        return
    micro = stage >= 2 or scheme != "per_micro_step"
    raise UnsupportedConfiguration(
        f"{name}: GSNR needs >= {MIN_GROUPS} gradient groups per step, this run has n={n} "
        f"({world} data-parallel rank(s), gradient_accumulation_steps={gas}, ZeRO stage {stage}: groups are "
        + ("ranks x micro-steps" if micro else "ranks") + "). Use more ranks"
        + (", or gradient_accumulation_steps >= 2" if micro
           else ", or \"vrgd\": {\"squares\": \"per_step\"} with gradient_accumulation_steps >= 2")
        + ", or set 'gsnr': false.")


__all__ = ["ReductionStats", "attach", "check_groups", "expected_groups"]
