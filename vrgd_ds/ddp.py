"""Gradient statistics for plain ``torchrun`` + ``torch.nn.parallel.DistributedDataParallel``::

    model = DistributedDataParallel(net)
    optimizer = VRAdam(model.parameters(), lr=1e-3)
    vrgd_ds.ddp.attach(model, optimizer)              # squares="per_step"

``squares="per_step"`` (default): DDP's own gradient reduction is untouched. Tensor hooks on the
parameters add every ``backward()``'s local gradient and its fp32 square into local buffers on
each rank (micro-steps under ``model.no_sync()`` included), and one all-reduce of
``[Σg | Σg²]`` per optimizer step completes them: n = ranks × backward passes per step, at twice
the fp32 gradient's bytes per step whatever the accumulation. Every rank must run the same
number of backward passes per step: the collective carries each rank's count and its square, and
a step whose counts differ raises on every rank (on a GPU at the next step's start, read back
without a wait). The mean gradient of the statistics is the local fp32 one (the user may clip
``.grad`` before ``step()``; the GSNR needs the unclipped scale). The same ``LocalStats`` serves
DeepSpeed's per-step scheme (``vrgd_ds/stats/local.py``: the loss scale is removed in exactly
one place, its hooks; nothing is divided by the world size: the collective sums).

``squares="per_micro_step"``: a DDP communication hook replaces the all-reduce of every
gradient bucket by a single fused fp32 all-reduce of ``[g | g²]``, where ``g`` is this rank's
local bucket gradient cast to fp32 (squares of the fp32 cast, also for fp16/bf16 models). The
reduced ``g`` half, divided by the number of ranks and cast to the bucket dtype, is what DDP
receives: the mean gradient DDP's own reduction produces, up to its rounding (summed in fp32,
then divided once, where DDP divides each rank's gradient before the sum). Each rank is one gradient group,
so ``n`` = number of ranks (with ``no_sync()`` only the last, synchronised ``backward()``
reduces). Cost per bucket: one collective of twice the bucket's elements in fp32 (fp16/bf16
buckets: four times the bytes of DDP's own reduction).
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations at registration.
import weakref
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from vrgd_ds.optim.base import MIN_GROUPS, GSNROptimizer
from vrgd_ds.optim.registry import vrgd_optimizer
from vrgd_ds.stats.comm import CommCounters, fused_all_reduce
from vrgd_ds.stats.hooks import gradients_cleared
from vrgd_ds.stats.local import CountSlot, LocalStats
from vrgd_ds.optim._impl import select_for
from vrgd_ds.stats.scaling import Scaling

#: the attribute of a DDP model attached to: (squares, its communication hook's state), so that a
#: new optimizer attaches to the same hook (DDP takes one)
_ATTACHED = "_vrgd_attached"
# (parameter, Σg buffer, Σg² buffer, offset in the bucket, length) of every parameter of a bucket
_Slice = tuple[Tensor, Tensor, Tensor, int, int]


class DDPStats:
    """``Σg`` and ``Σg²`` per parameter from DDP's reduction (a ``StatisticsSource``).

    ``counters`` count the fused all-reduces this rank issued and the bytes of their buffers
    (``vrgd_ds.stats.comm.CommCounters``, as every source); ``buckets`` is the number of buckets
    of the last synchronised ``backward()``.
    """

    #: no engine wraps the step: the optimizer's reset ends it, and a loss scale is the caller's
    #: (``set_grad_scaler``), for the optimizer to take out
    reset_ends_step = True

    def __init__(self, group: dist.ProcessGroup, world: int, kernels: Any) -> None:
        self.group = group
        self.world = world
        self.kernels = kernels  # the optimizer's implementation: pack_squares
        self._bufs: dict[int, tuple[Tensor, Tensor]] = {}
        self._fresh: set[int] = set()  # parameters reduced since the last reset
        self.counters = CommCounters()
        self.buckets = 0

    # -- StatisticsSource --------------------------------------------------------------------

    @property
    def n(self) -> int:
        """The number of ranks once gradients were reduced since the last step, else 0."""
        return self.world if self._fresh else 0

    def moments(self, params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        sum_g, sum_sq = [], []
        for p in params:
            if id(p) not in self._fresh:
                raise RuntimeError(
                    f"no VRGD statistics for a parameter of shape {tuple(p.shape)}: DDP reduced no gradient for it "
                    "since the last step (run backward() through the DDP-wrapped model, outside no_sync(), before "
                    "optimizer.step(); the optimizer's parameters must be the DDP model's)")
            g, s = self._bufs[id(p)]
            sum_g.append(g)
            sum_sq.append(s)
        return sum_g, sum_sq

    def reset(self) -> None:
        """The step is over: the statistics are stale until the next reduction overwrites them."""
        self._fresh.clear()

    # -- hook side ---------------------------------------------------------------------------

    def slices(self, bucket: dist.GradBucket, flat: Tensor) -> list[_Slice]:
        """Where each parameter's gradient lies in the flat bucket, with its buffers."""
        out = []
        base = flat.storage_offset()
        for p, grad in zip(bucket.parameters(), bucket.gradients()):
            bufs = self._bufs.get(id(p))
            if bufs is None:
                bufs = (torch.zeros(p.shape, dtype=torch.float32, device=p.device),
                        torch.zeros(p.shape, dtype=torch.float32, device=p.device))
                self._bufs[id(p)] = bufs
            out.append((p, bufs[0], bufs[1], grad.storage_offset() - base, grad.numel()))
        end = max((off + num for *_, off, num in out), default=0)
        if end > flat.numel():
            raise RuntimeError(f"DDP's gradient bucket holds {flat.numel()} elements but its parameters reach "
                               f"element {end}: unsupported bucket layout")
        return out

    def store(self, slices: list[_Slice], sum_g: Tensor, sum_sq: Tensor) -> None:
        """Writes each parameter's ``Σg`` and ``Σg²`` from the bucket's reduced halves."""
        for p, g, s, off, num in slices:
            g.view(-1).copy_(sum_g.narrow(0, off, num))
            s.view(-1).copy_(sum_sq.narrow(0, off, num))
            self._fresh.add(id(p))


