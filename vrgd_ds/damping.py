"""The noise-damping check: does an optimizer shrink the steps of coordinates whose gradient
is pure noise, relative to coordinates with a consistent signal?

This is what GSNR is for (Jiang et al., arXiv 2309.13681 §3: "elements with low GSNR ... are
suppressed"), so it is the property every VR optimizer is tested on against its base.

The problem: one parameter tensor of ``2·dim`` elements, ``θ₀ ~ N(0, 1)``. Every step has
``groups`` gradient groups (one ``backward()`` each, as in gradient accumulation). Group ``k``
draws, element-wise,

    noise coordinates  (first half):   g_k ~ N(0, 1)            GSNR ≈ 0
    signal coordinates (second half):  g_k = 1 + 0.1 · N(0, 1)  GSNR ≈ 100

through the loss ``⟨θ, g_k⟩ / groups``, so ``p.grad`` is the group mean ``ḡ``. The gradient
does not depend on θ, so the result does not depend on the learning rate (weight decay 0).
The figure: mean ``|Δθ|`` over noise coordinates divided by mean ``|Δθ|`` over signal
coordinates, over the last ``window`` steps. For SGD it is ``E|ḡ_noise| / 1 = √(2/π)/√groups``
(0.282 at 8 groups); Adam's normalisation gives noise coordinates steps of
``√((1-β1)/(1+β1))``-order (about 0.18).

    python -m vrgd_ds.damping        # the table for every family member and torch baselines
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


def noise_signal_ratio(make_optimizer: OptimizerFactory, *, dim: int = 512, groups: int = 8, steps: int = 300,
                       window: int = 100, seed: int = 0, rows: int = 1, noise: str = "rows") -> float:
    """Mean |update| of the noise coordinates / that of the signal coordinates (module docstring).

    ``rows > 1`` makes the tensor a ``[rows, 2·dim/rows]`` matrix (an optimizer with row or
    column ratios, MERIT, sees its structure): ``noise="rows"`` puts the noise coordinates in
    whole rows (the first half), ``"scattered"`` at a fixed random half of the elements."""
    if not 0 < window <= steps:
        raise ValueError(f"window must be in [1, steps={steps}], got {window}")
    if rows < 1 or (2 * dim) % rows or noise not in ("rows", "scattered"):
        raise ValueError(f"rows must divide 2·dim={2 * dim} and noise be 'rows' or 'scattered', got {rows}, {noise!r}")
    gen = torch.Generator().manual_seed(seed)
    theta = torch.nn.Parameter(torch.randn(2 * dim, generator=gen).view(rows, -1).squeeze(0))
    where = torch.randperm(2 * dim, generator=gen) if noise == "scattered" else torch.arange(2 * dim)
    opt = make_optimizer([theta])
    noise_sum = signal_sum = 0.0
    for step in range(steps):
        for _ in range(groups):
            g = torch.randn(2 * dim, generator=gen)
            g[dim:] = 1.0 + 0.1 * g[dim:]
            ((theta * g[where].view_as(theta)).sum() / groups).backward()
        before = theta.detach().clone()
        opt.step()
        opt.zero_grad()
        if step >= steps - window:
            delta = (theta.detach() - before).abs().reshape(-1)[torch.argsort(where)]
            noise_sum += float(delta[:dim].sum())
            signal_sum += float(delta[dim:].sum())
    return noise_sum / signal_sum


def family_table(**problem) -> list[tuple[str, float]]:
    """The ratio for every family member (each Adam-family placement) and torch's SGD/AdamW, on
    the one-row problem; MERIT, whose ratios are per row and column, only on a matrix
    (``noise_signal_ratio(..., rows=16)``, as tests/unit/test_damping.py measures it)."""
    import vrgd_ds
    from vrgd_ds.optim.adam import GSNR_PLACEMENTS

    rows: list[tuple[str, OptimizerFactory]] = [
        ("torch SGD", lambda p: torch.optim.SGD(p, lr=0.01)),
        ("VRSGD", lambda p: vrgd_ds.VRSGD(p, lr=0.01)),
        ("torch SGD momentum 0.9", lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)),
        ("VRMomentum", lambda p: vrgd_ds.VRMomentum(p, lr=0.01, momentum=0.9)),
        ("torch AdamW", lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0)),
        ("VRAdam gsnr=False", lambda p: vrgd_ds.VRAdam(p, lr=1e-3, weight_decay=0.0, gsnr=False)),
    ]
    for placement in GSNR_PLACEMENTS:
        rows.append((f"VRAdam {placement}", lambda p, pl=placement: vrgd_ds.VRAdam(
            p, lr=1e-3, weight_decay=0.0, gsnr_placement=pl)))
    rows.append(("Lamb", lambda p: vrgd_ds.Lamb(p, lr=1e-3, weight_decay=0.0)))
    for placement in GSNR_PLACEMENTS:
        rows.append((f"VRLamb {placement}", lambda p, pl=placement: vrgd_ds.VRLamb(
            p, lr=1e-3, weight_decay=0.0, gsnr_placement=pl)))
    rows += [
        ("Lars", lambda p: vrgd_ds.Lars(p, lr=0.1)),
        ("VRLars", lambda p: vrgd_ds.VRLars(p, lr=0.1)),
    ]
    return [(name, noise_signal_ratio(make, **problem)) for name, make in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--window", type=int, default=None, help="the last steps averaged (default min(100, --steps))")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in ("dim", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.groups < 2:
        ap.error(f"--groups must be at least 2 (the GSNR needs two gradient groups a step), got {args.groups}")
    if args.window is None:
        args.window = min(100, args.steps)
    if not 0 < args.window <= args.steps:
        ap.error(f"--window must be in [1, --steps={args.steps}], got {args.window}")
    print("| optimizer | noise / signal update |\n| --- | --- |")
    for name, ratio in family_table(**vars(args)):
        print(f"| {name} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
