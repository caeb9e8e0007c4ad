"""The optimizer state and checkpoint compatibility: the keys a member keeps per parameter, state
created lazily as a fresh start has it, step counters, and what a resume does when the state was
saved by another member or version (VRLamb <-> Lamb, ``gsnr`` on/off, options added since).
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import torch
from torch import Tensor

from vrgd_ds.optim.plan import Plan
from vrgd_ds.optim.retry import StepCounts
from vrgd_ds.optim.sharded import local_tensor

logger = logging.getLogger(__name__)


def gsnr_switch(saved: bool, built: bool) -> str:
    """What a resume does to the GSNR momentum when the state was saved with ``gsnr=saved`` and
    the optimizer is built with ``gsnr=built`` (``GSNROptimizer.load_state_dict``)."""
    if saved and not built:
        return "the GSNR momentum is dropped"
    if built and not saved:
        return "the GSNR momentum starts at p̂ = 1 (the base optimizer's step)"
    return "the GSNR momentum carries over"


def element_state_keys(state_keys: tuple[str, ...], group: dict[str, Any]) -> tuple[str, ...]:
    """The state a parameter of ``group`` holds per element once it stepped (beside ``step``)."""
    keys = list(state_keys)
    if group.get("momentum", 0.0) != 0.0:
        keys.append("momentum_buffer")  # the SGD family (sgd_update)
    if group["gsnr"] and group["beta3"] > 0:
        keys.append("gsnr_avg")
    return tuple(keys)


def fill_missing_options(groups: list[dict[str, Any]], keys: Iterable[str], defaults: dict[str, Any],
                         owner: str) -> None:
    """Groups saved before an option existed get its default (``__setstate__``), said once."""
    missing: dict[str, Any] = {}
    for group in groups:
        for k in keys:
            if k not in group:
                group[k] = missing[k] = defaults[k]
    if missing:
        logger.warning("%s: the loaded state has no %s (saved by an older version); using %s", owner,
                       ", ".join(missing), ", ".join(f"{k}={v!r}" for k, v in missing.items()))
    if "gsnr_placement" in missing:
        logger.warning("%s: checkpoints without gsnr_placement were trained with p̂ on both Adam moments, where it "
                       "cancels; they now continue with gsnr_placement=%r. To continue the saved trajectory "
                       "exactly, construct the optimizer with gsnr_placement='both_moments' before loading",
                       owner, missing["gsnr_placement"])


#: the options only the GSNR reads: a state saved with it off (a base optimizer's, or another
#: optimizer's) never used its values, so a load that turns it on takes them as built
GSNR_OPTIONS = ("gamma", "beta3", "gsnr_eps", "gsnr_placement")


def built_wiring(groups: list[dict[str, Any]], wiring_keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """The wiring options as built, per group, taken before a load replaces the groups."""
    return [{k: g[k] for k in wiring_keys if k in g} for g in groups]


def built_gsnr_options(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``GSNR_OPTIONS`` as built, per group (``after_load``)."""
    return [{k: g[k] for k in GSNR_OPTIONS if k in g} for g in groups]


def keep_fp32_state(state: dict[Tensor, dict[str, Any]], groups: list[dict[str, Any]],
                    saved: dict[str, Any]) -> None:
    """torch's ``load_state_dict`` casts every state tensor but ``step`` to its parameter's dtype;
    the VRGD state is fp32 for bf16 and fp16 parameters too (docs/design.md §1.2), so each
    floating-point tensor of the saved state is put back in fp32 from the saved values: an fp32
    one as saved, not rounded to the parameter's dtype, and one saved in another precision (the
    state of a base optimizer that kept it in the parameter's dtype) widened."""
    ids = (i for g in saved["param_groups"] for i in g["params"])
    params = (p for g in groups for p in g["params"])
    for i, p in zip(ids, params):
        if p.dtype == torch.float32 or p not in state:
            continue
        for key, value in saved["state"].get(i, {}).items():
            if key != "step" and isinstance(value, Tensor) and value.is_floating_point():
                state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)


