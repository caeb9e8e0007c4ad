"""The metrics of a VRGD step (docs/design.md §5) over small per-tensor tables, and the
``Recorder`` an optimizer keeps them in.

A step leaves one ``StepRecord``: two float64 tables with a row per model tensor (sums, and
maxima), complete across ranks, the number of gradient groups and the step's non-finite flag,
all possibly on the device; nothing is read back until ``summary()``/``tensor_rows()`` are
asked for (``gsnr_metrics()``), so the step itself never synchronises with the host.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import Tensor

from vrgd_ds import gsnr as G
from vrgd_ds.log import warn_once
from vrgd_ds.optim.plan import Plan, constant_columns, to_device

logger = logging.getLogger(__name__)

#: the causes of a skipped step reported in gsnr_metrics() (``step/skipped`` counts them all)
SKIP_REASONS = ("step/skipped_nonfinite", "step/skipped_overflow")

#: columns of the per-tensor tables, by name (one row per model tensor)
SUM_COLS = ("sum_r", "numel", "sum_s", "sum_gbar_sq", "clip_low", "clip_high", "zero_info", "sum_scale")
MAX_COLS = ("neg_min_r", "max_r", "trust", "adapted", "gsnr", "present")
S = {c: i for i, c in enumerate(SUM_COLS)}
M = {c: i for i, c in enumerate(MAX_COLS)}


def empty_tables(num_keys: int, device: torch.device) -> tuple[Tensor, Tensor]:
    sums = torch.zeros(num_keys, len(SUM_COLS), dtype=torch.float64, device=device)
    maxs = torch.full((num_keys, len(MAX_COLS)), -torch.inf, dtype=torch.float64, device=device)
    return sums, maxs


@dataclass
class StepRecord:
    """Per-tensor quantities of one step: small ``[T, k]`` tables, no step buffers kept."""

    sums: Tensor  # float64 [T, len(SUM_COLS)]
    maxs: Tensor  # float64 [T, len(MAX_COLS)], -inf where absent
    names: list[str]
    n: int
    found: Tensor | None = None  # float64 0-dim: 1 when the step was skipped on the device
    counted: bool = False  # ``found`` is in the recorder's skip count already (a tables kernel added it)
    #: one group's gradient over the values the source read, where it could not scale them as it
    #: read them (``group_unit`` of the source: Megatron's division of each micro-batch's loss by
    #: the step's micro-batches, known when the step begins); the noise scale's sums take its square
    unit: float = 1.0

    def merge(self, other: "StepRecord") -> None:
        """Another call of the same engine step (ZeRO-1/2 step each param group, ZeRO-3 each
        sub-group, one at a time): the gradient groups and their unit are those of the calls with
        the GSNR on (a call over groups with it off records ``n = 0``)."""
        if other.n and not self.n:
            self.n, self.unit = other.n, other.unit
        self.sums += other.sums
        torch.maximum(self.maxs, other.maxs, out=self.maxs)
        if other.found is not None:
            self.found = other.found if self.found is None else torch.maximum(self.found, other.found)

    def skipped(self) -> bool:
        return self.found is not None and bool(self.found > 0)

    def summary(self) -> dict[str, float]:
        """The step's metrics (host values; reads the tables once)."""
        if self.skipped():
            return skipped_summary("step/skipped_nonfinite", self.n)
        sums, maxs = self.sums.cpu(), self.maxs.cpu()
        m: dict[str, float] = {"step/skipped": 0.0, **{r: 0.0 for r in SKIP_REASONS}}
        present = maxs[:, M["present"]] > 0
        g = present & (maxs[:, M["gsnr"]] > 0)
        if bool(g.any()):
            s, mx = sums[g], maxs[g]
            numel = s[:, S["numel"]]
            informative = s[:, S["zero_info"]] < 0.5
            m["gsnr/n"] = float(self.n)
            m["gsnr/mean"] = float(s[:, S["sum_r"]].sum() / numel.sum())
            m["gsnr/min"] = float(-mx[:, M["neg_min_r"]].max())
            m["gsnr/max"] = float(mx[:, M["max_r"]].max())
            held = numel > 0  # an empty tensor has no mean
            tmean = s[held, S["sum_r"]] / numel[held] if bool(held.any()) else torch.zeros(1, dtype=s.dtype)
            m["gsnr/tensor_mean_min"] = float(tmean.min())
            m["gsnr/tensor_mean_max"] = float(tmean.max())
            used = numel[informative].sum().clamp_min(1)
            m["gsnr/clip_low_frac"] = float(s[informative, S["clip_low"]].sum() / used)
            m["gsnr/clip_high_frac"] = float(s[informative, S["clip_high"]].sum() / used)
            m["gsnr/zero_info_tensors"] = float((~informative).sum())
            m["gsnr/scale_mean"] = float(s[:, S["sum_scale"]].sum() / numel.sum())
            u2 = self.unit * self.unit
            ns = G.noise_scale(u2 * float(s[:, S["sum_s"]].sum()), u2 * float(s[:, S["sum_gbar_sq"]].sum()), self.n)
            m["noise_scale/trace_cov"] = ns.trace_cov
            m["noise_scale/grad_sq"] = ns.grad_sq
            m["noise_scale/b_simple_groups"] = ns.b_simple_groups
        adapted = present & (maxs[:, M["adapted"]] > 0)
        if bool(adapted.any()):
            trust = maxs[adapted, M["trust"]]
            m["trust_ratio/mean"] = float(trust.mean())
            m["trust_ratio/min"] = float(trust.min())
            m["trust_ratio/max"] = float(trust.max())
        return m

    def tensor_rows(self) -> Iterable[tuple[str, dict[str, float]]]:
        """``(tensor name, {metric: value})`` per model tensor of the step."""
        if self.skipped():
            return
        sums, maxs = self.sums.cpu(), self.maxs.cpu()
        for key in range(sums.shape[0]):
            s, mx = sums[key], maxs[key]
            if mx[M["present"]] <= 0:
                continue
            row: dict[str, float] = {}
            if mx[M["gsnr"]] > 0 and s[S["numel"]] > 0:  # an empty tensor has no GSNR figures
                numel = float(s[S["numel"]])
                row["gsnr_mean"] = float(s[S["sum_r"]]) / numel
                row["gsnr_min"] = -float(mx[M["neg_min_r"]])
                row["gsnr_max"] = float(mx[M["max_r"]])
                informative = s[S["zero_info"]] < 0.5  # else r stays 1, nothing clipped (as in summary)
                row["clip_low_frac"] = float(s[S["clip_low"]]) / numel if informative else 0.0
                row["clip_high_frac"] = float(s[S["clip_high"]]) / numel if informative else 0.0
                row["scale_mean"] = float(s[S["sum_scale"]]) / numel
            if mx[M["adapted"]] > 0 and mx[M["trust"]] > -torch.inf:  # as trust_ratio/*: adapted tensors only
                row["trust_ratio"] = float(mx[M["trust"]])
            yield self.names[key], row


