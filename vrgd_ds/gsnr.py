"""GSNR maths as pure functions (Jiang et al., arXiv 2309.13681, §3 eqs. 2, 7-10).

For ``n >= 2`` gradient groups with mean gradients ``g_d`` and, element-wise,
``sum_g = Σ_d g_d`` and ``sum_sq = Σ_d g_d²``::

    gbar = sum_g / n                      # the averaged gradient
    s    = sum_sq / n                     # mean of squares
    var  = max(s - gbar², 0)              # device-wise (biased) variance, eq. 7
    r    = min(gbar² / (var + eps), R_MAX)  # GSNR, eq. 2 (R_MAX: below)
    r    = clamp(r / mean_tensor(r), gamma, 1)   # eqs. 8-9, layer = one parameter tensor

A tensor whose mean r is 0 carries no information and keeps r = 1 (the zero-information
guard), as does one whose mean r is below fp32's normal range (``R_MEAN_MIN``). ``gamma = 1``
gives r = 1 everywhere.

The gradient noise scale ``B_simple = tr(Σ) / |G|²`` (McCandlish et al. 2018, "An
Empirical Model of Large-Batch Training", eq. 2.7 and App. A) comes from the same sums.

No torch.distributed, no optimizer state: segments (pieces of one tensor, e.g. under a
ZeRO partition) are described by lengths, and combining pieces is the caller's business.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

#: the largest r (2^64): ``var = 0`` gives ``gbar²/eps``, past fp32's range from |gbar| of about
#: 1.8e13 at the default eps (at 2 with the smallest eps); an infinite r made its tensor's mean
#: infinite and the scale ``inf · (1/inf) = NaN``. Above it r says nothing fp32 can resolve
#: (``s - gbar²`` rounds at 6e-8 of s), and the kernels' fp32 partial sums of r stay finite.
R_MAX = 2.0**64
#: the smallest tensor mean of r that normalises (fp32's smallest normal number, 2^-126): the
#: kernels scale by ``1/mean`` in fp32, infinite from a mean below 1/FLT_MAX (then 0·inf = NaN
#: for an element whose r is 0); a GPU flushes fp32 subnormals to 0 anyway. Below it, as at 0,
#: the tensor keeps r = 1.
R_MEAN_MIN = 2.0**-126


def gsnr(sum_g: Tensor, sum_sq: Tensor, n: int, eps: float) -> Tensor:
    """Raw element-wise GSNR ``min(gbar² / (max(s - gbar², 0) + eps), R_MAX)`` from the moment sums.

    Computed in the dtype of the inputs (fp32 statistics in the optimizers) in the order
    the fused kernels use, so both paths round alike.
    """
    inv_n = 1.0 / n
    gbar = sum_g * inv_n
    s = sum_sq * inv_n
    g2 = gbar * gbar
    var = (s - g2).clamp_min(0.0)
    return (g2 / (var + eps)).clamp_max(R_MAX)  # NaN stays NaN (a non-finite step is skipped)


@dataclass(frozen=True)
class SegmentScales:
    """Per-segment normalisation of the GSNR: ``clamp(r * inv_mean, lo, 1)``.

    ``lo`` is gamma, or 1 where the tensor's mean r is 0 or below ``R_MEAN_MIN`` (no
    information, r = 1).
    """

    inv_mean: Tensor  # float64 [S]
    lo: Tensor  # float64 [S]
    informative: Tensor  # bool [S]


def segment_scales(sum_r: Tensor, numel: Tensor, gamma: float) -> SegmentScales:
    """Normalisation constants from per-tensor sums of r and element counts (float64).

    ``sum_r``/``numel`` must already cover whole tensors (sum the pieces of a tensor split
    across segments or ranks first): eq. 8 normalises by the mean over the layer.
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    mean = sum_r.double() / numel.double()
    informative = mean >= R_MEAN_MIN
    # a scalar operand beside a float64 tensor stays float64 (two Python scalars would give fp32)
    inv_mean = torch.where(informative, mean.reciprocal(), 0.0)
    lo = torch.where(informative, torch.full_like(mean, gamma), 1.0)
    return SegmentScales(inv_mean=inv_mean, lo=lo, informative=informative)


def normalize(r: Tensor, inv_mean: float, lo: float) -> Tensor:
    """Eqs. 8-9 for one segment: ``clamp(r * inv_mean, lo, 1)``."""
    return (r * inv_mean).clamp(lo, 1.0)


def clip_counts(r: Tensor, inv_mean: float, lo: float) -> tuple[float, float]:
    """How many elements of a segment ``normalize`` raises to ``lo`` and cuts to 1 (metrics)."""
    x = r * inv_mean
    return float((x < lo).sum(dtype=torch.float64)), float((x > 1.0).sum(dtype=torch.float64))


def momentum(avg: Tensor, r: Tensor, beta3: float) -> Tensor:
    """The GSNR momentum ``p_t = beta3 · p_{t-1} + (1 - beta3) · r_t`` (docs/design.md §1.1)."""
    return avg * beta3 + r * (1.0 - beta3)


def p_hat(avg: Tensor, bc3: float, lo: float) -> Tensor:
    """The scale applied: ``clamp(p_t / (1 - beta3^t), lo, 1)``."""
    return (avg / bc3).clamp(lo, 1.0)


def gsnr_ema_bias_correction(beta3: float, step: Tensor) -> Tensor:
    """``1 - beta3**t`` per segment (float64 step counts): the bias correction of the GSNR
    momentum ``p_t`` (docs/design.md §1.3), and of Adam's moments with their betas."""
    return 1.0 - torch.pow(float(beta3), step.double())  # a float base: the same float64 pow, one op fewer


@dataclass(frozen=True)
class NoiseScale:
    """Gradient noise scale estimated from ``n`` groups (McCandlish et al. 2018, App. A).

    ``trace_cov`` is tr(Σ) of one *group's* mean gradient, ``grad_sq`` the unbiased |G|²;
    ``b_simple_groups = trace_cov / grad_sq`` is B_simple in units of gradient groups
    (multiply by samples per group for samples). NaN where |G|² is not positive: the
    estimate is too noisy at this step (average numerator and denominator over steps).
    """

    trace_cov: float
    grad_sq: float
    b_simple_groups: float


def noise_scale(sum_s: float, sum_gbar2: float, n: int) -> NoiseScale:
    """B_simple from ``Σ s`` (mean of squared group gradients) and ``Σ gbar²`` over elements.

    With group mean gradients ``g_d`` of b samples each: ``E[(1/n) Σ_d |g_d|²] = |G|² +
    tr(Σ)/b`` and ``E[|gbar|²] = |G|² + tr(Σ)/(n b)``, hence the unbiased estimates
    ``tr(Σ)/b = n/(n-1) (Σs - Σgbar²)`` and ``|G|² = Σgbar² - (tr(Σ)/b)/n``.
    """
    if n < 2:
        raise ValueError(f"the noise scale needs n >= 2 gradient groups, got {n}")
    trace_cov = n / (n - 1) * (sum_s - sum_gbar2)
    grad_sq = sum_gbar2 - trace_cov / n
    b = trace_cov / grad_sq if grad_sq > 0 else math.nan
    return NoiseScale(trace_cov=trace_cov, grad_sq=grad_sq, b_simple_groups=b)
