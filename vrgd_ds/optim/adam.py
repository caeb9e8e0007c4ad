"""VR-Adam (decoupled weight decay) — Jiang et al., arXiv 2309.13681 §4.2.

The paper's Appendix D is not public; this is our reconstruction (docs/design.md §1.3): "GSNR
adapts the gradient mean before gradients' momentum estimation ... we apply the momentum
mechanism on GSNR"::

    p_t = beta3 · p_{t-1} + (1 - beta3) · r_t ;   p̂_t = clamp(p_t / (1 - beta3^t), gamma, 1)
    m   = beta1 · m + (1 - beta1) · p̂_t ⊙ gbar        # GSNR-scaled first moment
    v   = beta2 · v + (1 - beta2) · gbar²              # raw second moment
    θ   = θ · (1 - lr · wd) - lr/(1 - beta1^t) · m / (sqrt(v)/sqrt(1 - beta2^t) + eps)

That is ``gsnr_placement="first_moment"``, the default. ``"both_moments"`` feeds p̂ ⊙ gbar to
m *and* v; wherever p̂ is steady per element, m' ≈ p̂·m and v' ≈ p̂²·v, so m̂'/√v̂' = m̂/√v̂:
Adam's step, p̂ cancels (kept for comparison). ``"update"`` keeps Adam's moments and multiplies
the update m̂/(√v̂+eps) by p̂ (the paper argues against it: the scale then never enters the
moments). On the noise-damping problem (``vrgd_ds.damping``) the noise/signal update ratio is
0.18 for AdamW and for both_moments, and about 0.02 for first_moment and update.

With ``gsnr=False`` (or ``gamma = 1``, any placement) this is AdamW in ``torch.optim.AdamW``'s
arithmetic. To change the reconstruction, change ``GsnrChunk``/``adam_chunk`` in
``_fused/kernels.cpp`` and ``_Gsnr``/``adam_step`` in ``_impl.py`` together (the tests compare them).
"""
from __future__ import annotations

from typing import Any

import torch

from vrgd_ds.optim import _impl, columns
from vrgd_ds.optim.base import GSNROptimizer, check_arg, constructor_args
from vrgd_ds.optim.checks import FP32_TINY, as_pair
from vrgd_ds.optim.functional import StepContext, counted_by, finish_rows, member_step, step_powers
from vrgd_ds.optim.plan import Plan

#: the accepted ``gsnr_placement`` values (module docstring); the first is the default
GSNR_PLACEMENTS = _impl.PLACEMENTS
UPDATE_PLACEMENT = _impl.UPDATE


def check_adam_args(owner: str, betas: tuple[float, float], eps: float) -> None:
    check_arg(owner, "betas", isinstance(betas, (tuple, list)) and len(betas) == 2, betas, "a pair (beta1, beta2)")
    check_arg(owner, "betas[0]", 0.0 <= betas[0] < 1.0, betas[0], "in [0, 1)")
    check_arg(owner, "betas[1]", 0.0 <= betas[1] < 1.0, betas[1], "in [0, 1)")
    # 0 (or a denormal, which the kernels may flush to 0) would make m̂/(√v̂ + eps) 0/0 where an
    # element's gradients have all been 0 (an embedding row no sample used): a NaN parameter
    check_arg(owner, "eps", eps >= FP32_TINY, eps, f">= {FP32_TINY:.4g}, the least normal fp32 (0 makes the update "
              "0/0 where an element's gradients have all been 0)")


def adam_update(plan: Plan, ctx: StepContext) -> dict[str, torch.Tensor]:
    """VR-Adam's update of one plan (module docstring), in one fused launch per segment table."""
    g = plan.group
    table = device_adam_table(plan, ctx) if ctx.device_tables else columns.build(columns.ADAM, **adam_columns(plan))
    counts = ctx.kernels.adam_step(
        plan.params, plan.grads, [st["exp_avg"] for st in plan.states], [st["exp_avg_sq"] for st in plan.states],
        seg=plan.seg, segf=table, lr=g["lr"], beta1=g["betas"][0],
        beta2=g["betas"][1], eps=g["eps"], weight_decay=g["weight_decay"], apply=True, placement=placement_index(plan),
        eps_gsnr=plan.eps_gsnr, **{k: v for k, v in plan.gsnr_args(ctx.n).items() if k != "eps"}, **plan.skip_args())
    if ctx.device_tables:
        finish_rows(plan, ctx, counts, table)
        return {}
    return {"gsnr_counts": counts}