def skipped_summary(reason: str, n: int) -> dict[str, float]:
    """Metrics of a skipped step: ``step/skipped`` 1 whatever the cause, and the cause."""
    if reason not in SKIP_REASONS:
        raise ValueError(f"unknown skip reason {reason!r}; one of {SKIP_REASONS}")
    return {"step/skipped": 1.0, **{r: float(r == reason) for r in SKIP_REASONS}, "gsnr/n": float(n)}


def _num_keys(plans: list[Plan], layout: Any | None) -> int:
    return max(p.key_base + len(p.params) for p in plans) if layout is None else layout.num_keys


_COVERS: dict[tuple, tuple[tuple, bool]] = {}


def _covers(plans: list[Plan], layout: Any, num_keys: int) -> bool:
    """Whether the plans' segments hold each of the layout's keys once (cached by the plan shapes)."""
    shapes = tuple(p.shape for p in plans)
    key = (id(layout), num_keys, tuple(map(id, shapes)))
    got = _COVERS.get(key)
    if got is None or any(a is not b for a, b in zip(got[0], shapes)):  # an id reused by another shape
        keys = frozenset().union(*(s.key_set for s in shapes))
        got = (shapes, len(keys) == num_keys == sum(len(s.key_set) for s in shapes))
        if len(_COVERS) > 64:
            _COVERS.clear()
        _COVERS[key] = got
    return got[1]


