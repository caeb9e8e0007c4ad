"""GSNR maths (docs/design.md §1) against float64 hand computations, and its invariants."""
import math

import numpy as np
import pytest
import torch

from vrgd_ds import gsnr as G


def normalize_segments(r: torch.Tensor, lengths: list[int], gamma: float) -> torch.Tensor:
    """Eqs. 8-9 over a flat tensor cut into whole-tensor segments, from the library's pieces."""
    pieces = r.split(lengths)
    sums = torch.stack([p.sum(dtype=torch.float64) for p in pieces])
    sc = G.segment_scales(sums, torch.tensor(lengths, dtype=torch.float64), gamma)
    return torch.cat([G.normalize(p, float(i), float(lo)) for p, i, lo in zip(pieces, sc.inv_mean, sc.lo)])

def groups(k=5, shape=(7, 3), dtype=torch.float64):
    return torch.randn(k, *shape, dtype=dtype) + 0.3


def by_hand(g: np.ndarray, eps: float) -> np.ndarray:
    """Paper eqs. 2 and 7 with numpy, element by element."""
    n = g.shape[0]
    out = np.empty(g.shape[1:])
    for idx in np.ndindex(*g.shape[1:]):
        col = [g[(d,) + idx] for d in range(n)]
        mean = sum(col) / n
        var = max(sum(c * c for c in col) / n - mean * mean, 0.0)
        out[idx] = mean * mean / (var + eps)
    return out


def test_gsnr_matches_hand_computation():
    g = groups()
    r = G.gsnr(g.sum(0), (g * g).sum(0), g.shape[0], 1e-12)
    np.testing.assert_allclose(r.numpy(), by_hand(g.numpy(), 1e-12), rtol=1e-10)


def test_normalise_and_clamp_per_segment():
    r = torch.rand(10, dtype=torch.float64) * 3
    out = normalize_segments(r, [4, 6], gamma=0.1)
    for piece, ref in zip(out.split([4, 6]), r.split([4, 6])):
        expect = np.clip(ref.numpy() / ref.numpy().mean(), 0.1, 1.0)
        np.testing.assert_allclose(piece.numpy(), expect, rtol=1e-12)
    assert out.min() >= 0.1 and out.max() <= 1.0


def test_zero_information_guard_keeps_r_one():
    """An all-zero gradient tensor (mean r == 0) keeps r = 1, like LAMB's zero-norm guard."""
    sc = G.segment_scales(torch.tensor([0.0, 2.0], dtype=torch.float64), torch.tensor([3.0, 4.0]), 0.1)
    assert sc.informative.tolist() == [False, True]
    assert G.normalize(torch.zeros(3), float(sc.inv_mean[0]), float(sc.lo[0])).tolist() == [1.0, 1.0, 1.0]
    assert float(sc.inv_mean[1]) == 2.0 and float(sc.lo[1]) == pytest.approx(0.1)


def test_zero_variance_is_clamped_not_infinite():
    """Identical groups: var == 0, r = gbar²/eps is huge but finite; the clamp bounds it."""
    g = torch.ones(4, 5, dtype=torch.float32)
    g[:, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    r = G.gsnr(g.sum(0), (g * g).sum(0), 4, 1e-12)
    assert torch.isfinite(r).all() and r[1:].min() > 1e10
    out = normalize_segments(r.double(), [5], 0.1)
    assert out[0] == pytest.approx(0.1) and (out[1:] <= 1).all()
    # a mean of 1e4 with no variance: gbar²/eps = 1e20 is past R_MAX = 2^64, which bounds it
    big = torch.full((4, 3), 1e4, dtype=torch.float32)
    assert (G.gsnr(big.sum(0), (big * big).sum(0), 4, 1e-12) == G.R_MAX).all()


@pytest.mark.parametrize("gamma", [0.0, -0.5, 1.5])
def test_gamma_out_of_range(gamma):
    with pytest.raises(ValueError, match="gamma"):
        G.segment_scales(torch.ones(1), torch.ones(1), gamma)


def test_scale_invariance_exact_for_powers_of_two():
    """A common scale c of all group gradients (loss scale, 1/GAS) leaves r unchanged: exact
    in floating point for c = 2^k with eps = 0, since every operation scales exactly."""
    g = groups(dtype=torch.float32)
    base = normalize_segments(G.gsnr(g.sum(0), (g * g).sum(0), 5, 0.0).reshape(-1).double(), [21], 0.1)
    for c in (2.0**-7, 2.0**10):
        h = g * c
        r = normalize_segments(G.gsnr(h.sum(0), (h * h).sum(0), 5, 0.0).reshape(-1).double(), [21], 0.1)
        assert torch.equal(r, base)


def test_scale_invariance_any_scale():
    g = groups()
    base = G.gsnr(g.sum(0), (g * g).sum(0), 5, 0.0)
    h = g * 0.37
    assert torch.allclose(G.gsnr(h.sum(0), (h * h).sum(0), 5, 0.0), base, rtol=1e-12)


def test_biased_and_unbiased_variance_agree_after_normalisation():
    """1/n vs 1/(n-1) variance differ by a constant that the per-tensor mean cancels (eps = 0)."""
    g = groups(k=6)
    n = 6
    biased = G.gsnr(g.sum(0), (g * g).sum(0), n, 0.0).reshape(-1)
    gbar = g.mean(0)
    unbiased = (gbar**2 / (g.var(0, unbiased=True))).reshape(-1)
    a = normalize_segments(biased, [21], 0.1)
    b = normalize_segments(unbiased, [21], 0.1)
    assert torch.allclose(a, b, rtol=1e-12)


def test_noise_scale_matches_hand_formula():
    g = groups(k=8, shape=(50,))
    s = (g * g).mean(0).sum().item()
    gb2 = (g.mean(0) ** 2).sum().item()
    ns = G.noise_scale(s, gb2, 8)
    # tr(Σ_group) is the unbiased sample variance summed over elements.
    assert ns.trace_cov == pytest.approx(g.var(0, unbiased=True).sum().item(), rel=1e-12)
    assert ns.grad_sq == pytest.approx(gb2 - ns.trace_cov / 8, rel=1e-12)
    assert ns.b_simple_groups == pytest.approx(ns.trace_cov / ns.grad_sq, rel=1e-12)


def test_noise_scale_recovers_known_ratio():
    """Groups drawn as G + noise with tr(Σ)/|G|² = 4: the estimate lands near 4."""
    torch.manual_seed(1)
    dim, k = 20000, 16
    G_true = torch.full((dim,), 0.1, dtype=torch.float64)
    noise_sd = math.sqrt(4 * (G_true**2).sum().item() / dim)
    g = G_true + noise_sd * torch.randn(k, dim, dtype=torch.float64)
    ns = G.noise_scale((g * g).mean(0).sum().item(), (g.mean(0) ** 2).sum().item(), k)
    assert ns.b_simple_groups == pytest.approx(4.0, rel=0.1)


def test_noise_scale_needs_two_groups():
    with pytest.raises(ValueError, match="n >= 2"):
        G.noise_scale(1.0, 1.0, 1)
