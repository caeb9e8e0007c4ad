"""A single-process reference of what a 2-rank DeepSpeed run of a VRGD optimizer computes.

It sees every rank's micro-batch gradients, groups them as docs/design.md §3 says for the stage
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
    """``squares``: the scheme whose statistics to mirror. ``per_micro_step``: groups are ranks on
    stage 0/ZeRO-1, ranks × micro-steps on ZeRO-2/3, Σg in fp32 from the groups. ``per_step``:
    ranks × micro-steps everywhere; Σg from the gradient DeepSpeed reduced (``gbar="engine"``,
    before clipping: n · ḡ in its dtype) or from the groups in fp32 (``gbar="local"``)."""

    def __init__(self, model: torch.nn.Module, make_opt, dtype: torch.dtype, stage: int, gas: int,
                 world: int, clip: float, squares: str = "per_micro_step", gbar: str = "local",
                 clip_norm_of: set[int] | None = None) -> None:
        self.master = copy.deepcopy(model).float()
        self.low = copy.deepcopy(model).to(dtype)
        self.dtype, self.stage, self.gas, self.world, self.clip = dtype, stage, gas, world, clip
        self.squares, self.gbar = squares, gbar
        self.clip_norm_of = clip_norm_of  # indices of the parameters the clipping norm counts (None: all)
        self.opt = make_opt(list(self.master.parameters()))
        self.stats = GivenStats()
        self.opt.set_statistics_source(self.stats)

    def step(self, batches, loss_fn, loss_scale: float) -> None:
        """``batches[r][j]``: micro-batch j of rank r (fewer than GAS: a step that ends early).

        Mirrors DeepSpeed's arithmetic in the low-precision dtype: the loss is scaled as
        ``(loss / GAS) · S``, also in a step of fewer micro-batches; stage 0/ZeRO-1 accumulate a rank's micro-batch gradients in
        ``.grad`` (low precision) and reduce once; ZeRO-2/3 reduce every micro-step and add the
        reduced gradients in the gradient-accumulation dtype (here the model dtype). The fused
        reduction averages in fp32 and rounds to the model dtype once. Statistics are fp32.
        """
        low = self.dtype
        with torch.no_grad():
            for lo, hi in zip(self.low.parameters(), self.master.parameters()):
                lo.copy_(hi.to(low))
        per_micro = self.stage >= 2  # DeepSpeed reduces every micro-step (else once, at the boundary)
        micro_groups = per_micro or self.squares == "per_step"
        groups: list[list[torch.Tensor]] = []  # fp32 gradient of every group
        reduced: list[list[torch.Tensor]] = []  # what one reduction hands DeepSpeed, per reduction
        locals_: list[list[list[torch.Tensor]]] = []  # [reduction][rank][param], low precision
        for r in range(self.world):
            self.low.zero_grad(set_to_none=True)
            acc_local: list[torch.Tensor] | None = None
            for j in range(len(batches[r])):
                self.low.zero_grad(set_to_none=True)
                loss = loss_fn(self.low, batches[r][j])
                ((loss / self.gas) * loss_scale).backward()
                micro = [p.grad.detach().clone() for p in self.low.parameters()]
                if micro_groups:
                    groups.append([g.float() * (self.gas / loss_scale) for g in micro])
                if per_micro:
                    if len(locals_) <= j:
                        locals_.append([])
                    locals_[j].append(micro)
                else:  # autograd accumulates into .grad in the model's dtype
                    acc_local = micro if acc_local is None else [(a + b) for a, b in zip(acc_local, micro)]
            if not per_micro:
                if not locals_:
                    locals_.append([])
                locals_[0].append(acc_local)
                if not micro_groups:
                    groups.append([g.float() / loss_scale for g in acc_local])
        for per_rank in locals_:  # fp32 all-reduce, average, round to the model dtype
            reduced.append([(sum(rk[i].float() for rk in per_rank) / self.world).to(low)
                            for i in range(len(per_rank[0]))])
        acc = reduced[0]
        for more in reduced[1:]:  # ZeRO-2/3 accumulation across micro-steps
            acc = [(a.float() + b.float()).to(low) for a, b in zip(acc, more)]
        n = len(groups)
        params = list(self.master.parameters())
        total_sq = 0.0
        for i, p in enumerate(params):
            gs = torch.stack([g[i] for g in groups])
            sum_g = gs.sum(0)
            if self.squares == "per_step" and self.gbar == "engine":
                # DeepSpeed's reduced gradient, before clipping: the groups' sum / (ranks · GAS), loss-scaled
                sum_g = acc[i].float() * (self.world * self.gas / loss_scale)
                if low == torch.float32:  # the true sum of the groups, but for the order of the additions
                    torch.testing.assert_close(sum_g, gs.sum(0), rtol=1e-4, atol=1e-6)
            self.stats.sums[id(p)] = (sum_g, gs.square().sum(0))
            p.grad = acc[i].float() / loss_scale
            if self.clip_norm_of is None or i in self.clip_norm_of:
                total_sq += float(p.grad.double().square().sum())
        if self.clip > 0:
            coef = self.clip / (total_sq ** 0.5 + 1e-6)
            if coef < 1:
                for p in params:
                    p.grad.mul_(coef)
        self.stats.groups = n
        self.opt.step()
