"""The stateful shell of the VRGD optimizer family. It keeps what torch.optim keeps (groups,
state, ``state_dict``) and gathers each group's tensors; the step itself is a function
(``functional.step_plans``) around each member's update, as torch's ``step()`` calls a
functional ``adam()``. Around it, in modules of their own: the plans and their cached tables
(``plan.py``), DTensor shards (``sharded.py``), state and checkpoint compatibility
(``state.py``), the retry after a kernel failure (``retry.py``) and metrics (``metrics.py``).

Statistics come from a source (``vrgd_ds.stats.source``): in one process the tensor hooks this
class installs (``vrgd_ds.stats.hooks``); under an engine (DeepSpeed, DDP, Megatron-core,
FSDP2) the source its integration attaches with ``set_statistics_source``, with a layout
(``vrgd_ds.stats.layout``) when the optimizer updates pieces of model tensors: per-tensor sums
are then completed across ranks by key.
"""
from __future__ import annotations

import contextlib
import contextvars
import difflib
import itertools
import logging
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from vrgd_ds.log import warn_once
from vrgd_ds.optim import _impl
from vrgd_ds.optim import functional as F
from vrgd_ds.optim import metrics as M
from vrgd_ds.optim import state as S
from vrgd_ds.optim.checks import check_dtypes
from vrgd_ds.optim.checks import InvalidArgument, check_arg, check_common  # noqa: F401 (their home before)
from vrgd_ds.optim.plan import Plan, Planner
from vrgd_ds.optim.retry import StepCounts, run_with_retry
from vrgd_ds.optim.sharded import gather, state_of
from vrgd_ds.stats.hooks import TensorHookStats
from vrgd_ds.stats.source import StatisticsSource

logger = logging.getLogger(__name__)

MIN_GROUPS, RECOMMENDED_GROUPS = F.MIN_GROUPS, F.RECOMMENDED_GROUPS
gsnr_switch = S.gsnr_switch
_SERIALS = itertools.count()
#: the registry name an optimizer is being built as (``registry.Variant``: Lamb is VRLamb, gsnr off)
BUILDING: contextvars.ContextVar[str | None] = contextvars.ContextVar("vrgd_building", default=None)
#: the options that variant fixes (``Lamb``: ``gsnr=False``), which no param group may set otherwise
FIXED: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("vrgd_fixed", default=None)
_FOR_ENGINE: contextvars.ContextVar[bool] = contextvars.ContextVar("vrgd_for_engine", default=False)


@contextlib.contextmanager
def built_for_engine() -> Iterator[None]:
    """Optimizers built inside install no tensor hooks: the engine integration building them
    (DeepSpeed's config path, Megatron-core, torchtitan) attaches its own statistics source."""
    token = _FOR_ENGINE.set(True)
    try:
        yield
    finally:
        _FOR_ENGINE.reset(token)


def constructor_args(frame_locals: dict[str, Any]) -> dict[str, Any]:
    """A member constructor's arguments (its ``locals()`` on entry), less ``self``, ``params`` and
    ``fused``: what its ``_group`` turns into the group options."""
    return {k: v for k, v in frame_locals.items() if k not in ("self", "params", "fused", "__class__")}


