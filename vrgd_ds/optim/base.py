"""The shell shared by the VRGD optimizer family: statistics, the GSNR pass, skipping on
non-finite gradients, and metrics. Each member adds only its update (``_update``).

A step, for every param group (DESIGN §1)::

    pass 1   per tensor: Σr, min r, max r, Σs, Σgbar² from the statistics (one read)
    check    non-finite statistics or gradients -> the whole step is skipped, state untouched
    scales   inv_mean and lo per tensor (normalisation, clamp, zero-information guard)
    pass 2   the member's fused update with r (or its momentum p̂) applied to the gradient

Statistics come from a source: in one process tensor hooks (``vrgd_ds.stats``); under
DeepSpeed or DDP the integration installs its own with ``set_statistics_source``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch
from torch import Tensor

from vrgd_ds import gsnr as G
from vrgd_ds.log import warn_once
from vrgd_ds.optim import _impl
from vrgd_ds.stats.hooks import TensorHookStats

logger = logging.getLogger(__name__)

MIN_GROUPS = 2
RECOMMENDED_GROUPS = 8


class StatisticsSource(Protocol):
    """Where ``Σg``, ``Σg²`` and the number of groups ``n`` come from."""

    @property
    def n(self) -> int: ...

    def moments(self, params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]: ...

    def reset(self) -> None: ...


def check_arg(owner: str, name: str, ok: bool, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{owner}: invalid {name}={value!r}: must be {want}")


@dataclass
class Plan:
    """What one param group's step works on: flat tensors cut into segments."""

    index: int
    group: dict[str, Any]
    params: list[Tensor]
    grads: list[Tensor]
    states: list[dict[str, Any]]
    seg: Tensor  # int64 [S, 3]: tensor index, start, length
    numel: Tensor  # float64 [S]
    steps: list[int] = field(default_factory=list)
    sum_g: list[Tensor] = field(default_factory=list)
    sum_sq: list[Tensor] = field(default_factory=list)
    avg: list[Tensor] = field(default_factory=list)
    moments: Tensor | None = None  # float64 [S, 6] from pass 1
    grad_norms: Tensor | None = None  # float64 [S, 3] (groups without GSNR)
    scales: G.SegmentScales | None = None

    @property
    def gsnr(self) -> bool:
        return self.group["gsnr"]

    def ones(self) -> Tensor:
        return torch.ones(self.seg.shape[0], dtype=torch.float64)

    def bias_correction(self, beta: float) -> Tensor:
        return torch.tensor([1.0 - beta**s for s in self.steps], dtype=torch.float64)

    def gsnr_columns(self) -> list[Tensor]:
        """Per-segment inv_mean, lo and GSNR-EMA bias correction (kernel columns 0..2)."""
        if not self.gsnr:
            return [self.ones(), self.ones(), self.ones()]
        beta3 = self.group["beta3"]
        bc3 = self.bias_correction(beta3) if beta3 > 0 else self.ones()
        return [self.scales.inv_mean, self.scales.lo, bc3]

    def gsnr_args(self, n: int) -> dict[str, Any]:
        """The statistics arguments of every kernel (empty lists: GSNR off)."""
        g = self.group
        return dict(sum_g=self.sum_g, sum_sq=self.sum_sq, avg=self.avg, inv_n=1.0 / max(n, 1),
                    eps=g["gsnr_eps"], beta3=g["beta3"] if self.gsnr else 0.0)


@dataclass
class _Rows:
    """What per-tensor metrics of the last step need, without the step's large tensors."""

    index: int
    group: dict[str, Any]
    params: list[Tensor]
    gsnr: bool
    moments: Tensor | None
    numel: Tensor


def table(cols: list[Tensor]) -> Tensor:
    return torch.stack([c.double() for c in cols], dim=1).contiguous()