def after_load(state: dict[Tensor, dict[str, Any]], groups: list[dict[str, Any]], built: list[dict[str, Any]],
               owner: str, report: bool, gsnr_built: list[dict[str, Any]] | None = None) -> None:
    """What ``load_state_dict`` does after torch's: each tensor's step counter its own tensor (a
    state dict may hand one step tensor to every parameter, as Megatron's distributed optimizer
    does, and the step adds 1 to each counter); the wiring options as built, and where the load
    turns the GSNR on, its options as built too (``gsnr_built``: the saved ones were never read);
    the GSNR momentum dropped where the GSNR is off (it starts at p̂ = 1 where it was off:
    ``init_state``); one warning saying what changed when ``report``."""
    seen: set[int] = set()
    for st in state.values():
        step = st.get("step")
        if isinstance(step, Tensor):
            if id(step) in seen:
                st["step"] = step.clone()
            seen.add(id(st["step"]))
    changed: dict[str, tuple[Any, Any]] = {}
    for i, (group, mine) in enumerate(zip(groups, built)):
        if not group.get("gsnr") and mine.get("gsnr") and gsnr_built is not None and i < len(gsnr_built):
            mine = {**gsnr_built[i], **mine}
        for k, v in mine.items():
            if group.get(k) != v:
                changed[k] = (group.get(k), v)
                group[k] = v
        if not (group["gsnr"] and group["beta3"] > 0):
            for p in group["params"]:
                if p in state:
                    state[p].pop("gsnr_avg", None)
    if changed and report:
        saved = ", ".join(f"{k}={a!r}" for k, (a, _) in changed.items())
        now = ", ".join(f"{k}={b!r}" for k, (_, b) in changed.items())
        what = gsnr_switch(*changed.get("gsnr", (True, True)))
        logger.warning("%s: resuming a state saved with %s as built (%s): the moments carry over, %s",
                       owner, saved, now, what)


def is_state_init(state: dict[Tensor, Any], groups: list[dict[str, Any]], recorded_groups: int,
                  agree: Callable[[list[bool]], list[bool]] | None = None) -> bool:
    """Whether a step is the one ``torch.distributed.checkpoint.state_dict`` (and torchtitan
    before a load) runs on a fresh optimizer to create its state: no state yet, every gradient
    zero, every ``lr`` 0, no statistics recorded (``recorded_groups`` 0). Such a step creates the
    state as a fresh start has it (``allocate``) and advances nothing: no step count, no GSNR
    momentum (a real step would need n >= 2 groups). ``agree`` (an OR over the ranks that share
    the step) makes the answer every rank's: a rank's own shard may hold only zero gradients in a
    real first step at lr 0 (a warmup from 0), and stepping alone would leave the others waiting
    in the step's collectives. The caller passes it at the first step of every rank alike (the
    recorded groups are the same on every rank; the state and the ``lr`` are among the flags
    agreed, since a pipeline stage's param groups are its own)."""
    if recorded_groups != 0:
        return False
    lr_set = any(float(g["lr"]) != 0.0 for g in groups)
    if agree is None and (state or lr_set):
        return False
    grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
    flags = [bool(state), lr_set, bool(grads), any(bool(local_tensor(x).any()) for x in grads)]
    has_state, lr_set, has_grads, nonzero = agree(flags) if agree is not None else flags
    return not has_state and not lr_set and has_grads and not nonzero


@torch.no_grad()
def allocate(state: dict[Tensor, dict[str, Any]], groups: list[dict[str, Any]], state_keys: tuple[str, ...],
             with_grads_only: bool = False, steps_only: bool = False) -> None:
    """Creates every state key a step would create, as a fresh start has it (step 0, zeros): what
    a sharded checkpoint loads into (Megatron's ``init_state_fn``). Keys present stay.
    ``with_grads_only``: for the tensors with a gradient only, as a step creates it (the state-
    creating step of ``is_state_init``: a frozen tensor gets no state, as in a trained run's
    checkpoint, whose load would otherwise miss its keys). ``steps_only``: the step counters
    alone (what a save that reads every tensor's step needs; a key made here would be saved as
    zeros where the tensor's state has none)."""
    for group in groups:
        keys = () if steps_only else element_state_keys(state_keys, group)
        for p in group["params"]:
            if with_grads_only and p.grad is None:
                continue
            st = state[p]
            if "step" not in st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device)
            for key in keys:
                if key not in st:  # a DTensor parameter gets DTensor state, sharded like it
                    st[key] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)