def _warn_if_replicated(owner: str, serial: int) -> None:
    """Statistics from this process's backward passes while a process group of several ranks runs:
    right for a model of this rank alone, wrong under DDP (HF Trainer or Accelerate without
    DeepSpeed wrap the model in DDP themselves), where every rank would step with its own GSNR and
    the replicas drift apart. Said once, naming the fix."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        warn_once(logger, f"replicated-{serial}", "%s: the GSNR statistics come from this process's backward passes "
                  "only, while %d ranks run. Under DistributedDataParallel (also HF Trainer or Accelerate without "
                  "DeepSpeed) call vrgd_ds.ddp.attach(model, optimizer) after wrapping the model, under FSDP2 "
                  "(fully_shard) vrgd_ds.fsdp.attach(model, optimizer), or every rank steps with its own "
                  "statistics and the replicas drift apart (trainer.optimizer, Accelerate's wrapper, is taken as "
                  "it is); a model of this rank alone needs nothing", owner, dist.get_world_size(), scope="job")


class GSNROptimizer(torch.optim.Optimizer):
    """Base of ``VRSGD``, ``VRMomentum``, ``VRAdam``, ``VRLamb``, ``VRLars``, ``VRMerit`` (and
    their bases, ``gsnr=False``). Not used directly.

    Common per-group options: ``gsnr`` (bool), ``gamma`` (lower clamp of r, in (0, 1]),
    ``beta3`` (momentum of r, 0 = off), ``gsnr_eps`` (added to the variance).
    """

    #: state keys created by the member, each fp32 and shaped like the parameter
    state_keys: tuple[str, ...] = ()
    #: group options that decide how the statistics are wired (hooks, DeepSpeed's reduction):
    #: a loaded state keeps the values this optimizer was built with (``load_state_dict``);
    #: every other option is the saved one, as torch restores ``lr``
    wiring_keys: tuple[str, ...] = ("gsnr",)
    #: ``load_state_dict`` warns what a resume changed (an integration that reports it itself turns this off)
    report_load = True

    def __init__(self, params: Any, defaults: dict[str, Any], fused: bool | str | None = None) -> None:
        self.name = BUILDING.get() or type(self).__name__
        owner = self.name
        check_common(owner, defaults)
        type(self)._check_options(owner, defaults)  # the keywords, named as such (a group's own: by its index)
        check_arg(owner, "fused", fused in _impl.FUSED_CHOICES, fused, " or ".join(map(repr, _impl.FUSED_CHOICES)))
        #: the kernel choice (``_impl.select``); an engine's statistics source takes the same
        self.fused = fused
        self._own_keys = tuple(defaults)  # torch adds keys of its own ("differentiable") to defaults
        self._fixed = dict(FIXED.get() or {})
        #: set by an integration whose wrapper calls step() once per sub-group (ZeRO-3): metrics
        #: then merge over the calls until ``begin_step_records()``
        self.merge_step_records = False
        #: bumped whenever the state or the groups may have been replaced (load_state_dict, new
        #: groups): a plan shape's ``ready`` mark is valid for one epoch
        self._epoch = 0
        self._start_runtime()
        super().__init__(params, defaults)  # each group through add_param_group: checked, watched

    #: what an optimizer builds as it runs (statistics, hooks, kernels, records), not copied or pickled
    _RUNTIME = ("_serial", "_kernels", "_stats", "_hook_stats", "_layout", "records", "step_calls", "_counts",
                "_planner", "_sharded", "_grad_scaler")

    def _start_runtime(self) -> None:
        self._serial = next(_SERIALS)  # names this optimizer in warn-once keys (an id() is reused)
        self._kernels: _impl.Kernels | None = None
        self._stats: StatisticsSource | None = None
        self._hook_stats: TensorHookStats | None = None
        self._layout: Any | None = None
        self.records = M.Recorder(self.name, self._serial)
        self.step_calls = 0
        self._counts = StepCounts()  # step counters the current step added to (undone on a retry)
        self._planner = Planner(self.name, getattr(self, "fused", None))
        self._sharded: dict[int, Tensor] = {}  # id(local shard) -> its DTensor parameter (FSDP2)
        self._grad_scaler: Any | None = None  # set_grad_scaler

    # ---- torch.optim.Optimizer behaviour -------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        """torch's (defaults, state, param groups) and this optimizer's settings; a copy or an
        unpickled optimizer builds its statistics anew, on its own tensors (``__setstate__``)."""
        return {**super().__getstate__(), **{k: v for k, v in self.__dict__.items()
                                             if k not in self._RUNTIME and not k.startswith("_optimizer_")}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_serial" not in self.__dict__:  # a copy (copy.deepcopy) or an unpickled optimizer
            self.name = self.__dict__.get("name", type(self).__name__)
            self.__dict__.setdefault("fused", None)
            self.__dict__.setdefault("_own_keys", tuple(k for k in self.defaults if k != "differentiable"))
            self.__dict__.setdefault("merge_step_records", False)
            self.__dict__.setdefault("_fixed", {})  # pickled before a variant recorded its fixed options
            self._start_runtime()
            self._watch(self.param_groups)
        self._epoch = getattr(self, "_epoch", 0) + 1
        self._planner = Planner(self.name, getattr(self, "fused", None))
        if getattr(self, "_hook_stats", None) is not None:
            self._hook_stats.groups = self.param_groups  # torch replaced the list
        S.fill_missing_options(self.param_groups, getattr(self, "_own_keys", self.defaults), self.defaults, self.name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, except that ``wiring_keys`` keep the values this optimizer was built with: a
        state saved by a member resumes in its base and back (VRLamb <-> Lamb, ``gsnr`` on/off).
        The shared state (moments) carries over; the GSNR momentum is dropped when the GSNR is
        off, and starts at p̂ = 1 (the base optimizer's step) when it was off. One warning says
        what changed (``state.after_load``)."""
        with self.loaded_elsewhere() as built:
            state_dict = self._checked_groups(state_dict, built)
            super().load_state_dict(state_dict)
            S.keep_fp32_state(self.state, self.param_groups, state_dict)

    @contextlib.contextmanager
    def loaded_elsewhere(self) -> Iterator[list[dict[str, Any]]]:
        """Around a load (``load_state_dict``'s, or one that bypasses it: DeepSpeed's universal
        checkpoint loader sets the saved groups' options and the state itself); yields the wiring
        as built. Afterwards the groups are checked as ``_checked_groups`` checks a state dict's
        (a load that bypasses it sets the saved options unchecked), the wiring is as built and the
        GSNR momentum as ``state.after_load`` leaves it."""
        built = S.built_wiring(self.param_groups, self.wiring_keys)
        gsnr_built = S.built_gsnr_options(self.param_groups)
        yield built
        self._epoch += 1
        self._check_loaded(built, gsnr_built)
        S.after_load(self.state, self.param_groups, built, self.name, self.report_load, gsnr_built)

    def _check_loaded(self, built: list[dict[str, Any]], gsnr_built: list[dict[str, Any]]) -> None:
        """The groups as a load left them: a ``gsnr_eps``, or an Adam-family ``eps``
        (``zero_eps_keys``), of 0 (earlier releases') resumes with the value built, with a warning; each group's options in range with its wiring as built.
        After ``load_state_dict`` (``_checked_groups`` ran first) a no-op."""
        for i, group in enumerate(self.param_groups):
            self._no_zero_eps(i, group, {**{k: self.defaults[k] for k in ("eps",) if k in self.defaults},
                                         **(gsnr_built[i] if i < len(gsnr_built) else {})})
            self._check_as_loaded(i, {**group, **(built[i] if i < len(built) else {})})

    #: the epsilons earlier releases accepted at 0, and the 0/0 that makes
    ZERO_EPS = {"gsnr_eps": "turns r into 0/0 where every gradient is equal",
                "eps": "turns the Adam update m/(sqrt(v) + eps) into 0/0 where an element's gradients have all been 0"}
    #: which of ``ZERO_EPS`` this member refuses at 0 now (LARS's eps may be 0)
    zero_eps_keys: tuple[str, ...] = ("gsnr_eps",)

    def _no_zero_eps(self, index: int, group: dict[str, Any], built: dict[str, Any]) -> None:
        """A ``gsnr_eps`` or (Adam family) ``eps`` of 0, which earlier releases accepted, resumes as
        ``built``'s value (this optimizer's), said."""
        for key in self.zero_eps_keys:
            why = self.ZERO_EPS[key]
            if group.get(key) == 0.0 and key in built:
                logger.warning("%s: param group %d was saved with %s=0, which %s; it resumes with %s=%g",
                               self.name, index, key, why, key, built[key])
                group[key] = built[key]

    def _check_as_loaded(self, index: int, options: dict[str, Any]) -> None:
        where = f"{self.name} (param group {index} as loaded)"
        check_common(where, options)
        type(self)._check_options(where, options)

    def _checked_groups(self, state_dict: dict[str, Any], built: list[dict[str, Any]]) -> dict[str, Any]:
        """The saved groups' options checked as this optimizer will hold them (its wiring; defaults
        for keys an older state lacks; a group without ``gsnr``, a base optimizer's, saved with it
        off, with the options it lacks as built), before anything is loaded. A saved ``gsnr_eps``, or an
        Adam-family ``eps`` (``zero_eps_keys``), of 0, which earlier releases accepted, resumes with this optimizer's value, with a warning."""
        groups = []
        for i, saved in enumerate(state_dict["param_groups"]):
            saved = dict(saved)
            if i < len(self.param_groups):
                self._no_zero_eps(i, saved, {k: self.param_groups[i][k] for k in self.ZERO_EPS
                                             if k in self.param_groups[i]})
            if "gsnr" not in saved and i < len(self.param_groups):  # a base optimizer's (torch's): the GSNR off, and
                self._refuse_foreign_options(i, saved)
                # the options it has no such key for (the GSNR's, never read; bias_correction ...) this group's as built
                saved = {**{k: v for k, v in self.param_groups[i].items() if k != "params"}, **saved, "gsnr": False}
            self._check_as_loaded(i, {**self.defaults, **saved, **(built[i] if i < len(built) else {})})
            self._own_moments(i, saved, state_dict.get("state", {}))
            groups.append(saved)
        return {**state_dict, "param_groups": groups}

    def _own_moments(self, index: int, saved: dict[str, Any], states: dict[Any, dict[str, Any]]) -> None:
        """A saved tensor that has stepped holds this member's moments (``state_keys``): one without
        them is another member's (VRSGD's, VRMomentum's, VRLars'), whose step count would go on
        with moments started at zero, their bias corrections as good as gone."""
        for key in saved.get("params", []):
            st = states.get(key) or {}
            step = st.get("step")
            if (not self.state_keys or step is None or any(k in st for k in self.state_keys)
                    or (isinstance(step, Tensor) and step.numel() != 1)):
                continue
            if float(step) > 0:
                raise ValueError(
                    f"{self.name}.load_state_dict: param group {index}'s tensor {key} has taken {float(step):g} steps "
                    f"but its saved state holds no {' or '.join(self.state_keys)}: it is the state of an optimizer "
                    f"without them (VRSGD, VRMomentum, VRLars), and {self.name} would start them at zero with the "
                    f"bias corrections of step {float(step):g}; load it into the optimizer it was saved from, or "
                    f"start {self.name} afresh")

    #: options of torch's optimizers that change the update unless at these values (a callable:
    #: of the saved group), for the members without the option
    _FOREIGN_NEUTRAL: dict[str, Callable[[dict[str, Any]], bool]] = {
        "maximize": lambda g: not g["maximize"],
        "amsgrad": lambda g: not g["amsgrad"],
        "momentum": lambda g: g["momentum"] == 0,
        "nesterov": lambda g: not g["nesterov"],
        "centered": lambda g: not g["centered"],
        # torch.optim.Adam's L2 decay; the family's Adam decays decoupled (AdamW)
        "decoupled_weight_decay": lambda g: g["decoupled_weight_decay"] or not g.get("weight_decay"),
    }

    def _foreign_option(self, group: dict[str, Any]) -> str | None:
        """A torch optimizer's option in ``group`` that this member does not have, set so that it
        changes the update (it would be dropped): its ``key=value`` words, else None."""
        for key, neutral in self._FOREIGN_NEUTRAL.items():
            if key in group and key not in self.defaults and not neutral(group):
                return f"{key}={group[key]!r}" + (f" and weight_decay={group.get('weight_decay')!r} (L2 decay)"
                                                 if key == "decoupled_weight_decay" else "")
        return None

    def _refuse_foreign_options(self, index: int, saved: dict[str, Any]) -> None:
        """A torch optimizer's group loaded into this member: an option of its update this member
        does not have, set so that it changes the update, is refused (it would be dropped)."""
        foreign = self._foreign_option(saved)
        if foreign:
            raise ValueError(
                f"{self.name}.load_state_dict: param group {index} was saved with {foreign}, which {self.name} does "
                "not implement, so its update would change unseen: load it into an optimizer that has it, or set "
                "the option as this one steps in the state dict first")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        try:
            self._check_group(self.param_groups[-1])
        except ValueError:  # refused: not left in the optimizer, unwatched
            self.param_groups.pop()
            raise
        self._epoch += 1
        self._watch(self.param_groups[-1:])

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        if self._stats is not None:
            self._stats.reset()  # a step the caller skipped must not leak into the next one

    def _check_group(self, group: dict[str, Any]) -> None:
        where = f"{self.name} (param group {len(self.param_groups) - 1})"
        for key in group:  # a key of its own beside the options (an engine's, a name) is the caller's;
            # one a letter or two from an option is a misspelt option, which would be left unread
            if key not in self._own_keys and key != "params":
                close = difflib.get_close_matches(key, self._own_keys, n=1, cutoff=0.85)
                if close:
                    raise ValueError(f"{where}: {key!r} is not an option of {self.name}; did you mean {close[0]!r}? "
                                     "(a param group's key the optimizer does not read is left unread)")
        foreign = self._foreign_option(group)  # torch's groups handed over as they are (Adam(...).param_groups)
        if foreign:
            raise ValueError(f"{where}: {foreign}, an option of torch's optimizers {self.name} does not implement: "
                             "its update would change unseen; leave it out of the param group")
        for key, value in self._fixed.items():
            if group.get(key, value) != value:
                raise ValueError(f"{where}: {self.name} is {type(self).__name__} with {key}={value!r}; use "
                                 f"{type(self).__name__} for a param group with {key}={group[key]!r}")
        if len({id(q) for q in group["params"]}) != len(group["params"]):  # torch only warns of it
            raise ValueError(f"{where}: a parameter appears more than once in the param group; list each once "
                             "(it would be stepped twice a step, its state counted twice)")
        check_common(where, group)
        check_dtypes(where, group["params"], self.fused)
        type(self)._check_options(where, group)

    @staticmethod
    def _check_options(owner: str, group: dict[str, Any]) -> None:
        """Members validate their own group options here."""

    # ---- statistics ----------------------------------------------------------------------

    def _watch(self, groups: list[dict[str, Any]]) -> None:
        """In one process, the statistics of groups with GSNR on come from tensor hooks; not when
        an engine's source provides them (attached, or about to be: ``built_for_engine``)."""
        groups = [g for g in groups if g["gsnr"]]
        if not groups or _FOR_ENGINE.get() or (self._stats is not None and self._hook_stats is None):
            return
        if self._hook_stats is None:
            self._hook_stats = self._stats = TensorHookStats(self.param_groups, self.fused, self.name)
        for group in groups:
            self._hook_stats.watch(group["params"])

    def set_statistics_source(self, source: StatisticsSource | None, layout: Any | None = None) -> None:
        """Feeds the optimizer from ``source`` (an engine's) instead of its tensor hooks.

        ``layout`` (``vrgd_ds.stats.layout.Layout``) maps the tensors it updates to model tensors
        (ZeRO, Megatron, FSDP2); per-tensor sums (GSNR mean, trust-ratio norms, metrics) are then
        completed across ranks by key.
        """
        if self._hook_stats is not None:
            self._hook_stats.remove()
            self._hook_stats = None
        self._stats = source
        self._layout = layout

    @property
    def statistics_source(self) -> StatisticsSource | None:
        return self._stats

    def set_grad_scaler(self, scaler: Any | None) -> None:
        """The ``torch.amp.GradScaler`` (fp16) whose loss scale S the statistics carry where this
        optimizer's tensor hooks, ``vrgd_ds.ddp.attach`` or ``vrgd_ds.fsdp.attach`` record them
        (the gradients as backward leaves them). At each step its scale is read once
        (``get_scale()``) and taken out where it shows: the GSNR floor compares ``gsnr_eps`` with
        the variance instead of S² times it, and the noise-scale figures are not S² too large.
        DeepSpeed's and Megatron's loss scalers are removed by their paths: a scaler there is
        refused at ``step()``. None: no scaler. A copy or an unpickled optimizer has none until
        told (docs/design.md §2)."""
        if scaler is not None and not callable(getattr(scaler, "get_scale", None)):
            raise TypeError(f"{self.name}.set_grad_scaler: expected a torch.amp.GradScaler (get_scale()), got "
                            f"{type(scaler).__name__}")
        self._grad_scaler = scaler

    def _grad_scale(self) -> float:
        """S of ``set_grad_scaler``'s scaler this step (1 without one, or disabled)."""
        scaler = self._grad_scaler
        if scaler is None or (callable(getattr(scaler, "is_enabled", None)) and not scaler.is_enabled()):
            return 1.0
        if not (self._stats is self._hook_stats or getattr(self._stats, "reset_ends_step", False)):
            raise RuntimeError(f"{self.name}: set_grad_scaler applies to statistics recorded in one process or by "
                               "vrgd_ds.ddp / vrgd_ds.fsdp; this engine's path removes its own loss scale: call "
                               "set_grad_scaler(None)")
        return float(scaler.get_scale())

    def kernels(self) -> _impl.Kernels:
        """The implementation in use (fused CPU kernels, Triton kernels, or the reference): the
        one the hooks selected, else ``_impl.select``'s for every parameter."""
        if self._kernels is None:
            if self._hook_stats is not None:
                self._kernels = self._hook_stats.kernels
            else:
                self._kernels = _impl.select(self.fused, [p for g in self.param_groups for p in g["params"]], self.name)
        return self._kernels

    # ---- the step --------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            first = self._layout is not None and self.step_calls == 0  # every rank's first step alike
            if S.is_state_init(self.state, self.param_groups, 0 if self._stats is None else self._stats.n,
                               self._any_rank if first else None):
                self.allocate_state(with_grads_only=True)
            else:
                run_with_retry(self._step, self._undo)
        finally:
            if self._stats is not None:
                self._stats.reset()
        return loss

    def _any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over the ranks that step together (the layout's group and stages)."""
        device = getattr(self._layout, "device", None) or torch.device("cpu")
        t = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=device)
        self._layout.all_reduce(t, "max")
        self._layout.all_reduce_stages(t, "max")
        return [bool(x) for x in t.tolist()]

    def _undo(self) -> None:
        self.step_calls -= 1
        self._counts.undo()

    def _step(self) -> None:
        self.step_calls += 1
        self._counts.clear()
        if not self.merge_step_records:
            self.records.begin()
        kernels = self.kernels()
        if isinstance(kernels, _impl.WithFallback):
            kernels.new_step()
        plans = self._plans(kernels.sync_free)
        if not plans:
            return
        if self._stats is None and any(p.gsnr for p in plans):
            raise RuntimeError(
                f"{self.name}: a param group has gsnr=True but no statistics are recorded: in one process the tensor "
                "hooks are set where a group with gsnr on is added, and none had it (turned on since?): build the "
                "optimizer, or add the group, with gsnr=True; under an engine, attach its statistics source first")
        hooks = self._hook_stats
        if hooks is not None and self._stats is hooks and hooks.n < F.MIN_GROUPS and hooks.started_after_gradients():
            raise RuntimeError(
                f"{self.name}.step(): the gradients hold backward passes from before this optimizer's statistics "
                f"started (it was built, or a state loaded into a new one, after them) and only {hooks.n} since, "
                f"fewer than the {F.MIN_GROUPS} gradient groups a step needs: build the optimizer before the step's "
                "first backward(), or zero the gradients and run the step's backward passes again")
        n = F.groups_now(self._stats, self.name, self._serial) if any(p.gsnr for p in plans) else 0
        if n and self.step_calls == 1 and self._stats is self._hook_stats:
            _warn_if_replicated(self.name, self._serial)
        # one group's gradient over the values the source holds: Megatron's 1/micro-batches
        # (``group_unit``), a GradScaler's S (set_grad_scaler)
        unit = float(getattr(self._stats, "group_unit", 1.0) or 1.0) / (self._grad_scale() if n else 1.0)
        if hooks is not None and self._stats is hooks:
            hooks.expect_unit(unit)  # the next steps' pass 1 in the hooks, at this step's loss scale
        ctx = F.StepContext(kernels, n, self._layout, self.name, self._serial, counts=self._counts, unit=unit)
        if kernels.sync_free:
            ctx.skipped = self.records.device_counter(plans[0].tdev)
        out = F.step_plans(type(self), plans, ctx, self._stats, self._epoch, self._counts)
        if out is None:
            return self.records.skipped("step/skipped_nonfinite", n)
        results, found = out
        record = M.step_tables(plans, results, n, found, self._layout, ctx.metric_tables)
        record.counted = ctx.counted
        record.unit = unit
        self.records.record(record)

    def _plans(self, sync_free: bool) -> list[Plan]:
        """The plan of every group with gradients here; under a layout, of every group (each rank
        takes part in every group's collectives, also in one of which it holds no piece)."""
        gathered = [gather(g, self._layout is not None, self._sharded, self.name) for g in self.param_groups]
        if not any(ps for ps, _ in gathered) and self._layout is None:
            return []
        device = next((ps[0].device for ps, _ in gathered if ps), None)
        if device is None:  # this rank holds no piece of any group (Megatron's distributed optimizer)
            device = self._layout.device
        tdev = device if sync_free else torch.device("cpu")
        plans, key_base = [], 0
        for i, (g, (ps, gs)) in enumerate(zip(self.param_groups, gathered)):
            plan = self._planner.plan(i, g, ps, gs, key_base, tdev, self._layout, self._epoch,
                                      lambda p: state_of(self.state, self._sharded, p), self.state)
            key_base += len(plan.params)
            if plan.params or self._layout is not None:
                plans.append(plan)
        return plans

    # ---- the member's side (static: the step function reads them as data) ----------------

    @staticmethod
    def _needs_grad_norms(group: dict[str, Any]) -> bool:
        """Whether a group without GSNR uses ‖θ‖² and ‖g‖² per tensor (``plan.grad_norms``):
        pass 1 then computes them, which also answers the non-finite check."""
        return False

    @staticmethod
    def _prepare(plans: list[Plan], ctx: F.StepContext) -> dict[str, Any]:
        """Cross-group quantities computed before any update (e.g. LAMB's global norm)."""
        return {}

    @staticmethod
    def _update(plan: Plan, ctx: F.StepContext) -> dict[str, Tensor]:
        """The member's update. Returns ``gsnr_counts`` [S, 3] (elements raised to gamma, cut to 1,
        and the sum of the scale p̂ applied) and optionally ``trust`` [S] with ``adapted`` [S]; or
        nothing when its kernels wrote the step's metric rows (``ctx.device_tables``)."""
        raise NotImplementedError

    # ---- state and metrics -------------------------------------------------------------------

    def element_state_keys(self, group: dict[str, Any]) -> tuple[str, ...]:
        """The state a parameter of ``group`` holds per element once it stepped (beside ``step``)."""
        return S.element_state_keys(self.state_keys, group)

    def allocate_state(self, with_grads_only: bool = False, steps_only: bool = False) -> None:
        """Every state key a step would create, as a fresh start has it (``state.allocate``)."""
        self._epoch += 1
        S.allocate(self.state, self.param_groups, self.state_keys, with_grads_only, steps_only)

    def begin_step_records(self) -> None:
        self.records.begin()

    def record_skipped(self, reason: str, n: int) -> None:
        """A step skipped by the engine (``metrics.Recorder.skipped``)."""
        self.records.skipped(reason, n)

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far (reading it waits for the device when the kernels skip there)."""
        return self.records.skipped_steps

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
        return self.records.summary(per_tensor, samples_per_group)
