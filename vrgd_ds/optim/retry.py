"""A step whose kernels failed before writing anything runs again on the reference
implementation (``_impl.WithFallback`` raises ``StepRetry``); what the failed attempt counted
is taken back first, so the retried step counts once."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from vrgd_ds.optim import _impl


class StepCounts:
    """The step counters one attempt added to, and by how much."""

    def __init__(self) -> None:
        self._added: list[tuple[list[Tensor], float | list[Tensor]]] = []
        self._device: list[tuple[list[Tensor], Tensor, Tensor | None]] = []

    def clear(self) -> None:
        self._added, self._device = [], []

    def add(self, counters: list[Tensor], added: float | list[Tensor]) -> None:
        torch._foreach_add_(counters, added)
        self._added.append((counters, added))

    def added_on_device(self, counters: list[Tensor], found: Tensor, skipped: Tensor | None) -> None:
        """A tables kernel added ``1 - found`` to each counter and ``found`` to ``skipped``."""
        self._device.append((counters, found, skipped))

    def undo(self) -> None:
        for counters, added in self._added:
            torch._foreach_add_(counters, -added if isinstance(added, float) else [-a for a in added])
        for counters, found, skipped in self._device:
            if counters:
                torch._foreach_add_(counters, [-(1.0 - found).float()] * len(counters))
            if skipped is not None:
                skipped -= found
        self._added, self._device = [], []


def run_with_retry(step: Callable[[], None], undo: Callable[[], None]) -> None:
    """``step()``; once more after ``undo()`` when its kernels failed before writing anything."""
    try:
        step()
    except _impl.StepRetry:  # the Triton kernels failed before writing anything: the reference now
        undo()
        step()
