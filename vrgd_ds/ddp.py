"""Gradient statistics taken inside ``torch.nn.parallel.DistributedDataParallel``'s own
gradient reduction, for plain ``torchrun`` + DDP training (one gradient group per rank).

A DDP communication hook replaces the all-reduce of every gradient bucket by a single fused
fp32 all-reduce of ``[g | g²]``, where ``g`` is this rank's local bucket gradient cast to
fp32 (squares are taken of the fp32 cast, also for fp16/bf16 models). The reduced ``g`` half,
divided by the number of ranks and cast to the bucket dtype, is what DDP receives: the same
mean gradient its default hook produces, so ``p.grad`` is the mean over ranks. ``Σg`` and
``Σg²`` go into fp32 buffers shaped like each parameter, which the optimizer reads at its
step::

    model = DistributedDataParallel(net)
    optimizer = VRAdam(model.parameters(), lr=1e-3)
    vrgd_ds.ddp.attach(model, optimizer)

Each rank is one gradient group, so ``n`` = number of ranks. With gradient accumulation under
``model.no_sync()`` only the last, synchronised ``backward()`` reduces: a rank's group is then
the sum of its accumulated micro-batch gradients, and ``n`` is still the number of ranks.
Every synchronised ``backward()`` reduces the rank's whole accumulated ``.grad``, so the
statistics always describe the last one (the one ``p.grad`` comes from).

Cost per bucket: one collective of twice the bucket's elements in fp32 (fp16/bf16 buckets:
four times the bytes of DDP's own reduction).
"""
# No ``from __future__ import annotations``: DDP checks the hook's annotations at registration.
from typing import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from vrgd_ds.optim.base import MIN_GROUPS, GSNROptimizer

# (parameter, Σg buffer, Σg² buffer, offset in the bucket, length) of every parameter of a bucket
_Slice = tuple[Tensor, Tensor, Tensor, int, int]


class DDPStats:
    """``Σg`` and ``Σg²`` per parameter from DDP's reduction (a ``StatisticsSource``).

    ``collectives`` and ``bytes_sent`` count the fused all-reduces this rank issued and the
    bytes of their buffers; ``buckets`` is the number of buckets of the last synchronised
    ``backward()``.
    """

    def __init__(self, group: dist.ProcessGroup, world: int) -> None:
        self.group = group
        self.world = world
        self._bufs: dict[int, tuple[Tensor, Tensor]] = {}
        self._fresh: set[int] = set()  # parameters reduced since the last reset
        self.collectives = 0
        self.bytes_sent = 0
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

    def count(self, buf: Tensor) -> None:
        self.collectives += 1
        self.bytes_sent += buf.numel() * buf.element_size()

    def store(self, slices: list[_Slice], reduced: Tensor, numel: int) -> None:
        """Writes ``Σg`` (first half of ``reduced``) and ``Σg²`` (second half) per parameter."""
        for p, g, s, off, num in slices:
            g.view(-1).copy_(reduced.narrow(0, off, num))
            s.view(-1).copy_(reduced.narrow(0, numel + off, num))
            self._fresh.add(id(p))


def fused_allreduce_hook(stats: DDPStats, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP communication hook: one fp32 all-reduce of ``[g | g²]`` per bucket; the future's
    value is the bucket with the mean gradient, as with torch's ``allreduce_hook``."""
    flat = bucket.buffer()
    if flat.is_sparse:
        raise RuntimeError("VRGD statistics do not support sparse gradients under DDP; use a dense layer "
                           "(e.g. nn.Embedding(sparse=False))")
    numel = flat.numel()
    slices = stats.slices(bucket, flat)
    buf = torch.empty(2 * numel, dtype=torch.float32, device=flat.device)
    buf[:numel].copy_(flat)
    torch.square(buf[:numel], out=buf[numel:])
    stats.count(buf)
    if bucket.is_last():
        stats.buckets = bucket.index() + 1
    world = stats.world

    def finish(fut: torch.futures.Future[list[Tensor]]) -> Tensor:
        reduced = fut.value()[0]
        stats.store(slices, reduced, numel)
        flat.copy_(reduced[:numel].div_(world))  # the mean, rounded once to the bucket dtype
        return flat

    return dist.all_reduce(buf, group=stats.group, async_op=True).get_future().then(finish)


def attach(ddp_model: DistributedDataParallel, optimizer: GSNROptimizer) -> DDPStats:
    """Feeds ``optimizer`` with statistics from ``ddp_model``'s gradient reduction.

    Registers a communication hook on ``ddp_model`` (DDP allows one; call before training)
    and makes the returned ``DDPStats`` the optimizer's statistics source; the optimizer's
    parameters must be those of ``ddp_model``. Needs >= 2 ranks in the DDP process group
    when any param group has ``gsnr=True``.

    With ``torch.amp.GradScaler`` the statistics are of the scaled gradients; the GSNR is
    invariant to that scale (up to ``gsnr_eps``, which acts as ``gsnr_eps / scale²``), and a
    step the scaler skips never reaches the optimizer, whose ``zero_grad()`` clears them.
    """
    if not isinstance(optimizer, GSNROptimizer):
        raise TypeError(f"vrgd_ds.ddp.attach needs a VRGD optimizer (VRSGD, VRMomentum, VRAdam, VRLamb, VRLars, "
                        f"Lamb, Lars), got {type(optimizer).__name__}")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"vrgd_ds.ddp.attach needs a torch.nn.parallel.DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}")
    group = ddp_model.process_group
    world = group.size()
    gsnr_params = [p for g in optimizer.param_groups if g["gsnr"] for p in g["params"]]
    if any(g["gsnr"] for g in optimizer.param_groups):
        if world < MIN_GROUPS:
            raise ValueError(f"{type(optimizer).__name__} with gsnr=True under DDP needs >= {MIN_GROUPS} ranks in "
                             f"the DDP process group (one gradient group per rank), got {world}: use >= 2 ranks "
                             "or gsnr=False")
        ignored = ddp_model.parameters_to_ignore
        reduced = {id(p) for name, p in ddp_model.module.named_parameters()
                   if p.requires_grad and name not in ignored}
        missing = sum(1 for p in gsnr_params if p.requires_grad and id(p) not in reduced)
        if missing:
            raise ValueError(f"{missing} parameter(s) of a gsnr=True param group of {type(optimizer).__name__} are "
                             "not reduced by this DDP model: build the optimizer on ddp_model.parameters()")
    stats = DDPStats(group, world)
    ddp_model.register_comm_hook(stats, fused_allreduce_hook)
    optimizer.set_statistics_source(stats)
    return stats


__all__ = ["attach", "DDPStats", "fused_allreduce_hook"]
