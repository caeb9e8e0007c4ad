"""VR-LARS and LARS (You et al. 2017, "Large Batch Training of Convolutional Networks";
NVIDIA's LARC for the clipping mode; Jiang et al., arXiv 2309.13681 for the GSNR part).

    g'       = p̂ ⊙ g
    local_lr = η ‖θ‖ / (‖g'‖ + wd ‖θ‖)      1 if ‖θ‖ or ‖g'‖ is 0, or trust_ratio=False
    local_lr = min(local_lr / lr, 1)         (clip=True: LARC clipping mode)
    d        = local_lr · (g' + wd · θ)
    buf      = μ · buf + d ;   θ -= lr · buf     (SGD momentum on d, Nesterov optional)

Bias and norm parameters get neither adaptation nor decay through ``param_groups``.
"""
from __future__ import annotations

from typing import Any

import torch

from vrgd_ds.optim import columns
from vrgd_ds.optim.base import GSNROptimizer, check_arg, constructor_args
from vrgd_ds.optim.functional import StepContext, finish_rows, member_step
from vrgd_ds.optim.plan import Plan
from vrgd_ds.optim.sgd import device_sgd_table, sgd_update


def lars_update(plan: Plan, ctx: StepContext) -> dict[str, torch.Tensor]:
    """VR-LARS's update of one plan: per-tensor norms of θ and p̂ ⊙ g completed over each whole
    tensor, the local lr from them, then SGD momentum on the adapted direction."""
    g, kernels, n = plan.group, ctx.kernels, ctx.n
    if ctx.device_tables:
        table, norms_table = device_sgd_table(plan, ctx, norms_table=plan.gsnr)
    norms = plan.grad_norms  # pass 1 of a group without GSNR computed exactly these
    if plan.gsnr:
        segf = norms_table if ctx.device_tables else columns.build(columns.NORMS, **plan.gsnr_columns())
        norms = kernels.scaled_grad_norms(plan.params, plan.grads, seg=plan.seg, segf=segf, **plan.gsnr_args(n))
    sq = ctx.complete(plan, norms[:, :2])
    if ctx.device_tables:  # the local lr into the table's lr_mult column, then the step and its rows
        trust = torch.empty(plan.num_segments, 2, dtype=torch.float64, device=plan.tdev)
        kernels.lars_trust(sq, table, trust, g["weight_decay"], g["eps"], g["trust_coefficient"], g["lr"],
                           adapt=bool(g["trust_ratio"]), clip=bool(g["clip"] and g["lr"] > 0))
        finish_rows(plan, ctx, sgd_update(plan, kernels, n, table=table), table, trust, trust=2)
        return {}
    w, u = sq[:, 0].sqrt(), sq[:, 1].sqrt()
    adapted = torch.full_like(w, bool(g["trust_ratio"]), dtype=torch.bool) & (w > 0) & (u > 0)
    denom = torch.where(adapted, u + g["weight_decay"] * w + g["eps"], torch.ones_like(u))
    local = torch.where(adapted, g["trust_coefficient"] * w / denom, torch.ones_like(w))
    if g["clip"] and g["lr"] > 0:
        local = torch.where(adapted, (local / g["lr"]).clamp(max=1.0), local)
    counts = sgd_update(plan, kernels, n, lr_mult=local)
    return {"gsnr_counts": counts, "trust": local, "adapted": adapted}


class VRLars(GSNROptimizer):
    r"""VR-LARS; see the module docstring.

    Args:
        params: parameters or param groups; a group with ``trust_ratio=False`` is not adapted.
        lr: learning rate.
        momentum: heavy-ball coefficient.
        nesterov: Nesterov momentum.
        weight_decay: L2 penalty inside the adapted direction.
        trust_coefficient: η (0.001).
        clip: LARC clipping mode, local lr capped at the global lr.
        eps: added to the denominator of the local lr.
        gamma, gsnr_eps, gsnr, fused: as :class:`vrgd_ds.VRAdam`; beta3 defaults to 0 (r as is).
    """

    state_keys = ()
    device_tables = True  # the sync-free kernels build its tables on the device (functional.step_plans)

    def __init__(self, params: Any, lr: float = 1.0, momentum: float = 0.9, nesterov: bool = False,
                 weight_decay: float = 0.0, trust_coefficient: float = 0.001, clip: bool = False, eps: float = 0.0,
                 gamma: float = 0.1, beta3: float = 0.0, gsnr_eps: float = 1e-12, gsnr: bool = True,
                 fused: bool | str | None = None) -> None:
        super().__init__(params, self._group(constructor_args(locals())), fused=fused)

    @classmethod
    def _group(cls, args: dict[str, Any]) -> dict[str, Any]:
        gsnr_keys = ("gamma", "beta3", "gsnr_eps", "gsnr")
        return dict(lr=args["lr"], momentum=args["momentum"], dampening=0.0,
                    **{k: v for k, v in args.items() if k not in ("lr", "momentum", *gsnr_keys)}, trust_ratio=True,
                    **{k: args[k] for k in gsnr_keys})

    @staticmethod
    def _check_options(owner: str, group: dict[str, Any]) -> None:
        check_arg(owner, "momentum", 0.0 <= group["momentum"] < 1.0, group["momentum"], "in [0, 1)")
        check_arg(owner, "nesterov", not group["nesterov"] or group["momentum"] > 0, group["nesterov"],
                  "False unless momentum > 0")
        check_arg(owner, "trust_coefficient", group["trust_coefficient"] > 0, group["trust_coefficient"], "> 0")
        check_arg(owner, "eps", group["eps"] >= 0, group["eps"], ">= 0")

    @staticmethod
    def _needs_grad_norms(group: dict[str, Any]) -> bool:
        return True

    _update = staticmethod(lars_update)


vr_lars = member_step("vr_lars", VRLars, "VR-LARS")
