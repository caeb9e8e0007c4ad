"""Linear regression, after the paper's §7.2–7.3 (Jiang et al., arXiv 2309.13681): SGD vs VR-SGD.

Claims tested: VR-SGD reaches SGD's 100-step loss in about half the steps; the best gamma is
about 0.04–0.2; the best number of gradient groups k is about 32–256.

Setup (the paper gives the weights, the init, the loss, the steps and the batch; the input
distribution and the noise level are ours): true weights ``W_i = i`` (i = 1..10), zero init,
MSE, 100 steps, a fresh batch of 2048 samples per step split into k groups of 2048/k. Inputs
``x ~ U(0, 1)^10`` (``--features normal`` for ``N(0, I)``: isotropic, where SGD at LR 0.5 solves
the problem in one step and nothing can beat it), targets ``y = x·W + σ·ε`` with label noise
σ = 0 and σ = 5 (about the clean target's standard deviation, 5.7). The loss reported is the
exact excess population MSE ``(w − W)ᵀ E[xxᵀ] (w − W)`` (the noise floor σ² removed), not a
batch estimate. The k group gradients are computed in closed form and handed to the optimizer
as its statistics source (``set_statistics_source``), so k = 1024 costs no more than k = 2.

Each optimizer's LR is chosen on the same grid (``--lr``) by the mean final loss over seeds,
among the LRs where no seed diverged (its loss overflowed, or the optimizer skipped a step for
non-finite values); the sensitivity sweeps re-tune the LR at every gamma and every k. SGD is
``VRSGD(gsnr=False)`` (equal to ``torch.optim.SGD``; gamma = 1 equals it too). Per-weight GSNR:
``ḡ_i² / var_i`` over the k groups, before the per-tensor normalisation.

    python studies/linreg.py            # full: 5 seeds, the whole grids, ~2 min on 2 CPU cores
    python studies/linreg.py --quick    # 1 seed, small grids (CI)
"""
from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from statistics import mean
from typing import Any

import torch
from common import DOCS, Output, at_least_one, plt, spread, table
from torch import Tensor

import vrgd_ds

DIM = 10
W_TRUE = torch.arange(1, DIM + 1, dtype=torch.float32)


