"""Gradient statistics in one process: a tensor hook per parameter sees every backward's
gradient before it is accumulated into ``.grad``, so each ``backward()`` between two
optimizer steps is one gradient group (docs/design.md §3, first row).

Statistics are fp32 ``Σg`` and ``Σg²`` buffers per parameter, allocated once and reused:
the first backward after a reset *writes* them instead of adding, so a reset costs no pass
over memory. In the backward that is expected to be a step's last (the one that reaches the
previous step's ``n``), the accumulate function may also return the step's pass 1 for the
tensor (its GSNR moments at that ``n``), taken while the data is in cache; it is kept with
the ``n`` it was taken at, and the step uses it when that backward was indeed the last
(``taken_moments``).

The source takes its kernels through the selection rule (``_impl.select``) for the tensors of the
groups it watches; the optimizer that built it steps with the same object (one fallback state).
"""
from __future__ import annotations

import logging
import weakref
from typing import Any, Iterable

import torch
from torch import Tensor

from vrgd_ds.log import name_of, warn_once
from vrgd_ds.optim import _impl
from vrgd_ds.optim.checks import FP32_TINY
from vrgd_ds.stats.backward import BackwardGroups, remove_hooks

logger = logging.getLogger(__name__)


def warn_dropped(source: object, owner: str, count: int) -> None:
    """Said once per statistics ``source``: the statistics of ``count`` backward passes went with
    gradients cleared before any optimizer step (the rule of every source: the statistics start
    anew with the gradient)."""
    warn_once(logger, f"dropped-{name_of(source)}", "%s: the statistics of %d backward pass(es) were dropped: the "
              "gradients were cleared (model.zero_grad()) with no optimizer step between, e.g. a step "
              "GradScaler skipped", owner, count)


