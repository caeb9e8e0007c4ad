"""The VRGD step as functions: what every member shares (pass 1 of the statistics, the
non-finite check, the GSNR scales, state creation) around the member's own update, and
``functional_step``, which each member's public function (``vr_sgd``, ``vr_momentum``,
``vr_adam``, ``vr_lamb``, ``vr_lars``, ``vr_merit``, in its module, exported by
``vrgd_ds.optim``) calls, for a reader or another framework that keeps its own state.

A step, for every param group (docs/design.md §1)::

    pass 1   per tensor: Σr, min r, max r, Σs, Σgbar² from the statistics (one read)
    check    non-finite statistics or gradients -> the whole step is skipped, state untouched
    scales   inv_mean and lo per tensor (normalisation, clamp, zero-information guard)
    pass 2   the member's update with r (or its momentum p̂) applied to the gradient

As in ``torch.optim``, the optimizer classes gather lists and call these functions; the kernels
(reference, C++ multi-tensor, Triton fused) are chosen by the one rule of ``_impl.select``. A
member is its class's data: ``state_keys``, and the static functions ``_update(plan, ctx)``,
``_prepare(plans, ctx)`` (cross-group quantities, e.g. LAMB's global norm) and
``_needs_grad_norms(group)``.
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import Tensor

from vrgd_ds import gsnr as G
from vrgd_ds.log import warn_once
from vrgd_ds.optim import _impl, columns
from vrgd_ds.optim.checks import FP32_TINY, check_common, check_dtypes, check_given_tensors
from vrgd_ds.optim import metrics as M
from vrgd_ds.optim import state as S
from vrgd_ds.optim.plan import Plan, Planner
from vrgd_ds.optim.retry import StepCounts
from vrgd_ds.stats import layout as L
from vrgd_ds.stats.source import GivenStatistics, StatisticsSource

logger = logging.getLogger(__name__)

MIN_GROUPS = 2
RECOMMENDED_GROUPS = 8


class Member(Protocol):
    """What the shared step needs of a member (its class, read as data)."""

    state_keys: tuple[str, ...]

    @staticmethod
    def _update(plan: Plan, ctx: "StepContext") -> dict[str, Tensor]: ...

    @staticmethod
    def _prepare(plans: list[Plan], ctx: "StepContext") -> dict[str, Any]: ...

    @staticmethod
    def _needs_grad_norms(group: dict[str, Any]) -> bool: ...


@dataclass
class StepContext:
    """What a member's update reads besides its plan: the kernels, the number of gradient groups
    ``n``, the layout that completes per-tensor sums across shards (None: one process), the
    optimizer's name (messages) and ``extras`` from ``_prepare``."""

    kernels: Any
    n: int
    layout: Any | None
    owner: str
    serial: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    counts: StepCounts | None = None  # the step counters this attempt added to (undone on a retry)
    #: the step's skip counter on the device (the optimizer's ``Recorder``), None: not counted
    skipped: Tensor | None = None
    #: set by ``step_plans``: whether the member builds its tables on the device, the flags its
    #: first tables kernel reduces to the skip decision, and the metric tables its kernels write
    device_tables: bool = False
    flags: Tensor | None = None
    metric_tables: tuple[Tensor, Tensor] | None = None
    counted: bool = False  # a tables kernel has added the skip decision to ``skipped``
    #: one group's gradient over the values the source holds (Megatron's 1/micro-batches, a
    #: GradScaler's S: ``GSNROptimizer._step``)
    unit: float = 1.0

    def complete(self, plan: Plan, values: Tensor) -> Tensor:
        """Per-segment sums ``[S, k]`` -> sums over each segment's whole model tensor."""
        return L.complete(self.layout, plan.keys, values)

    def total(self, plans: list[Plan], values: list[Tensor]) -> Tensor:
        """A sum over every model tensor the optimizer updates, each counted once."""
        return L.total(self.layout, [p.keys for p in plans], values)

    def warn_once(self, what: str, msg: str, *args: Any, scope: str = "rank") -> None:
        warn_once(logger, f"{what}-{self.serial}", msg, *args, scope=scope)


