"""The shell shared by the VRGD optimizer family: statistics, the GSNR pass, skipping on
non-finite gradients, and metrics. Each member adds only its update (``_update``).

A step, for every param group (docs/design.md §1)::

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
import operator
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch
from torch import Tensor

from vrgd_ds import gsnr as G
from vrgd_ds.log import warn_once
from vrgd_ds.optim import _impl, columns
from vrgd_ds.optim import metrics as M
from vrgd_ds.stats.hooks import TensorHookStats

logger = logging.getLogger(__name__)

MIN_GROUPS = 2
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
    shapes: list[tuple[int, ...]]  # per key: the whole model tensor's shape
    replicated: Tensor | None  # bool [num_keys] or None: copies another pipeline stage counts

    @property
    def num_keys(self) -> int: ...

    def segments(self, p: Tensor) -> list[tuple[int, int, int]]:
        """``(start, length, key)`` of each model-tensor piece inside the flat tensor ``p``."""
        ...

    def offsets(self, p: Tensor) -> list[int]:
        """Where each piece of ``segments(p)`` starts inside its model tensor."""
        ...

    def all_reduce(self, t: Tensor, op: str) -> None:
        """In-place ``"sum"`` or ``"max"`` over the ranks holding pieces of these model tensors
        (every one of them calls it). ``"sum"`` takes per-key tables (rows = keys), so a rank
        holding a copy of a tensor another rank holds too (tensor parallelism) adds it once."""
        ...

    def all_reduce_stages(self, t: Tensor, op: str) -> None:
        """In-place over the pipeline stages, of a value complete for this stage's tensors
        (nothing to do without pipeline parallelism)."""
        ...


class InvalidArgument(ValueError):
    """A hyper-parameter out of range; ``name`` is the argument."""

    def __init__(self, owner: str, name: str, value: Any, want: str) -> None:
        super().__init__(f"{owner}: invalid {name}={value!r}: must be {want}")
        self.name = name


def check_arg(owner: str, name: str, ok: bool, value: Any, want: str) -> None:
    if not ok:
        raise InvalidArgument(owner, name, value, want)


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host table on ``device`` without blocking the host (pinned memory)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class Plan:
    """What one param group's step works on: flat tensors cut into segments.

    The segment table is built on the host from shapes (``seg``, CPU int64 ``[S, 3]``: tensor
    index, start, length); every per-segment quantity derived from data (moments, scales,
    bias corrections, trust ratios, the non-finite flag) is a float64 tensor on ``tdev``, the
    device the kernels keep their tables on: the parameters' device for the sync-free
    (Triton) kernels, the CPU otherwise. So the step reads nothing back to the host.
    """

    index: int
    group: dict[str, Any]
    params: list[Tensor]
    grads: list[Tensor]
    states: list[dict[str, Any]]
    seg: Tensor  # int64 [S, 3] on the host: tensor index, start, length
    numel: Tensor  # float64 [S] on tdev: whole-tensor element count of each segment's piece
    keys: Tensor  # int64 [S] on tdev: the model tensor each segment belongs to
    tdev: torch.device = torch.device("cpu")
    key_base: int = 0  # one process: the key of the plan's first tensor (keys number tensors in order)
    tensor_of: Tensor | None = None  # int64 [S] on tdev: the tensor index of each segment
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # key -> the whole model tensor's shape
    rows: list[list[int]] = field(default_factory=list)  # per segment, host ints: tensor index, start, length,
    #                                                      key, numel (one process), offset in the model tensor
    step_t: Tensor | None = None  # float64 [S] on tdev: the step count after this step
    found: Tensor | None = None  # float64 0-dim on tdev: 1 when the step is skipped (sync-free kernels)
    sum_g: list[Tensor] = field(default_factory=list)
    sum_sq: list[Tensor] = field(default_factory=list)
    avg: list[Tensor] = field(default_factory=list)
    moments: Tensor | None = None  # float64 [S, 6] from pass 1
    grad_norms: Tensor | None = None  # float64 [S, 3] (groups without GSNR)
    scales: G.SegmentScales | None = None
    shape: PlanShape | None = None

    @property
    def gsnr(self) -> bool:
        return self.group["gsnr"]

    @property
    def num_segments(self) -> int:
        return self.seg.shape[0]

    def ones(self) -> Tensor:
        return torch.ones(self.num_segments, dtype=torch.float64, device=self.tdev)

    def per_segment(self, per_param: list[float]) -> Tensor:
        """A value per parameter of the plan (host) -> per segment (ZeRO: several per flat tensor)."""
        return to_device(torch.tensor(per_param, dtype=torch.float64), self.tdev).index_select(0, self.tensor_of)

    def bias_correction(self, beta: float) -> Tensor:
        return G.gsnr_ema_bias_correction(beta, self.step_t)

    def gsnr_columns(self) -> dict[str, Tensor]:
        """The GSNR columns of every kernel table (``columns.GSNR``): inv_mean, lo and the
        GSNR momentum's bias correction bc3."""
        if not self.gsnr:
            return dict(inv_mean=self.ones(), lo=self.ones(), bc3=self.ones())
        beta3 = self.group["beta3"]
        bc3 = self.bias_correction(beta3) if beta3 > 0 else self.ones()
        return dict(inv_mean=self.scales.inv_mean, lo=self.scales.lo, bc3=bc3)

    def gsnr_args(self, n: int) -> dict[str, Any]:
        """The statistics arguments of every kernel (empty lists: GSNR off)."""
        g = self.group
        return dict(sum_g=self.sum_g, sum_sq=self.sum_sq, avg=self.avg, inv_n=1.0 / max(n, 1),
                    eps=g["gsnr_eps"], beta3=g["beta3"] if self.gsnr else 0.0)

    def skip_args(self) -> dict[str, Any]:
        """``found_inf`` for the sync-free kernels (which skip on the device), else nothing."""
        return {} if self.found is None else {"found_inf": self.found}


