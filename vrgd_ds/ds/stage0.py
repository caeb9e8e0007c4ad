"""DeepSpeed without ZeRO (stage 0): the engine's own bucketed all-reduce, the basic optimizer
unwrapped (fp32) or under ``FP16_UnfusedOptimizer`` (fp16/bf16, fp32 master copies).

Everything this path reads or replaces in DeepSpeed 0.19.8 is here and checked at attach time:

* ``engine.allreduce_bucket(bucket, dp_group, dp_world_size)`` and ``engine.flatten``: replaced
  by the fused ``[g | (c·g)²]`` all-reduce (per-micro-step scheme);
* ``engine.clip_fp32_gradients`` (fp32) or ``FP16_UnfusedOptimizer.unscale_and_clip_grads``:
  where the reduced gradient is read for ``gbar="engine"`` (per-step scheme);
* ``FP16_UnfusedOptimizer.fp16_groups``/``fp32_groups``: model parameter → master copy;
  ``loss_scale``: the scale removed from the squares;
* ``engine.seq_data_parallel_group``: the group the gradients are reduced over.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import deepspeed.comm as dist

from vrgd_ds.ds.internals import UnsupportedConfiguration, require
from vrgd_ds.ds.local import buckets_or_hooks
from vrgd_ds.stats.comm import fused_all_reduce_sync
from vrgd_ds.stats.layout import Layout, ModelTensors
from vrgd_ds.stats.local import PAD, LocalStats

_ENGINE = ("allreduce_bucket", "clip_fp32_gradients", "seq_data_parallel_group", "gradient_accumulation_steps",
           "set_train_batch_size")
_ENGINE_LATE = ("flatten",)  # set by the engine after it configured the optimizer: checked at the first use
_FP16_UNFUSED = ("fp16_groups", "fp32_groups", "loss_scale", "unscale_and_clip_grads", "fused_lamb_legacy")


class Stage0:
    """The stage-0 engine path (``vrgd_ds/ds/paths.py``'s ``EnginePath``)."""

    per_micro_step = False  # DeepSpeed reduces once per step, at the accumulation boundary

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.wrapper = engine.optimizer
        opt = engine.basic_optimizer
        require(engine, _ENGINE, "DeepSpeedEngine")
        self.unfused = type(self.wrapper).__name__ == "FP16_UnfusedOptimizer"
        if self.unfused:
            require(self.wrapper, _FP16_UNFUSED, "FP16_UnfusedOptimizer")
            # set by DeepSpeed for a config optimizer named "lamb": its FusedLamb's legacy step with
            # grads/scale arguments; ours steps as a torch optimizer on the fp32 masters
            self.wrapper.fused_lamb_legacy = False
            self.pairs = [(p, m) for lp, hp in zip(self.wrapper.fp16_groups, self.wrapper.fp32_groups)
                          for p, m in zip(lp, hp) if p.requires_grad]
        elif self.wrapper is opt:  # frozen parameters have no gradient to read (DeepSpeed skips them too)
            self.pairs = [(p, p) for g in opt.param_groups for p in g["params"] if p.requires_grad]
        else:
            raise UnsupportedConfiguration(
                f"vrgd_ds: DeepSpeed wrapped the VRGD optimizer in {type(self.wrapper).__name__}, which the hooks "
                "do not cover (stage 0 supports fp32 and bf16; fp16 needs ZeRO stage 1 or more)")

    def targets(self) -> list[Tensor]:
        """The tensors the basic optimizer updates: the parameters, or their fp32 master copies."""
        return [m for _, m in self.pairs]

    def loss_scale(self) -> float:
        return self.wrapper.loss_scale if self.unfused else 1.0

    def layout(self, model: ModelTensors, device: torch.device) -> Layout:
        layout = Layout(model.names, model.numel, group=None, device=device, shapes=model.shapes, comm=dist)
        for p, m in self.pairs:
            layout.add(m, [(0, m.numel(), model.keys[id(p)])])
        return layout

    def configure(self, opt: Any) -> None:
        """Every tensor is whole on every rank: nothing to refuse."""

    # -- the per-micro-step scheme (vrgd_ds/ds/sources.py) ------------------------------------------

    def hook_reduction(self, stats: Any) -> None:
        """``engine.allreduce_bucket`` becomes one fused all-reduce of ``[g | (c·g)²]``; the ``g``
        half, divided by the ranks, goes back into the bucket as DeepSpeed's average would."""
        engine, pairs = self.engine, self.pairs
        by_param = {id(p): m for p, m in pairs}
        for p, m in pairs:
            stats.piece(p, m, 0, m.numel())

        def allreduce_bucket(bucket, dp_group, dp_world_size=None):
            require(engine, _ENGINE_LATE, "DeepSpeedEngine")
            k = dp_world_size or dist.get_world_size(group=dp_group)
            tensor = engine.flatten(bucket)
            owner = {p.grad.data_ptr(): (p, by_param[id(p)]) for p, _ in pairs if p.grad is not None}
            found = [owner.get(t.data_ptr()) for t in bucket]
            if any(f is None for f in found):
                raise RuntimeError("a gradient in DeepSpeed's reduction bucket belongs to no parameter of the "
                                   "VRGD optimizer (stage 0); was a parameter left out of the optimizer?")
            stats.begin_round([p for p, _ in found])
            c = stats.multiplier()
            red_g, red_sq = fused_all_reduce_sync(dist, tensor, c, dp_group, stats.counters, stats.kernels,
                                                  stats.squares_dtype)
            off = 0
            for t, (p, m) in zip(bucket, found):
                num = t.numel()
                stats.add(id(m), 0, red_g.narrow(0, off, num), red_sq.narrow(0, off, num), c, stats.first(p))
                off += num
            tensor.copy_(red_g.mul_(1.0 / k))  # DeepSpeed's postscale average
            return tensor

        engine.allreduce_bucket = allreduce_bucket

    # -- the per-step scheme (vrgd_ds/ds/local.py) --------------------------------------------------

    def local_buffers(self, stats: LocalStats) -> None:
        """One statistics bucket over all parameters, ``[Σg | Σg²]``, all-reduced in place once per
        step; the optimizer's statistics are views of it. Without accumulation the squares come
        from the flat bucket DeepSpeed reduces at the boundary (``allreduce_bucket``): one launch
        per bucket; with accumulation DeepSpeed reduces the accumulated gradient, so a tensor hook
        per parameter records each micro-step."""
        pairs = self.pairs
        group = self.engine.seq_data_parallel_group
        device = pairs[0][1].device if pairs else torch.device("cpu")
        bucket = stats.add_bucket(sum(p.numel() for p, _ in pairs), device, lambda b: b.all_reduce_in_place(group))
        off = 0
        for p, m in pairs:
            n = p.numel()
            stats.place(p, bucket, off, n)
            g, sq = bucket.halves()
            stats.alias(m, None if g is None else g.narrow(0, off, n), sq.narrow(0, off, n))
            off += n
        self.record_micro_steps(stats)

    def node_buffers(self, stats: Any) -> None:
        """The hierarchical scheme (``vrgd_ds/stats/hierarchical.py``) where every rank steps every
        parameter: all parameters as one flat group (padded to ``node_size · PAD``), cut into one
        partition per local rank; the node buffers reduced across nodes and gathered within the
        node at the step into the whole group's sums, which the optimizer's statistics view.
        Micro-steps recorded as ``local_buffers`` records them."""
        pairs = self.pairs
        device = pairs[0][1].device if pairs else torch.device("cpu")
        quantum = stats.nodes.size * PAD
        total = sum(p.numel() for p, _ in pairs)
        bucket = stats.add_node_bucket(-(-total // quantum) * quantum, device, replicated=True)
        g, sq = stats.halves(bucket)
        off = 0
        for p, m in pairs:
            n = p.numel()
            stats.place_flat(p, bucket, off, n)
            stats.alias(m, None if g is None else g.narrow(0, off, n), sq.narrow(0, off, n))
            off += n
        self.record_micro_steps(stats)

    def record_micro_steps(self, stats: LocalStats) -> None:
        engine, pairs = self.engine, self.pairs
        original = engine.allreduce_bucket

        def allreduce_bucket(bucket, dp_group, dp_world_size=None):
            if not use_buckets[0]:
                return original(bucket, dp_group, dp_world_size)
            require(engine, _ENGINE_LATE, "DeepSpeedEngine")
            owner = {p.grad.data_ptr(): p for p, _ in pairs if p.grad is not None}
            found = [owner.get(t.data_ptr()) for t in bucket]
            if any(f is None for f in found):
                raise RuntimeError("a gradient in DeepSpeed's reduction bucket belongs to no parameter of the "
                                   "VRGD optimizer (stage 0); was a parameter left out of the optimizer?")
            flat = engine.flatten(bucket)
            stats.record_bucket(tuple(map(id, found)), flat, lambda: members(found))
            # one tensor flattens to itself: DeepSpeed reduces the flat bucket just read, in place
            return original([flat], dp_group, dp_world_size)

        def members(found) -> list[tuple[int, int]]:
            out, off = [], 0
            for p in found:
                out.append((stats.index(p), off))
                off += p.numel()
            return out

        engine.allreduce_bucket = allreduce_bucket
        use_buckets = buckets_or_hooks(engine, stats, [p for p, _ in pairs],
                                       lambda: int(engine.gradient_accumulation_steps()) == 1, reduced_at_boundary=True)

    def capture_engine_gradient(self, stats: LocalStats) -> None:
        """``gbar="engine"``: the reduced gradient, read just before DeepSpeed unscales and clips it."""
        pairs = self.pairs
        owner, name = (self.wrapper, "unscale_and_clip_grads") if self.unfused else (self.engine,
                                                                                    "clip_fp32_gradients")
        original = getattr(owner, name)

        def read_then(*args, **kwargs):
            for _, m in pairs:
                if m.grad is not None:
                    stats.capture(m, m.grad)
            return original(*args, **kwargs)

        setattr(owner, name, read_then)
