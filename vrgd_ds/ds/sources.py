"""Gradient statistics taken inside DeepSpeed's own gradient reduction (docs/design.md §3).

One source per engine path. Each replaces the reduction of one bucket by a single fused
fp32 all-reduce (ZeRO-3: one coalesced reduce-scatter) of ``[g | (c·g)²]``, where ``c``
turns the local, loss-scaled gradient into one group's gradient:

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

from typing import Any, Callable

import torch
from torch import Tensor

import deepspeed.comm as dist

from vrgd_ds.stats.local import CommCounters, moment_buffers, moment_views


class ReductionStats:
    """``Σg`` and ``Σg²`` per flat tensor the basic optimizer updates (a ``StatisticsSource``).

    ``groups_per_round`` is the number of ranks; ``per_micro_step`` tells whether every
    micro-step is a round (ZeRO-2/3) or only the accumulation boundary (stage 0, ZeRO-1).
    """

    def __init__(self, engine: Any, flats: list[Tensor], world: int, per_micro_step: bool,
                 loss_scale: Callable[[], float], kernels: Any) -> None:
        self.engine = engine
        self.world = world
        self.per_micro_step = per_micro_step
        self.kernels = kernels  # the optimizer's implementation: pack_squares
        self._loss_scale = loss_scale
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
        scale = float(self._loss_scale())
        gas = self.engine.gradient_accumulation_steps() if self.per_micro_step else 1
        return gas / scale

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


class _Scratch:
    """Reusable fused buffers, one per dtype: a fresh multi-GB allocation per bucket would pay
    its page faults (CPU) or allocator traffic every time."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, Tensor] = {}

    def get(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._bufs[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


_scratch = _Scratch()


def fused_all_reduce(flat: Tensor, c: float, group: Any, counters: CommCounters, kernels: Any,
                     squares_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``(Σ_r x_r, Σ_r (c·x_r)²)`` for this rank's flat local values ``x``, both fp32 views of
    shared scratch buffers (use them before the next call).

    fp32 squares: one all-reduce of ``[x | (c·x)²]``. bf16 squares: a collective cannot mix
    dtypes, so the fp32 ``x`` and the bf16 squares go as two all-reduces issued together
    (``async_op``; on NCCL they queue back to back on one stream) — half the extra bytes, one
    more call per bucket. Squares are formed in fp32 and rounded once to bf16 (8-bit mantissa:
    relative error <= 2^-9 per element before the sum).
    """
    n = flat.numel()
    if squares_dtype == torch.float32:
        buf = _scratch.get(2 * n, flat.device)
        kernels.pack_squares(flat.view(-1), buf[:n], buf[n:], c)  # one pass: [x | (c x)²]
        dist.all_reduce(buf, group=group)
        counters.add(n, buf.numel() * buf.element_size())
        return buf[:n], buf[n:]
    g = _scratch.get(n, flat.device)
    sq32 = _scratch.get(n, flat.device, torch.float64).view(torch.float32)[:n]  # fp32 squares before rounding
    kernels.pack_squares(flat.view(-1), g, sq32, c)
    sq = _scratch.get(n, flat.device, squares_dtype)
    sq.copy_(sq32)  # one rounding to bf16
    works = [dist.all_reduce(g, group=group, async_op=True), dist.all_reduce(sq, group=group, async_op=True)]
    for w in works:
        w.wait()
    counters.add(n, g.numel() * g.element_size() + sq.numel() * sq.element_size(), calls=2)
    return g, sq.float()


# ---- stage 0 (plain, FP16_UnfusedOptimizer for fp16/bf16) -------------------------------------


def attach_stage0(engine: Any, pairs: list[tuple[Tensor, Tensor]], world: int) -> ReductionStats:
    """``pairs``: (model parameter, tensor the basic optimizer updates) — the same tensor in
    fp32, the fp32 master copy under FP16_UnfusedOptimizer."""
    wrapper = engine.optimizer
    scale = (lambda: wrapper.loss_scale) if hasattr(type(wrapper), "loss_scale") else (lambda: 1.0)
    stats = ReductionStats(engine, [m for _, m in pairs], world, per_micro_step=False, loss_scale=scale,
                           kernels=engine.basic_optimizer.kernels())
    by_param = {id(p): m for p, m in pairs}
    for p, m in pairs:
        stats.piece(p, m, 0, m.numel())

    def allreduce_bucket(bucket, dp_group, dp_world_size=None):
        k = dp_world_size or dist.get_world_size(group=dp_group)
        tensor = engine.flatten(bucket)
        owner = {p.grad.data_ptr(): (p, by_param[id(p)]) for p, _ in pairs if p.grad is not None}
        found = [owner.get(t.data_ptr()) for t in bucket]
        if any(f is None for f in found):
            raise RuntimeError("a gradient in DeepSpeed's reduction bucket belongs to no parameter of the "
                               "VRGD optimizer (stage 0); was a parameter left out of the optimizer?")
        stats.begin_round([p for p, _ in found])
        c = stats.multiplier()
        red_g, red_sq = fused_all_reduce(tensor, c, dp_group, stats.counters, stats.kernels, stats.squares_dtype)
        off = 0
        for t, (p, m) in zip(bucket, found):
            num = t.numel()
            stats.add(id(m), 0, red_g.narrow(0, off, num), red_sq.narrow(0, off, num), c, stats.first(p))
            off += num
        tensor.copy_(red_g.mul_(1.0 / k))  # DeepSpeed's postscale average
        return tensor

    engine.allreduce_bucket = allreduce_bucket
    return stats


# ---- ZeRO-1 / ZeRO-2 (DeepSpeedZeroOptimizer) -------------------------------------------------


def zero12_pieces(zopt: Any, i: int) -> list[tuple[Tensor, int, int, int]]:
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


def attach_zero12(engine: Any, zopt: Any, world: int, stage: int) -> ReductionStats:
    flats = list(zopt.single_partition_of_fp32_groups)
    stats = ReductionStats(engine, flats, world, per_micro_step=stage >= 2, loss_scale=lambda: zopt.loss_scale,
                           kernels=engine.basic_optimizer.kernels())
    # Bucket layout -> (flat index, source offset in the bucket, destination, length), per bucket.
    pieces = {i: {id(p): (src, dst, num) for p, src, dst, num in zero12_pieces(zopt, i)}
              for i in range(len(flats))}
    for i, flat in enumerate(flats):
        for p, _, dst, num in zero12_pieces(zopt, i):
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
        red_g, red_sq = fused_all_reduce(tensor, c, group, stats.counters, stats.kernels, stats.squares_dtype)
        n = tensor.numel()
        off = 0
        for i, pidx, _ in bucket.params:
            p = zopt.bit16_groups[i][pidx]
            piece = pieces[i].get(id(p))
            if piece is not None:
                src, dst, num = piece
                stats.add(id(flats[i]), dst, red_g.narrow(0, off + src, num), red_sq.narrow(0, off + src, num), c,
                          stats.first(p))
            off += p.numel()
        if off != n:
            raise RuntimeError(f"DeepSpeed's reduction bucket holds {n} elements but its parameters {off}: the "
                               "bucket layout differs from DeepSpeed 0.19.8's (unsupported DeepSpeed version?)")
        flat = tensor.view(-1)
        if flat.dtype == torch.float32:
            torch.mul(red_g, 1.0 / k, out=flat)  # DeepSpeed's postscale average
        else:
            flat.copy_(red_g.mul_(1.0 / k))
        return tensor

    zopt.gradient_reduction_w_predivide = gradient_reduction_w_predivide
    return stats


# ---- ZeRO-3 (DeepSpeedZeroOptimizer_Stage3) ---------------------------------------------------

_AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def zero3_pieces(zopt: Any, i: int) -> list[tuple[Tensor, int, int]]:
    """(model parameter, start in this rank's flat partition, valid length) for sub-group i."""
    out = []
    for p in zopt.fp16_groups[i]:
        _, offset, part_numel = zopt.grad_position[zopt.get_param_id(p)]
        rank = dist.get_rank(group=zopt._get_param_partition_group(p))
        valid = max(0, min(p.ds_numel - rank * int(part_numel), int(part_numel)))
        out.append((p, int(offset), valid))
    return out


def zero3_tensor_offset(zopt: Any, p: Tensor) -> int:
    """Where this rank's partition of ``p`` starts inside the whole tensor (ZeRO-3 cuts each
    parameter into equal ``partition_numel`` pieces, rank r holding the r-th)."""
    _, _, part_numel = zopt.grad_position[zopt.get_param_id(p)]
    return min(dist.get_rank(group=zopt._get_param_partition_group(p)) * int(part_numel), int(p.ds_numel))


def attach_zero3(engine: Any, zopt: Any, world: int) -> ReductionStats:
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    flats = list(zopt.fp32_partitioned_groups_flat)
    stats = ReductionStats(engine, flats, world, per_micro_step=True, loss_scale=lambda: zopt.loss_scale,
                           kernels=engine.basic_optimizer.kernels())
    where = {}
    for i in range(len(flats)):
        for p, offset, valid in zero3_pieces(zopt, i):
            where[id(p)] = (i, offset, valid)
            if valid:
                stats.piece(p, flats[i], offset, valid)
    zopt.reduce_scatter = True  # every bucket goes through __avg_scatter_grads

    def avg_scatter_grads(params, communication_data_type):
        group = zopt._get_param_partition_group(params[0])
        k = dist.get_world_size(group=group)
        stats.begin_round(params)
        c = stats.multiplier()
        grads = [p.grad.float() for p in params]
        squares = []
        for g in grads:  # one pass each: (c g)² in fp32
            sq = torch.empty(g.shape, dtype=torch.float32, device=g.device)
            stats.kernels.pack_squares(g, None, sq.view(-1), c)
            squares.append(sq)
        t = len(params)
        numel = sum(g.numel() for g in grads)
        if stats.squares_dtype == torch.float32:
            parts = reduce_scatter_coalesced(grads + squares, group)  # one collective, averaged over k
            g_parts, sq_parts = parts[:t], parts[t:]
            stats.counters.add(numel, 2 * 4 * numel)
        else:  # a coalesced call flattens into one dtype: the bf16 squares go as a second one
            g_parts = reduce_scatter_coalesced(grads, group)
            sq_parts = [x.float() for x in reduce_scatter_coalesced([x.to(stats.squares_dtype) for x in squares], group)]
            stats.counters.add(numel, 4 * numel + 2 * numel, calls=2)
        for p, gp, sp in zip(params, g_parts, sq_parts):
            i, offset, valid = where[id(p)]
            if valid:  # the coalesced reduce-scatter averaged over k: the squares' sum is k times it
                sp.mul_(k)
                stats.add(id(flats[i]), offset, gp.view(-1)[:valid], sp.view(-1)[:valid], k * c, stats.first(p))
        return [gp.to(zopt.gradient_accumulation_dtype) for gp in g_parts]

    setattr(zopt, _AVG_SCATTER, avg_scatter_grads)
    return stats


def expected_groups(world: int, gas: int, stage: int, scheme: str = "per_micro_step") -> int:
    """n at every step of a run (docs/design.md §3): ranks × micro-steps, but only ranks on stage 0 /
    ZeRO-1 with the per-micro-step fused reduction (DeepSpeed reduces there once per step)."""
    return world * (gas if stage >= 2 or scheme == "per_step" else 1)


__all__ = ["ReductionStats", "CommCounters", "attach_stage0", "attach_zero12", "attach_zero3",
           "expected_groups", "zero12_pieces", "zero3_pieces", "zero3_tensor_offset"]