def gradients_cleared(source: Any, params: Iterable[Tensor], owner: str) -> bool:
    """Whether the gradients an engine source's statistics (``n`` > 0) were recorded from have been
    cleared with no optimizer step between: a step GradScaler skipped, then ``model.zero_grad()``
    (HF Trainer's order), not the optimizer's ``zero_grad()``, which ends the step. The statistics
    then start anew with the gradient, as the hooks' do (``TensorHookStats._drop_if_cleared``);
    said once (``warn_dropped``)."""
    if any(p.grad is not None for p in params):
        return False
    warn_dropped(source, owner, source.n // source.world)
    return True


class TensorHookStats:
    """Per-backward fp32 moments of the gradients of a set of parameters.

    ``n`` is the number of gradient groups since the last ``reset()``: the largest number
    of backward passes any watched parameter took part in. A parameter absent from some
    backward contributed a zero gradient there, which its sums already reflect.
    """

    def __init__(self, groups: list[dict[str, Any]], fused: bool | str | None, owner: str) -> None:
        """``groups``: the optimizer's param groups (read for ``gsnr`` and ``gsnr_eps``, which a
        group may change between steps); ``fused``: the optimizer's kernel choice."""
        self.groups, self._fused, self._owner = groups, fused, owner
        self._kernels: _impl.Kernels | None = None
        self._eps: dict[Tensor, float] = {}  # per watched parameter, as the hooks last used it
        self._buffers: dict[Tensor, tuple[Tensor, Tensor]] = {}
        self._counts: dict[Tensor, int] = {}
        self._accumulated: set[Tensor] = set()  # tensors whose .grad a backward added to since the last reset
        self._passes = BackwardGroups()  # which backward() a hook runs in
        self._group = 0  # the backward() of the last hook (BackwardGroups.serial)
        self._moments: dict[Tensor, tuple[int, Tensor]] = {}
        self._expect = 0  # groups in the previous step (0: unknown, take moments every time)
        self._unit = 1.0  # one group's gradient over the values recorded, as the last step took it
        self._handed_out = False  # moments() gave the buffers away since the last reset
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._watched: set[int] = set()
        self._late: set[int] = set()  # watched at this step (``_unrecorded``), or whose .grad was there first
        self._pre_grad: set[int] = set()  # watched while holding a gradient, no backward recorded since
        self._started_late = False  # a tensor was watched while holding a (non-zero) gradient this step
        self._resets = 0  # steps begun (``reset``): an unfreezing is said once per step it happens in
        weakref.finalize(self, remove_hooks, self._handles)  # an optimizer dropped (rebuilt) leaves no hooks behind

    @property
    def kernels(self) -> _impl.Kernels:
        """The implementation the selection rule picks for every tensor of the groups."""
        if self._kernels is None:
            self._kernels = _impl.select(self._fused, [p for g in self.groups for p in g["params"]], self._owner)
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: _impl.Kernels) -> None:
        self._kernels = kernels

    def _accumulate(self, p: Tensor, grad: Tensor, sum_g: Tensor, sum_sq: Tensor, fresh: bool,
                    n: int) -> Tensor | None:
        """One backward into ``p``'s statistics; with ``n`` > 0 also the tensor's pass 1 at ``n``
        groups where the implementation can take it in the same pass."""
        eps = self._eps.get(p)
        if eps is None:  # a parameter added since
            u2 = self._unit * self._unit  # as the step takes gsnr_eps (functional.step_plans); 0: GSNR off
            self._eps = {q: max(g["gsnr_eps"] / u2, FP32_TINY) if g["gsnr"] else 0.0
                         for g in self.groups for q in g["params"]}
            eps = self._eps.get(p, 0.0)
        return self.kernels.accumulate_moments(grad, sum_g, sum_sq, fresh, 1.0 / n if n and eps else 0.0, eps)

    def watch(self, params: Iterable[Tensor]) -> None:
        """Registers the hook on each parameter that requires grad (idempotent)."""
        me = weakref.ref(self)
        for p in params:
            if not p.requires_grad or id(p) in self._watched:
                continue
            self._watched.add(id(p))
            if p.grad is not None and bool(p.grad.any()):  # an optimizer built, or a group added, mid-accumulation
                self._pre_grad.add(id(p))  # (zeros a zero_grad(set_to_none=False) left add nothing)
                self._started_late = True
            p_ref = weakref.ref(p)

            def hook(grad: Tensor, me=me, p_ref=p_ref) -> None:
                stats, param = me(), p_ref()
                if stats is not None and param is not None:
                    stats._record(param, grad)

            def accumulated(param: Tensor, me=me) -> None:  # after autograd added to param.grad
                stats = me()
                if stats is not None:
                    stats._accumulated.add(param)

            self._handles.append(p.register_hook(hook))
            self._handles.append(p.register_post_accumulate_grad_hook(accumulated))

    def _record(self, p: Tensor, grad: Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"VRGD statistics do not support sparse gradients (parameter of shape {tuple(p.shape)}); "
                "use a dense layer (e.g. nn.Embedding(sparse=False))"
            )
        group = self._passes.current()
        if group != self._group:  # the first hook of a backward()
            self._group = group
            self._drop_if_cleared()
        bufs = self._buffers.get(p)
        if bufs is not None and (bufs[0].shape != p.shape or bufs[0].device != p.device):
            # the parameter given another shape or moved (``p.data = ...``, ``model.to(...)`` after the
            # optimizer was built): new buffers where this step has not recorded it yet, else refused
            if self._counts.get(p, 0):
                raise RuntimeError(
                    f"{self._owner}: a parameter changed from shape {tuple(bufs[0].shape)} on {bufs[0].device} to "
                    f"{tuple(p.shape)} on {p.device} between backward passes of one step: its statistics cannot "
                    "go on; zero the gradients (optimizer.zero_grad()) and run the step's backward passes again")
            bufs = None
        if bufs is None:
            bufs = (torch.empty(p.shape, dtype=torch.float32, device=p.device),
                    torch.empty(p.shape, dtype=torch.float32, device=p.device))
            self._buffers[p] = bufs
        self._passes.record(p, p, self._owner, group)
        count = self._counts.get(p, 0)
        if count == 0 and self._pre_grad and id(p) in self._pre_grad:
            self._pre_grad.discard(id(p))
            if p.grad is not None:  # this backward adds to passes the statistics did not see
                self._late.add(id(p))
        row = self._accumulate(p, grad.detach(), bufs[0], bufs[1], count == 0,
                               count + 1 if count + 1 >= self._expect else 0)
        self._counts[p] = count + 1
        if row is not None:  # an older row stays, but its n no longer matches (taken_moments)
            self._moments[p] = (count + 1, row)

    def _drop_if_cleared(self) -> None:
        """At a backward's first hook, before it records anything: when a gradient a backward of
        this step added to has been cleared since (``model.zero_grad()`` with no optimizer step
        between: a step the caller skipped, GradScaler's on an overflow), the statistics start anew,
        as the gradient does. A gradient never added to ``.grad``, as under ``torch.autograd.grad``,
        is no sign of it."""
        if self._counts and any(q.grad is None for q in self._accumulated):
            warn_dropped(self, self._owner, self.n)
            self.reset()

    @property
    def n(self) -> int:
        return max(self._counts.values(), default=0)

    def recorded(self, p: Tensor) -> bool:
        return self._counts.get(p, 0) > 0

    def moments(self, params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        """``Σg`` and ``Σg²`` (fp32, shaped like each parameter) since the last reset. The
        buffers are handed out writable, so the moments the hooks took are no longer used."""
        self._handed_out = True
        sum_g, sum_sq = [], []
        for p in params:
            if not self.recorded(p) or id(p) in self._late or id(p) in self._pre_grad:
                self._unrecorded(p)
            sum_g.append(self._buffers[p][0])
            sum_sq.append(self._buffers[p][1])
        return sum_g, sum_sq

    def expect_unit(self, unit: float) -> None:
        """The step's unit (a GradScaler's 1/S: ``GSNROptimizer.set_grad_scaler``): the next
        backward's pass 1 takes ``gsnr_eps`` as the step will, so that the step can use it."""
        if unit != self._unit:
            self._unit = unit
            self._eps = {}

    def started_after_gradients(self) -> bool:
        """Whether tensors were watched in this step while holding a gradient (``n`` then counts
        only the backward passes since, fewer than the gradients hold)."""
        return self._started_late

    def _unrecorded(self, p: Tensor) -> None:
        """A parameter with a gradient that no backward of this step reached. Zero sums, which the
        zero-information guard turns into r = 1 (the base optimizer's step), where a zero gradient
        is what ``zero_grad(set_to_none=False)`` left on a tensor the step did not use (every
        micro-step's gradient was zero; torch's optimizers step it too), and where the tensor was
        not watched: frozen when the statistics started (unfrozen since, as gradual unfreezing
        does), or in a group whose ``gsnr`` was off then. Such a tensor, and every other one
        unfrozen since, is watched from the next backward on; said once per step where it
        happens. Otherwise (a gradient set by hand): an error."""
        shape = tuple(p.shape)
        unwatched = id(p) not in self._watched or id(p) in self._late or id(p) in self._pre_grad
        if unwatched:
            before = set(self._watched)
            self.watch([q for g in self.groups if g["gsnr"] for q in g["params"]])
            self._late |= self._watched - before  # unwatched in this step too (until reset)
            warn_once(logger, f"unwatched-{name_of(self)}-{self._resets}", "%s: a parameter of shape %s had backward passes the "
                      "VRGD statistics did not see in this step: it did not require grad, or its group had gsnr off, "
                      "when they started watching it, or its gradient was there before they started (an optimizer "
                      "built, or a group added, mid-accumulation). It takes the base optimizer's step (r = 1) now "
                      "and the GSNR from the next step on, as does any other such tensor", self._owner, shape)
        if unwatched or (p.grad is not None and not bool(p.grad.any())):
            bufs = self._buffers.get(p)
            if bufs is None:
                bufs = self._buffers[p] = (torch.zeros(shape, dtype=torch.float32, device=p.device),
                                           torch.zeros(shape, dtype=torch.float32, device=p.device))
            else:
                bufs[0].zero_()
                bufs[1].zero_()
            return
        raise RuntimeError(
            f"a parameter of shape {shape} has a gradient but no VRGD statistics: its gradient did not come "
            "from backward() since the last step (gradients set by hand are not seen)")

    def taken_moments(self, params: list[Tensor], n: int, eps: float) -> Tensor | None:
        """The step's pass 1 as each parameter's latest backward took it, ``[len(params), 6]``,
        when every row was taken at ``n`` groups with ``gsnr_eps=eps`` and the buffers are still
        as then (else None: the step computes it)."""
        if self._handed_out or (self._late and any(id(p) in self._late for p in params)):
            return None
        if any(self._eps.get(p) != eps for p in params):
            self._eps = {}  # gsnr_eps changed: the next backward looks it up again
            return None
        rows = []
        for p in params:
            got = self._moments.get(p)
            if got is None or got[0] != n:
                return None
            rows.append(got[1])
        return torch.stack(rows)

    def reset(self) -> None:
        """Starts a new step: the next backward overwrites the sums."""
        self._expect = self.n or self._expect
        self._counts.clear()
        self._moments.clear()
        self._accumulated.clear()
        self._passes.close()
        self._handed_out = False
        self._late.clear()
        self._pre_grad.clear()
        self._started_late = False
        self._resets += 1

    def remove(self) -> None:
        """Removes the hooks and frees the buffers (another source feeds the optimizer)."""
        remove_hooks(self._handles)
        self._watched.clear()
        self._buffers.clear()
        self._counts.clear()
        self._moments.clear()

    def buffer_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self._buffers.values())