def groups_now(source: StatisticsSource | None, owner: str, serial: int = 0) -> int:
    """The gradient groups of this step, refused below ``MIN_GROUPS`` with the fix."""
    if source is None:
        raise RuntimeError(f"{owner}: no statistics source is attached")
    n = source.n
    if n < MIN_GROUPS:
        agree = getattr(source, "agree_on_count", None)
        if agree is not None:  # ranks with other counts refuse together
            agree()
        raise RuntimeError(
            f"{owner}.step(): GSNR needs at least {MIN_GROUPS} gradient groups per step, got n={n}. "
            "In one process every backward() between two step() calls is one group: split the batch into "
            ">= 2 micro-batches and call backward() on each (gradient accumulation); under DeepSpeed/DDP use "
            ">= 2 data-parallel ranks or gradient_accumulation_steps >= 2 (ZeRO-2/3). Or set gsnr=False."
        )
    if n < RECOMMENDED_GROUPS:
        warn_once(logger, f"small-n-{n}-{serial}", "GSNR estimated from only n=%d gradient groups; the paper "
                  "recommends n >= %d (best 32-256)", n, RECOMMENDED_GROUPS, scope="job")
    return n


def local_layout(layout: Any | None) -> bool:
    """Whether per-tensor sums and the skip decision need no collective (one process, or a layout
    whose every rank holds whole, identical tensors)."""
    return layout is None or (getattr(layout, "group", False) is None and getattr(layout, "stages", None) is None)


def step_plans(member: Member, plans: list[Plan], ctx: StepContext, source: StatisticsSource | None, epoch: int,
               counts: StepCounts) -> tuple[list[dict[str, Tensor]], Tensor | None] | None:
    """One step of ``plans``: pass 1, the non-finite check, state, scales and the member's update.
    Returns each plan's results and the device's skip flag (sync-free kernels), or None when the
    step was skipped on the host (nothing written).

    With the sync-free kernels, pass 1 answers the non-finite check in the same launch; a member
    with ``device_tables`` (every one but MERIT) then builds its kernel tables, the skip decision,
    the step counters, its trust ratios and its metric rows in kernels of their own
    (``columns.DeviceTables``), reading what pass 1 left on the device."""
    kernels, n, layout = ctx.kernels, ctx.n, ctx.layout
    sync_free = kernels.sync_free
    ctx.device_tables = sync_free and getattr(member, "device_tables", False) and all(
        p.shape is not None and p.shape.unique_keys for p in plans)
    tdev = plans[0].tdev
    # Pass 1 everywhere before any state changes: a non-finite statistic or gradient (the
    # gradient the update reads, which a hook may have rewritten after backward) skips the
    # step, on every rank alike (each checks its own partition).
    flags = []
    # a source whose sums are of g/u (Megatron divides each micro-batch's loss by the step's
    # micro-batches u: ``group_unit``; a GradScaler multiplies it by S: u = 1/S) gets gsnr_eps/u²,
    # the floor of one micro-batch's gradient on every engine and layout, whatever the split of
    # the batch into ranks and micro-batches or the loss scale
    unit = ctx.unit
    for plan in plans:
        plan.eps_gsnr = max(plan.group["gsnr_eps"] / (unit * unit), FP32_TINY)  # a normal fp32, as checked
        if plan.gsnr:
            plan.moments = None
            taken = getattr(source, "taken_moments", None)
            if taken is not None and layout is None and plan.seg.shape[0] == len(plan.params):  # whole tensors
                plan.moments = taken(plan.params, n, plan.eps_gsnr)  # before moments() hands out
            plan.sum_g, plan.sum_sq = source.moments(plan.params)
            if plan.moments is None and sync_free:  # the gradient's check in pass 1's launch
                plan.moments = kernels.checked_moments(plan.sum_g, plan.sum_sq, plan.grads, plan.seg, 1.0 / n,
                                                       plan.eps_gsnr)
                flags.append(plan.moments[:, 5])
                continue
            if plan.moments is None:
                plan.moments = kernels.gsnr_moments(plan.sum_g, plan.sum_sq, plan.seg, 1.0 / n, plan.eps_gsnr)
            flags += [plan.moments[:, 5], kernels.nonfinite(plan.grads, plan.seg)]
        elif member._needs_grad_norms(plan.group):  # the norms' pass also answers the non-finite check
            plan.grad_norms = kernels.scaled_grad_norms(
                plan.params, plan.grads, [], [], [], plan.seg, plan.shape.ones_table(len(columns.NORMS)), 1.0, 0.0, 0.0)
            flags.append(plan.grad_norms[:, 2])
        else:  # reads the gradient only (one word per parameter, the norms' pass reads two)
            flags.append(kernels.nonfinite(plan.grads, plan.seg))
    if ctx.device_tables and len(flags) == 1 and flags[0].numel() and local_layout(layout):
        ctx.flags = flags[0]  # the tables kernel takes the largest itself
    else:
        found = torch.cat([f.reshape(-1).to(tdev, torch.float64) for f in flags]) if flags else None
        if found is None or found.numel() == 0:  # a rank holding no piece finds nothing
            found = torch.zeros(1, dtype=torch.float64, device=tdev)
        else:
            found = found.amax().reshape(1)
        if layout is not None:
            layout.all_reduce(found, "max")
            layout.all_reduce_stages(found, "max")
        ctx.flags = found
    if ctx.device_tables:
        found = torch.empty((), dtype=torch.float64, device=tdev)  # written by the first plan's tables kernel
    else:
        found = ctx.flags[0]
        if not sync_free and bool(found > 0):  # host tables: the decision costs nothing here
            return None
    if sync_free:
        for plan in plans:
            plan.found = found
    for plan in plans:  # the same collectives in the same order on either route (a rank's route is its own)
        S.init_state(plan, member.state_keys, epoch, counts, count=not ctx.device_tables)
        if plan.gsnr:
            plan.whole_r = ctx.complete(plan, plan.moments[:, :1])
            if not ctx.device_tables:
                plan.scales = G.segment_scales(plan.whole_r[:, 0], plan.numel, plan.group["gamma"])
    if ctx.device_tables:
        ctx.metric_tables = M.device_tables(plans, layout)
    ctx.extras = member._prepare(plans, ctx)
    return [member._update(plan, ctx) for plan in plans], (found if sync_free else None)