@dataclass
class PlanShape:
    """What a plan derives from its tensors' shapes and the layout alone, built once and reused
    while the group holds the same tensors with gradients (``GSNROptimizer._plan``): the segment
    table, its device columns and the metrics' per-tensor names. ``ready`` is the optimizer's
    state epoch at which every state tensor of the plan was last found complete."""

    seg: Tensor
    numel: Tensor
    keys: Tensor
    tensor_of: Tensor
    length: Tensor  # float64 [S] on tdev: each segment's length
    shapes: dict[int, tuple[int, ...]]
    rows: list[list[int]]
    names: list[str]
    ready: int = -1
    states: list[dict[str, Any]] | None = None  # the tensors' state dicts, valid for the epoch ``ready``
    length_share: Tensor | None = None  # float64 [S] on tdev: each segment's share of its whole tensor
    _constants: dict[bool, dict[str, Tensor]] = field(default_factory=dict)

    def constants(self, gsnr: bool) -> dict[str, Tensor]:
        """The metric tables' constant columns for this plan (made once)."""
        got = self._constants.get(gsnr)
        if got is None:
            got = self._constants[gsnr] = _constants(self.length.numel(), self.length.device, gsnr)
        return got


def _constants(segments: int, device: torch.device, gsnr: bool) -> dict[str, Tensor]:
    """Constant columns of the metric tables: absent extremes and trust (-inf), and the gsnr and
    present flags."""
    absent = torch.full((segments, 2), -torch.inf, dtype=torch.float64, device=device)
    flags = torch.tensor([[float(gsnr), 1.0]], dtype=torch.float64).expand(segments, 2).contiguous()
    return {"extremes": absent, "untrusted": absent, "flags": flags.to(device)}


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return None
    return DTensor


_DTENSOR = _dtensor_type()


