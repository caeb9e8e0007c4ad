"""The shell shared by the VRGD optimizer family: statistics, the GSNR pass, skipping on
non-finite gradients, and metrics. Each member adds only its update (``_update``).

A step, for every param group (DESIGN §1)::

    pass 1   per tensor: Σr, min r, max r, Σs, Σgbar² from the statistics (one read)
    check    non-finite statistics or gradients -> the whole step is skipped, state untouched
    scales   inv_mean and lo per tensor (normalisation, clamp, zero-information guard)
    pass 2   the member's fused update with r (or its momentum p̂) applied to the gradient

Statistics come from a source: in one process tensor hooks (``vrgd_ds.stats``); under
DeepSpeed or DDP the integration installs its own with ``set_statistics_source``, with a
``Layout`` when the optimizer sees flat ZeRO partitions: segments of a flat tensor are then
pieces of model tensors (keys), and per-tensor sums are completed across ranks by key.
"""
from __future__ import annotations

import itertools
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
#: the causes of a skipped step reported in gsnr_metrics() (``step/skipped`` counts them all)
SKIP_REASONS = ("step/skipped_nonfinite", "step/skipped_overflow")
RECOMMENDED_GROUPS = 8
_SERIALS = itertools.count()


class StatisticsSource(Protocol):
    """Where ``Σg``, ``Σg²`` and the number of groups ``n`` come from."""

    @property
    def n(self) -> int: ...

    def moments(self, params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]: ...

    def reset(self) -> None: ...


class Layout(Protocol):
    """Flat partitions -> model tensors (ZeRO). Keys index model tensors ``0..num_keys-1``."""

    names: list[str]  # per key
    numel: Tensor  # float64 [num_keys]: element count of each whole model tensor

    @property
    def num_keys(self) -> int: ...

    def segments(self, p: Tensor) -> list[tuple[int, int, int]]:
        """``(start, length, key)`` of each model-tensor piece inside the flat tensor ``p``."""
        ...

    def all_reduce(self, t: Tensor, op: str) -> None:
        """In-place ``"sum"`` or ``"max"`` over the data-parallel group (every rank calls it)."""
        ...


class InvalidArgument(ValueError):
    """A hyper-parameter out of range; ``name`` is the argument."""

    def __init__(self, owner: str, name: str, value: Any, want: str) -> None:
        super().__init__(f"{owner}: invalid {name}={value!r}: must be {want}")
        self.name = name


def check_arg(owner: str, name: str, ok: bool, value: Any, want: str) -> None:
    if not ok:
        raise InvalidArgument(owner, name, value, want)


@dataclass
class Plan:
    """What one param group's step works on: flat tensors cut into segments."""

    index: int
    group: dict[str, Any]
    params: list[Tensor]
    grads: list[Tensor]
    states: list[dict[str, Any]]
    seg: Tensor  # int64 [S, 3]: tensor index, start, length
    numel: Tensor  # float64 [S]: whole-tensor element count of each segment's piece
    keys: Tensor  # int64 [S]: the model tensor each segment belongs to
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

    def per_segment(self, per_param: list[float]) -> Tensor:
        """A value per parameter of the plan -> per segment (ZeRO: several per flat tensor)."""
        return torch.tensor(per_param, dtype=torch.float64).index_select(0, self.seg[:, 0])

    def bias_correction(self, beta: float) -> Tensor:
        return self.per_segment([1.0 - beta**s for s in self.steps])

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


# Columns of the per-tensor metric tables (one row per model tensor, complete across ranks).
_SUM_COLS = ("sum_r", "numel", "sum_s", "sum_gbar_sq", "clip_low", "clip_high", "zero_info", "sum_scale")
_MAX_COLS = ("neg_min_r", "max_r", "trust", "adapted", "gsnr", "present")
_S = {c: i for i, c in enumerate(_SUM_COLS)}
_M = {c: i for i, c in enumerate(_MAX_COLS)}


