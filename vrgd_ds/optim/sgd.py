"""VR-SGD and VR-Momentum (Jiang et al., arXiv 2309.13681, Algorithm 1 and §4.1).

Heavy-ball momentum, optionally Nesterov, on the GSNR-scaled gradient::

    d   = p̂ ⊙ g + wd · θ                     # GSNR scales the data gradient only
    buf = μ · buf + (1 - dampening) · d        # buf = d at the first step
    d   = d + μ · buf  (Nesterov)  or  buf
    θ  -= lr · d

``p̂`` is r (``beta3 = 0``, the paper's VR-SGD) or its bias-corrected momentum. With
``gsnr=False`` (or ``gamma = 1``) this is ``torch.optim.SGD`` with the same arguments.
"""
from __future__ import annotations

from typing import Any

import torch

from vrgd_ds.optim import columns
from vrgd_ds.optim.base import GSNROptimizer, check_arg, constructor_args
from vrgd_ds.optim.functional import StepContext, counted_by, finish_rows, member_step, step_powers
from vrgd_ds.optim.plan import Plan


def sgd_update(plan: Plan, kernels: Any, n: int, lr_mult: torch.Tensor | None = None,
               table: torch.Tensor | None = None) -> torch.Tensor:
    """One (VR-)SGD/momentum step of a plan; ``lr_mult`` per segment (LARS), default 1; ``table``:
    the ``sgd_step`` table built on the device (``device_sgd_table``), buffers created there."""
    g = plan.group
    momentum = g["momentum"]
    bufs: list[torch.Tensor] = []
    first = plan.ones() * 0.0 if table is None else None  # read with a momentum buffer only
    if momentum != 0.0 and table is None:
        # The buffer's first applied step copies d: a buffer created now, or the first counted step
        # (a step the sync-free kernels skipped on the device leaves the new buffer at zero).
        first = (plan.step_t <= 1).double()
        created = _create_buffers(plan)
        if created is not None:  # a host table only when a buffer is new (a steady step copies nothing)
            first = torch.maximum(created, first)
    if momentum != 0.0:
        bufs = [st["momentum_buffer"] for st in plan.states]
    segf = table if table is not None else columns.build(
        columns.SGD, **plan.gsnr_columns(), lr_mult=plan.ones() if lr_mult is None else lr_mult, first=first)
    return kernels.sgd_step(plan.params, plan.grads, bufs, seg=plan.seg, segf=segf, lr=g["lr"],
                            weight_decay=g["weight_decay"], momentum=momentum, dampening=g["dampening"],
                            nesterov=g["nesterov"], **plan.gsnr_args(n), **plan.skip_args())


def _create_buffers(plan: Plan) -> torch.Tensor | None:
    """Creates the momentum buffers the plan's tensors lack; per segment 1.0 where one was created
    (None: none was)."""
    created = [0.0 if "momentum_buffer" in st else 1.0 for st in plan.states]
    if not any(created):
        return None
    for p, st in zip(plan.params, plan.states):
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    return plan.per_segment(created)


def device_sgd_table(plan: Plan, ctx: StepContext, norms_table: bool = False) -> tuple[torch.Tensor,
                                                                                        torch.Tensor | None]:
    """``columns.SGD``'s table (``lr_mult`` 1) and, with ``norms_table``, the ``scaled_grad_norms``
    table, built on the device by one kernel (``Triton.sgd_tables``) that also takes the step's skip
    decision and counts the step; buffers the plan lacks are created first."""
    g = plan.group
    momentum = g["momentum"] != 0.0
    created = _create_buffers(plan) if momentum else None
    beta3 = g["beta3"] if plan.gsnr else 0.0
    ema = plan.gsnr and beta3 > 0
    powers = step_powers(plan, (beta3,)) if ema else None
    out = torch.empty(plan.num_segments, len(columns.SGD), dtype=torch.float64, device=plan.tdev)
    norms = torch.empty(plan.num_segments, len(columns.NORMS), dtype=torch.float64,
                        device=plan.tdev) if norms_table else None
    skipped = counted_by(ctx)
    ctx.kernels.sgd_tables(ctx.flags, plan.found, skipped, plan.counters, out if powers is None else powers,
                           plan.tensor_of, plan.whole_r if plan.gsnr else out, plan.numel, created, out, norms,
                           gamma=g["gamma"], gsnr=plan.gsnr, ema=ema, momentum=momentum)
    ctx.counts.added_on_device(plan.counters, plan.found, skipped)
    return out, norms


