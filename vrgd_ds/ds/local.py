"""The per-step scheme on DeepSpeed (``"vrgd": {"squares": "per_step"}``), written once against
the engine paths (``vrgd_ds/ds/paths.py``): each path says where the local buffers sit, which
collective brings them into the optimizer's partition (``local_buffers``) and where DeepSpeed's
reduced gradient is read for ``gbar="engine"`` (``capture_engine_gradient``). The scheme itself,
and why it is exact: ``vrgd_ds/stats/local.py``.
"""
from __future__ import annotations

from typing import Any

import torch

import deepspeed.comm as dist

from vrgd_ds.stats.local import LocalStats


def attach(engine: Any, path: Any, world: int, gbar: str, squares_dtype: torch.dtype, kernels: Any,
           hooks_only: bool = False) -> LocalStats:
    """``hooks_only`` (``"vrgd": {"micro_steps": "hooks"}``): a tensor hook per parameter even where
    a DeepSpeed bucket holds each micro-step."""
    stats = LocalStats(dist, kernels, world, path.targets(), gbar, squares_dtype, path.loss_scale,
                       engine.gradient_accumulation_steps)
    stats.hooks_only = hooks_only
    path.local_buffers(stats)
    if gbar == "engine":
        path.capture_engine_gradient(stats)
    return stats
