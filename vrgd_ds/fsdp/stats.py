"""Gradient statistics taken at FSDP2's own reduction (``vrgd_ds.fsdp.attach``; docs/fsdp.md).

FSDP2 packs each parameter group's unsharded micro-step gradients into one flat, rank-major
buffer (dim 0 of every tensor padded to the shard count) and reduce-scatters it over the shard
group; each rank's output is its shard of every tensor, one after another, each padded. The
reduce-scatter is ``FSDPModule.set_custom_reduce_scatter``'s to replace: ``ReduceScatterWithSquares``
runs FSDP's own reduce-scatter unchanged (so ``gamma = 1`` is the base optimizer bit for bit) and,
from the same input, one ``pack_squares`` launch writes the fp32 squares, one reduce-scatter (sum)
hands this rank its shard of their sum over the shard group, and one ``unpack_bucket`` launch
adds ``[Σg | Σg²]`` of the shard into the group's statistics bucket (``StatsBucket``, laid out
like FSDP's output, so the statistics are sharded like the parameters: no full-size buffer).

``Σg`` is FSDP's reduced output itself, read before FSDP divides it and, under HSDP, before the
replicas' all-reduce (times the shard count when the collective averaged): no second reduction of
the gradient. Under HSDP one all-reduce of every bucket (one allocation) over the replicate
group per step, in fp32, which also sums the replicas' counts of reductions: unequal ones (a
replica that ran another micro-step with the replicas' all-reduce deferred) are refused, on a
GPU at the next step's start (the count read back behind the step's work).
``n`` = shard ranks × replicate ranks × reductions of a parameter in the step; a group is what one
reduction carries: one micro-step's gradient when every backward reduces (FSDP's default), a
rank's accumulated gradient when ``set_requires_gradient_sync(False)`` defers the reduction to the
last micro-step (then ``n`` = ranks), as the loop weights its loss (the GSNR does not depend on
that weight). Every parameter must be reduced equally often in a step.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from vrgd_ds.fsdp.internals import UnsupportedFSDPConfiguration
from vrgd_ds.stats.hooks import gradients_cleared
from vrgd_ds.stats.local import CountSlot, LocalStats
from vrgd_ds.stats.scaling import Scaling


def reduced_by_fsdp(group: Any) -> list[int]:
    """Indices of the parameters of FSDP parameter group ``group`` that its ``post_backward`` is
    about to reduce, in order: FSDP2's own rule (``FSDPParamGroup.post_backward``, torch 2.13)."""
    out = []
    for i, fp in enumerate(group.fsdp_params):
        if not hasattr(fp, "_unsharded_param"):
            continue
        if (fp.unsharded_accumulated_grad is not None or fp.unsharded_param.grad is not None
                or (group.reduce_scatter_unused_params and fp.unsharded_param.requires_grad)):
            out.append(i)
    return out