class VRMomentum(GSNROptimizer):
    r"""VR-Momentum: SGD with (Nesterov) momentum on the GSNR-scaled gradient.

    Args:
        params: parameters or param groups (see ``vrgd_ds.param_groups``).
        lr: learning rate.
        momentum: heavy-ball coefficient μ.
        dampening: dampening of the momentum update.
        nesterov: Nesterov momentum (needs momentum > 0, dampening = 0).
        weight_decay: L2 penalty added to the scaled gradient (as ``torch.optim.SGD``).
        gamma: lower clamp of the normalised GSNR, in (0, 1] (paper: 0.1).
        beta3: momentum of the GSNR (0: off, the paper's VR-SGD).
        gsnr_eps: added to the variance in the GSNR.
        gsnr: False gives the base optimizer through the same code.
        fused: as :class:`vrgd_ds.VRAdam` (None: the fused kernels of the parameters' device).
    """

    device_tables = True  # the sync-free kernels build its tables on the device (functional.step_plans)

    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.9, dampening: float = 0.0,
                 nesterov: bool = False, weight_decay: float = 0.0, gamma: float = 0.1, beta3: float = 0.0,
                 gsnr_eps: float = 1e-12, gsnr: bool = True, fused: bool | str | None = None) -> None:
        super().__init__(params, constructor_args(locals()), fused=fused)

    @classmethod
    def _group(cls, args: dict[str, Any]) -> dict[str, Any]:
        return dict(args)

    @staticmethod
    def _check_options(owner: str, group: dict[str, Any]) -> None:
        check_arg(owner, "momentum", 0.0 <= group["momentum"] < 1.0, group["momentum"], "in [0, 1)")
        check_arg(owner, "dampening", 0.0 <= group["dampening"] <= 1.0, group["dampening"], "in [0, 1]")
        check_arg(owner, "nesterov", not group["nesterov"] or (group["momentum"] > 0 and group["dampening"] == 0),
                  group["nesterov"], "False unless momentum > 0 and dampening = 0")

    @staticmethod
    def _update(plan: Plan, ctx: StepContext) -> dict[str, torch.Tensor]:
        if not ctx.device_tables:
            return {"gsnr_counts": sgd_update(plan, ctx.kernels, ctx.n)}
        table, _ = device_sgd_table(plan, ctx)
        finish_rows(plan, ctx, sgd_update(plan, ctx.kernels, ctx.n, table=table), table)
        return {}


class VRSGD(VRMomentum):
    r"""VR-SGD (paper Algorithm 1): ``θ -= lr · (r ⊙ gbar + wd · θ)``, no momentum.

    Args as :class:`VRMomentum` without the momentum options.
    """

    def __init__(self, params: Any, lr: float = 0.1, weight_decay: float = 0.0, gamma: float = 0.1,
                 beta3: float = 0.0, gsnr_eps: float = 1e-12, gsnr: bool = True, fused: bool | str | None = None) -> None:
        super().__init__(params, lr=lr, momentum=0.0, weight_decay=weight_decay, gamma=gamma, beta3=beta3,
                         gsnr_eps=gsnr_eps, gsnr=gsnr, fused=fused)

    @classmethod
    def _group(cls, args: dict[str, Any]) -> dict[str, Any]:
        return dict(lr=args["lr"], momentum=0.0, dampening=0.0, nesterov=False, **{k: v for k, v in args.items()
                                                                               if k != "lr"})


vr_momentum = member_step("vr_momentum", VRMomentum, "VR-Momentum")
vr_sgd = member_step("vr_sgd", VRSGD, "VR-SGD")