def device_tables(plans: list[Plan], layout: Any | None) -> tuple[Tensor, Tensor]:
    """The step's tables for kernels that write each plan's rows at its keys (``Triton.finish``):
    left unset where the plans' segments hold every key once (one process always; a layout when
    this rank holds a piece of every tensor), else the empty tables, whose rows no plan writes."""
    tdev = plans[0].tdev
    num_keys = _num_keys(plans, layout)
    if layout is None or _covers(plans, layout, num_keys):
        return (torch.empty(num_keys, len(SUM_COLS), dtype=torch.float64, device=tdev),
                torch.empty(num_keys, len(MAX_COLS), dtype=torch.float64, device=tdev))
    return empty_tables(num_keys, tdev)


def step_tables(plans: list[Plan], results: list[dict[str, Tensor]], n: int, found: Tensor | None,
                layout: Any | None, written: tuple[Tensor, Tensor] | None = None) -> StepRecord:
    """Per-model-tensor tables of one step call, complete across ranks and pipeline stages (two
    small collectives, two more under pipeline stages).
    ``written``: tables whose rows the step's kernels wrote already (``device_tables``)."""
    tdev = plans[0].tdev
    sums, maxs = empty_tables(_num_keys(plans, layout), tdev) if written is None else written
    for plan, res in zip(plans, results if written is None else ()):
        k = plan.keys
        if k.numel() == 0:
            continue
        const = plan.shape.constants(plan.gsnr) if plan.shape is not None else constant_columns(k.numel(), tdev,
                                                                                               plan.gsnr)
        # columns in SUM_COLS / MAX_COLS order, each table one cat of views and the few columns computed here
        if plan.gsnr:
            mom, cnt = plan.moments, res["gsnr_counts"]
            length = plan.shape.length if plan.shape is not None else to_device(plan.seg[:, 2].double(), tdev)
            zero_info = torch.where(plan.scales.informative, 0.0, plan.shape.length_share
                                    if plan.shape is not None else length / plan.numel.clamp_min(1))
            cols = torch.cat([mom[:, 0:1], length[:, None], mom[:, 3:5], cnt[:, 0:2], zero_info[:, None],
                              cnt[:, 2:3]], dim=1)
            sums.index_add_(0, k, cols)
            extremes = torch.cat([-mom[:, 1:2], mom[:, 2:3]], dim=1)
        else:
            extremes = const["extremes"]
        trust = ([res["trust"][:, None], res["adapted"][:, None].double()] if "trust" in res
                 else [const["untrusted"]])
        top = torch.cat([extremes, *trust, const["flags"]], dim=1)
        maxs.scatter_reduce_(0, k.unsqueeze(1).expand_as(top), top, "amax")
    if layout is not None:
        layout.all_reduce(sums, "sum")
        layout.all_reduce(maxs, "max")
        sums, maxs, names = layout.join_stages(sums, maxs)
    else:
        names = [""] * sums.shape[0]
        for plan in plans:
            names[plan.key_base:plan.key_base + len(plan.params)] = plan.shape.names
    return StepRecord(sums, maxs, names, n, found)


