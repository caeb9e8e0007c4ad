"""The per-step scheme on DeepSpeed (``"vrgd": {"squares": "per_step"}``), written once against
the engine paths (``vrgd_ds/ds/paths.py``): each path says where the local buffers sit, which
collective brings them into the optimizer's partition (``local_buffers``) and where DeepSpeed's
reduced gradient is read for ``gbar="engine"`` (``capture_engine_gradient``). The scheme itself,
and why it is exact: ``vrgd_ds/stats/local.py``.
"""
from __future__ import annotations

from typing import Any, Callable

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


def buckets_or_hooks(engine: Any, stats: LocalStats, params: list, holds_micro_step: Callable[[], bool]) -> list[bool]:
    """Where each micro-step is read, chosen now and again whenever ``set_train_batch_size``
    changes the accumulation: DeepSpeed's bucket when ``holds_micro_step()`` (and the config does
    not ask for hooks), else a tensor hook per parameter. Returns a one-element list the engine
    path's reduction wrapper reads (True: record the bucket)."""
    use_buckets = [False]

    def choose() -> None:
        use_buckets[0] = holds_micro_step() and not stats.hooks_only
        for p in params:
            if use_buckets[0]:
                stats.unhook(p)
            else:
                stats.hook(p)

    choose()
    set_batch = engine.set_train_batch_size

    def set_train_batch_size(*args, **kwargs):
        out = set_batch(*args, **kwargs)
        choose()
        return out

    engine.set_train_batch_size = set_train_batch_size
    return use_buckets