def _one_synchronised_backward(stats: DDPStats, ddp_model: DistributedDataParallel) -> None:
    """Refuses, at its forward (before any collective of it), a second synchronised micro-step in a
    step under ``squares='per_micro_step'``: its bucket would hold the first one's reduced mean plus
    its own gradient. Gradients cleared since (``gradients_cleared``) start a new step instead."""
    if stats.n and torch.is_grad_enabled():  # reduced this step
        # looked for at any forward: the next step's first may be under no_sync() (accumulation)
        if gradients_cleared(stats, ddp_model.parameters(), "vrgd_ds.ddp"):
            stats.reset()
            return
        if not ddp_model.require_backward_grad_sync:
            return
        raise RuntimeError(
            "vrgd_ds.ddp: squares='per_micro_step' reduces each rank's gradient once a step, and this step "
            "synchronises a second backward(), whose bucket would hold the first one's reduced mean plus its own "
            "gradient (a forward with gradients enabled outside no_sync() counts: run one that no backward "
            "follows, such as an evaluation, under torch.no_grad()); accumulate under model.no_sync() up to the "
            "last backward, or attach with squares='per_step' (every backward is a group)")


def fused_allreduce_hook(stats: DDPStats, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: one fp32 all-reduce of ``[g | g²]`` per bucket; the future's
    value is the bucket with the mean gradient, as with torch's ``allreduce_hook``."""
    flat = bucket.buffer()
    if flat.is_sparse:
        raise RuntimeError("VRGD statistics do not support sparse gradients under DDP; use a dense layer "
                           "(e.g. nn.Embedding(sparse=False))")
    slices = stats.slices(bucket, flat)
    # fresh buffers: DDP keeps several buckets in flight
    sum_g, sum_sq, works = fused_all_reduce(dist, flat, 1.0, stats.group, stats.counters, stats.kernels,
                                            scratch=None)
    if bucket.is_last():
        stats.buckets = bucket.index() + 1
    world, ref = stats.world, weakref.ref(stats)

    def finish(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
        # the statistics held weakly: the future keeps its callback until the process group lets
        # the work go (another thread, some time after the step), which must not keep a deleted
        # optimizer's statistics alive
        alive = ref()
        if alive is not None:
            alive.store(slices, sum_g, sum_sq)
        flat.copy_(sum_g.div_(world))  # the mean, rounded once to the bucket dtype
        return flat

    return works[0].get_future().then(finish)


class _HookState:
    """The state of the communication hook a DDP model takes (one): the statistics it feeds, those
    of the optimizer attached last (``serve``), held weakly: once their optimizer is gone the
    model's reductions are DDP's own again (``_ddp_all_reduce`` on ``group``)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._stats: Any = None  # a weak reference once served

    @property
    def stats(self) -> Any:
        return None if self._stats is None else self._stats()

    def serve(self, stats: Any) -> None:
        self._stats = weakref.ref(stats)


class _Served(_HookState):
    """The hook's state under ``squares="per_micro_step"``."""

    def __init__(self, stats: DDPStats) -> None:
        super().__init__(stats.group)
        self.serve(stats)


def _served_fused_hook(served: _Served, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    stats = served.stats
    if stats is None:
        return _ddp_all_reduce(served.group, bucket.buffer())
    return fused_allreduce_hook(stats, bucket)


def _refuse_join(ddp_model: DistributedDataParallel) -> None:
    """A training forward under ``DistributedDataParallel.join()`` (torch's ``Join``: uneven inputs)
    is refused: a rank out of data serves the others' reductions with zero buckets through the
    communication hook, which the statistics would count as gradient groups (``per_micro_step``) or
    answer with other collectives than the ranks still training (``per_step``)."""
    config = getattr(ddp_model, "_join_config", None)
    if config is not None and config.enable:
        raise RuntimeError(
            "vrgd_ds.ddp: DistributedDataParallel.join() (uneven inputs) is not supported: a rank that has run out "
            "of data serves the others' reductions with zero gradients, which the statistics would count as "
            "gradient groups (or, with squares='per_step', answer with other collectives than the ranks still "
            "training). Give every rank the same number of batches (DistributedSampler(..., drop_last=True)) and "
            "train outside join()")


def _served_forward(served: _Served, ddp_model: DistributedDataParallel) -> None:
    stats = served.stats
    if stats is not None and torch.is_grad_enabled():
        _refuse_join(ddp_model)
    if stats is not None:
        _one_synchronised_backward(stats, ddp_model)


def attach(ddp_model: DistributedDataParallel, optimizer: GSNROptimizer,
           squares: str = "per_step", micro_steps: str = "auto") -> "DDPStats | LocalStats":
    """Feeds ``optimizer`` with statistics of ``ddp_model``'s training.

    ``squares="per_step"`` (default): DDP's own reduction untouched; tensor hooks on the
    parameters sum every ``backward()``'s local gradient and square in fp32 on each rank
    (``no_sync()`` micro-steps included), and one all-reduce of ``[Σg | Σg²]`` per optimizer step
    (twice the fp32 gradient's bytes, whatever the accumulation) completes them: n = ranks ×
    backward passes per step (``vrgd_ds.stats.local``). ``"per_micro_step"``: a communication hook
    replaces DDP's all-reduce of every bucket by one fused fp32 ``[g | g²]`` (n = ranks; DDP
    allows one hook: a new optimizer attached to the same model takes it over, with the same
    ``squares``). ``micro_steps`` (``"per_step"``): ``"auto"`` reads a step's first
    synchronised backward from DDP's buckets, and from a tensor hook per parameter the backward
    passes after a step's second forward (the bucket then holds the reduced mean of the ones
    before plus the new gradient) or under ``no_sync()``; ``"hooks"`` always from the hooks
    (the same statistics bit for bit, one launch per tensor). The optimizer's parameters must be those of
    ``ddp_model``. Needs >= 2 ranks in the DDP process group when any param group has
    ``gsnr=True``.

    With ``torch.amp.GradScaler`` the statistics are of the scaled gradients:
    ``optimizer.set_grad_scaler(scaler)`` takes its scale out (without it the GSNR is the same
    only up to ``gsnr_eps``, which acts as ``gsnr_eps / scale²``, and the noise-scale figures
    are scale² too large). A step the scaler skips never reaches the optimizer, whose
    ``zero_grad()`` clears them (``model.zero_grad()`` too: the next forward finds the gradients
    cleared).
    """
    optimizer = vrgd_optimizer(optimizer, "vrgd_ds.ddp.attach")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"vrgd_ds.ddp.attach needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    group = ddp_model.process_group
    world = group.size()
    gsnr_params = [p for g in optimizer.param_groups if g["gsnr"] for p in g["params"]]
    if any(g["gsnr"] for g in optimizer.param_groups):
        if world < MIN_GROUPS:
            raise ValueError(f"{optimizer.name} with gsnr=True under DDP needs >= {MIN_GROUPS} ranks in "
                             f"the DDP process group (one gradient group per rank), got {world}: use >= 2 ranks "
                             "or gsnr=False")
        ignored = ddp_model.parameters_to_ignore
        reduced = {id(p) for name, p in ddp_model.module.named_parameters()
                   if p.requires_grad and name not in ignored}
        missing = sum(1 for p in gsnr_params if p.requires_grad and id(p) not in reduced)
        if missing:
            raise ValueError(f"{missing} parameter(s) of a gsnr=True param group of {optimizer.name} are "
                             "not reduced by this DDP model: build the optimizer on ddp_model.parameters()")
    if squares not in ("per_step", "per_micro_step"):
        raise ValueError(f"vrgd_ds.ddp.attach: squares={squares!r}: use 'per_step' or 'per_micro_step'")
    if micro_steps not in ("auto", "hooks"):
        raise ValueError(f"vrgd_ds.ddp.attach: micro_steps={micro_steps!r}: use 'auto' or 'hooks'")
    if squares == "per_micro_step" and micro_steps != "auto":
        raise ValueError(f"vrgd_ds.ddp.attach: micro_steps={micro_steps!r} applies to squares='per_step' only "
                         "(the communication hook of 'per_micro_step' reads every micro-step itself); leave it out")
    before = getattr(ddp_model, _ATTACHED, None)  # (squares, the communication hook's state)
    if before is not None and before[0] != squares:
        raise ValueError(f"vrgd_ds.ddp.attach: this DDP model is attached with squares={before[0]!r}, and DDP takes "
                         f"one communication hook: attach the new optimizer with squares={before[0]!r}, or wrap the "
                         "module in a new DistributedDataParallel")
    if squares == "per_micro_step":
        stats = DDPStats(group, world, select_for(optimizer))
        if before is not None:  # a new optimizer: the hook feeds its statistics from the next reduction on
            before[1].serve(stats)
        else:
            served = _Served(stats)
            ddp_model.register_comm_hook(served, _served_fused_hook)
            ddp_model.register_forward_pre_hook(lambda module, args: _served_forward(served, ddp_model))
            setattr(ddp_model, _ATTACHED, (squares, served))
        optimizer.set_statistics_source(stats)
        return stats
    return _attach_per_step(ddp_model, optimizer, group, world, gsnr_params, micro_steps == "hooks",
                            before[1] if before is not None else None)


def _attach_per_step(ddp_model: DistributedDataParallel, optimizer: GSNROptimizer, group: dist.ProcessGroup,
                     world: int, params: list[Tensor], hooks_only: bool = False,
                     path: "_BucketPath | None" = None) -> LocalStats:
    """Local sums of every backward's gradient and square, one fused all-reduce per step. Where
    every backward synchronises, DDP's own gradient buckets hold each micro-step's local
    gradient when its communication hook runs: one ``pack_bucket`` launch per bucket, then the
    all-reduce DDP makes without a hook, bit for bit (``_ddp_all_reduce``; with
    ``gradient_as_bucket_view=True`` DDP divides a gradient that already is its bucket's view, a
    second synchronised backward or one after ``zero_grad(set_to_none=False)``, where this
    multiplies: the mean differs in rounding on a world size that is not a power of 2). A step that accumulates under
    ``no_sync()`` reduces the accumulated gradient, so its micro-steps are read by a tensor hook
    per parameter, installed when a forward pass runs under ``no_sync()`` and removed when a step
    synchronises every backward again (``_BucketPath``)."""
    params = [p for p in params if p.requires_grad]
    stats = LocalStats(dist, select_for(optimizer), Scaling(world), params, gbar="local", squares_dtype=torch.float32)
    stats.reset_ends_step = True  # no engine wraps the step: the optimizer's reset ends it
    stats.hooks_only = hooks_only
    total = sum(p.numel() for p in params)
    device = params[0].device if params else torch.device("cpu")
    # one more element: the step's backward passes (in the Σg half, their square in the Σg² half),
    # which every rank must have run alike
    bucket = stats.add_bucket(total + 1, device, lambda b: b.all_reduce_in_place(group))
    stats.count_slot = CountSlot(
        bucket, total, world, "backward passes",
        "squares=\"per_step\" needs the same number of backward() calls per step on every rank (the statistics "
        "count n = ranks × backward passes; with unequal counts each rank would take another step and the replicas "
        "drift apart). Give every rank the same number of micro-batches (a backward pass counts where it reaches a "
        "parameter of a GSNR group: where those are only a branch some batches skip, give a parameter that every "
        "pass reaches the GSNR too)")
    g, sq = bucket.halves()
    off = 0
    for p in params:
        n = p.numel()
        stats.place(p, bucket, off, n)
        stats.alias(p, g.narrow(0, off, n), sq.narrow(0, off, n))
        off += n
    if path is not None:  # a new optimizer on a model attached before: the hooks feed its statistics from now on
        path.serve(stats, params)
    else:
        path = _BucketPath(stats, ddp_model, group, params)
        ddp_model.register_comm_hook(path, _per_step_hook)
        ddp_model.register_forward_pre_hook(path.before_forward)
        setattr(ddp_model, _ATTACHED, ("per_step", path))
    optimizer.set_statistics_source(stats)
    return stats


class _BucketPath(_HookState):
    """Which micro-steps DDP's buckets hold: the step's first, when each backward synchronises (a
    bucket holds ``.grad``, to which autograd adds each later micro-step's local gradient: the
    reduced mean of the ones before plus it); none of a step that accumulates under ``no_sync()``
    (its last backward reduces the sum). The others are read by a tensor hook per parameter,
    installed from the step's second forward on, or its first under ``no_sync()``: the hook's
    state under ``squares="per_step"``."""

    def __init__(self, stats: LocalStats, ddp_model: DistributedDataParallel, group: dist.ProcessGroup,
                 params: list[Tensor]) -> None:
        super().__init__(group)
        self.ddp = ddp_model
        self.serve(stats, params)

    def serve(self, stats: LocalStats, params: list[Tensor]) -> None:  # type: ignore[override]
        """Feeds ``stats`` (of ``params``) from now on; the statistics served before lose their
        tensor hooks, so the optimizer they fed gets no more groups."""
        before = self.stats
        if before is not None:
            before.unhook()
        super().serve(stats)
        self.params = params
        self.accumulating = False  # this step accumulates: under no_sync(), or from its second forward on
        self.hooked = False
        self._step = -1

    def before_forward(self, module: Any, args: Any) -> None:
        stats = self.stats
        if stats is None or not torch.is_grad_enabled():  # none fed; an evaluation between steps
            return
        _refuse_join(self.ddp)
        if stats.fresh_step() != self._step:  # the first forward of a step
            self._step = stats.fresh_step()
            self.accumulating = False
        elif stats.n and gradients_cleared(stats, self.params, "vrgd_ds.ddp"):
            stats.end_step()
            self._step = stats.fresh_step()
            self.accumulating = False
        else:  # a second micro-step: its backward adds to the first's .grad
            self.accumulating = True
        if not self.ddp.require_backward_grad_sync:
            self.accumulating = True
        want_hooks = self.accumulating or stats.hooks_only
        if want_hooks != self.hooked:
            for p in self.params:
                if want_hooks:
                    stats.hook(p)
                else:
                    stats.unhook(p)
            self.hooked = want_hooks

    @staticmethod
    def members(stats: LocalStats, bucket: dist.GradBucket) -> list[tuple[int, int]]:
        """The bucket's parameters that have statistics, with their offsets in its buffer (DDP's
        buckets also hold the parameters of ``gsnr=False`` groups)."""
        base = bucket.buffer().storage_offset()
        return [(stats.index(p), grad.storage_offset() - base)
                for p, grad in zip(bucket.parameters(), bucket.gradients()) if stats.holds(p)]


def _per_step_hook(path: _BucketPath, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook of the per-step scheme: the bucket's local gradients into the
    statistics (one launch), then the bucket's all-reduce as DDP makes it without a hook."""
    stats = path.stats
    if stats is not None and not path.hooked:
        flat = bucket.buffer()
        if flat.is_sparse:
            raise RuntimeError("VRGD statistics do not support sparse gradients under DDP; use a dense layer "
                               "(e.g. nn.Embedding(sparse=False))")
        params = bucket.parameters()
        stats.record_bucket((bucket.index(), tuple(map(id, params))), flat, lambda: path.members(stats, bucket))
    return _ddp_all_reduce(path.group, bucket.buffer())


def _ddp_all_reduce(group: dist.ProcessGroup, flat: Tensor) -> torch.futures.Future[Tensor]:
    """The bucket's mean as DDP's reducer makes it without a hook: each rank's gradient times
    ``1/world`` (a multiply: torch's ``default_hooks.allreduce_hook`` divides, which rounds
    otherwise on a world size that is not a power of 2), then the sum."""
    flat.mul_(1.0 / group.size())
    return dist.all_reduce(flat, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


__all__ = ["attach", "DDPStats", "LocalStats", "fused_allreduce_hook"]
