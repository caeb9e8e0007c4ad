"""Adaptive global batch from the gradient noise scale the GSNR statistics already give.

SimiGrad (Qin et al., NeurIPS 2021) grows or shrinks the batch to keep the cosine similarity
of the two half-batch gradients near a target. That cosine follows from the gradient noise
scale ``B_simple = tr(Σ)/‖G‖²`` (McCandlish et al. 2018; ``Σ`` the per-sample gradient
covariance, ``G`` the true gradient), which VRGD's ``Σg``/``Σg²`` estimate every step at no
extra communication (``noise_scale/*`` in ``gsnr_metrics()``):

Each half of a batch of ``B`` samples has the mean gradient ``h_i = G + e_i`` with independent
noise, ``E e_i = 0`` and ``E‖e_i‖² = tr(Σ)/(B/2)``. Hence ``E⟨h_1, h_2⟩ = ‖G‖²`` and
``E‖h_i‖² = ‖G‖² + 2 tr(Σ)/B``, and to first order (the ratio of the expectations, exact as the
dimension grows and the norms concentrate)

    cos(h_1, h_2) ≈ ‖G‖² / (‖G‖² + 2 tr(Σ)/B) = 1 / (1 + 2 B_simple / B).

So a target similarity ``s*`` is a target batch ``B* = 2 B_simple s* / (1 − s*)``, and a target
``B / B_simple = ρ`` is the similarity ``ρ / (ρ + 2)`` (``ρ = 1``, the batch at the noise
scale: 1/3). :class:`BatchController` is that rule with the engineering a run needs: the two
moments smoothed separately over steps (their ratio, not the mean of noisy ratios), an
adjustment every ``every`` steps once the warmup is over, at most a factor ``max_change`` per
adjustment, a dead band, ``[min_batch, max_batch]``, and a granularity (micro-batch × ranks,
so only the accumulation changes). It is pure: statistics in, next batch out, its state a
dict for checkpoints.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

LrRule = Literal["linear", "sqrt", "none"]


def similarity_from_ratio(batch_over_bsimple: float) -> float:
    """The expected half-batch cosine at ``B / B_simple``: ``ρ / (ρ + 2)``."""
    return batch_over_bsimple / (batch_over_bsimple + 2.0)


def implied_similarity(batch: float, b_simple: float) -> float:
    """``1 / (1 + 2 B_simple / B)``; NaN where the noise scale is unknown."""
    if not math.isfinite(b_simple) or b_simple < 0:
        return math.nan
    return 1.0 / (1.0 + 2.0 * b_simple / batch)


def lr_factor(rule: LrRule, batch: int, reference: int) -> float:
    """The learning-rate multiplier tied to the batch: ``(B/B_ref)``, ``√(B/B_ref)`` or 1."""
    if rule == "linear":
        return batch / reference
    if rule == "sqrt":
        return math.sqrt(batch / reference)
    return 1.0


class SettingsDiffer(ValueError):
    """A saved controller's settings are not this one's; ``changed`` names them."""

    def __init__(self, changed: list[str]) -> None:
        super().__init__(f"the checkpoint's adaptive_batch settings differ in {', '.join(changed)}: resume with the "
                         "settings it was saved with")
        self.changed = changed


@dataclass
class ControllerSettings:
    """What :class:`BatchController` needs; ``vrgd_ds.train.config.AdaptiveBatchConfig`` is the
    validated ``job.phases[i].adaptive_batch`` block these come from."""

    initial_batch: int
    min_batch: int
    max_batch: int
    granularity: int
    target_similarity: float | None = None
    target_ratio: float | None = None  # B / B_simple
    every: int = 10
    start_step: int = 0  # no adjustment before this many steps of the phase (the warmup)
    smoothing: float = 0.9  # EMA factor of tr(Σ) and ‖G‖² per step
    max_change: float = 2.0  # at most ×/÷ this per adjustment
    tolerance: float = 0.1  # no change while the target is within this fraction of the batch

    def __post_init__(self) -> None:
        if (self.target_similarity is None) == (self.target_ratio is None):
            raise ValueError("give exactly one of target_similarity and target_ratio")
        if self.target_similarity is not None and not 0.0 < self.target_similarity < 1.0:
            raise ValueError(f"target_similarity must be in (0, 1), got {self.target_similarity}")
        if self.target_ratio is not None and not self.target_ratio > 0.0:
            raise ValueError(f"target_ratio must be > 0, got {self.target_ratio}")
        g = self.granularity
        for name in ("initial_batch", "min_batch", "max_batch"):
            value = getattr(self, name)
            if value < g or value % g:
                raise ValueError(f"{name}={value} must be a positive multiple of micro_batch x ranks = {g}")
        if not self.min_batch <= self.initial_batch <= self.max_batch:
            raise ValueError(f"need min_batch <= initial batch <= max_batch, got {self.min_batch}, "
                             f"{self.initial_batch}, {self.max_batch}")
        if self.every < 1 or not 0.0 <= self.smoothing < 1.0 or self.max_change <= 1.0 or self.tolerance < 0:
            raise ValueError("need every >= 1, 0 <= smoothing < 1, max_change > 1, tolerance >= 0")

    @property
    def ratio(self) -> float:
        """The target ``B / B_simple``."""
        if self.target_ratio is not None:
            return self.target_ratio
        s = self.target_similarity
        return 2.0 * s / (1.0 - s)


@dataclass
class Decision:
    """What the controller did at one step."""

    batch: int  # the batch of the next step
    b_simple: float  # smoothed, samples (NaN until known)
    implied_similarity: float  # at the batch of the step just taken
    target: float  # the unrounded target batch (NaN when there was no adjustment)
    changed: bool


@dataclass
class BatchController:
    """Statistics in, next global batch out (module docstring)."""

    settings: ControllerSettings
    batch: int = 0
    steps: int = 0  # steps of this phase observed
    ema_trace: float = 0.0  # tr(Σ) per sample, debiased by ema_weight
    ema_grad_sq: float = 0.0
    ema_weight: float = 0.0
    last_change: int = 0
    history: list[tuple[int, int]] = field(default_factory=list)  # (step, new batch) of each change

    def __post_init__(self) -> None:
        if not self.batch:
            self.batch = self.settings.initial_batch

    def b_simple(self) -> float:
        """The smoothed noise scale in samples: EMA tr(Σ) / EMA ‖G‖² (NaN while ‖G‖² ≤ 0)."""
        if self.ema_weight == 0.0 or self.ema_grad_sq <= 0.0:
            return math.nan
        return max(self.ema_trace, 0.0) / self.ema_grad_sq

    def observe(self, trace_cov_per_sample: float, grad_sq: float, batch_taken: int | None = None) -> Decision:
        """One optimizer step's estimates (``tr(Σ)`` per sample, i.e. ``noise_scale/trace_cov``
        × samples per group, and ``noise_scale/grad_sq``) at the batch the step took
        (``batch_taken``; default the controller's: a phase's last step may take another);
        returns the batch of the next step. Non-finite estimates (a skipped step) are ignored."""
        st = self.settings
        batch_taken = self.batch if batch_taken is None else batch_taken
        self.steps += 1
        if math.isfinite(trace_cov_per_sample) and math.isfinite(grad_sq):
            a = st.smoothing
            self.ema_trace = a * self.ema_trace + (1 - a) * trace_cov_per_sample
            self.ema_grad_sq = a * self.ema_grad_sq + (1 - a) * grad_sq
            self.ema_weight = a * self.ema_weight + (1 - a)
        bs = self.b_simple()
        implied = implied_similarity(batch_taken, bs)
        due = self.steps >= st.start_step and self.steps - self.last_change >= st.every and self.steps % st.every == 0
        if not due or math.isnan(bs):
            return Decision(self.batch, bs, implied, math.nan, False)
        target = st.ratio * bs
        if abs(target - self.batch) <= st.tolerance * self.batch:
            return Decision(self.batch, bs, implied, target, False)
        bounded = min(max(target, self.batch / st.max_change), self.batch * st.max_change)
        bounded = min(max(bounded, st.min_batch), st.max_batch)
        g = st.granularity
        # the nearest multiple of g, inside the cap, and one multiple toward the target where that
        # brings the batch nearer it: where the cap is narrower than g (a batch of a few multiples)
        # nearest rounding stayed put for good, and rounding up could pass the cap (a ×2 step under
        # max_change 1.5); a forced step past a target within g/2 would step back at the next
        # adjustment, and so on for as long as the noise scale stays
        new = int(round(bounded / g)) * g
        if abs(target - self.batch) > g / 2:
            if target > self.batch:
                new = max(new - g if new > self.batch * st.max_change else new, self.batch + g)
            else:
                new = min(new + g if new < self.batch / st.max_change else new, self.batch - g)
        new = min(max(new, st.min_batch), st.max_batch)
        changed = new != self.batch
        if changed:
            self.batch, self.last_change = new, self.steps
            self.history.append((self.steps, new))
        return Decision(self.batch, bs, implied, target, changed)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "steps": self.steps, "ema_trace": self.ema_trace,
                "ema_grad_sq": self.ema_grad_sq, "ema_weight": self.ema_weight, "last_change": self.last_change,
                "history": [list(h) for h in self.history], "settings": asdict(self.settings)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The saved controller; the settings must be the saved ones except ``granularity``
        (micro-batch × ranks: a resume on another number of ranks), to whose multiples the
        saved batch is then rounded (within ``[min_batch, max_batch]``)."""
        saved = state.get("settings")
        mine = asdict(self.settings)
        changed = sorted(k for k in (saved or {}) if k != "granularity" and saved[k] != mine.get(k))
        if changed:
            raise SettingsDiffer(changed)
        g, st = self.settings.granularity, self.settings
        self.batch = min(max(int(round(int(state["batch"]) / g)) * g, st.min_batch), st.max_batch)
        self.steps = int(state["steps"])
        self.ema_trace, self.ema_grad_sq = float(state["ema_trace"]), float(state["ema_grad_sq"])
        self.ema_weight, self.last_change = float(state["ema_weight"]), int(state["last_change"])
        self.history = [tuple(h) for h in state["history"]]