class LocalState(MutableMapping):
    """The state of a DTensor parameter (FSDP2, ``vrgd_ds/fsdp``) as the kernels see it: each
    state tensor read as its local shard (a view: the kernels update the DTensor in place), and
    a local tensor shaped like the parameter's shard stored as a DTensor with the parameter's
    mesh and placements, so a checkpoint (DCP) holds sharded state. Scalars (``step``) stay
    plain tensors, as torch's optimizers keep them."""

    def __init__(self, state: dict[str, Any], param: Tensor) -> None:
        self._state, self._param = state, param
        self._local_shape = param._local_tensor.shape

    def __getitem__(self, key: str) -> Any:
        v = self._state[key]
        return v._local_tensor if isinstance(v, _DTENSOR) else v

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, Tensor) and not isinstance(value, _DTENSOR) and value.dim() > 0:
            if value.shape != self._local_shape:
                raise ValueError(f"state {key!r} of shape {tuple(value.shape)} for a parameter whose shard is "
                                 f"{tuple(self._local_shape)}")
            p = self._param
            value = _DTENSOR.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
        self._state[key] = value

    def __delitem__(self, key: str) -> None:
        del self._state[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def local_tensor(p: Tensor) -> Tensor:
    """``p`` itself, or its local shard when it is a DTensor (a view of the same storage)."""
    return p._local_tensor if _DTENSOR is not None and isinstance(p, _DTENSOR) else p


_IS_SPARSE = operator.attrgetter("is_sparse")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_NUMEL = torch.Tensor.numel


def gsnr_switch(saved: bool, built: bool) -> str:
    """What a resume does to the GSNR momentum when the state was saved with ``gsnr=saved`` and
    the optimizer is built with ``gsnr=built`` (``GSNROptimizer.load_state_dict``)."""
    if saved and not built:
        return "the GSNR momentum is dropped"
    if built and not saved:
        return "the GSNR momentum starts at p̂ = 1 (the base optimizer's step)"
    return "the GSNR momentum carries over"


class GSNROptimizer(torch.optim.Optimizer):
    """Base of ``VRSGD``, ``VRMomentum``, ``VRAdam``, ``VRLamb``, ``VRLars`` (and ``Lamb``,
    ``Lars``: the same code with ``gsnr=False``). Not used directly.

    Common per-group options: ``gsnr`` (bool), ``gamma`` (lower clamp of r, in (0, 1]),
    ``beta3`` (momentum of r, 0 = off), ``gsnr_eps`` (added to the variance).
    """

    #: state keys created by the member, each fp32 and shaped like the parameter
    state_keys: tuple[str, ...] = ()
    #: group options that decide how the statistics are wired (hooks, DeepSpeed's reduction):
    #: a loaded state keeps the values this optimizer was built with (``load_state_dict``);
    #: every other option is the saved one, as torch restores ``lr``
    wiring_keys: tuple[str, ...] = ("gsnr",)
    #: ``load_state_dict`` warns what a resume changed (an integration that reports it itself
    #: turns this off)
    report_load = True

    def __init__(self, params: Any, defaults: dict[str, Any], fused: bool | None = None) -> None:
        owner = type(self).__name__
        check_arg(owner, "lr", isinstance(defaults["lr"], (int, float)) and defaults["lr"] >= 0, defaults["lr"], ">= 0")
        check_arg(owner, "gamma", 0.0 < defaults["gamma"] <= 1.0, defaults["gamma"], "in (0, 1]")
        check_arg(owner, "beta3", 0.0 <= defaults["beta3"] < 1.0, defaults["beta3"], "in [0, 1)")
        check_arg(owner, "gsnr_eps", defaults["gsnr_eps"] >= 0.0, defaults["gsnr_eps"], ">= 0")
        check_arg(owner, "weight_decay", defaults["weight_decay"] >= 0.0, defaults["weight_decay"], ">= 0")
        check_arg(owner, "fused", fused in _impl.FUSED_CHOICES, fused, " or ".join(map(repr, _impl.FUSED_CHOICES)))
        self._fused = fused
        self._own_keys = tuple(defaults)  # torch adds keys of its own ("differentiable") to defaults
        self._serial = next(_SERIALS)  # names this optimizer in warn-once keys (an id() is reused)
        self._kernels: _impl.Kernels | None = None
        self._stats: StatisticsSource | None = None
        self._hook_stats: TensorHookStats | None = None
        self._gsnr_eps: dict[Tensor, float] = {}  # per parameter, as the hooks last used it
        self._layout: Layout | None = None
        self._metrics: dict[str, float] = {}  # a step skipped before any kernel ran (host-decided)
        self._record: M.StepRecord | None = None  # the last step's tables (possibly on the device)
        #: set by an integration whose wrapper calls step() once per sub-group (ZeRO-3):
        #: metrics then merge over the calls until ``begin_step_records()``
        self.merge_step_records = False
        self._skipped_host = 0
        self._skipped_device: Tensor | None = None  # steps the sync-free kernels skipped (read lazily)
        self.step_calls = 0
        self._counted: list[tuple[list[Tensor], Any]] = []  # step counters the current step added to
        #: bumped whenever the state or the groups may have been replaced (load_state_dict, new groups):
        #: a plan shape's ``ready`` mark is valid for one epoch
        self._epoch = 0
        self._shapes: dict[tuple, PlanShape] = {}
        self._sharded: dict[int, Tensor] = {}  # id(local shard) -> its DTensor parameter (FSDP2)
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
        self._epoch = getattr(self, "_epoch", 0) + 1
        self._shapes = {}
        missing: dict[str, Any] = {}
        for group in self.param_groups:  # groups saved before a key existed get its default
            for k in getattr(self, "_own_keys", self.defaults):
                if k not in group:
                    group[k] = missing[k] = self.defaults[k]
        if missing:
            logger.warning("%s: the loaded state has no %s (saved by an older version); using %s", type(self).__name__,
                           ", ".join(missing), ", ".join(f"{k}={v!r}" for k, v in missing.items()))
        if "gsnr_placement" in missing:
            logger.warning("%s: checkpoints without gsnr_placement were trained with p̂ on both Adam moments, where it "
                           "cancels; they now continue with gsnr_placement=%r. To continue the saved trajectory "
                           "exactly, construct the optimizer with gsnr_placement='both_moments' before loading",
                           type(self).__name__, missing["gsnr_placement"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that ``wiring_keys`` keep the values this optimizer was built with: a
        state saved by a member resumes in its base and back (VRLamb <-> Lamb, ``gsnr`` on/off).
        The shared state (moments) carries over; the GSNR momentum is dropped when the GSNR is
        off, and starts at p̂ = 1 (the base optimizer's step) when it was off (``_init_state``).
        One warning says what changed. Each tensor's step counter is its own tensor afterwards: a
        state dict may hand one step tensor to every parameter (Megatron's distributed optimizer
        does), and the step adds 1 to each counter."""
        built = [{k: g[k] for k in self.wiring_keys if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        self._epoch += 1
        seen: set[int] = set()
        for st in self.state.values():
            step = st.get("step")
            if isinstance(step, Tensor):
                if id(step) in seen:
                    st["step"] = step.clone()
                seen.add(id(st["step"]))
        changed: dict[str, tuple[Any, Any]] = {}
        for group, mine in zip(self.param_groups, built):
            for k, v in mine.items():
                if group.get(k) != v:
                    changed[k] = (group.get(k), v)
                    group[k] = v
            if not (group["gsnr"] and group["beta3"] > 0):
                for p in group["params"]:
                    if p in self.state:
                        self.state[p].pop("gsnr_avg", None)
        if changed and self.report_load:
            saved = ", ".join(f"{k}={a!r}" for k, (a, _) in changed.items())
            now = ", ".join(f"{k}={b!r}" for k, (_, b) in changed.items())
            what = gsnr_switch(*changed.get("gsnr", (True, True)))
            logger.warning("%s: resuming a state saved with %s as built (%s): the moments carry over, %s",
                           type(self).__name__, saved, now, what)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if getattr(self, "_metrics", None) is None:  # called from torch's __init__
            return
        self._epoch += 1
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
        """The implementation in use (fused CPU kernels, Triton kernels, or the reference)."""
        if self._kernels is None:
            params = [p for g in self.param_groups for p in g["params"]]
            self._kernels = _impl.select(self._fused, params, type(self).__name__)
        return self._kernels

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reading it waits for the device when the kernels skip there)."""
        device = 0 if self._skipped_device is None else int(self._skipped_device.item())
        return self._skipped_host + device

    def reduce_segments(self, plan: Plan, values: Tensor) -> Tensor:
        """Per-segment sums ``[S, k]`` -> sums over each segment's whole model tensor."""
        # Per rank a model tensor is at most one segment (one piece of one flat partition), so
        # index_add_ has no colliding rows here (deterministic also with CUDA atomics), and with no
        # other rank to add (a layout without a group) the sums are the values themselves.
        if self._layout is None or getattr(self._layout, "group", False) is None:
            return values.double()
        buf = torch.zeros(self._layout.num_keys, values.shape[1], dtype=torch.float64, device=values.device)
        buf.index_add_(0, plan.keys, values.double())
        self._layout.all_reduce(buf, "sum")
        return buf.index_select(0, plan.keys)

    def global_sum(self, plans: list[Plan], values: list[Tensor]) -> Tensor:
        """A float64 sum of per-segment values (``[S]`` per plan) over every model tensor this
        optimizer's model updates, each counted once: all ranks under ZeRO, tensor-parallel
        shards and pipeline stages under Megatron."""
        if self._layout is None:
            return torch.stack([v.double().sum() for v in values]).sum()
        buf = torch.zeros(self._layout.num_keys, 1, dtype=torch.float64, device=values[0].device)
        for plan, v in zip(plans, values):
            buf.index_add_(0, plan.keys, v.double().reshape(-1, 1))
        self._layout.all_reduce(buf, "sum")
        if self._layout.replicated is not None:  # a tied weight's copy: the stage that owns it counts it
            buf[self._layout.replicated.to(buf.device)] = 0
        total = buf.sum().reshape(1)
        self._layout.all_reduce_stages(total, "sum")
        return total[0]

    # ---- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._is_state_init():
            self.allocate_state()
            if self._stats is not None:
                self._stats.reset()
            return loss
        try:
            try:
                self._step()
            except _impl.StepRetry:  # the Triton kernels failed before writing anything: the reference now
                self._undo_step_counts()
                self._step()
        finally:
            if self._stats is not None:
                self._stats.reset()
        return loss

    def _is_state_init(self) -> bool:
        """The step ``torch.distributed.checkpoint.state_dict`` (and torchtitan before a load) runs
        on a fresh optimizer to create its state: every gradient zero, every ``lr`` 0, no
        statistics recorded. It creates the state as a fresh start has it (``allocate_state``) and
        advances nothing: no step count, no GSNR momentum (a real step would need n >= 2 groups)."""
        if self.state or any(float(g["lr"]) != 0.0 for g in self.param_groups):
            return False
        if self._stats is not None and self._stats.n != 0:
            return False
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        return bool(grads) and not any(bool(local_tensor(x).any()) for x in grads)

    def _gather(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
        """The group's parameters with a gradient, and their gradients (``map`` does the per-tensor
        checks in C: the host cost of a steady step hardly grows with the number of tensors)."""
        params = [p for p in group["params"] if p.grad is not None]
        grads = [p.grad for p in params]
        if params and _DTENSOR is not None and any(map(isinstance, params, itertools.repeat(_DTENSOR))):
            # FSDP2 (vrgd_ds/fsdp): the kernels work on the local shards; the state stays keyed by
            # the DTensor parameters (``_plan``)
            if self._layout is None:
                raise RuntimeError(f"{type(self).__name__} steps DTensor (sharded) parameters: call "
                                   "vrgd_ds.fsdp.attach(model, optimizer) first (its per-tensor sums and statistics "
                                   "span the shards)")
            for p in params:
                self._sharded[id(p._local_tensor)] = p
            params, grads = list(map(local_tensor, params)), list(map(local_tensor, grads))
        if grads and (any(map(_IS_SPARSE, grads)) or not all(map(_IS_CONTIGUOUS, grads))):
            for p, gr in zip(params, grads):
                if gr.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; "
                                       "use a dense layer (e.g. nn.Embedding(sparse=False))")
                if not gr.is_contiguous():
                    raise RuntimeError(f"{type(self).__name__} needs contiguous parameters and gradients "
                                       f"(the gradient of a parameter of shape {tuple(p.shape)} is not)")
        return params, grads

    def _plan(self, index: int, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], key_base: int,
              tdev: torch.device) -> Plan:
        key = (index, key_base, tdev, id(self._layout), tuple(map(id, params)), tuple(map(_NUMEL, params)))
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._plan_shape(index, group, params, key_base, tdev)
            if len(self._shapes) > 64:
                self._shapes.clear()
            self._shapes[key] = shape
        if shape.states is None or shape.ready != self._epoch:  # the state dicts, looked up once per epoch
            shape.states = [self._state_of(p) for p in params]
        plan = Plan(index, group, params, grads, shape.states, shape.seg, shape.numel, shape.keys, tdev, key_base)
        plan.tensor_of, plan.shapes, plan.rows, plan.shape = shape.tensor_of, shape.shapes, shape.rows, shape
        return plan

    def _state_of(self, p: Tensor) -> dict[str, Any]:
        """The state dict of ``p``; of its DTensor parameter when ``p`` is a local shard."""
        owner = self._sharded.get(id(p))
        if owner is None:
            return self.state[p]
        return LocalState(self.state[owner], owner)

    def _plan_shape(self, index: int, group: dict[str, Any], params: list[Tensor], key_base: int,
                    tdev: torch.device) -> PlanShape:
        """The segment table of a group's tensors (built when they change, not every step)."""
        for p in params:
            if not p.is_contiguous():
                raise RuntimeError(f"{type(self).__name__} needs contiguous parameters and gradients "
                                   f"(a parameter of shape {tuple(p.shape)} is not)")
        if self._layout is None:  # every tensor is a whole model tensor
            rows = [[i, 0, p.numel(), key_base + i, p.numel(), 0] for i, p in enumerate(params)]
            shapes = {key_base + i: tuple(p.shape) for i, p in enumerate(params)}
            given = group.get("param_names")
            name_of = {id(q): nm for q, nm in zip(group["params"], given)} if given else {}
            names = [name_of.get(id(p), f"group{index}.param{j}") for j, p in enumerate(params)]
        else:
            rows = [[i, start, length, key, 0, offset] for i, p in enumerate(params)
                    for (start, length, key), offset in zip(self._layout.segments(p), self._layout.offsets(p))]
            shapes = {row[3]: self._layout.shapes[row[3]] for row in rows}
            names = []
        t = torch.tensor(rows, dtype=torch.long).reshape(-1, 6)
        seg, keys = t[:, :3].contiguous(), t[:, 3].contiguous()
        numel = t[:, 4].double() if self._layout is None else self._layout.numel.index_select(0, keys)
        length = seg[:, 2].double()
        return PlanShape(seg, to_device(numel, tdev), to_device(keys, tdev), to_device(seg[:, 0].contiguous(), tdev),
                         to_device(length, tdev), shapes, rows, names,
                         length_share=to_device(length / numel.clamp_min(1), tdev))

    def _undo_step_counts(self) -> None:
        """What ``_step`` counted before its kernels failed (the step is run again)."""
        self.step_calls -= 1
        for counters, added in self._counted:
            torch._foreach_add_(counters, -added if isinstance(added, float) else [-a for a in added])
        self._counted = []

    def _step(self) -> None:
        self.step_calls += 1
        self._counted = []
        if not self.merge_step_records:
            self.begin_step_records()
        kernels = self.kernels()
        if isinstance(kernels, _impl.WithFallback):
            kernels.new_step()
        sync_free = kernels.sync_free
        gathered = [self._gather(g) for g in self.param_groups]
        if not any(ps for ps, _ in gathered) and self._layout is None:
            return
        device = next((ps[0].device for ps, _ in gathered if ps), None)
        if device is None:  # this rank holds no piece of any group (Megatron's distributed optimizer)
            device = self._layout.device
        tdev = device if sync_free else torch.device("cpu")
        plans, key_base = [], 0
        for i, (g, (ps, gs)) in enumerate(zip(self.param_groups, gathered)):
            plan = self._plan(i, g, ps, gs, key_base, tdev)
            key_base += len(plan.params)
            # Under a layout every rank takes part in every group's collectives, also in a group
            # of which it holds no piece (Megatron's distributed optimizer can leave it none).
            if plan.params or self._layout is not None:
                plans.append(plan)
        n = 0
        if any(p.gsnr for p in plans):
            n = self._groups_now()
        # Pass 1 everywhere before any state changes: a non-finite statistic or gradient (the
        # gradient the update reads, which a hook may have rewritten after backward) skips the
        # step, on every rank alike (each checks its own partition).
        flags = []
        for plan in plans:
            if plan.gsnr:
                plan.moments = self._moments_from_hooks(plan, n)  # before moments() hands out
                plan.sum_g, plan.sum_sq = self._stats.moments(plan.params)
                if plan.moments is None:
                    plan.moments = kernels.gsnr_moments(plan.sum_g, plan.sum_sq, plan.seg, 1.0 / n,
                                                        plan.group["gsnr_eps"])
                flags += [plan.moments[:, 5], kernels.nonfinite(plan.grads, plan.seg)]
            elif self._needs_grad_norms(plan.group):  # the norms' pass also answers the non-finite check
                plan.grad_norms = kernels.scaled_grad_norms(
                    plan.params, plan.grads, [], [], [], plan.seg, columns.build(columns.NORMS, **plan.gsnr_columns()),
                    1.0, 0.0, 0.0)
                flags.append(plan.grad_norms[:, 2])
            else:  # reads the gradient only (one word per parameter, the norms' pass reads two)
                flags.append(kernels.nonfinite(plan.grads, plan.seg))
        found = torch.cat([f.reshape(-1).to(tdev, torch.float64) for f in flags]) if flags else None
        if found is None or found.numel() == 0:  # a rank holding no piece finds nothing
            found = torch.zeros(1, dtype=torch.float64, device=tdev)
        else:
            found = found.amax().reshape(1)
        if self._layout is not None:
            self._layout.all_reduce(found, "max")
            self._layout.all_reduce_stages(found, "max")
        found = found[0]
        if not sync_free:
            if bool(found > 0):  # host tables: the decision costs nothing here
                self.record_skipped("step/skipped_nonfinite", n)
                return
        else:
            for plan in plans:
                plan.found = found
        for plan in plans:
            self._init_state(plan)
            if plan.gsnr:
                sum_r = self.reduce_segments(plan, plan.moments[:, :1])[:, 0]
                plan.scales = G.segment_scales(sum_r, plan.numel, plan.group["gamma"])
        extras = self._prepare(plans, kernels)
        results = [self._update(plan, kernels, n, extras) for plan in plans]
        self._record_metrics(plans, results, n, found if sync_free else None)

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

    def element_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state a parameter of ``group`` holds per element once it stepped (beside ``step``)."""
        keys = list(self.state_keys)
        if group.get("momentum", 0.0) != 0.0:
            keys.append("momentum_buffer")  # the SGD family (sgd_update)
        if group["gsnr"] and group["beta3"] > 0:
            keys.append("gsnr_avg")
        return tuple(keys)

    @torch.no_grad()
    def allocate_state(self) -> None:
        """Creates every state key a step would create, as a fresh start has it (step 0, zeros):
        what a sharded checkpoint loads into (Megatron's ``init_state_fn``). Keys present stay."""
        self._epoch += 1
        for group in self.param_groups:
            keys = self.element_state_keys(group)
            for p in group["params"]:
                st = self.state[p]
                if "step" not in st:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
                for key in keys:
                    if key not in st:  # a DTensor parameter gets DTensor state, sharded like it
                        st[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)

    def _init_state(self, plan: Plan) -> None:
        """Creates missing state lazily (also keys an older checkpoint lacks) and counts the step.

        Step counters live on the table device: the host for the host-table kernels, the
        parameters' device for the sync-free kernels, where a skipped step (``plan.found``)
        does not count."""
        beta3 = plan.group["beta3"] if plan.gsnr else 0.0
        counters = None
        if plan.shape is not None and plan.shape.ready == self._epoch:
            try:  # the same state as at the last complete check (nothing replaced it since: same epoch)
                counters = [st["step"] for st in plan.states]
                if beta3 > 0:
                    plan.avg = [st["gsnr_avg"] for st in plan.states]
            except KeyError:
                counters, plan.avg = None, []
        if counters is None:
            counters = self._complete_state(plan, beta3)
            if plan.shape is not None:
                plan.shape.ready = self._epoch
        if not counters:  # no piece of this group here (a layout's collectives only)
            plan.step_t = torch.ones(0, dtype=torch.float64, device=plan.tdev)
            return
        # a device scalar per counter (a list): the 0-d-tensor overload reads the scalar on the host
        added = 1.0 if plan.found is None else [(1.0 - plan.found).float()] * len(counters)
        torch._foreach_add_(counters, added)
        self._counted.append((counters, added))
        # A skipped step's bias corrections must stay finite (its kernels store nothing).
        steps = torch.stack(counters).double().clamp_min(1.0)
        plan.step_t = steps.index_select(0, plan.tensor_of)

    def _complete_state(self, plan: Plan, beta3: float) -> list[Tensor]:
        """Every state tensor of the plan, created where missing; returns the step counters."""
        counters = []
        for p, st in zip(plan.params, plan.states):
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32, device=plan.tdev)
            elif st["step"].device != plan.tdev:
                st["step"] = st["step"].to(plan.tdev)
            for key in self.state_keys:
                if key not in st:
                    st[key] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            if beta3 > 0 and "gsnr_avg" not in st:
                # p̂ = 1 after the bias correction 1 - beta3**step: zeros on a fresh start; on a
                # state without it (GSNR switched on at a resume) the base optimizer's step,
                # which the measured GSNR then takes over from
                prior = 1.0 - torch.pow(beta3, st["step"].to(device=p.device, dtype=torch.float32))
                st["gsnr_avg"] = prior * torch.ones(p.shape, dtype=torch.float32, device=p.device)
            counters.append(st["step"])
            if beta3 > 0:
                plan.avg.append(st["gsnr_avg"])
        return counters

    def _needs_grad_norms(self, group: dict[str, Any]) -> bool:
        """Whether a group without GSNR uses ‖θ‖² and ‖g‖² per tensor (``plan.grad_norms``):
        pass 1 then computes them, which also answers the non-finite check."""
        return False

    def _prepare(self, plans: list[Plan], kernels: _impl.Kernels) -> dict[str, Any]:
        """Cross-group quantities computed before any update (e.g. LAMB's global norm)."""
        return {}

    def _update(self, plan: Plan, kernels: _impl.Kernels, n: int, extras: dict[str, Any]) -> dict[str, Tensor]:
        """The member's update. Returns ``gsnr_counts`` [S, 3] (elements raised to gamma, cut to 1,
        and the sum of the scale p̂ applied) and optionally ``trust`` [S] with ``adapted`` [S]."""
        raise NotImplementedError

    # ---- metrics ---------------------------------------------------------------------------

    def _record_metrics(self, plans: list[Plan], results: list[dict[str, Tensor]], n: int,
                        found: Tensor | None) -> None:
        record = self._step_tables(plans, results, n, found)
        if found is not None:
            skipped = found.reshape(1).double()
            self._skipped_device = skipped if self._skipped_device is None else self._skipped_device + skipped
        self._metrics = {}
        if self._record is None:
            self._record = record
        else:
            self._record.merge(record)

    def record_skipped(self, reason: str, n: int) -> None:
        """Metrics of a skipped step: ``step/skipped`` 1 whatever the cause, and the cause,
        ``step/skipped_nonfinite`` (non-finite gradients or statistics, seen here or by the
        engine) or ``step/skipped_overflow`` (an fp16 dynamic loss scaler's overflow)."""
        self._metrics = M.skipped_summary(reason, n)
        self._skipped_host += 1
        self._record = None
        if reason == "step/skipped_nonfinite":
            warn_once(logger, f"nonfinite-{self._serial}", "%s: non-finite gradients, step skipped (state untouched); "
                      "see gsnr_metrics()['step/skipped_total'] for the count", type(self).__name__)

    def begin_step_records(self) -> None:
        """Starts the metrics of a new step (called by ``step()`` unless an integration merges)."""
        self._record = None
        self._metrics = {}

    def _step_tables(self, plans: list[Plan], results: list[dict[str, Tensor]], n: int,
                     found: Tensor | None) -> M.StepRecord:
        """Per-model-tensor tables of this call, complete across ranks (two small collectives)."""
        tdev = plans[0].tdev
        if self._layout is None:
            num_keys = max(p.key_base + len(p.params) for p in plans)
        else:
            num_keys = self._layout.num_keys
        sums, maxs = M.empty_tables(num_keys, tdev)
        for plan, res in zip(plans, results):
            k = plan.keys
            if k.numel() == 0:
                continue
            const = plan.shape.constants(plan.gsnr) if plan.shape is not None else _constants(k.numel(), tdev, plan.gsnr)
            # columns in M.SUM_COLS / M.MAX_COLS order, each table one cat of views and the few
            # columns computed here
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
        if self._layout is not None:
            self._layout.all_reduce(sums, "sum")
            self._layout.all_reduce(maxs, "max")
            names = self._layout.names
        else:
            names = [""] * num_keys
            for plan in plans:
                names[plan.key_base:plan.key_base + len(plan.params)] = plan.shape.names
        return M.StepRecord(sums, maxs, names, n, found)

    def gsnr_metrics(self, per_tensor: bool = False, samples_per_group: int | None = None) -> dict[str, float]:
        """Metrics of the last ``step()`` (docs/design.md §5) as ``dict[str, float]``; the same on
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

        With the sync-free (Triton) kernels this is where the step's tables are read back.
        """
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