def step_powers(plan: Plan, betas: tuple[float, ...]) -> Tensor | None:
    """``betas`` to the power of each tensor's step count after a taken step, ``[k, T]`` on the
    device (a skipped step writes nothing, so its count does not matter): one torch ``pow`` beside
    the tables kernels, which take it. None for a rank holding no piece of the group."""
    counters = plan.counters
    if not counters:
        return None
    steps = (counters[0].reshape(1) if len(counters) == 1 else torch.stack(counters)) + 1.0
    return torch.pow(plan.shape.powers_base(betas), steps)


def counted_by(ctx: StepContext) -> Tensor | None:
    """The skip counter for the step's first tables kernel to add the decision to (None after it)."""
    skipped = None if ctx.counted else ctx.skipped
    ctx.counted = ctx.counted or skipped is not None
    return skipped


def finish_rows(plan: Plan, ctx: StepContext, res: Tensor, table: Tensor, norms: Tensor | None = None,
                lamb: Tensor | None = None, trust: int = 0, adapt: bool = False) -> None:
    """The plan's metric rows in one kernel (``Triton.finish``), from what the step's pass and pass
    1 left on the device; ``trust`` 1: LAMB's trust ratios from ``norms`` into ``lamb`` first, 2:
    ``norms`` holds LARS's ``[trust, adapted]`` rows."""
    g = plan.group
    sums, maxs = ctx.metric_tables
    shape = plan.shape
    ctx.kernels.finish(res, table if norms is None else norms, table, plan.whole_r if plan.gsnr else table,
                       plan.numel, plan.moments if plan.gsnr else table, plan.keys, shape.length, shape.length_share,
                       lamb, sums, maxs, lr=g["lr"], min_coeff=g.get("min_coeff", 0.0),
                       max_coeff=g.get("max_coeff", 0.0), gsnr=plan.gsnr, trust=trust, adapt=adapt)