def device_adam_table(plan: Plan, ctx: StepContext, mult: torch.Tensor | None = None) -> torch.Tensor:
    """``columns.ADAM``'s table with its ``lr / bc1`` column, built on the device by one kernel
    (``Triton.adam_tables``) that also takes the step's skip decision and counts the step: what
    ``adam_columns``, ``state.init_state`` and ``functional.step_plans`` compute with torch
    operations otherwise."""
    g = plan.group
    beta1, beta2 = g["betas"]
    beta3 = g["beta3"] if plan.gsnr else 0.0
    out = torch.empty(plan.num_segments, len(columns.ADAM) + 1, dtype=torch.float64, device=plan.tdev)
    bias, ema = bool(g["bias_correction"]), plan.gsnr and beta3 > 0
    powers = step_powers(plan, (beta1, beta2, beta3)) if bias or ema else None
    skipped = counted_by(ctx)
    ctx.kernels.adam_tables(ctx.flags, plan.found, skipped, plan.counters, out if powers is None else powers,
                            plan.tensor_of, plan.whole_r if plan.gsnr else out, plan.numel, mult, out,
                            gamma=g["gamma"], lr=g["lr"],
                            bc1_mult=1.0 if g.get("grad_averaging", True) else 1.0 - beta1, gsnr=plan.gsnr, ema=ema,
                            bias=bias)
    ctx.counts.added_on_device(plan.counters, plan.found, skipped)
    return out


def check_placement(owner: str, group: dict[str, Any]) -> None:
    check_arg(owner, "gsnr_placement", group["gsnr_placement"] in GSNR_PLACEMENTS, group["gsnr_placement"],
              f"one of {', '.join(map(repr, GSNR_PLACEMENTS))}")


def check_adam_group(owner: str, group: dict[str, Any]) -> None:
    """A group's Adam-family options: its placement, betas and eps (a group's ``betas[0]=1``
    would divide by a zero bias correction)."""
    check_placement(owner, group)
    check_adam_args(owner, group["betas"], group["eps"])


def placement_index(plan: Plan) -> int:
    """The kernels' index of the group's placement (any index is the base step without GSNR)."""
    return GSNR_PLACEMENTS.index(plan.group["gsnr_placement"])


def adam_columns(plan: Plan, grad_mult: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The columns of ``columns.ADAM`` by name: GSNR's, bc1, sqrt(bc2), gradient multiplier."""
    g = plan.group
    beta1, beta2 = g["betas"]
    if g["bias_correction"]:
        bc1 = plan.bias_correction(beta1)
        bc2s = plan.bias_correction(beta2).sqrt()
    else:
        bc1 = bc2s = plan.ones()
    if not g.get("grad_averaging", True):  # m = beta1·m + g is the averaged m / (1 - beta1): m̂ shares it
        bc1 = bc1 * (1.0 - beta1)
    return dict(plan.gsnr_columns(), bc1=bc1, bc2s=bc2s, grad_mult=plan.ones() if grad_mult is None else grad_mult)


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
        gsnr_placement: where p̂ enters: ``"first_moment"`` (default), ``"both_moments"``
            (cancels in m̂/√v̂; for comparison) or ``"update"`` (module docstring).
        gsnr: False gives AdamW through the same code.
        fused: None (default): the fused kernels of the parameters' device (C++ on CPU, Triton on
            CUDA) where they apply, else the reference; True: demand them; False: the reference;
            "triton": the Triton kernels (on CPU under TRITON_INTERPRET=1).
    """

    state_keys = ("exp_avg", "exp_avg_sq")
    zero_eps_keys = ("gsnr_eps", "eps")  # Adam's eps, accepted at 0 by earlier releases too
    device_tables = True  # the sync-free kernels build its tables on the device (functional.step_plans)

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, bias_correction: bool = True, gamma: float = 0.1, beta3: float = 0.9,
                 gsnr_eps: float = 1e-12, gsnr_placement: str = GSNR_PLACEMENTS[0], gsnr: bool = True,
                 fused: bool | str | None = None) -> None:
        super().__init__(params, self._group(constructor_args(locals())), fused=fused)

    @classmethod
    def _group(cls, args: dict[str, Any]) -> dict[str, Any]:
        return dict(args, betas=as_pair(args["betas"]))  # ranges: check_adam_group, on the built group

    _check_options = staticmethod(check_adam_group)
    _update = staticmethod(adam_update)


vr_adam = member_step("vr_adam", VRAdam, "VR-AdamW")
