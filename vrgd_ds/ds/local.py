"""The per-step statistics scheme on each DeepSpeed engine path (``"vrgd": {"squares":
"per_step"}``): where the local buffers sit, which collective brings them into the
optimizer's partition, and where DeepSpeed's reduced gradient is read for ``gbar="engine"``.
The scheme itself, and why it is exact: ``vrgd_ds/stats/local.py``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import deepspeed.comm as dist

from vrgd_ds.stats.local import LocalStats, Flat, reduce


# ---- per engine path ----------------------------------------------------------------------------


def attach_stage0(engine: Any, pairs: list[tuple[Tensor, Tensor]], world: int, gbar: str,
                  squares_dtype: torch.dtype, kernels: Any) -> LocalStats:
    """Stage 0: one flat local buffer over all parameters, all-reduced once per step; the
    optimizer's statistics are views of it. ``pairs``: (model parameter, tensor the basic
    optimizer updates)."""
    wrapper = engine.optimizer
    scale = (lambda: wrapper.loss_scale) if hasattr(type(wrapper), "loss_scale") else (lambda: 1.0)
    stats = LocalStats(dist, kernels, world, [m for _, m in pairs], gbar, squares_dtype, scale,
                       engine.gradient_accumulation_steps)
    total = sum(p.numel() for p, _ in pairs)
    device = pairs[0][1].device if pairs else torch.device("cpu")
    group = engine.seq_data_parallel_group

    def reduce_flat(f: Flat) -> list[Any]:
        if f.g is not None and squares_dtype == torch.float32:  # [Σg | Σg²]: one all-reduce, twice the bytes
            works = reduce(stats, f.both, f.both, group, scatter=False, dtype=torch.float32)
            stats.counters.grad_bytes_fp32 -= 4 * f.g.numel()  # it stands for one fp32 gradient
            return works
        works = reduce(stats, f.sq, f.sq, group, scatter=False, dtype=squares_dtype)
        if f.g is not None:
            works += reduce(stats, f.g, f.g, group, scatter=False, dtype=torch.float32, squares=False)
        return works

    flat = stats.add_flat(total, device, reduce_flat)
    off = 0
    for p, m in pairs:
        n = p.numel()
        stats.watch(p, flat, off, n)
        g, _ = stats.target_bufs(m)  # the statistics of m are views of the reduced flat buffer
        stats.alias(m, g if flat.g is None else flat.g.narrow(0, off, n), flat.sq.narrow(0, off, n))
        off += n
    if gbar == "engine":
        if type(wrapper).__name__ == "FP16_UnfusedOptimizer":
            original = wrapper.unscale_and_clip_grads

            def unscale_and_clip_grads(total_norm, apply_scale=True):
                for _, m in pairs:
                    if m.grad is not None:
                        stats.capture(m, m.grad)
                return original(total_norm, apply_scale)

            wrapper.unscale_and_clip_grads = unscale_and_clip_grads
        else:
            clip = engine.clip_fp32_gradients

            def clip_fp32_gradients():
                for _, m in pairs:
                    if m.grad is not None:
                        stats.capture(m, m.grad)
                return clip()

            engine.clip_fp32_gradients = clip_fp32_gradients
    return stats


def attach_zero12(engine: Any, zopt: Any, world: int, gbar: str, squares_dtype: torch.dtype,
                  kernels: Any) -> LocalStats:
    """ZeRO-1/2: a local buffer per param group laid out like DeepSpeed's flat ``bit16_groups_flat``
    (padding included), reduce-scattered into this rank's partition once per step."""
    targets = list(zopt.single_partition_of_fp32_groups)
    stats = LocalStats(dist, kernels, world, targets, gbar, squares_dtype, lambda: zopt.loss_scale,
                       engine.gradient_accumulation_steps)
    for i, flat16 in enumerate(zopt.bit16_groups_flat):
        group = zopt.real_dp_process_group[i]
        gb, sb = stats.target_bufs(targets[i])
        k = dist.get_world_size(group=group)
        if flat16.numel() != k * targets[i].numel():
            raise RuntimeError(f"DeepSpeed's flat group {i} holds {flat16.numel()} elements, not {k} partitions of "
                               f"{targets[i].numel()}: a layout DeepSpeed 0.19.8 does not produce")

        def reduce_flat(f: Flat, gb=gb, sb=sb, group=group) -> list[Any]:
            works = reduce(stats, f.sq, sb, group, scatter=True, dtype=squares_dtype)
            if f.g is not None:
                works += reduce(stats, f.g, gb, group, scatter=True, dtype=torch.float32, squares=False)
            return works

        flat = stats.add_flat(flat16.numel(), flat16.device, reduce_flat)
        base, size = flat16.data_ptr(), flat16.element_size()
        for p in zopt.bit16_groups[i]:
            off = (p.data_ptr() - base) // size
            if not 0 <= off <= flat16.numel() - p.numel():
                raise RuntimeError("a parameter of a ZeRO-1/2 group is not a view of DeepSpeed's flat buffer "
                                   "(bit16_groups_flat): a layout DeepSpeed 0.19.8 does not produce")
            stats.watch(p, flat, off, p.numel())
    if gbar == "engine":
        original = zopt.unscale_and_clip_grads

        def unscale_and_clip_grads(grad_groups_flat, total_norm):
            for grad in grad_groups_flat:
                for t in targets:
                    if t.grad is grad:
                        stats.capture(t, grad)
            return original(grad_groups_flat, total_norm)

        zopt.unscale_and_clip_grads = unscale_and_clip_grads
    return stats