# ---- a member's step as a function ---------------------------------------------------------

def options(cls: type, hyper: dict[str, Any]) -> dict[str, Any]:
    """The group options ``cls(params, **hyper)`` would build (its ``_group`` of its
    constructor's arguments with their defaults), without an optimizer."""
    sig = inspect.signature(cls.__init__)
    args = {k: p.default for k, p in sig.parameters.items()
            if k not in ("self", "params", "fused") and p.default is not inspect.Parameter.empty}
    unknown = sorted(set(hyper) - set(args))
    if unknown:
        raise TypeError(f"{cls.__name__}: unknown option {unknown[0]!r}; accepted: {', '.join(args)}")
    args.update(hyper)
    group = cls._group(args)
    check_common(cls.__name__, group)
    cls._check_options(cls.__name__, group)
    return group


@torch.no_grad()
def functional_step(cls: type, params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[dict[str, Any]],
                    sum_g: Sequence[Tensor] | None = None, sum_sq: Sequence[Tensor] | None = None, n: int = 0, *,
                    fused: bool | str | None = None, **hyper: Any) -> dict[str, float]:
    """One step of member ``cls`` on whole tensors in one process, from statistics the caller
    accumulated (``sum_g``/``sum_sq``: Σg and Σg² over ``n`` gradient groups, fp32 and shaped like
    each parameter; None with ``gsnr=False``). ``states``: one dict per parameter, created and
    updated in place as the optimizer keeps it (``step``, the member's moments, ``gsnr_avg``).
    Returns the step's metrics (``GSNROptimizer.gsnr_metrics``)."""
    params, grads = list(params), list(grads)
    group = dict(options(cls, hyper), params=params)
    owner = cls.__name__
    check_dtypes(owner, params, fused)
    check_given_tensors(owner, params, grads, list(states))
    kernels = _impl.select(fused, params, owner)
    if isinstance(kernels, _impl.WithFallback):
        kernels.new_step()
    source = GivenStatistics(params, sum_g or [], sum_sq or [], n) if group["gsnr"] else None
    n = groups_now(source, owner) if group["gsnr"] else 0
    tdev = params[0].device if kernels.sync_free else torch.device("cpu")
    by_id = {id(p): st for p, st in zip(params, states)}
    plan = Planner(owner).plan(0, group, params, grads, 0, tdev, None, 0, lambda p: by_id[id(p)])
    ctx = StepContext(kernels, n, None, owner, counts=StepCounts())
    out = step_plans(cls, [plan], ctx, source, 0, ctx.counts)
    if out is None:
        return M.skipped_summary("step/skipped_nonfinite", n)
    results, found = out
    return M.step_tables([plan], results, n, found, None, ctx.metric_tables).summary()


def member_step(name: str, cls: type, what: str) -> Callable[..., dict[str, float]]:
    """A member's public step function (``vr_adam`` and the others): ``functional_step`` with
    ``cls``, documented as such."""
    def step(params: Sequence[Tensor], grads: Sequence[Tensor], states: Sequence[dict[str, Any]],
             sum_g: Sequence[Tensor] | None = None, sum_sq: Sequence[Tensor] | None = None, n: int = 0, *,
             fused: bool | str | None = None, **options: Any) -> dict[str, float]:
        return functional_step(cls, params, grads, states, sum_g, sum_sq, n, fused=fused, **options)

    step.__name__ = step.__qualname__ = name
    step.__doc__ = (f"One {what} step of ``params`` in place (``functional.functional_step``): ``grads`` the "
                    f"gradients, ``states`` one dict per parameter (created and updated as {cls.__name__} keeps "
                    "them), ``sum_g``/``sum_sq`` Σg and Σg² over ``n`` gradient groups (None with gsnr=False), "
                    f"``options`` {cls.__name__}'s keyword arguments. Returns the step's metrics.")
    return step


__all__ = ["StepContext", "member_step", "functional_step", "groups_now", "options", "step_plans", "MIN_GROUPS", "RECOMMENDED_GROUPS"]
