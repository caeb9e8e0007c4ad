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

from vrgd_ds.ds.internals import UnsupportedConfiguration
from vrgd_ds.stats import hierarchical
from vrgd_ds.stats.hierarchical import NodeStats, node_groups
from vrgd_ds.stats.local import LocalStats
from vrgd_ds.stats.scaling import Scaling


def scaling(engine: Any, path: Any, world: int, per_micro_step: bool = True) -> Scaling:
    """DeepSpeed's scaling of the values the statistics read (``vrgd_ds/stats/scaling.py``): the
    path's loss scale, and each micro-step's loss divided by the accumulation steps. A reduction
    at the accumulation boundary (``per_micro_step=False``) reads the accumulated gradient, whose
    average over the micro-steps is the one group."""
    accumulation = engine.gradient_accumulation_steps if per_micro_step else Scaling(world).accumulation
    return Scaling(world, path.loss_scale, accumulation)


def attach(engine: Any, path: Any, world: int, gbar: str, squares_dtype: torch.dtype, kernels: Any,
           hooks_only: bool = False) -> LocalStats:
    """``hooks_only`` (``"vrgd": {"micro_steps": "hooks"}``): a tensor hook per parameter even where
    a DeepSpeed bucket holds each micro-step."""
    stats = LocalStats(dist, kernels, scaling(engine, path, world), path.targets(), gbar, squares_dtype)
    stats.hooks_only = hooks_only
    path.local_buffers(stats)
    if gbar == "engine":
        path.capture_engine_gradient(stats)
    return stats


def buckets_or_hooks(engine: Any, stats: LocalStats, params: list, holds_micro_step: Callable[[], bool],
                     reduced_at_boundary: bool = False) -> list[bool]:
    """Where each micro-step is read, chosen now and again whenever ``set_train_batch_size``
    changes the accumulation: DeepSpeed's bucket when ``holds_micro_step()`` (and the config does
    not ask for hooks), else a tensor hook per parameter. Returns a one-element list the engine
    path's reduction wrapper reads (True: record the bucket). ``reduced_at_boundary`` (stage 0,
    ZeRO-1: the bucket is reduced at the accumulation boundary only): while the bucket is read,
    ``engine.set_gradient_accumulation_boundary(False)`` is refused, since the backward passes up
    to the boundary would reach the bucket as one sum."""
    use_buckets = [False]
    if reduced_at_boundary:
        set_boundary = engine.set_gradient_accumulation_boundary

        def set_gradient_accumulation_boundary(is_boundary: bool) -> Any:
            if not is_boundary and use_buckets[0]:
                raise UnsupportedConfiguration(
                    "vrgd_ds: engine.set_gradient_accumulation_boundary(False) with gradient_accumulation_steps 1 "
                    "is not supported with VRGD optimizers on stage 0 and ZeRO-1: the backward passes up to the "
                    "boundary are summed and reduced once, one group per rank to the statistics; set "
                    "gradient_accumulation_steps to the backward passes per step (Accelerate: its "
                    "gradient_accumulation_steps), or 'gsnr': false")
            return set_boundary(is_boundary)

        engine.set_gradient_accumulation_boundary = set_gradient_accumulation_boundary

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


def host_node_size(group: Any, world: int) -> int:
    """The ranks per node: those that share a host (``vrgd_ds.stats.hierarchical.host_node_size``),
    refused naming ``vrgd.node_size`` where they are not consecutive."""
    try:
        return hierarchical.host_node_size(group, world)
    except ValueError as exc:
        raise UnsupportedConfiguration(f"vrgd.node_size: {exc}; set \"vrgd\": {{\"node_size\": N}} to say which ranks "
                                       "form a node") from None


def attach_hierarchical(engine: Any, path: Any, world: int, gbar: str, kernels: Any, node_size: int | None,
                        hooks_only: bool = False) -> NodeStats:
    """The hierarchical scheme on an engine path that supports it (``path.node_buffers``)."""
    group = engine.seq_data_parallel_group
    if dist.get_world_size(group=group) != dist.get_world_size():
        raise UnsupportedConfiguration(
            "vrgd.squares: 'hierarchical' needs the data-parallel group to be every rank (no model parallelism "
            "beside it); use 'per_step'")
    size = node_size if node_size is not None else host_node_size(group, world)
    if world % size:
        raise UnsupportedConfiguration(f"vrgd.node_size: {size} does not divide the {world} data-parallel ranks")
    nodes = node_groups(dist, world, dist.get_rank(), size)
    stats = NodeStats(dist, kernels, scaling(engine, path, world), path.targets(), gbar, nodes)
    stats.hooks_only = hooks_only
    path.node_buffers(stats)
    if gbar == "engine":
        path.capture_engine_gradient(stats)
    return stats
