"""ZeRO-1 and ZeRO-2 (``DeepSpeedZeroOptimizer``): one flat fp32 partition per param group on
each rank; model tensors may be cut between ranks.

Everything this path reads or replaces in DeepSpeed 0.19.8 is here and checked at attach time:

* ``gradient_reduction_w_predivide(tensor, communication_data_type)``: replaced by the fused
  ``[g | (c·g)²]`` all-reduce (per-micro-step scheme); ``reduce_scatter`` is set to False so
  every bucket goes through it; ``ipg_buckets[dtype].params``: the bucket's parameters, in order;
* ``grad_start_offset``/``grad_partition_insertion_offset``/``partition_size``/``bit16_groups``/
  ``get_param_id``/``real_dp_process_group``: which piece of each parameter this rank owns;
* ``single_partition_of_fp32_groups``: the tensors the basic optimizer updates;
  ``bit16_groups_flat``: the flat layout (padding included) the per-step local buffer copies;
* ``average_tensor(tensor, communication_data_type)``: where an ipg bucket (``ipg_buckets[dtype]``,
  its ``params`` of ``(group, index, id)`` in bucket order) holds one micro-step's gradients just
  before DeepSpeed reduces it (per-step scheme);
* ``unscale_and_clip_grads(grad_groups_flat, total_norm)``: where the reduced gradient is read
  for ``gbar="engine"``; ``loss_scale``; ``dp_process_group``.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from vrgd_ds.ds.internals import UnsupportedConfiguration, require
from vrgd_ds.ds.local import buckets_or_hooks
from vrgd_ds.stats.comm import fused_all_reduce_sync
from vrgd_ds.stats.layout import Layout, ModelTensors
from vrgd_ds.stats.local import LocalStats

_REQUIRED = ("gradient_reduction_w_predivide", "average_tensor", "grad_start_offset",
             "grad_partition_insertion_offset", "single_partition_of_fp32_groups", "bit16_groups",
             "bit16_groups_flat", "ipg_buckets", "partition_size", "real_dp_process_group", "dp_process_group",
             "loss_scale", "get_param_id", "unscale_and_clip_grads", "overlap_comm", "reduction_stream",
             "check_grad_overflow", "compute_grad_norm", "dtype")


def pieces(zopt: Any, i: int) -> list[tuple[Tensor, int, int, int]]:
    """(model parameter, start in the parameter, start in this rank's partition, length) of
    every piece of param group ``i`` this rank owns."""
    part = dist.get_rank(group=zopt.real_dp_process_group[i])
    starts = zopt.grad_start_offset[i][part]
    inserts = zopt.grad_partition_insertion_offset[i][part]
    out = []
    for p in zopt.bit16_groups[i]:
        pid = zopt.get_param_id(p)
        if pid in starts:
            src, dst = int(starts[pid]), int(inserts[pid])
            num = int(min(p.numel() - src, zopt.partition_size[i] - dst))
            if num > 0:
                out.append((p, src, dst, num))
    return out


class Zero12:
    """The ZeRO-1/2 engine path (``vrgd_ds/ds/paths.py``'s ``EnginePath``)."""

    def __init__(self, engine: Any, stage: int) -> None:
        self.engine = engine
        self.zopt = engine.optimizer
        require(self.zopt, _REQUIRED, type(self.zopt).__name__)
        self.per_micro_step = stage >= 2  # ZeRO-2 reduces every micro-step, ZeRO-1 at the boundary
        self.flats = list(self.zopt.single_partition_of_fp32_groups)
        self.pieces = [pieces(self.zopt, i) for i in range(len(self.flats))]

    def targets(self) -> list[Tensor]:
        return self.flats

    def loss_scale(self) -> float:
        return self.zopt.loss_scale

    def layout(self, model: ModelTensors, device: torch.device) -> Layout:
        layout = Layout(model.names, model.numel, group=self.zopt.dp_process_group, device=device,
                        shapes=model.shapes, comm=dist)
        for flat, owned in zip(self.flats, self.pieces):
            layout.add(flat, [(dst, num, model.keys[id(p)], src) for p, src, dst, num in owned])
        return layout

    def configure(self, opt: Any) -> None:
        # DeepSpeedZeroOptimizer._optimizer_step calls step() once per param group (param_groups
        # narrowed to that group): one engine step's metrics merge over the calls.
        opt.merge_step_records = True
        # a step skipped on a non-finite gradient is DeepSpeed's decision over every group, taken before
        # the first call: its overflow check (bf16.check_grad_overflow) or, in fp32, its global norm
        unchecked = None
        if not self.zopt.check_grad_overflow and self.zopt.dtype == torch.bfloat16:
            unchecked = "bf16.check_grad_overflow false"
        elif not self.zopt.check_grad_overflow and not self.zopt.compute_grad_norm:
            unchecked = "zero_optimization.compute_grad_norm false"
        if unchecked and len(opt.param_groups) > 1:
            raise UnsupportedConfiguration(
                f"vrgd_ds: '{unchecked}' is not supported with VRGD optimizers and {len(opt.param_groups)} param "
                "groups: DeepSpeed then checks no gradient for NaN/inf before ZeRO-1/2 step the groups one at a "
                "time, so a non-finite gradient would skip the groups from its own on and step those before it; "
                "remove the key")
        if len(opt.param_groups) > 1 and any(g.get("grad_pre_normalization") for g in opt.param_groups):
            raise UnsupportedConfiguration(
                "vrgd_ds: grad_pre_normalization under ZeRO-1/2 with more than one param group is not supported: "
                "ZeRO-1/2 step the param groups one at a time, so the global gradient norm would be per group")

    # -- the per-micro-step scheme (vrgd_ds/ds/sources.py) ------------------------------------------

    def hook_reduction(self, stats: Any) -> None:
        """Every bucket goes through ``gradient_reduction_w_predivide``, which becomes one fused
        all-reduce of ``[g | (c·g)²]``; this rank's pieces of the squares go to its partition."""
        zopt, flats = self.zopt, self.flats
        owned = {i: {id(p): (src, dst, num) for p, src, dst, num in ps} for i, ps in enumerate(self.pieces)}
        for flat, ps in zip(flats, self.pieces):
            for p, _, dst, num in ps:
                stats.piece(p, flat, dst, num)
        group = zopt.dp_process_group
        zopt.reduce_scatter = False  # every bucket goes through gradient_reduction_w_predivide

        def gradient_reduction_w_predivide(tensor, communication_data_type):
            if tensor.numel() == 0:
                return tensor
            k = dist.get_world_size(group=group)
            bucket = zopt.ipg_buckets[communication_data_type]
            stats.begin_round([zopt.bit16_groups[i][pidx] for i, pidx, _ in bucket.params])
            c = stats.multiplier()
            red_g, red_sq = fused_all_reduce_sync(dist, tensor, c, group, stats.counters, stats.kernels,
                                                  stats.squares_dtype)
            n = tensor.numel()
            off = 0
            for i, pidx, _ in bucket.params:
                p = zopt.bit16_groups[i][pidx]
                piece = owned[i].get(id(p))
                if piece is not None:
                    src, dst, num = piece
                    stats.add(id(flats[i]), dst, red_g.narrow(0, off + src, num), red_sq.narrow(0, off + src, num),
                              c, stats.first(p))
                off += p.numel()
            if off != n:
                raise RuntimeError(f"DeepSpeed's reduction bucket holds {n} elements but its parameters {off}: the "
                                   "bucket layout differs from DeepSpeed 0.19.8's (unsupported DeepSpeed version?)")
            flat = tensor.view(-1)
            if flat.dtype == torch.float32:
                torch.mul(red_g, 1.0 / k, out=flat)  # DeepSpeed's postscale average
                return tensor
            flat.copy_(red_g.mul_(1.0 / k))
            # as DeepSpeed's: a reduction in another dtype than the bucket's returns its result in that
            # dtype (ZeRO-2 with fp32 grad_accum_dtype adds it to the fp32 partition), else the bucket
            return red_g if communication_data_type != tensor.dtype else tensor

        zopt.gradient_reduction_w_predivide = gradient_reduction_w_predivide

    # -- the per-step scheme (vrgd_ds/ds/local.py) --------------------------------------------------

    def local_buffers(self, stats: LocalStats) -> None:
        """A statistics bucket per param group laid out like DeepSpeed's flat ``bit16_groups_flat``
        (padding included), one rank's ``[Σg | Σg²]`` after another, reduce-scattered into this
        rank's partition once per step; each micro-step's squares from DeepSpeed's ipg buckets
        (``record_micro_steps``)."""
        zopt, targets = self.zopt, self.flats
        for i, flat16 in enumerate(zopt.bit16_groups_flat):
            group = zopt.real_dp_process_group[i]
            k = dist.get_world_size(group=group)
            if flat16.numel() != k * targets[i].numel():
                raise RuntimeError(f"DeepSpeed's flat group {i} holds {flat16.numel()} elements, not {k} partitions "
                                   f"of {targets[i].numel()}: a layout DeepSpeed 0.19.8 does not produce")
            bucket = stats.add_bucket(flat16.numel(), flat16.device, lambda b, group=group: b.reduce_scatter(group),
                                      ranks=k)
            stats.alias(targets[i], *bucket.scatter_outputs())
            base, size = flat16.data_ptr(), flat16.element_size()
            for p in zopt.bit16_groups[i]:
                off = (p.data_ptr() - base) // size
                if not 0 <= off <= flat16.numel() - p.numel():
                    raise RuntimeError("a parameter of a ZeRO-1/2 group is not a view of DeepSpeed's flat buffer "
                                       "(bit16_groups_flat): a layout DeepSpeed 0.19.8 does not produce")
                stats.place(p, bucket, off, p.numel())
        self.record_micro_steps(stats)

    def node_buffers(self, stats: Any) -> None:
        """The hierarchical scheme (``vrgd_ds/stats/hierarchical.py``): per param group a node buffer
        of this rank's local index, reduced across nodes into this rank's partition once per step;
        each micro-step read from DeepSpeed's ipg buckets as ``local_buffers`` does."""
        zopt, targets = self.zopt, self.flats
        for i, flat16 in enumerate(zopt.bit16_groups_flat):
            k = dist.get_world_size(group=zopt.real_dp_process_group[i])
            if k != stats.world or flat16.numel() != k * targets[i].numel():
                raise RuntimeError(f"DeepSpeed's flat group {i} holds {flat16.numel()} elements, not {stats.world} "
                                   f"partitions of {targets[i].numel()}: a layout DeepSpeed 0.19.8 does not produce")
            b = stats.add_node_bucket(flat16.numel(), flat16.device)
            stats.alias(targets[i], *stats.halves(b))
            base, size = flat16.data_ptr(), flat16.element_size()
            for p in zopt.bit16_groups[i]:
                stats.place_flat(p, b, (p.data_ptr() - base) // size, p.numel())
        self.record_micro_steps(stats)

    def bucket_holds_micro_step(self) -> bool:
        """Whether DeepSpeed's ipg bucket holds one micro-step's local gradient when it is reduced:
        ZeRO-2 reduces every micro-step; ZeRO-1 reduces the accumulated gradient at the boundary,
        which is one micro-step's only without accumulation."""
        return self.per_micro_step or int(self.engine.gradient_accumulation_steps()) == 1

    def record_micro_steps(self, stats: LocalStats) -> None:
        """Each micro-step's gradients into the statistics: one ``pack_bucket`` launch per ipg
        bucket, queued on the current stream just before DeepSpeed's ``average_tensor`` reduces
        the bucket in place (with ``overlap_comm``, after every stream that copied into the bucket,
        and before the reduction stream, made to wait for it); where no
        bucket holds one micro-step (ZeRO-1 with accumulation), a tensor hook per parameter.
        ``set_train_batch_size`` changes the accumulation: the choice is made again there."""
        zopt, engine = self.zopt, self.engine
        groups = zopt.bit16_groups
        params = [p for g in groups for p in g]
        original = zopt.average_tensor

        def members(entries) -> list[tuple[int, int]]:
            out, off = [], 0
            for i, j, _ in entries:
                p = groups[i][j]
                out.append((stats.index(p), off))
                off += p.numel()
            return out

        acc = get_accelerator()
        ordered = zopt.overlap_comm and not acc.resolves_data_dependency()  # streams to order (a GPU)

        def average_tensor(tensor, communication_data_type):
            if use_buckets[0]:
                bucket = zopt.ipg_buckets[communication_data_type]
                entries = bucket.params
                if ordered:
                    current = acc.current_stream()
                    for stream in bucket.copy_streams:  # producers on other streams (torch.compile)
                        current.wait_stream(stream)
                stats.record_bucket(tuple(entries), tensor, lambda: members(entries))
                if ordered:  # DeepSpeed's reduction stream waits for the copy streams only, where it
                    # has any: the in-place reduction must also wait for the kernel reading the bucket
                    zopt.reduction_stream.wait_stream(current)
            return original(tensor, communication_data_type)

        zopt.average_tensor = average_tensor
        use_buckets = buckets_or_hooks(engine, stats, params, self.bucket_holds_micro_step,
                                       reduced_at_boundary=not self.per_micro_step)

    def capture_engine_gradient(self, stats: LocalStats) -> None:
        """``gbar="engine"``: each group's reduced partition gradient, read just before DeepSpeed
        unscales and clips it."""
        zopt, targets = self.zopt, self.flats
        original = zopt.unscale_and_clip_grads

        def unscale_and_clip_grads(grad_groups_flat, total_norm):
            for grad in grad_groups_flat:
                for t in targets:
                    if t.grad is grad:
                        stats.capture(t, grad)
            return original(grad_groups_flat, total_norm)

        zopt.unscale_and_clip_grads = unscale_and_clip_grads