class GroupGradients:
    """The optimizer's statistics source for one step: the k group gradients, given directly."""

    def __init__(self) -> None:
        self.k = 0
        self.sum_g: Tensor | None = None
        self.sum_sq: Tensor | None = None

    @property
    def n(self) -> int:
        return self.k

    def feed(self, p: Tensor, groups: Tensor) -> None:
        self.k = groups.shape[0]
        self.sum_g, self.sum_sq = groups.sum(0), groups.pow(2).sum(0)
        p.grad = groups.mean(0)

    def moments(self, params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        assert self.sum_g is not None and self.sum_sq is not None
        return [self.sum_g], [self.sum_sq]

    def reset(self) -> None:
        pass


def second_moment(features: str) -> Tensor:
    """``E[x xᵀ]`` of the input distribution."""
    if features == "uniform":  # Var 1/12 on the diagonal, mean 1/2 everywhere
        return torch.full((DIM, DIM), 0.25) + torch.eye(DIM) / 12
    return torch.eye(DIM)


def run(optimizer: str, lr: float, seed: int, *, k: int, gamma: float, sigma: float, features: str, steps: int,
        batch: int) -> dict[str, Any]:
    """One training run: the excess loss after every step (index 0 = init) and per-weight GSNR."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.zeros(DIM))
    opt = vrgd_ds.VRSGD([w], lr=lr, gamma=gamma, gsnr=optimizer == "VR-SGD")
    source = GroupGradients()
    opt.set_statistics_source(source)
    cov = second_moment(features)

    def excess() -> float:
        d = w.detach() - W_TRUE
        value = float(d @ cov @ d)
        return value if math.isfinite(value) else math.inf

    losses, gsnr = [excess()], []
    m = batch // k
    for _ in range(steps):
        x = torch.rand(batch, DIM, generator=gen) if features == "uniform" else torch.randn(batch, DIM, generator=gen)
        y = x @ W_TRUE + sigma * torch.randn(batch, generator=gen)
        xs = x.view(k, m, DIM)
        resid = xs @ w.detach() - y.view(k, m)
        groups = (2.0 / m) * torch.einsum("kmd,km->kd", xs, resid)  # each group's mean MSE gradient
        g_mean = groups.mean(0)
        var = (groups.pow(2).mean(0) - g_mean.pow(2)).clamp_min(0)
        gsnr.append((g_mean.pow(2) / var.clamp_min(1e-30)).tolist())
        source.feed(w, groups)
        opt.step()
        losses.append(excess())
        # Diverged: the loss overflowed, or the optimizer skipped a step for non-finite gradients or
        # statistics. It skips rather than write them, so the weights stay put and the loss plateaus
        # where it got to (~1e36-1e38), finite: not a result of training at this LR. The skip count
        # is exact where a threshold on the loss's growth would be a choice; a run whose loss grows
        # but stays finite keeps its loss, what its LR did in these steps (behind any LR that trains).
        if losses[-1] == math.inf or opt.skipped_steps:
            losses[-1] = math.inf
            losses += [math.inf] * (steps - len(losses) + 1)
            break
    return {"losses": losses, "gsnr": gsnr}


def tuned(optimizer: str, lrs: list[float], seeds: list[int], out: Output, tag: dict[str, Any],
          **problem: Any) -> tuple[float | None, list[dict[str, Any]]]:
    """The LR of the grid with the lowest mean final loss among those where no seed diverged, and
    its runs; ``None`` and the first LR's runs where every LR diverged."""
    best: tuple[float, float, list[dict[str, Any]]] | None = None
    first: list[dict[str, Any]] | None = None
    for lr in lrs:
        runs = [run(optimizer, lr, s, **problem) for s in seeds]
        first = first or runs
        finals = [r["losses"][-1] for r in runs]
        score = mean(finals) if all(math.isfinite(f) for f in finals) else math.inf
        out.log_run({**tag, "optimizer": optimizer, "lr": lr, "final": finals,
                     **{key: v for key, v in problem.items() if key in ("k", "gamma", "sigma")}})
        if math.isfinite(score) and (best is None or score < best[0]):
            best = (score, lr, runs)
    if best is None:
        assert first is not None
        return None, first
    return best[1], best[2]


def lr_text(lr: float | None) -> str:
    return "none (every LR diverged)" if lr is None else f"{lr:g}"


def losses_text(values: list[float]) -> str:
    """``spread`` of the seeds' losses, or ``diverged`` where one of them did."""
    return spread(values, "{:.3g}") if all(math.isfinite(v) for v in values) else "diverged"


def steps_to_reach(curve: list[float], target: float) -> int | None:
    """The first step whose loss is at most ``target``."""
    return next((t for t, v in enumerate(curve) if v <= target), None)


def mean_curve(runs: list[dict[str, Any]]) -> list[float]:
    return [mean(vals) for vals in zip(*(r["losses"] for r in runs))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 seed, small grids: a smoke run")
    ap.add_argument("--seeds", type=at_least_one, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--k", type=int, default=64, help="gradient groups per step of the main comparison")
    ap.add_argument("--gamma", type=float, default=0.1, help="VR-SGD's gamma in the main comparison and the k sweep")
    ap.add_argument("--features", choices=("uniform", "normal"), default="uniform")
    ap.add_argument("--label-noise", type=float, action="append", default=None, help="σ values (default 0 and 5)")
    ap.add_argument("--lr", type=float, action="append", default=None, help="the LR grid of every optimizer")
    ap.add_argument("--out", type=Path, default=None, help="default docs/studies/linreg (quick: runs/studies/linreg)")
    args = ap.parse_args()
    seeds = list(range(1 if args.quick else args.seeds))
    lrs = args.lr or ([0.05, 0.2, 0.5] if args.quick else [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.7, 1.0])
    sigmas = args.label_noise or [0.0, 5.0]
    gammas = [0.1, 1.0] if args.quick else [0.01, 0.02, 0.04, 0.1, 0.2, 0.4, 1.0]
    ks = [8, 64] if args.quick else [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    for k in ks + [args.k]:
        if args.batch % k:
            raise SystemExit(f"--batch {args.batch} is not divisible into {k} groups")
    out_dir = args.out or (Path("runs/studies/linreg") if args.quick else DOCS / "linreg")
    out = Output(out_dir, "linreg", {"seeds": seeds, "steps": args.steps, "batch": args.batch, "k": args.k,
                                     "gamma": args.gamma, "features": args.features, "label_noise": sigmas,
                                     "lr_grid": lrs, "gamma_grid": gammas, "k_grid": ks, "quick": args.quick})
    torch.set_num_threads(1)
    logging.getLogger("vrgd_ds").setLevel(logging.ERROR)  # diverging grid points, n = 2 warnings
    problem = {"features": args.features, "steps": args.steps, "batch": args.batch}
    pyplot = plt()

    # 1. the main comparison: loss curves and steps to SGD's final loss
    rows, curves, gsnr_runs = [], {}, {}
    for sigma in sigmas:
        for name in ("SGD", "VR-SGD"):
            lr, runs = tuned(name, lrs, seeds, out, {"sweep": "main"}, k=args.k, gamma=args.gamma, sigma=sigma,
                             **problem)
            curves[sigma, name] = (lr, runs)
            if name == "VR-SGD":
                gsnr_runs[sigma] = runs[0]["gsnr"]
        sgd_final = mean_curve(curves[sigma, "SGD"][1])[-1]
        for name in ("SGD", "VR-SGD"):
            lr, runs = curves[sigma, name]
            reach = [steps_to_reach(r["losses"], sgd_final) for r in runs]
            reach_txt = ", ".join("never" if s is None else str(s) for s in reach)
            if not math.isfinite(sgd_final):
                reach_txt = "— (SGD diverged)"
            rows.append((f"{sigma:g}", name, lr_text(lr), losses_text([r["losses"][-1] for r in runs]),
                         losses_text([r["losses"][args.steps // 2] for r in runs]), reach_txt))
    out.add_table(f"Loss after {args.steps} steps (k = {args.k}, gamma = {args.gamma}, {len(seeds)} seeds)",
                  table(["label noise σ", "optimizer", "best LR", f"excess loss at step {args.steps}",
                         f"at step {args.steps // 2}", "steps to reach SGD's final mean loss (per seed)"], rows))
    fig, axes = pyplot.subplots(1, len(sigmas), figsize=(5 * len(sigmas), 3.6), squeeze=False)
    for ax, sigma in zip(axes[0], sigmas):
        for name in ("SGD", "VR-SGD"):
            lr, runs = curves[sigma, name]
            ax.semilogy(mean_curve(runs), label=f"{name} (lr {lr_text(lr)})")
        ax.set(title=f"label noise σ = {sigma:g}", xlabel="step", ylabel="excess MSE (mean over seeds)")
        ax.legend()
    out.savefig(fig, "loss.png")
    fig, axes = pyplot.subplots(1, len(sigmas), figsize=(5 * len(sigmas), 3.6), squeeze=False)
    for ax, sigma in zip(axes[0], sigmas):
        per_weight = list(zip(*gsnr_runs[sigma]))
        for i, series in enumerate(per_weight):
            # step t + 1 of the table: the GSNR of the gradients that step applied
            ax.semilogy(range(1, len(series) + 1), series, label=f"w{i + 1}", color=pyplot.cm.viridis(i / (DIM - 1)))
        ax.set(title=f"VR-SGD, per-weight GSNR, σ = {sigma:g} (seed 0)", xlabel="step", ylabel="ḡ² / var")
    axes[0][-1].legend(fontsize=6, ncol=2)
    out.savefig(fig, "gsnr.png")
    gsnr_rows = []
    for sigma in sigmas:
        per_step = gsnr_runs[sigma]
        picks = sorted({0, len(per_step) // 10, len(per_step) // 2, len(per_step) - 1})
        for t in picks:
            gsnr_rows.append((f"{sigma:g}", t + 1, *(f"{v:.3g}" for v in per_step[t])))
    out.add_table("VR-SGD per-weight GSNR at chosen steps (seed 0)",
                  table(["σ", "step", *(f"w{i + 1}" for i in range(DIM))], gsnr_rows))

    # 2. sensitivity to gamma and to k, the LR re-tuned at every point
    def sweep(key: str, values: list[Any]) -> dict[float, list[tuple[Any, float | None, list[float]]]]:
        res = {}
        for sigma in sigmas:
            res[sigma] = []
            for v in values:
                params = {"k": args.k, "gamma": args.gamma, key: v}
                lr, runs = tuned("VR-SGD", lrs, seeds, out, {"sweep": key}, sigma=sigma, **params, **problem)
                res[sigma].append((v, lr, [r["losses"][-1] for r in runs]))
        return res

    for key, values, fixed in (("gamma", gammas, f"k = {args.k}"), ("k", ks, f"gamma = {args.gamma}")):
        res = sweep(key, values)
        srows = []
        for sigma in sigmas:
            sgd = [r["losses"][-1] for r in curves[sigma, "SGD"][1]]
            trained = [item for item in res[sigma] if item[1] is not None]
            best = min(trained, key=lambda item: mean(item[2]))[0] if trained else None
            for v, lr, finals in res[sigma]:
                ratio = mean(finals) / mean(sgd) if lr is not None and math.isfinite(mean(sgd)) else None
                srows.append((f"{sigma:g}", f"{v:g}" + (" (best)" if v == best else ""), lr_text(lr),
                              losses_text(finals), "—" if ratio is None else f"{ratio:.3g}"))
        out.add_table(f"VR-SGD sensitivity to {key} ({fixed}; LR re-tuned per point; SGD's own best LR as the base)",
                      table(["σ", key, "best LR", f"excess loss at step {args.steps}", "/ SGD's"], srows))
        fig, ax = pyplot.subplots(figsize=(5, 3.6))
        for sigma in sigmas:
            ax.loglog([v for v, _, _ in res[sigma]], [mean(f) for _, _, f in res[sigma]], marker="o",
                      label=f"VR-SGD σ = {sigma:g}")
            ax.axhline(mean(r["losses"][-1] for r in curves[sigma, "SGD"][1]), ls="--", lw=0.8,
                       color=ax.lines[-1].get_color(), label=f"SGD σ = {sigma:g}")
        ax.set(xlabel=key, ylabel=f"excess MSE at step {args.steps}", title=f"sensitivity to {key}")
        ax.legend(fontsize=7)
        out.savefig(fig, f"{key}.png")
    out.finish()


if __name__ == "__main__":
    main()