class FSDPStats(LocalStats):
    """``Σg`` and ``Σg²`` of every sharded parameter, from FSDP2's reductions (a
    ``StatisticsSource``); one statistics bucket per FSDP parameter group, laid out like its
    reduce-scatter output. ``reductions`` counts the reductions seen, ``counters`` the extra
    collectives and their bytes."""

    reset_ends_step = True  # no engine wraps the step: the optimizer's reset ends it

    def __init__(self, kernels: Any, world: int, targets: list[Tensor], squares_dtype: torch.dtype) -> None:
        super().__init__(dist, kernels, Scaling(world), targets, gbar="local", squares_dtype=squares_dtype)
        self._groups: list[tuple[Any, Any, list[int], list[int]]] = []  # (fsdp group, bucket, indices, offsets)
        self._pending: dict[int, list[int]] = {}
        self._hsdp: list[bool] = []  # per FSDP parameter group: reduced over replicas too
        self._left_grads = False  # a reduction of this step has set its shards' .grad
        self.reductions = 0

    def add_group(self, group: Any, replicate: Any | None) -> int:
        """Places the sharded parameters of FSDP parameter group ``group`` in a bucket of their own;
        ``replicate``: HSDP's replicate group, over which the bucket is summed once per step."""
        sizes = [fp.padded_sharded_param_size.numel() for fp in group.fsdp_params]
        device = group.fsdp_params[0].sharded_param.device
        # HSDP: the first bucket's collective sums the whole allocation (every bucket is a view of
        # it) over the replicas in fp32: one collective per step
        # (held weakly, as the buckets hold their source: ``StatsBucket``)
        first_hsdp = replicate is not None and not self._groups
        reduce = None if not first_hsdp else lambda b, g=replicate, ref=weakref.ref(self): ref()._replicas(g)
        # and one more element there: the reductions of the step (and their square in the Σg² half),
        # which every replica must have made alike
        # (a replica's micro-steps are its own where the replicas' all-reduce is deferred)
        bucket = self.add_bucket(sum(sizes) + first_hsdp, device, reduce)
        if first_hsdp:
            self.count_slot = CountSlot(
                bucket, sum(sizes), replicate.size(), "reductions of each parameter",
                "under HSDP every replica reduces its gradients equally often in a step (the statistics count "
                "n = ranks × reductions; with unequal counts the replicas would take different steps and drift "
                "apart): give every replica the same number of micro-batches and the same "
                "set_requires_gradient_sync calls")
        indices, offsets, off = [], [], 0
        for fp, size in zip(group.fsdp_params, sizes):
            local = fp.sharded_param._local_tensor
            indices.append(self.place(local, bucket, off, local.numel()))
            offsets.append(off)
            off += size
        self._groups.append((group, bucket, indices, offsets))
        self._hsdp.append(replicate is not None)
        return len(self._groups) - 1

    def _replicas(self, replicate: Any) -> list[Any]:
        arena = self.arena
        return self.launch(arena, arena, replicate, scatter=False, dtype=torch.float32, grad_elems=arena.numel() // 2)

    def alias_all(self) -> None:
        """The optimizer reads each shard's statistics as views of its bucket (after every
        ``add_group``: the buckets share one allocation, made here)."""
        for group, bucket, _, offsets in self._groups:
            g, sq = bucket.halves()
            for fp, off in zip(group.fsdp_params, offsets):
                local = fp.sharded_param._local_tensor
                n = local.numel()
                self.alias(local, g.narrow(0, off, n), sq.narrow(0, off, n))

    # -- FSDP's side -----------------------------------------------------------------------------

    def about_to_reduce(self, gi: int) -> None:
        """Called where FSDP's ``post_backward`` of group ``gi`` begins: which parameters it reduces
        (none while ``set_requires_gradient_sync(False)`` accumulates: the gradient reduced later is
        then one group)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise UnsupportedFSDPConfiguration(
                "vrgd_ds.fsdp: the backward is being captured in a CUDA graph, whose replays would skip the "
                "statistics' bookkeeping (it runs in Python at each reduction): run the backward eagerly "
                "(torchtitan: training.disable_cuda_graphs, which vrgd_ds.fsdp.torchtitan.with_vrgd sets)")
        group = self._groups[gi][0]
        if any(id(fp.sharded_param._local_tensor) not in self._index for fp in group.fsdp_params):
            raise UnsupportedFSDPConfiguration(
                "vrgd_ds.fsdp: the model's shards were replaced after vrgd_ds.fsdp.attach: model.to(...), .float(), "
                ".cpu() and the like make FSDP2 build new local shards, which the statistics and the optimizer's "
                "layout do not know. Move or cast the model first, then build the optimizer and attach it")
        if group.reduce_grads:
            comm = group._reduce_scatter_comm
            if not (isinstance(comm, ReduceScatterWithSquares) and comm.stats is self and comm.gi == gi):
                raise UnsupportedFSDPConfiguration(
                    f"vrgd_ds.fsdp: FSDP's reduce-scatter was replaced after vrgd_ds.fsdp.attach (by "
                    f"{type(comm).__name__}: set_custom_reduce_scatter, set_allocate_memory_from_process_group_for_comm, "
                    "set_symm_mem_for_comm), so the statistics would see no reduction and every tensor step as the "
                    "base optimizer: set FSDP's communication options before attach, or not at all")
            if group._all_reduce_hook is not None:
                raise UnsupportedFSDPConfiguration(
                    "vrgd_ds.fsdp: set_all_reduce_hook after vrgd_ds.fsdp.attach: the hook changes the reduced "
                    "gradient after the statistics read it; remove it")
            # gradients cleared since this step's reductions (``gradients_cleared``): a reduction that
            # sets its shards' .grad (not HSDP's with the replicas' all-reduce deferred,
            # set_requires_all_reduce(False), which keeps its output aside) makes every shard's None
            # a sign of a clear; looked for in backward's order, the last group first
            shards = (fp.sharded_param for g, *_ in reversed(self._groups) for fp in g.fsdp_params)
            if self._recorded() and self._left_grads and gradients_cleared(self, shards, "vrgd_ds.fsdp"):
                self.end_step()
            self._pending[gi] = reduced_by_fsdp(group)

    def end_step(self) -> None:
        self._left_grads = False
        super().end_step()

    def start(self) -> None:
        """The step begins: every parameter with statistics was reduced equally often (a group is
        what one reduction carries, so ``n`` must be one number)."""
        if not (self._started or self._stale):
            seen = self._counts[self._counts > 0]
            if seen.size and seen.min() != seen.max():
                raise UnsupportedFSDPConfiguration(
                    f"vrgd_ds.fsdp: in this step FSDP reduced some parameters {int(seen.min())} times and others "
                    f"{int(seen.max())} times (set_requires_gradient_sync(False) on some modules only, or a module "
                    "left out of some micro-steps), so the number of gradient groups n would differ between "
                    "tensors: reduce every module equally often in a step")
        super().start()

    def record_reduction(self, gi: int, inp: Tensor, out: Tensor, op: Any, rs_group: Any) -> None:
        """One FSDP reduce-scatter of group ``gi`` has put this rank's shard of the sum over
        ``rs_group`` of ``inp`` into ``out`` (averaged when ``op`` is AVG)."""
        group, bucket, indices, offsets = self._groups[gi]
        chosen = self._pending.pop(gi, None)
        if chosen is None:
            raise RuntimeError("vrgd_ds.fsdp: an FSDP reduce-scatter ran outside FSDP's post_backward")
        ranks = rs_group.size()
        starts, start = [], 0
        for i in chosen:
            starts.append(start)
            start += group.fsdp_params[i].padded_sharded_param_size.numel()
        if start != out.numel() or start * ranks != inp.numel():
            raise RuntimeError(f"vrgd_ds.fsdp: FSDP reduced {inp.numel()} elements into {out.numel()} for parameters "
                               f"whose padded shards hold {start}: an FSDP layout this release does not know")
        members = [(indices[i], s) for i, s in zip(chosen, starts)]
        plan = self._plan_for(("fsdp", gi, tuple(chosen)), lambda: members, self._plan)
        both = torch.empty(2 * start, dtype=torch.float32, device=out.device)  # [Σg | Σg²] of this shard
        squares = torch.empty(inp.numel(), dtype=torch.float32, device=inp.device)
        self.kernels.pack_squares(inp, None, squares, 1.0)
        works = self.launch(squares, both.narrow(0, start, start), rs_group, scatter=True, dtype=self.squares_dtype,
                            grad_elems=inp.numel())
        both.narrow(0, 0, start).copy_(out).mul_(self._undo_average(group, op, ranks))
        for w in works:
            w() if callable(w) else w.wait()
        table = self._table(plan, self._counts)
        self.kernels.unpack_bucket(both, table, self.arena, start, True)
        self._counts[plan.params] += 1
        self.stat_counters.launches += 3
        self.reductions += 1
        self._left_grads = self._left_grads or not self._hsdp[gi] or bool(group.all_reduce_grads)

    @staticmethod
    def _undo_average(group: Any, op: Any, ranks: int) -> float:
        """What turns FSDP's reduced output into the sum of its input over the shard group."""
        if op == dist.ReduceOp.AVG:
            return float(ranks)
        if op == dist.ReduceOp.SUM:
            return 1.0
        return float(group.gradient_divide_factor)  # PREMUL_SUM(1 / factor)


class ReduceScatterWithSquares(DefaultReduceScatter):
    """FSDP's default reduce-scatter (its allocation and collective), followed by the statistics
    of what it reduced, for FSDP parameter group ``gi`` of ``stats``. It holds the statistics
    weakly: once their optimizer is gone it is FSDP's default again, and the model may be
    attached to another."""

    def __init__(self, stats: FSDPStats, gi: int) -> None:
        super().__init__()
        self._stats, self.gi = weakref.ref(stats), gi

    @property
    def stats(self) -> FSDPStats | None:
        return self._stats()

    def __call__(self, output_tensor: Tensor, input_tensor: Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        stats = self._stats()
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        if stats is None:
            return work
        if async_op and work is not None:
            work.wait()
        stats.record_reduction(self.gi, input_tensor, output_tensor, op, group)
        return work


__all__ = ["FSDPStats", "ReduceScatterWithSquares", "reduced_by_fsdp"]
