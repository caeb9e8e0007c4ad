"""VR-LAMB and LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning";
Jiang et al., arXiv 2309.13681 §4.2 for the GSNR part, reconstructed as in ``adam.py``).

    g     = g · c              c = max_grad_norm / max(‖g‖_global, max_grad_norm) when
                                grad_pre_normalization (NVLAMB, NVIDIA's BERT recipe), else 1
    m     = beta1 · m + (1 - beta1) · p̂ ⊙ g       v = beta2 · v + (1 - beta2) · g²
    u     = m̂ / (sqrt(v̂) + eps) + wd · θ
    trust = clamp(‖θ‖ / ‖u‖, min_coeff, max_coeff), 1 if either norm is 0 or the group has
            trust_ratio=False (bias and LayerNorm parameters, see ``param_groups``)
    θ    -= lr · trust · u

p̂ enters as ``gsnr_placement`` says (``adam.py``: ``first_moment`` above, the default;
``both_moments``, which cancels; ``update``, p̂ ⊙ m̂/(√v̂+eps)). The trust ratio then sets the
tensor's step norm, ‖Δθ‖ = lr · clamp(‖θ‖/‖u‖) · ‖u‖ = lr · ‖θ‖ wherever the clamp is
inactive, exactly as in LAMB: what VR-LAMB changes is how the step is distributed inside a
tensor (towards high-GSNR elements), not its size.

Norms are per parameter tensor, also when a tensor is split across ZeRO partitions (the
integration sums the pieces), so trust ratios equal the unsharded ones.

apex's ``FusedLAMB`` (NVIDIA's BERT recipe builds it directly) takes arguments that
:class:`VRLamb` accepts with the same meanings (``apex/optimizers/fused_lamb.py``,
``csrc/multi_tensor_lamb.cu``):

* ``max_grad_norm`` given: the global pre-normalisation above, at that threshold
  (``grad_pre_normalization`` defaults to whether it was given; apex always clips, at 1.0 unless told);
* ``use_nvlamb=False``: groups with ``weight_decay == 0`` keep trust 1 (apex's default; ours adapts
  every group unless it sets ``trust_ratio=False``);
* ``grad_averaging=False``: m = beta1 · m + g (no 1 - beta1 on the gradient); kept as the averaged m
  with m̂ divided by (1 - beta1) — the same update, a state that differs from apex's by that factor;
* ``adam_w_mode=False``: L2 regularisation, g ← c · g + wd · θ into both moments and no decay in u
  (with ``gsnr=False`` only: the GSNR scales the data gradient, and L2 makes the decay part of it);
* ``amsgrad=True`` refused, as apex does; ``set_grad_none``: the default of ``zero_grad``.

apex's trust ratio is unclamped (``min_coeff=0, max_coeff=inf``). ``VRFusedLAMB`` (a variant in
``registry.py``: data, not a subclass) is :class:`VRLamb` with every default of ``FusedLAMB`` and
its positional order: ``from vrgd_ds import VRFusedLAMB as FusedLAMB`` switches a script written
for apex.
"""
from __future__ import annotations

from typing import Any

import torch

from vrgd_ds.optim.adam import (GSNR_PLACEMENTS, UPDATE_PLACEMENT, adam_columns, check_adam_group,
                                 device_adam_table, placement_index)
from vrgd_ds.optim import columns
from vrgd_ds.optim.base import BUILDING, GSNROptimizer, check_arg, constructor_args
from vrgd_ds.optim.checks import as_pair, check_flags
from vrgd_ds.optim.functional import StepContext, finish_rows, member_step
from vrgd_ds.optim.plan import Plan