class GSNROptimizer(torch.optim.Optimizer):
    """Base of ``VRSGD``, ``VRMomentum``, ``VRAdam``, ``VRLamb``, ``VRLars`` (and ``Lamb``,
    ``Lars``: the same code with ``gsnr=False``). Not used directly.

    Common per-group options: ``gsnr`` (bool), ``gamma`` (lower clamp of r, in (0, 1]),
    ``beta3`` (momentum of r, 0 = off), ``gsnr_eps`` (added to the variance).
    """

    #: state keys created by the member, each fp32 and shaped like the parameter
    state_keys: tuple[str, ...] = ()

    def __init__(self, params: Any, defaults: dict[str, Any], fused: bool | None = None) -> None:
        owner = type(self).__name__
        check_arg(owner, "lr", isinstance(defaults["lr"], (int, float)) and defaults["lr"] >= 0, defaults["lr"], ">= 0")
        check_arg(owner, "gamma", 0.0 < defaults["gamma"] <= 1.0, defaults["gamma"], "in (0, 1]")
        check_arg(owner, "beta3", 0.0 <= defaults["beta3"] < 1.0, defaults["beta3"], "in [0, 1)")
        check_arg(owner, "gsnr_eps", defaults["gsnr_eps"] >= 0.0, defaults["gsnr_eps"], ">= 0")
        check_arg(owner, "weight_decay", defaults["weight_decay"] >= 0.0, defaults["weight_decay"], ">= 0")
        check_arg(owner, "fused", fused in (None, True, False), fused, "None, True or False")
        self._fused = fused
        self._kernels: _impl.Kernels | None = None
        self._stats: StatisticsSource | None = None
        self._hook_stats: TensorHookStats | None = None
        self._segment_reducer: Callable[[Plan, Tensor], Tensor] | None = None
        self._metrics: dict[str, float] = {}
        self._per_tensor: list[tuple[_Rows, dict[str, Tensor]]] = []
        self.skipped_steps = 0
        super().__init__(params, defaults)
        for group in self.param_groups:
            self._check_group(group)
        if any(g["gsnr"] for g in self.param_groups):
            self._hook_stats = TensorHookStats(self._accumulate)
            self._stats = self._hook_stats
            for group in self.param_groups:
                if group["gsnr"]:
                    self._hook_stats.watch(group["params"])

    # ---- torch.optim.Optimizer behaviour -------------------------------------------------

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups saved before a key existed get its default
            for k, v in self.defaults.items():
                group.setdefault(k, v)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if getattr(self, "_metrics", None) is None:  # called from torch's __init__
            return
        self._check_group(group)
        if group["gsnr"]:
            if self._hook_stats is None and self._stats is None:
                self._hook_stats = TensorHookStats(self._accumulate)
                self._stats = self._hook_stats
            if self._hook_stats is not None:
                self._hook_stats.watch(group["params"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._stats is not None:
            self._stats.reset()  # a step the caller skipped must not leak into the next one

    def _check_group(self, group: dict[str, Any]) -> None:
        """Members validate their own group options here."""

    # ---- statistics ----------------------------------------------------------------------

    def set_statistics_source(self, source: StatisticsSource | None,
                              segment_reducer: Callable[[Plan, Tensor], Tensor] | None = None) -> None:
        """Feeds the optimizer from ``source`` (DeepSpeed, DDP) instead of its tensor hooks.

        ``segment_reducer(plan, values[S, k])`` turns per-segment sums into whole-tensor sums
        for every segment (e.g. across ZeRO partitions); default: segments are tensors.
        """
        if self._hook_stats is not None:
            self._hook_stats.remove()
            self._hook_stats = None
        self._stats = source
        self._segment_reducer = segment_reducer

    @property
    def statistics_source(self) -> StatisticsSource | None:
        return self._stats

    def _accumulate(self, grad: Tensor, sum_g: Tensor, sum_sq: Tensor, fresh: bool) -> None:
        self.kernels(grad.device.type == "cpu").accumulate_moments(grad, sum_g, sum_sq, fresh)

    def kernels(self, cpu_only: bool = True) -> _impl.Kernels:
        """The implementation in use (fused CPU kernels or the reference)."""
        if self._kernels is None:
            params = [p for g in self.param_groups for p in g["params"]]
            self._kernels = _impl.select(self._fused, params, type(self).__name__)
        return self._kernels

    def reduce_segments(self, plan: Plan, values: Tensor) -> Tensor:
        """Per-segment sums ``[S, k]`` -> sums over each segment's whole tensor."""
        if self._segment_reducer is None:
            return values
        return self._segment_reducer(plan, values)

    # ---- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._step()
        finally:
            if self._stats is not None:
                self._stats.reset()
        return loss

    def _plan(self, index: int, group: dict[str, Any]) -> Plan:
        params, grads, states = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; "
                                   "use a dense layer (e.g. nn.Embedding(sparse=False))")
            if not p.is_contiguous() or not p.grad.is_contiguous():
                raise RuntimeError(f"{type(self).__name__} needs contiguous parameters and gradients "
                                   f"(a parameter of shape {tuple(p.shape)} is not)")
            params.append(p)
            grads.append(p.grad)
            states.append(self.state[p])
        seg = torch.tensor([[i, 0, p.numel()] for i, p in enumerate(params)], dtype=torch.long).reshape(-1, 3)
        return Plan(index, group, params, grads, states, seg, seg[:, 2].double())

    def _step(self) -> None:
        plans = [p for p in (self._plan(i, g) for i, g in enumerate(self.param_groups)) if p.params]
        if not plans:
            return
        kernels = self.kernels()
        n = 0
        if any(p.gsnr for p in plans):
            n = self._groups_now()
        # Pass 1 everywhere before any state changes: a non-finite gradient skips the step.
        nonfinite = False
        for plan in plans:
            if plan.gsnr:
                plan.sum_g, plan.sum_sq = self._stats.moments(plan.params)
                plan.moments = kernels.gsnr_moments(plan.sum_g, plan.sum_sq, plan.seg, 1.0 / n,
                                                    plan.group["gsnr_eps"])
                nonfinite |= bool(plan.moments[:, 5].any())
            else:
                plan.grad_norms = kernels.scaled_grad_norms(
                    plan.params, plan.grads, [], [], [], plan.seg, table([plan.ones()] * 3), 1.0, 0.0, 0.0)
                nonfinite |= bool(plan.grad_norms[:, 2].any())
        if nonfinite:
            self.skipped_steps += 1
            self._metrics = {"step/skipped_nonfinite": 1.0, "step/skipped_total": float(self.skipped_steps),
                             "gsnr/n": float(n)}
            self._per_tensor = []
            warn_once(logger, f"nonfinite-{id(self)}", "%s: non-finite gradients, step skipped (state untouched); "
                      "see gsnr_metrics()['step/skipped_total'] for the count", type(self).__name__)
            return
        for plan in plans:
            self._init_state(plan)
            if plan.gsnr:
                sums = self.reduce_segments(plan, torch.stack([plan.moments[:, 0], plan.numel], 1))
                plan.scales = G.segment_scales(sums[:, 0], sums[:, 1], plan.group["gamma"])
        extras = self._prepare(plans, kernels)
        results = [self._update(plan, kernels, n, extras) for plan in plans]
        self._record_metrics(plans, results, n)

    def _groups_now(self) -> int:
        if self._stats is None:
            raise RuntimeError(f"{type(self).__name__}: no statistics source is attached")
        n = self._stats.n
        if n < MIN_GROUPS:
            raise RuntimeError(
                f"{type(self).__name__}.step(): GSNR needs at least {MIN_GROUPS} gradient groups per step, got n={n}. "
                "In one process every backward() between two step() calls is one group: split the batch into "
                ">= 2 micro-batches and call backward() on each (gradient accumulation); under DeepSpeed/DDP use "
                ">= 2 data-parallel ranks or gradient_accumulation_steps >= 2 (ZeRO-2/3). Or set gsnr=False."
            )
        if n < RECOMMENDED_GROUPS:
            warn_once(logger, f"small-n-{n}-{id(self)}", "GSNR estimated from only n=%d gradient groups; the paper recommends "
                      "n >= %d (best 32-256)", n, RECOMMENDED_GROUPS)
        return n

    def _init_state(self, plan: Plan) -> None:
        """Creates missing state lazily (also keys an older checkpoint lacks) and counts the step."""
        beta3 = plan.group["beta3"] if plan.gsnr else 0.0
        for p, st in zip(plan.params, plan.states):
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in self.state_keys:
                if key not in st:
                    st[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if beta3 > 0 and "gsnr_avg" not in st:
                st["gsnr_avg"] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            st["step"] += 1
            plan.steps.append(int(st["step"].item()))
            if beta3 > 0:
                plan.avg.append(st["gsnr_avg"])

    def _prepare(self, plans: list[Plan], kernels: _impl.Kernels) -> dict[str, Any]:
        """Cross-group quantities computed before any update (e.g. LAMB's global norm)."""
        return {}

    def _update(self, plan: Plan, kernels: _impl.Kernels, n: int, extras: dict[str, Any]) -> dict[str, Tensor]:
        """The member's update. Returns ``clip_counts`` [S, 2] and optionally ``trust`` [S]."""
        raise NotImplementedError

    # ---- metrics ---------------------------------------------------------------------------

    def _record_metrics(self, plans: list[Plan], results: list[dict[str, Tensor]], n: int) -> None:
        m: dict[str, float] = {"step/skipped_nonfinite": 0.0, "step/skipped_total": float(self.skipped_steps)}
        gs = [(p, r) for p, r in zip(plans, results) if p.gsnr]
        if gs:
            mom = torch.cat([p.moments for p, _ in gs])
            numel = torch.cat([p.numel for p, _ in gs])
            informative = torch.cat([p.scales.informative for p, _ in gs])
            clips = torch.cat([r["clip_counts"] for _, r in gs])
            tmean = mom[:, 0] / numel.clamp_min(1)
            m["gsnr/n"] = float(n)
            m["gsnr/mean"] = float(mom[:, 0].sum() / numel.sum())
            m["gsnr/min"] = float(mom[:, 1].min())
            m["gsnr/max"] = float(mom[:, 2].max())
            m["gsnr/tensor_mean_min"] = float(tmean.min())
            m["gsnr/tensor_mean_max"] = float(tmean.max())
            used = numel[informative].sum().clamp_min(1)
            m["gsnr/clip_low_frac"] = float(clips[informative, 0].sum() / used)
            m["gsnr/clip_high_frac"] = float(clips[informative, 1].sum() / used)
            m["gsnr/zero_info_tensors"] = float((~informative).sum())
            ns = G.noise_scale(float(mom[:, 3].sum()), float(mom[:, 4].sum()), n)
            m["noise_scale/trace_cov"] = ns.trace_cov
            m["noise_scale/grad_sq"] = ns.grad_sq
            m["noise_scale/b_simple_groups"] = ns.b_simple_groups
        trusts = [r["trust"][r["adapted"]] for r in results if "trust" in r]
        trusts = torch.cat(trusts) if trusts else torch.empty(0)
        if trusts.numel():
            m["trust_ratio/mean"] = float(trusts.mean())
            m["trust_ratio/min"] = float(trusts.min())
            m["trust_ratio/max"] = float(trusts.max())
        # Per-tensor rows are built only when asked for (gsnr_metrics(per_tensor=True)):
        # a Python loop over every tensor would cost a noticeable slice of the step.
        # Only small per-segment tensors are kept: no gradient or statistics buffer.
        per = [(_Rows(plan.index, plan.group, plan.params, plan.gsnr, plan.moments, plan.numel), res)
               for plan, res in zip(plans, results)]
        self._metrics, self._per_tensor = m, per

    def gsnr_metrics(self, per_tensor: bool = False, samples_per_group: int | None = None) -> dict[str, float]:
        """Metrics of the last ``step()`` (DESIGN §5) as ``dict[str, float]``.

        ``gsnr/mean|min|max``: raw GSNR over all elements before normalisation;
        ``gsnr/tensor_mean_min|max``: extremes of the per-tensor means; ``gsnr/clip_low_frac``,
        ``gsnr/clip_high_frac``: fraction of elements raised to gamma / cut to 1; ``gsnr/n``;
        ``noise_scale/*``: B_simple in gradient groups, and in samples when
        ``samples_per_group`` is given (``noise_scale/b_simple``); ``trust_ratio/*`` (LAMB,
        LARS); ``step/skipped_*``. ``per_tensor=True`` adds ``tensor/<name>/<metric>``.
        """
        out = dict(self._metrics)
        if samples_per_group is not None and "noise_scale/b_simple_groups" in out:
            out["noise_scale/b_simple"] = out["noise_scale/b_simple_groups"] * samples_per_group
        if per_tensor:
            for name, row in self._tensor_rows():
                for k, v in row.items():
                    out[f"tensor/{name}/{k}"] = v
        return out

    def _tensor_rows(self) -> Iterable[tuple[str, dict[str, float]]]:
        for plan, res in self._per_tensor:
            names = plan.group.get("param_names")
            name_of = {id(q): nm for q, nm in zip(plan.group["params"], names)} if names else {}
            numel = plan.numel.clamp_min(1)
            cols: dict[str, list[float]] = {}
            if plan.gsnr:
                cols["gsnr_mean"] = (plan.moments[:, 0] / numel).tolist()
                cols["gsnr_min"] = plan.moments[:, 1].tolist()
                cols["gsnr_max"] = plan.moments[:, 2].tolist()
                cols["clip_low_frac"] = (res["clip_counts"][:, 0] / numel).tolist()
                cols["clip_high_frac"] = (res["clip_counts"][:, 1] / numel).tolist()
            if "trust" in res:
                cols["trust_ratio"] = res["trust"].tolist()
            for i, p in enumerate(plan.params):
                yield name_of.get(id(p), f"group{plan.index}.param{i}"), {k: v[i] for k, v in cols.items()}
