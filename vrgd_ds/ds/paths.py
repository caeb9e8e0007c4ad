"""The DeepSpeed engine paths the VRGD statistics attach to, one module each, owning that path's
DeepSpeed internals (listed at the top of each module, checked at attach time):

===========  ==============================  ===============================================
stage        module                          the optimizer updates
===========  ==============================  ===============================================
0            ``vrgd_ds/ds/stage0.py``        the parameters, or FP16_UnfusedOptimizer's fp32 copies
1, 2         ``vrgd_ds/ds/zero12.py``        one flat fp32 partition per param group
3            ``vrgd_ds/ds/zero3.py``         one flat fp32 partition per sub-group
===========  ==============================  ===============================================

The two statistics schemes are written once against ``EnginePath``: per micro-step
(``vrgd_ds/ds/sources.py``: the path replaces DeepSpeed's bucket reduction) and per step
(``vrgd_ds/ds/local.py``: the path lays out local buffers and their one collective).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import Tensor

from vrgd_ds.ds.internals import UnsupportedConfiguration
from vrgd_ds.ds.stage0 import Stage0
from vrgd_ds.ds.zero12 import Zero12
from vrgd_ds.ds.zero3 import Zero3
from vrgd_ds.stats.layout import Layout, ModelTensors


class EnginePath(Protocol):
    #: whether DeepSpeed reduces every micro-step (ZeRO-2/3) or once per step (stage 0, ZeRO-1)
    per_micro_step: bool

    def targets(self) -> list[Tensor]:
        """The tensors the basic optimizer updates, whose statistics the sources provide."""

    def loss_scale(self) -> float:
        """The loss scale now (1 without a scaler): removed from the squares before summing."""

    def layout(self, model: ModelTensors, device: torch.device) -> Layout:
        """Where each model tensor's pieces lie in the targets (per-tensor sums across ranks)."""

    def configure(self, opt: Any) -> None:
        """Sets what the optimizer must know of this path, or refuses what it cannot do."""

    def hook_reduction(self, stats: Any) -> None:
        """Per micro-step: DeepSpeed's bucket reduction replaced by the fused one, feeding ``stats``."""

    def local_buffers(self, stats: Any) -> None:
        """Per step: the local buffers, their hooks and their one collective."""

    def capture_engine_gradient(self, stats: Any) -> None:
        """Per step, ``gbar="engine"``: where the reduced gradient is read before unscaling."""


def for_engine(engine: Any, stage: int) -> EnginePath:
    if stage == 0:
        return Stage0(engine)
    if stage in (1, 2):
        return Zero12(engine, stage)
    if stage == 3:
        return Zero3(engine)
    raise UnsupportedConfiguration(f"vrgd_ds: unknown ZeRO stage {stage}")


__all__ = ["EnginePath", "for_engine"]