def init_state(plan: Plan, state_keys: tuple[str, ...], epoch: int, counts: StepCounts, count: bool = True) -> None:
    """Creates missing state lazily (also keys an older checkpoint lacks) and counts the step
    (``count``; else ``plan.counters`` holds the counters for the member's tables kernel, which
    counts them on the device).

    Step counters live on the table device: the host for the host-table kernels, the
    parameters' device for the sync-free kernels, where a skipped step (``plan.found``)
    does not count. ``epoch``: the optimizer's state epoch; a plan shape found complete in the
    same epoch is not checked again."""
    beta3 = plan.group["beta3"] if plan.gsnr else 0.0
    counters = None
    if plan.shape is not None and plan.shape.ready == epoch:
        try:  # the same state as at the last complete check (nothing replaced it since: same epoch)
            counters = [st["step"] for st in plan.states]
            if beta3 > 0:
                plan.avg = [st["gsnr_avg"] for st in plan.states]
        except KeyError:
            counters, plan.avg = None, []
    if counters is None:
        counters = _complete(plan, state_keys, beta3)
        if plan.shape is not None:
            plan.shape.ready = epoch
    plan.counters = counters
    if not count:
        return
    if not counters:  # no piece of this group here (a layout's collectives only)
        plan.step_t = torch.ones(0, dtype=torch.float64, device=plan.tdev)
        return
    # a device scalar per counter (a list): the 0-d-tensor overload reads the scalar on the host
    added = 1.0 if plan.found is None else [(1.0 - plan.found).float()] * len(counters)
    counts.add(counters, added)
    # A skipped step's bias corrections must stay finite (its kernels store nothing).
    steps = torch.stack(counters).double().clamp_min(1.0)
    plan.step_t = steps.index_select(0, plan.tensor_of)


def _complete(plan: Plan, state_keys: tuple[str, ...], beta3: float) -> list[Tensor]:
    """Every state tensor of the plan, created where missing; returns the step counters."""
    counters = []
    for i, (p, st) in enumerate(zip(plan.params, plan.states)):
        step = st.get("step")
        if step is None:
            # torch.optim.SGD keeps no counter: its loaded momentum buffer has been applied, so the
            # next step is not the buffer's first (``sgd_update``'s ``first`` would copy d over it).
            # apex's FusedLAMB/FusedAdam keep theirs in the param group: their loaded moments
            # are that many steps old, and the bias corrections go on from there
            taken = plan.group.get("step")
            if "momentum_buffer" in st:
                count = 1.0
            elif any(key in st for key in state_keys) and isinstance(taken, (int, float, Tensor)):
                count = float(taken)
            else:
                count = 0.0
            st["step"] = torch.tensor(count, dtype=torch.float32, device=plan.tdev)
        elif not isinstance(step, Tensor) or step.dtype != torch.float32 or step.dim():
            # a loaded counter of another kind (an int, torch's float64 ones, an int64 tensor): the
            # kernels read one fp32 value (the Triton tables read its bits as fp32)
            st["step"] = torch.tensor(float(step), dtype=torch.float32, device=plan.tdev)
        elif step.device != plan.tdev:
            st["step"] = step.to(plan.tdev)
        for key, value in list(st.items()):
            if key != "step" and isinstance(value, Tensor) and value.numel() != p.numel():
                # a loaded state of another model's tensor (a resized vocabulary or hidden size, or a
                # scalar parameter's 0-d state): torch's load_state_dict matches tensors by position
                # only, and the kernels would read and write the parameter's length of it
                raise ValueError(f"optimizer state {key!r} of shape {tuple(value.shape)} for a parameter of shape "
                                 f"{tuple(p.shape)} (param group {plan.index}, its tensor {i}): the "
                                 "loaded optimizer state is another model's; load the checkpoint into the model it "
                                 "was saved from, or start the optimizer afresh")
            if key != "step" and isinstance(value, Tensor) and not value.is_contiguous():
                # a loaded state keeps the saved strides (a transposed or sliced tensor): the kernels
                # read each tensor's memory in order
                st[key] = value.contiguous()
        for key in state_keys:
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
