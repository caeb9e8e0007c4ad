"""VR-Adam (decoupled weight decay) — Jiang et al., arXiv 2309.13681 §4.2.

The paper's Appendix D is not public; this is our reconstruction (DESIGN §1.3): "GSNR
adapts the gradient mean before gradients' momentum estimation ... we apply the momentum
mechanism on GSNR"::

    p_t = beta3 · p_{t-1} + (1 - beta3) · r_t ;   p̂_t = p_t / (1 - beta3^t)
    g'  = p̂_t ⊙ gbar
    m, v = Adam moments of g'
    θ  = θ · (1 - lr · wd) - lr/(1 - beta1^t) · m / (sqrt(v)/sqrt(1 - beta2^t) + eps)

With ``gsnr=False`` (or ``gamma = 1``) this is AdamW in ``torch.optim.AdamW``'s arithmetic.
To change the reconstruction, change ``GsnrChunk`` in ``_fused/kernels.cpp`` and ``_Gsnr``
in ``_impl.py`` together (the tests compare them).
"""
from __future__ import annotations

from typing import Any

import torch

from vrgd_ds.optim.base import GSNROptimizer, Plan, check_arg, table


def check_adam_args(owner: str, betas: tuple[float, float], eps: float) -> None:
    check_arg(owner, "betas[0]", 0.0 <= betas[0] < 1.0, betas[0], "in [0, 1)")
    check_arg(owner, "betas[1]", 0.0 <= betas[1] < 1.0, betas[1], "in [0, 1)")
    check_arg(owner, "eps", eps >= 0.0, eps, ">= 0")


def adam_columns(plan: Plan, grad_mult: torch.Tensor | None = None) -> torch.Tensor:
    """Kernel table: inv_mean, lo, bc3, bc1, sqrt(bc2), gradient multiplier."""
    g = plan.group
    beta1, beta2 = g["betas"]
    if g["bias_correction"]:
        bc1 = plan.bias_correction(beta1)
        bc2s = plan.bias_correction(beta2).sqrt()
    else:
        bc1 = bc2s = plan.ones()
    return table(plan.gsnr_columns() + [bc1, bc2s, plan.ones() if grad_mult is None else grad_mult])


class VRAdam(GSNROptimizer):
    r"""VR-Adam with decoupled weight decay (VR-AdamW); see the module docstring.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: Adam's (beta1, beta2).
        eps: added to sqrt(v̂).
        weight_decay: decoupled weight decay.
        bias_correction: Adam bias correction of m and v.
        gamma: lower clamp of the normalised GSNR, in (0, 1] (paper: 0.1).
        beta3: momentum of the GSNR (paper: 0.9), bias-corrected.
        gsnr_eps: added to the variance in the GSNR.
        gsnr: False gives AdamW through the same code.
        fused: True/False/None: fused CPU kernels / reference / fused where applicable.
    """

    state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, bias_correction: bool = True, gamma: float = 0.1, beta3: float = 0.9,
                 gsnr_eps: float = 1e-12, gsnr: bool = True, fused: bool | None = None) -> None:
        check_adam_args(type(self).__name__, betas, eps)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, gamma=gamma, beta3=beta3, gsnr_eps=gsnr_eps, gsnr=gsnr)
        super().__init__(params, defaults, fused=fused)

    def _update(self, plan, kernels, n, extras):
        g = plan.group
        counts = kernels.adam_step(
            plan.params, plan.grads, [st["exp_avg"] for st in plan.states], [st["exp_avg_sq"] for st in plan.states],
            seg=plan.seg, segf=adam_columns(plan), lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1],
            eps=g["eps"], weight_decay=g["weight_decay"], apply=True, eps_gsnr=g["gsnr_eps"],
            **{k: v for k, v in plan.gsnr_args(n).items() if k != "eps"})
        return {"clip_counts": counts}