def attach_zero3(engine: Any, zopt: Any, world: int, gbar: str, squares_dtype: torch.dtype, kernels: Any,
                 pieces: dict[int, tuple[int, int, int]]) -> LocalStats:
    """ZeRO-3: one full-size local buffer per parameter, reduce-scattered once per step with
    DeepSpeed's own coalesced reduce-scatter (its partitioning of each parameter); ``pieces``:
    parameter id -> (sub-group, offset in this rank's flat partition, valid length)."""
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    targets = list(zopt.fp32_partitioned_groups_flat)
    stats = LocalStats(dist, kernels, world, targets, gbar, squares_dtype, lambda: zopt.loss_scale,
                       engine.gradient_accumulation_steps)
    params = [p for group in zopt.fp16_groups for p in group]
    sizes = [int(p.ds_numel) for p in params]
    group = zopt.dp_process_group
    k = dist.get_world_size(group=group)

    def reduce_flat(f: Flat) -> list[Any]:
        views = [f.sq.narrow(0, off, n) for off, n in zip(offsets, sizes)]
        parts = _scatter3(stats, reduce_scatter_coalesced, views, group, squares_dtype)
        gparts = None
        if f.g is not None:
            gparts = _scatter3(stats, reduce_scatter_coalesced, [f.g.narrow(0, off, n) for off, n in zip(offsets, sizes)],
                               group, torch.float32, squares=False)
        for j, p in enumerate(params):
            sub, dst, valid = pieces[id(p)]
            if valid:
                gb, sb = stats.target_bufs(targets[sub])
                sb.narrow(0, dst, valid).copy_(parts[j].view(-1)[:valid]).mul_(k)  # the helper averages over k
                if gparts is not None:
                    gb.narrow(0, dst, valid).copy_(gparts[j].view(-1)[:valid]).mul_(k)
        return []

    offsets, off = [], 0
    for n in sizes:
        offsets.append(off)
        off += n
    flat = stats.add_flat(off, targets[0].device if targets else torch.device("cpu"), reduce_flat)
    for p, o, n in zip(params, offsets, sizes):
        stats.watch(p, flat, o, n)
    if gbar == "engine":
        original = zopt.unscale_and_clip_grads

        def unscale_and_clip_grads(sub_group_id, total_norm):
            t = targets[sub_group_id]
            stats.capture(t, t.grad)
            return original(sub_group_id, total_norm)

        zopt.unscale_and_clip_grads = unscale_and_clip_grads
    return stats


def _scatter3(stats: LocalStats, reduce_scatter_coalesced: Any, views: list[Tensor], group: Any,
              dtype: torch.dtype, squares: bool = True) -> list[Tensor]:
    k = dist.get_world_size(group=group)
    # the helper pads every tensor to a multiple of k, as it does for DeepSpeed's own fp32 gradient
    # reduce-scatter: the padded size is what one fp32 gradient costs on this path
    sent = sum(-(-v.numel() // k) * k for v in views)
    if dtype != torch.float32:
        low = [v.to(dtype) for v in views]
        stats.count(sent if squares else 0, sent * low[0].element_size())
        return [x.float() for x in reduce_scatter_coalesced(low, group)]
    stats.count(sent if squares else 0, sent * 4)
    return reduce_scatter_coalesced(views, group)
