"""A single-process reference of what a 2-rank DeepSpeed run of a VRGD optimizer computes.

It sees every rank's micro-batch gradients, groups them as DESIGN §3 says for the stage
(ranks for stage 0/ZeRO-1, ranks × micro-steps for ZeRO-2/3), applies DeepSpeed's gradient
clipping to the mean gradient and steps the same optimizer class on fp32 master weights.
"""
from __future__ import annotations

import copy

import torch


class GivenStats:
    """A statistics source holding sums computed by hand."""

    def __init__(self) -> None:
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.groups = 0

    @property
    def n(self) -> int:
        return self.groups

    def moments(self, params):
        return [self.sums[id(p)][0] for p in params], [self.sums[id(p)][1] for p in params]

    def reset(self) -> None:
        pass


class Reference:
    def __init__(self, model: torch.nn.Module, make_opt, dtype: torch.dtype, stage: int, gas: int,
                 world: int, clip: float) -> None:
        self.master = copy.deepcopy(model).float()
        self.low = copy.deepcopy(model).to(dtype)
        self.dtype, self.stage, self.gas, self.world, self.clip = dtype, stage, gas, world, clip
        self.opt = make_opt(list(self.master.parameters()))
        self.stats = GivenStats()
        self.opt.set_statistics_source(self.stats)

    def step(self, batches, loss_fn, loss_scale: float) -> None:
        """``batches[r][j]``: micro-batch j of rank r. Gradients are taken from the
        low-precision copy with the loss scaled like DeepSpeed (loss · S / GAS)."""
        with torch.no_grad():
            for lo, hi in zip(self.low.parameters(), self.master.parameters()):
                lo.copy_(hi.to(self.dtype))
        per_group = []
        for r in range(self.world):
            micro = []
            for j in range(self.gas):
                self.low.zero_grad(set_to_none=True)
                loss = loss_fn(self.low, batches[r][j])
                (loss * (loss_scale / self.gas)).backward()
                micro.append([p.grad.float() * (self.gas / loss_scale) for p in self.low.parameters()])
            if self.stage >= 2:
                per_group.extend(micro)
            else:
                per_group.append([sum(g[i] for g in micro) / self.gas for i in range(len(micro[0]))])
        n = len(per_group)
        params = list(self.master.parameters())
        total_sq = 0.0
        for i, p in enumerate(params):
            gs = torch.stack([g[i] for g in per_group])
            self.stats.sums[id(p)] = (gs.sum(0), gs.square().sum(0))
            p.grad = gs.sum(0) / n
            total_sq += float(p.grad.double().square().sum())
        if self.clip > 0:
            coef = self.clip / (total_sq ** 0.5 + 1e-6)
            if coef < 1:
                for p in params:
                    p.grad.mul_(coef)
        self.stats.groups = n
        self.opt.step()