def trust_ratios(plan: Plan, sq_norms: torch.Tensor, min_coeff: float,
                 max_coeff: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``clamp(‖θ‖/‖u‖, min, max)`` per segment from whole-tensor ``[‖θ‖², ‖u‖²]``, guarded to 1
    where a norm is 0 or adaptation is off (a few vectorised ops on the ``[S, 2]`` table; a ratio
    the guard replaces may be inf or NaN, never read). Returns (trust, adapted mask)."""
    g = plan.group
    norms = sq_norms[:, :2].sqrt()
    on = adapts(g)
    adapted = (norms > 0).all(dim=1) if on else torch.zeros(norms.shape[0], dtype=torch.bool, device=norms.device)
    ratio = (norms[:, 0] / norms[:, 1]).clamp(min_coeff, max_coeff)
    return torch.where(adapted, ratio, 1.0), adapted


def adapts(group: dict[str, Any]) -> bool:
    """Whether the group's trust ratios adapt (else 1): ``trust_ratio``, and apex's ``use_nvlamb``
    rule for groups without weight decay."""
    return bool(group["trust_ratio"]) and bool(group.get("use_nvlamb", True) or group["weight_decay"] != 0)


def lamb_needs_grad_norms(group: dict[str, Any]) -> bool:
    return bool(group["grad_pre_normalization"])  # the global gradient norm


def lamb_prepare(plans: list[Plan], ctx: StepContext) -> dict[str, Any]:
    """The global gradient norm for NVLAMB pre-normalisation, over every group that asks."""
    wanted = [p for p in plans if p.group["grad_pre_normalization"]]
    if not wanted:
        return {}
    sq = []
    for plan in wanted:
        norms = plan.grad_norms if plan.grad_norms is not None else ctx.kernels.scaled_grad_norms(
            plan.params, plan.grads, [], [], [], plan.seg,
            columns.build(columns.NORMS, inv_mean=plan.ones(), lo=plan.ones(), bc3=plan.ones()), 1.0, 0.0, 0.0)
        sq.append(norms[:, 1])
    return {"global_grad_norm": ctx.total(wanted, sq).sqrt()}  # float64, on the device


def lamb_update(plan: Plan, ctx: StepContext) -> dict[str, torch.Tensor]:
    """VR-LAMB's update of one plan: the moments and ‖θ‖², ‖u‖² in one pass, the norms completed
    over each whole tensor, then the trust-ratio apply pass."""
    g, kernels, n = plan.group, ctx.kernels, ctx.n
    mult = None
    if g["grad_pre_normalization"]:
        norm = ctx.extras["global_grad_norm"]
        mult = g["max_grad_norm"] / norm.clamp_min(g["max_grad_norm"])
    m = [st["exp_avg"] for st in plan.states]
    v = [st["exp_avg_sq"] for st in plan.states]
    params, grads, decay = plan.params, plan.grads, g["weight_decay"]
    if not g["adam_w_mode"]:  # apex's L2 mode: c · g + wd · θ into both moments, no decay in u
        c = 1.0 if mult is None else mult.reshape(())
        # in fp32, as apex: wd · θ is mostly far larger than g, which a bf16 sum would round away.
        # The moments' pass reads θ for ‖θ‖² only (apply=False): fp32 copies of bf16/fp16
        # parameters (exact) give it the one dtype per call the kernels take
        params = [p.float() for p in plan.params]
        grads = [gr.float() * c + p * decay for gr, p in zip(plan.grads, params)]
        mult, decay = None, 0.0
    device = ctx.device_tables
    if device:
        cols, table = None, device_adam_table(plan, ctx, None if mult is None else mult.reshape(()))
    else:
        cols = adam_columns(plan, None if mult is None else plan.ones() * mult)
        table = columns.build(columns.ADAM, **cols)
    gsnr_args = {k: val for k, val in plan.gsnr_args(n).items() if k != "eps"}
    placement = placement_index(plan)
    out = kernels.adam_step(params, grads, m, v, seg=plan.seg, segf=table,
                            lr=g["lr"], beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                            weight_decay=decay, apply=False, placement=placement,
                            eps_gsnr=plan.eps_gsnr, **gsnr_args, **plan.skip_args(),
                            apply_dtype=plan.params[0].dtype if plan.params else None)
    norms = ctx.complete(plan, out[:, :2])
    if device:
        apply_table = torch.empty(plan.num_segments, len(columns.LAMB_APPLY) + 1, dtype=torch.float64,
                                  device=plan.tdev)
        finish_rows(plan, ctx, out, table, norms, lamb=apply_table, trust=1, adapt=adapts(g))
    else:
        trust, adapted = trust_ratios(plan, norms, g["min_coeff"], g["max_coeff"])
        apply_cols = dict({k: cols[k] for k in columns.LAMB_APPLY if k != "trust"}, trust=trust)
        apply_table = columns.build(columns.LAMB_APPLY, **apply_cols)
    if placement != UPDATE_PLACEMENT or not plan.gsnr:  # only the update placement reads p̂ again
        gsnr_args.update(sum_g=[], sum_sq=[], avg=[])
    kernels.lamb_apply(plan.params, m, v, seg=plan.seg, segf=apply_table,
                       lr=g["lr"], eps=g["eps"], weight_decay=decay, eps_gsnr=plan.eps_gsnr,
                       **gsnr_args, **plan.skip_args())
    return {} if device else {"gsnr_counts": out[:, 2:5], "trust": trust, "adapted": adapted}


def check_coeffs(owner: str, options: dict[str, Any]) -> None:
    """The trust ratio's clamp ``[min_coeff, max_coeff]``, naming the bound that is out of range."""
    check_arg(owner, "min_coeff", options["min_coeff"] >= 0.0, options["min_coeff"], ">= 0")
    check_arg(owner, "max_coeff", options["max_coeff"] >= options["min_coeff"], options["max_coeff"],
              f">= min_coeff ({options['min_coeff']})")


def _apex_options(owner: str, options: dict[str, Any]) -> dict[str, Any]:
    """apex ``FusedLAMB``'s ``amsgrad`` (refused) and ``max_grad_norm`` (which turns the
    pre-normalisation on unless ``grad_pre_normalization`` is given), as the constructor's keywords
    and a param group's own options take them."""
    out = dict(options)
    amsgrad = out.pop("amsgrad", False)
    check_arg(owner, "amsgrad", not amsgrad, amsgrad, "False (LAMB has no AMSGrad variant; apex refuses it too)")
    if "max_grad_norm" in out and out.get("grad_pre_normalization") is None:
        out["grad_pre_normalization"] = out["max_grad_norm"] is not None
    return out


class VRLamb(GSNROptimizer):
    r"""VR-LAMB; see the module docstring.

    Args:
        params: parameters or param groups; a group with ``trust_ratio=False`` is not adapted.
        lr: learning rate.
        betas: Adam's (beta1, beta2).
        eps: added to sqrt(v̂).
        weight_decay: decoupled weight decay (inside u, as LAMB).
        bias_correction: Adam bias correction of m and v.
        min_coeff, max_coeff: trust-ratio clamp (DeepSpeed FusedLamb: 0.01, 10; BERT-64k: max 0.3).
        grad_pre_normalization: divide gradients by max(global norm, max_grad_norm)/max_grad_norm first
            (default: whether ``max_grad_norm`` was given).
        max_grad_norm: threshold of the pre-normalisation (default 1.0).
        use_nvlamb: adapt groups with ``weight_decay == 0`` too (apex's ``use_nvlamb``; False keeps them at 1).
        grad_averaging: (1 - beta1) on the gradient in m (apex's ``grad_averaging``).
        adam_w_mode: decoupled weight decay; False: L2 inside the gradient (apex's mode 0; gsnr=False only).
        amsgrad: must be False (apex refuses it too).
        set_grad_none: what ``zero_grad()`` does by default.
        gamma, beta3, gsnr_eps, gsnr_placement, gsnr, fused: as :class:`vrgd_ds.VRAdam`.
    """

    state_keys = ("exp_avg", "exp_avg_sq")
    zero_eps_keys = ("gsnr_eps", "eps")  # Adam's eps, accepted at 0 by earlier releases too
    device_tables = True  # the sync-free kernels build its tables on the device (functional.step_plans)

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 1e-2, bias_correction: bool = True, min_coeff: float = 0.01,
                 max_coeff: float = 10.0, grad_pre_normalization: bool | None = None,
                 max_grad_norm: float | None = None, use_nvlamb: bool = True, grad_averaging: bool = True,
                 adam_w_mode: bool = True, amsgrad: bool = False, set_grad_none: bool = True,
                 gamma: float = 0.1, beta3: float = 0.9, gsnr_eps: float = 1e-12,
                 gsnr_placement: str = GSNR_PLACEMENTS[0], gsnr: bool = True,
                 fused: bool | str | None = None) -> None:
        check_flags(BUILDING.get() or type(self).__name__, {"set_grad_none": set_grad_none})
        self.set_grad_none = set_grad_none
        super().__init__(params, self._group(constructor_args(locals())), fused=fused)

    @classmethod
    def _group(cls, args: dict[str, Any]) -> dict[str, Any]:
        owner = BUILDING.get() or cls.__name__
        a = _apex_options(owner, args)  # ranges: _check_options, on the built group
        a.pop("set_grad_none")
        a["max_grad_norm"] = 1.0 if a["max_grad_norm"] is None else a["max_grad_norm"]
        gsnr_keys = ("gamma", "beta3", "gsnr_eps", "gsnr_placement", "gsnr")
        return dict({k: v for k, v in a.items() if k not in gsnr_keys}, betas=as_pair(a["betas"]), trust_ratio=True,
                    **{k: a[k] for k in gsnr_keys})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A group's own ``amsgrad`` and ``max_grad_norm`` as the constructor takes them: ``amsgrad``
        refused, ``max_grad_norm`` turning the pre-normalisation on unless the group says otherwise."""
        super().add_param_group(_apex_options(f"{self.name} (param group {len(self.param_groups)})", param_group))

    @staticmethod
    def _check_options(owner: str, group: dict[str, Any]) -> None:
        check_adam_group(owner, group)
        check_coeffs(owner, group)
        norm = group["max_grad_norm"]
        check_arg(owner, "max_grad_norm", isinstance(norm, (int, float)) and norm > 0, norm, "a number > 0")
        if not group["adam_w_mode"] and group["gsnr"]:
            raise ValueError(f"{owner}: adam_w_mode=False (L2 regularisation inside the gradient) "
                             "works with gsnr=False only: the GSNR scales the data gradient, and L2 makes the "
                             "decay part of it. Use adam_w_mode=True (decoupled decay, apex's default) or Lamb")

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    _needs_grad_norms = staticmethod(lamb_needs_grad_norms)
    _prepare = staticmethod(lamb_prepare)
    _update = staticmethod(lamb_update)


vr_lamb = member_step("vr_lamb", VRLamb, "VR-LAMB")