@dataclass
class _Tables:
    """Per-tensor quantities of one step: small [T, k] tables, no step buffers kept."""

    sums: Tensor  # float64 [T, len(_SUM_COLS)]
    maxs: Tensor  # float64 [T, len(_MAX_COLS)], -inf where absent
    names: list[str]

    def merge(self, other: "_Tables") -> None:
        self.sums += other.sums
        torch.maximum(self.maxs, other.maxs, out=self.maxs)


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
        self._serial = next(_SERIALS)  # names this optimizer in warn-once keys (an id() is reused)
        self._kernels: _impl.Kernels | None = None
        self._stats: StatisticsSource | None = None
        self._hook_stats: TensorHookStats | None = None
        self._gsnr_eps: dict[Tensor, float] = {}  # per parameter, as the hooks last used it
        self._layout: Layout | None = None
        self._metrics: dict[str, float] = {}
        self._tables: _Tables | None = None
        #: set by an integration whose wrapper calls step() once per sub-group (ZeRO-3):
        #: metrics then merge over the calls until ``begin_step_records()``
        self.merge_step_records = False
        self.skipped_steps = 0
        self.step_calls = 0
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
        missing: dict[str, Any] = {}
        for group in self.param_groups:  # groups saved before a key existed get its default
            for k, v in self.defaults.items():
                if k not in group:
                    group[k] = missing[k] = v
        if missing:
            logger.warning("%s: the loaded state has no %s (saved by an older version); using %s", type(self).__name__,
                           ", ".join(missing), ", ".join(f"{k}={v!r}" for k, v in missing.items()))
        if "gsnr_placement" in missing:
            logger.warning("%s: checkpoints without gsnr_placement were trained with p̂ on both Adam moments, where it "
                           "cancels; they now continue with gsnr_placement=%r. To continue the saved trajectory "
                           "exactly, construct the optimizer with gsnr_placement='both_moments' before loading",
                           type(self).__name__, missing["gsnr_placement"])

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

    def set_statistics_source(self, source: StatisticsSource | None, layout: Layout | None = None) -> None:
        """Feeds the optimizer from ``source`` (DeepSpeed, DDP) instead of its tensor hooks.

        ``layout`` maps flat partitions to model tensors (ZeRO); per-tensor sums (GSNR
        mean, trust-ratio norms, metrics) are then completed across ranks by key.
        """
        if self._hook_stats is not None:
            self._hook_stats.remove()
            self._hook_stats = None
        self._stats = source
        self._layout = layout

    @property
    def statistics_source(self) -> StatisticsSource | None:
        return self._stats

    def _accumulate(self, p: Tensor, grad: Tensor, sum_g: Tensor, sum_sq: Tensor, fresh: bool, n: int) -> Tensor | None:
        """One backward into ``p``'s statistics (tensor hooks); with ``n`` > 0 also takes the
        tensor's pass 1 at ``n`` groups where the implementation can do it in the same pass."""
        eps = self._gsnr_eps.get(p)
        if eps is None:  # a parameter added since, or not in a group with GSNR on
            self._gsnr_eps = {q: g["gsnr_eps"] for g in self.param_groups if g["gsnr"] for q in g["params"]}
            eps = self._gsnr_eps.get(p, 0.0)
        return self.kernels(grad.device.type == "cpu").accumulate_moments(
            grad, sum_g, sum_sq, fresh, 1.0 / n if n and p in self._gsnr_eps else 0.0, eps)

    def _moments_from_hooks(self, plan: Plan, n: int) -> Tensor | None:
        """Pass 1 of ``plan`` as the tensor hooks took it in the last backward, when that is
        exactly what ``gsnr_moments`` would compute now: one whole-tensor segment per
        parameter, every row taken at ``n`` groups with the group's current ``gsnr_eps``."""
        if self._stats is not self._hook_stats or self._layout is not None or plan.seg.shape[0] != len(plan.params):
            return None
        if any(self._gsnr_eps.get(p) != plan.group["gsnr_eps"] for p in plan.params):
            self._gsnr_eps = {}  # gsnr_eps changed: the next backward looks it up again
            return None
        rows = self._hook_stats.last_moments(plan.params, n)
        return None if rows is None else torch.stack(rows)

    def kernels(self, cpu_only: bool = True) -> _impl.Kernels:
        """The implementation in use (fused CPU kernels or the reference)."""
        if self._kernels is None:
            params = [p for g in self.param_groups for p in g["params"]]
            self._kernels = _impl.select(self._fused, params, type(self).__name__)
        return self._kernels

    def reduce_segments(self, plan: Plan, values: Tensor) -> Tensor:
        """Per-segment sums ``[S, k]`` -> sums over each segment's whole model tensor."""
        if self._layout is None:
            return values
        buf = torch.zeros(self._layout.num_keys, values.shape[1], dtype=torch.float64)
        buf.index_add_(0, plan.keys, values.double())
        self._layout.all_reduce(buf, "sum")
        return buf.index_select(0, plan.keys)

    def reduce_scalar(self, value: float) -> float:
        """A sum over everything this optimizer updates (all ranks under ZeRO)."""
        if self._layout is None:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        self._layout.all_reduce(t, "sum")
        return float(t[0])

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

    def _plan(self, index: int, group: dict[str, Any], key_base: int) -> Plan:
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
        if self._layout is None:  # every tensor is a whole model tensor
            rows = [[i, 0, p.numel(), key_base + i, p.numel()] for i, p in enumerate(params)]
        else:
            rows = [[i, start, length, key, 0] for i, p in enumerate(params)
                    for start, length, key in self._layout.segments(p)]
        t = torch.tensor(rows, dtype=torch.long).reshape(-1, 5)
        seg, keys = t[:, :3].contiguous(), t[:, 3].contiguous()
        numel = t[:, 4].double() if self._layout is None else self._layout.numel.index_select(0, keys)
        return Plan(index, group, params, grads, states, seg, numel, keys)

    def _step(self) -> None:
        self.step_calls += 1
        if not self.merge_step_records:
            self.begin_step_records()
        plans, key_base = [], 0
        for i, g in enumerate(self.param_groups):
            plan = self._plan(i, g, key_base)
            key_base += len(plan.params)
            if plan.params:
                plans.append(plan)
        if not plans:
            return
        kernels = self.kernels()
        n = 0
        if any(p.gsnr for p in plans):
            n = self._groups_now()
        # Pass 1 everywhere before any state changes: a non-finite statistic or gradient (the
        # gradient the update reads, which a hook may have rewritten after backward) skips the
        # step, on every rank alike (each checks its own partition).
        nonfinite = False
        for plan in plans:
            if plan.gsnr:
                plan.moments = self._moments_from_hooks(plan, n)  # before moments() hands the buffers out
                plan.sum_g, plan.sum_sq = self._stats.moments(plan.params)
                if plan.moments is None:
                    plan.moments = kernels.gsnr_moments(plan.sum_g, plan.sum_sq, plan.seg, 1.0 / n,
                                                        plan.group["gsnr_eps"])
                nonfinite |= bool(plan.moments[:, 5].any()) or bool(kernels.nonfinite(plan.grads, plan.seg).any())
            else:
                plan.grad_norms = kernels.scaled_grad_norms(
                    plan.params, plan.grads, [], [], [], plan.seg, table([plan.ones()] * 3), 1.0, 0.0, 0.0)
                nonfinite |= bool(plan.grad_norms[:, 2].any())
        if self._layout is not None:
            flag = torch.tensor([float(nonfinite)], dtype=torch.float64)
            self._layout.all_reduce(flag, "max")
            nonfinite = bool(flag[0] > 0)
        if nonfinite:
            self.record_skipped("step/skipped_nonfinite", n)
            return
        for plan in plans:
            self._init_state(plan)
            if plan.gsnr:
                sum_r = self.reduce_segments(plan, plan.moments[:, :1])[:, 0]
                plan.scales = G.segment_scales(sum_r, plan.numel, plan.group["gamma"])
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
            warn_once(logger, f"small-n-{n}-{self._serial}", "GSNR estimated from only n=%d gradient groups; the paper recommends "
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
        """The member's update. Returns ``gsnr_counts`` [S, 3] (elements raised to gamma, cut to 1,
        and the sum of the scale p̂ applied) and optionally ``trust`` [S] with ``adapted`` [S]."""
        raise NotImplementedError

    # ---- metrics ---------------------------------------------------------------------------

    def _record_metrics(self, plans: list[Plan], results: list[dict[str, Tensor]], n: int) -> None:
        tables = self._step_tables(plans, results)
        if self._tables is None:
            self._tables = tables
        else:
            self._tables.merge(tables)
        self._metrics = self._summarise(self._tables, n)

    def record_skipped(self, reason: str, n: int) -> None:
        """Metrics of a skipped step: ``step/skipped`` 1 whatever the cause, and the cause,
        ``step/skipped_nonfinite`` (non-finite gradients or statistics, seen here or by the
        engine) or ``step/skipped_overflow`` (an fp16 dynamic loss scaler's overflow)."""
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}; one of {SKIP_REASONS}")
        self.skipped_steps += 1
        self._metrics = {"step/skipped": 1.0, **{r: float(r == reason) for r in SKIP_REASONS}, "gsnr/n": float(n)}
        self._tables = None
        if reason == "step/skipped_nonfinite":
            warn_once(logger, f"nonfinite-{self._serial}", "%s: non-finite gradients, step skipped (state untouched); "
                      "see gsnr_metrics()['step/skipped_total'] for the count", type(self).__name__)

    def begin_step_records(self) -> None:
        """Starts the metrics of a new step (called by ``step()`` unless an integration merges)."""
        self._tables = None

    def _step_tables(self, plans: list[Plan], results: list[dict[str, Tensor]]) -> _Tables:
        """Per-model-tensor tables of this call, complete across ranks (two small collectives)."""
        if self._layout is None:
            num_keys = int(max(int(p.keys.max()) + 1 if p.keys.numel() else 0 for p in plans))
        else:
            num_keys = self._layout.num_keys
        sums = torch.zeros(num_keys, len(_SUM_COLS), dtype=torch.float64)
        maxs = torch.full((num_keys, len(_MAX_COLS)), -torch.inf, dtype=torch.float64)
        for plan, res in zip(plans, results):
            k = plan.keys
            if k.numel() == 0:
                continue
            cols = torch.zeros(k.numel(), len(_SUM_COLS), dtype=torch.float64)
            top = torch.full((k.numel(), len(_MAX_COLS)), -torch.inf, dtype=torch.float64)
            top[:, _M["present"]] = 1.0
            top[:, _M["gsnr"]] = float(plan.gsnr)
            if plan.gsnr:
                cols[:, _S["sum_r"]] = plan.moments[:, 0]
                cols[:, _S["sum_s"]] = plan.moments[:, 3]
                cols[:, _S["sum_gbar_sq"]] = plan.moments[:, 4]
                cols[:, _S["clip_low"]] = res["gsnr_counts"][:, 0]
                cols[:, _S["clip_high"]] = res["gsnr_counts"][:, 1]
                cols[:, _S["sum_scale"]] = res["gsnr_counts"][:, 2]
                cols[:, _S["numel"]] = plan.seg[:, 2].double()
                top[:, _M["neg_min_r"]] = -plan.moments[:, 1]
                top[:, _M["max_r"]] = plan.moments[:, 2]
                zero_info = (~plan.scales.informative).double()
                cols[:, _S["zero_info"]] = zero_info * plan.seg[:, 2].double() / plan.numel.clamp_min(1)
            if "trust" in res:
                top[:, _M["trust"]] = res["trust"]
                top[:, _M["adapted"]] = res["adapted"].double()
            sums.index_add_(0, k, cols)
            maxs.scatter_reduce_(0, k.unsqueeze(1).expand_as(top), top, "amax")
        if self._layout is not None:
            self._layout.all_reduce(sums, "sum")
            self._layout.all_reduce(maxs, "max")
            names = self._layout.names
        else:
            names = [""] * num_keys
            for plan in plans:
                given = plan.group.get("param_names")
                name_of = {id(q): nm for q, nm in zip(plan.group["params"], given)} if given else {}
                for j, p in enumerate(plan.params):
                    names[int(plan.keys[j])] = name_of.get(id(p), f"group{plan.index}.param{j}")
        return _Tables(sums, maxs, names)

    @staticmethod
    def _summarise(t: _Tables, n: int) -> dict[str, float]:
        m: dict[str, float] = {"step/skipped": 0.0, **{r: 0.0 for r in SKIP_REASONS}}
        present = t.maxs[:, _M["present"]] > 0
        g = present & (t.maxs[:, _M["gsnr"]] > 0)
        if bool(g.any()):
            s, mx = t.sums[g], t.maxs[g]
            numel = s[:, _S["numel"]]
            informative = s[:, _S["zero_info"]] < 0.5
            m["gsnr/n"] = float(n)
            m["gsnr/mean"] = float(s[:, _S["sum_r"]].sum() / numel.sum())
            m["gsnr/min"] = float(-mx[:, _M["neg_min_r"]].max())
            m["gsnr/max"] = float(mx[:, _M["max_r"]].max())
            tmean = s[:, _S["sum_r"]] / numel.clamp_min(1)
            m["gsnr/tensor_mean_min"] = float(tmean.min())
            m["gsnr/tensor_mean_max"] = float(tmean.max())
            used = numel[informative].sum().clamp_min(1)
            m["gsnr/clip_low_frac"] = float(s[informative, _S["clip_low"]].sum() / used)
            m["gsnr/clip_high_frac"] = float(s[informative, _S["clip_high"]].sum() / used)
            m["gsnr/zero_info_tensors"] = float((~informative).sum())
            m["gsnr/scale_mean"] = float(s[:, _S["sum_scale"]].sum() / numel.sum())
            ns = G.noise_scale(float(s[:, _S["sum_s"]].sum()), float(s[:, _S["sum_gbar_sq"]].sum()), n)
            m["noise_scale/trace_cov"] = ns.trace_cov
            m["noise_scale/grad_sq"] = ns.grad_sq
            m["noise_scale/b_simple_groups"] = ns.b_simple_groups
        adapted = present & (t.maxs[:, _M["adapted"]] > 0)
        if bool(adapted.any()):
            trust = t.maxs[adapted, _M["trust"]]
            m["trust_ratio/mean"] = float(trust.mean())
            m["trust_ratio/min"] = float(trust.min())
            m["trust_ratio/max"] = float(trust.max())
        return m

    def gsnr_metrics(self, per_tensor: bool = False, samples_per_group: int | None = None) -> dict[str, float]:
        """Metrics of the last ``step()`` (DESIGN §5) as ``dict[str, float]``; the same on
        every rank under ZeRO (per-tensor sums are completed across ranks at the step).

        ``gsnr/mean|min|max``: raw GSNR over all elements before normalisation;
        ``gsnr/tensor_mean_min|max``: extremes of the per-tensor means; ``gsnr/clip_low_frac``,
        ``gsnr/clip_high_frac``: fraction of elements raised to gamma / cut to 1;
        ``gsnr/scale_mean``: mean of the scale p̂ applied (1: no effect this step); ``gsnr/n``;
        ``noise_scale/*``: B_simple in gradient groups, and in samples when
        ``samples_per_group`` is given (``noise_scale/b_simple``); ``trust_ratio/*`` (LAMB,
        LARS); ``step/skipped`` (1: this step was skipped), its cause ``step/skipped_nonfinite`` or
        ``step/skipped_overflow``, ``step/skipped_total``. ``per_tensor=True`` adds
        ``tensor/<name>/<metric>``.
        """
        out = dict(self._metrics)
        if out:
            out["step/skipped_total"] = float(self.skipped_steps)
        if samples_per_group is not None and "noise_scale/b_simple_groups" in out:
            out["noise_scale/b_simple"] = out["noise_scale/b_simple_groups"] * samples_per_group
        if per_tensor:
            for name, row in self._tensor_rows():
                for k, v in row.items():
                    out[f"tensor/{name}/{k}"] = v
        return out

    def _tensor_rows(self) -> Iterable[tuple[str, dict[str, float]]]:
        t = self._tables
        if t is None:
            return
        for key in range(t.sums.shape[0]):
            s, mx = t.sums[key], t.maxs[key]
            if mx[_M["present"]] <= 0:
                continue
            row: dict[str, float] = {}
            if mx[_M["gsnr"]] > 0:
                numel = float(s[_S["numel"]]) or 1.0
                row["gsnr_mean"] = float(s[_S["sum_r"]]) / numel
                row["gsnr_min"] = -float(mx[_M["neg_min_r"]])
                row["gsnr_max"] = float(mx[_M["max_r"]])
                row["clip_low_frac"] = float(s[_S["clip_low"]]) / numel
                row["clip_high_frac"] = float(s[_S["clip_high"]]) / numel
                row["scale_mean"] = float(s[_S["sum_scale"]]) / numel
            if mx[_M["trust"]] > -torch.inf:
                row["trust_ratio"] = float(mx[_M["trust"]])
            yield t.names[key], row