class Recorder:
    """An optimizer's step metrics: the last step's tables (possibly on the device, read only
    when asked for), the skip counts, and the metrics of a step skipped on the host. Tables
    recorded before ``begin()`` merge (ZeRO-3 steps one sub-group per call)."""

    def __init__(self, owner: str, serial: int) -> None:
        self.owner, self.serial = owner, serial
        self._metrics: dict[str, float] = {}  # a step skipped before any kernel ran (host-decided)
        self._record: StepRecord | None = None
        self._skipped_host = 0
        self._skipped_device: Tensor | None = None  # steps the sync-free kernels skipped (read lazily)

    def begin(self) -> None:
        """Starts the metrics of a new step."""
        self._record = None
        self._metrics = {}

    def device_counter(self, device: torch.device) -> Tensor:
        """The device's skip count, for a tables kernel to add each step's decision to."""
        if self._skipped_device is None:
            self._skipped_device = torch.zeros(1, dtype=torch.float64, device=device)
        elif self._skipped_device.device != device:
            self._skipped_device = self._skipped_device.to(device)
        return self._skipped_device

    def record(self, record: StepRecord) -> None:
        if record.found is not None and not record.counted:
            skipped = record.found.reshape(1).double()
            self._skipped_device = skipped if self._skipped_device is None else self._skipped_device + skipped
        self._metrics = {}
        if self._record is None:
            self._record = record
        else:
            self._record.merge(record)

    def skipped(self, reason: str, n: int) -> None:
        """A skipped step: ``step/skipped`` 1 whatever the cause, and the cause,
        ``step/skipped_nonfinite`` (non-finite gradients or statistics, seen here or by the
        engine) or ``step/skipped_overflow`` (an fp16 dynamic loss scaler's overflow)."""
        self._metrics = skipped_summary(reason, n)
        self._skipped_host += 1
        self._record = None
        if reason == "step/skipped_nonfinite":
            warn_once(logger, f"nonfinite-{self.serial}", "%s: non-finite gradients or statistics, step skipped (state untouched); "
                      "see gsnr_metrics()['step/skipped_total'] for the count", self.owner)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reading it waits for the device when the kernels skip there)."""
        device = 0 if self._skipped_device is None else int(self._skipped_device.item())
        return self._skipped_host + device

    @classmethod
    def combined(cls, recorders: list["Recorder"]) -> "Recorder":
        """The recorders of several optimizers that took one engine step, each over its own tensors
        (torchtitan builds one per optimizer name), as one: their tables one under the other, so
        the GSNR and the noise scale are over all their tensors as one optimizer's would be; the
        step skipped if any skipped it; the skip count the largest (they skip together)."""
        out = cls("+".join(r.owner for r in recorders), -1)
        out._metrics = next((dict(r._metrics) for r in recorders if r._metrics), {})
        records = [r._record for r in recorders if r._record is not None]
        if records:
            device = records[0].sums.device
            founds = [rec.found.reshape(()).to(device) for rec in records if rec.found is not None]
            found = torch.stack(founds).amax() if founds else None
            gsnr_on = next((rec for rec in records if rec.n), records[0])  # an optimizer with it off records n = 0
            out._record = StepRecord(torch.cat([rec.sums.to(device) for rec in records]),
                                     torch.cat([rec.maxs.to(device) for rec in records]),
                                     [name for rec in records for name in rec.names], gsnr_on.n, found,
                                     counted=True, unit=gsnr_on.unit)
        out._skipped_host = max((r.skipped_steps for r in recorders), default=0)
        return out

    def summary(self, per_tensor: bool = False, samples_per_group: int | None = None) -> dict[str, float]:
        """The metrics of the last step (``GSNROptimizer.gsnr_metrics``)."""
        out = dict(self._metrics)
        if not out and self._record is not None:
            out = self._record.summary()
        if out:
            out["step/skipped_total"] = float(self.skipped_steps)
        if samples_per_group is not None and "noise_scale/b_simple_groups" in out:
            out["noise_scale/b_simple"] = out["noise_scale/b_simple_groups"] * samples_per_group
        if per_tensor and self._record is not None:
            for name, row in self._record.tensor_rows():
                for k, v in row.items():
                    out[f"tensor/{name}/{k}"] = v
        return out
