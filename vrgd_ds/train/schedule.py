"""Learning rate per phase: linear warmup, then polynomial decay to zero.

``lr(t) = peak · (t + 1)/w`` for ``t < w``, then ``peak · (1 - (t - w)/(T - w))^power``, with
``t`` the step within the phase, ``T`` its steps and ``w = ⌈warmup_fraction · T⌉`` whole steps
(a fractional ``w`` would put the last warmup step above the peak: ``(t + 1)/w > 1``). The
largest rate of a phase is therefore exactly its peak, reached at the last warmup step
(the first step when there is no warmup). The shape of
NVIDIA's BERT LAMB recipe (DeepLearningExamples ``PyTorch/LanguageModeling/BERT/schedulers.py``,
``PolyWarmUpScheduler``, power 0.5), with the decay measured from the end of warmup so the
rate is continuous there. It is a pure function of the global step: resuming needs only the step.

A phase with ``adaptive_batch`` runs the same shape over *samples*: with ``B`` the phase's
``global_batch``, ``T`` its steps and ``c`` the samples it consumed before a step of ``b``
samples, warmup ``(c + b)/(w·B)`` until ``c ≥ w·B``, then ``(1 - (c - w·B)/((T - w)·B))^power``,
times the batch rule's factor (``b/B`` or ``√(b/B)``). At ``b = B`` this is the step formula.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config imports this module
    from vrgd_ds.train.config import JobConfig


def warmup_steps(fraction: float, total: int) -> int:
    """Whole warmup steps: ``⌈fraction · total⌉`` (a product a rounding error above a whole number,
    e.g. 0.1 · 30, counts as that number)."""
    return min(total, math.ceil(fraction * total - 1e-9))


class PhaseSchedule:
    def __init__(self, job: JobConfig) -> None:
        self.phases = job.phases
        self.steps = job.phase_steps()

    def phase_of(self, step: int) -> tuple[int, int]:
        """(phase index, step within the phase) of global step ``step`` (0-based)."""
        start = 0
        for i, n in enumerate(self.steps):
            if step < start + n:
                return i, step - start
            start += n
        return len(self.steps) - 1, step - (start - self.steps[-1])

    def phase_start(self, index: int) -> int:
        return sum(self.steps[:index])

    def lr(self, step: int) -> float:
        """Learning rate of the optimizer step that follows ``step`` completed steps (phases of a
        fixed batch)."""
        return self.lr_in_phase(*self.phase_of(step))

    def lr_in_phase(self, i: int, t: int) -> float:
        """Learning rate of phase ``i``'s step that follows ``t`` completed steps of the phase."""
        p, total = self.phases[i], self.steps[i]
        warmup = warmup_steps(p.warmup_fraction, total)
        if t < warmup:
            return p.lr * ((t + 1) / warmup)  # the ratio first: exactly 1 at the last warmup step
        return p.lr * max(0.0, 1.0 - (t - warmup) / max(total - warmup, 1.0)) ** p.decay_power

    def lr_samples(self, index: int, consumed: int, batch: int, factor: float = 1.0) -> float:
        """Learning rate of phase ``index``'s step of ``batch`` samples after ``consumed`` samples
        of the phase (module docstring), times ``factor`` (the batch rule's)."""
        p, total = self.phases[index], self.steps[index]
        ref = p.global_batch
        warm = warmup_steps(p.warmup_fraction, total) * ref
        if consumed < warm:
            return p.lr * min(1.0, (consumed + batch) / warm) * factor
        span = max((total * ref) - warm, 1)
        return p.lr * max(0.0, 1.0 - (consumed - warm) / span) ** p.decay_power * factor
