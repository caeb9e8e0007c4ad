"""Large-batch collapse check on real data that ships offline: scikit-learn's handwritten
digits (1,797 8×8 images, 10 classes; ``sklearn.datasets.load_digits``), in the spirit of the
paper's CIFAR-10 table (arXiv 2309.13681, Table 5: at 8k, Adam 20.74% vs VR-Adam 90.86%).

A small MLP (64-128-128-10, ReLU) trains for a fixed number of epochs at each batch size, from
small to most of the training set, so larger batches take fewer steps. Every step has
``--groups`` gradient groups (micro-batches, one backward each). The peak LR follows the
square-root rule from each optimizer's base LR at batch 32, times a grid factor; 10% linear
warmup, then cosine decay to 0. For every (optimizer, batch) cell the grid factor with the best
mean *validation* accuracy over seeds is chosen (validation: 20% of the training split), and
the table reports that factor's test accuracy and generalisation gap (train − test accuracy),
mean and spread (min–max) over seeds.

    python studies/collapse.py                      # full: every family, 3 seeds -> docs/studies/collapse
    python studies/collapse.py --family adam        # Adam vs VR-Adam in each placement
    python studies/collapse.py --quick              # 1 seed, 2 batches, 3 epochs (CI)
    python studies/collapse.py --tables-from docs/studies/collapse   # its tables and plot again, no training

Needs scikit-learn (``pip install "vrgd-ds[studies]"``).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean

import torch
from common import DOCS, Output, at_least_one, plt, spread, table
from torch import nn

import vrgd_ds
from vrgd_ds.optim.adam import GSNR_PLACEMENTS

Factory = Callable[[list, float], torch.optim.Optimizer]


def _family() -> dict[str, tuple[float, Factory]]:
    """label -> (base LR at batch 32, factory(param groups, lr))."""
    out: dict[str, tuple[float, Factory]] = {
        "Momentum": (0.05, lambda g, lr: vrgd_ds.VRMomentum(g, lr=lr, momentum=0.9, gsnr=False)),
        "VR-Momentum": (0.05, lambda g, lr: vrgd_ds.VRMomentum(g, lr=lr, momentum=0.9)),
        "Adam": (2e-3, lambda g, lr: vrgd_ds.VRAdam(g, lr=lr, gsnr=False)),
        "LAMB": (1e-2, lambda g, lr: vrgd_ds.Lamb(g, lr=lr)),
        "LARS": (2.0, lambda g, lr: vrgd_ds.Lars(g, lr=lr, momentum=0.9, trust_coefficient=0.001)),
        "VR-LARS": (2.0, lambda g, lr: vrgd_ds.VRLars(g, lr=lr, momentum=0.9, trust_coefficient=0.001)),
    }
    for pl in GSNR_PLACEMENTS:
        out[f"VR-Adam {pl}"] = (2e-3, lambda g, lr, pl=pl: vrgd_ds.VRAdam(g, lr=lr, gsnr_placement=pl))
        out[f"VR-LAMB {pl}"] = (1e-2, lambda g, lr, pl=pl: vrgd_ds.VRLamb(g, lr=lr, gsnr_placement=pl))
    return out


OPTIMIZERS = _family()
FAMILIES = {
    "adam": ["Adam"] + [f"VR-Adam {pl}" for pl in GSNR_PLACEMENTS],
    "lamb": ["LAMB"] + [f"VR-LAMB {pl}" for pl in GSNR_PLACEMENTS],
    "momentum": ["Momentum", "VR-Momentum"],
    "lars": ["LARS", "VR-LARS"],
}


def load(seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Train / validation / test splits (60/20/20 of the data set, stratified), standardised."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    x_tr, x_val, y_tr, y_val = train_test_split(x_rest, y_rest, test_size=0.25, stratify=y_rest, random_state=seed)
    mu, sd = x_tr.mean(0), x_tr.std(0) + 1e-6
    return {k: (torch.tensor((a - mu) / sd, dtype=torch.float32), torch.tensor(b)) for k, (a, b) in
            {"train": (x_tr, y_tr), "val": (x_val, y_val), "test": (x_test, y_test)}.items()}


def accuracy(model: nn.Module, split: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float((model(split[0]).argmax(1) == split[1]).float().mean())


def train(label: str, batch: int, lr: float, seed: int, data: dict, args: argparse.Namespace) -> dict[str, float]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = OPTIMIZERS[label][1](vrgd_ds.param_groups(model, weight_decay=args.weight_decay), lr)
    x, y = data["train"]
    steps_per_epoch = max(1, len(x) // batch)
    total = steps_per_epoch * args.epochs
    warmup = max(1, round(0.1 * total))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warmup if s < warmup else
                                              0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total - warmup))))
    gen = torch.Generator().manual_seed(seed)
    loss_fn = nn.CrossEntropyLoss()
    nonfinite = False
    for _ in range(args.epochs):
        perm = torch.randperm(len(x), generator=gen)
        for s in range(steps_per_epoch):
            idx = perm[s * batch:(s + 1) * batch]
            for mb in idx.chunk(args.groups):  # one backward per group
                (loss_fn(model(x[mb]), y[mb]) * len(mb) / len(idx)).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        nonfinite |= not all(torch.isfinite(p).all() for p in model.parameters())
    tr, val, te = (accuracy(model, data[k]) for k in ("train", "val", "test"))
    return {"train": tr, "val": val, "test": te, "gap": tr - te, "steps": total, "nonfinite": nonfinite}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1 seed, batches 32 and 512, 3 epochs: a smoke run")
    ap.add_argument("--optimizer", action="append", default=None, choices=list(OPTIMIZERS))
    ap.add_argument("--family", action="append", default=None, choices=list(FAMILIES),
                    help="default: every family")
    ap.add_argument("--batch", type=int, action="append", default=None)
    ap.add_argument("--seeds", type=at_least_one, default=3)
    ap.add_argument("--lr-factor", type=float, action="append", default=None,
                    help="grid around the sqrt-scaled base LR (default 0.25 0.5 1 2 4)")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=None, help="default docs/studies/collapse (quick: runs/studies/collapse)")
    ap.add_argument("--tables-from", type=Path, default=None, metavar="DIR",
                    help="write DIR's tables and plot again from its runs.jsonl and meta.json, training nothing "
                         "(after a change to how they are summarised); the other options are DIR's")
    args = ap.parse_args()
    if args.tables_from is not None:
        rebuild(args.tables_from)
        return
    labels = list(args.optimizer or [])
    for fam in args.family or ([] if labels else list(FAMILIES)):
        labels += [lb for lb in FAMILIES[fam] if lb not in labels]
    if args.quick:
        args.seeds, args.epochs = 1, 3
    batches = args.batch or ([32, 512] if args.quick else [32, 128, 512, 1024])
    factors = args.lr_factor or ([0.5, 2.0] if args.quick else [0.25, 0.5, 1.0, 2.0, 4.0])
    torch.set_num_threads(1)
    logging.getLogger("vrgd_ds").setLevel(logging.ERROR)  # skipped steps of a diverging grid point
    data = load()
    if max(batches) > len(data["train"][0]):
        raise SystemExit(f"--batch {max(batches)}: the training split has only {len(data['train'][0])} samples")
    out = Output(args.out or (Path("runs/studies/collapse") if args.quick else DOCS / "collapse"), "collapse",
                 {"optimizers": labels, "batches": batches, "seeds": args.seeds, "lr_factors": factors,
                  "epochs": args.epochs, "groups": args.groups, "weight_decay": args.weight_decay,
                  "base_lr_at_32": {lb: OPTIMIZERS[lb][0] for lb in labels}, "quick": args.quick})
    print(f"digits: {len(data['train'][0])} train / {len(data['val'][0])} val / {len(data['test'][0])} test, "
          f"{args.epochs} epochs, {args.groups} groups per step, {args.seeds} seeds, LR grid x{factors}", flush=True)
    grid: dict[tuple[str, int, float], list[dict[str, float]]] = {}
    lrs: dict[tuple[str, int, float], float] = {}
    t0 = time.perf_counter()
    for batch in batches:
        for label in labels:
            base = OPTIMIZERS[label][0] * math.sqrt(batch / 32)
            for f in factors:
                lrs[label, batch, f] = base * f
                runs = grid[label, batch, f] = [train(label, batch, base * f, seed, data, args)
                                                for seed in range(args.seeds)]
                out.log_run({"optimizer": label, "batch": batch, "lr": base * f, "factor": f, "runs": runs})
            print(f"  batch {batch:5d} {label:24s} [{time.perf_counter() - t0:.0f} s]", flush=True)
    summarise(out, grid, lrs, labels, batches, factors, args.seeds, args.epochs, args.groups)
    out.finish()


def rebuild(directory: Path) -> None:
    """``--tables-from``: the record's tables and plot from its runs, its meta.json kept but for
    a line saying when and by which commit they were written again."""
    meta = json.loads((directory / "meta.json").read_text())
    cfg = meta["config"]
    grid, lrs = {}, {}
    for line in (directory / "runs.jsonl").read_text().splitlines():
        rec = json.loads(line)
        grid[rec["optimizer"], rec["batch"], rec["factor"]] = rec["runs"]
        lrs[rec["optimizer"], rec["batch"], rec["factor"]] = rec["lr"]  # the LR it ran at, not today's base LR
    missing = [k for k in ((lb, b, f) for lb in cfg["optimizers"] for b in cfg["batches"] for f in cfg["lr_factors"])
               if k not in grid]
    if missing:
        raise SystemExit(f"{directory}/runs.jsonl lacks {len(missing)} grid point(s) of its meta.json, e.g. {missing[0]}")
    out = Output(directory, "collapse", cfg, resume=True)
    rewritten = {"command": out.meta["command"], "commit": out.meta["machine"]["commit"], "date": out.meta["started"]}
    out.meta = {**meta, "tables_rewritten": rewritten}
    summarise(out, grid, lrs, cfg["optimizers"], cfg["batches"], cfg["lr_factors"], cfg["seeds"], cfg["epochs"],
              cfg["groups"])
    out.finish(wall_s=meta["wall_s"])


def summarise(out: Output, grid: dict[tuple[str, int, float], list[dict[str, float]]],
              lrs: dict[tuple[str, int, float], float], labels: list[str], batches: list[int], factors: list[float],
              seeds: int, epochs: int, groups: int) -> None:
    """The table (the factor of best mean validation accuracy per cell, its test accuracy and gap)
    and the plot, into ``out``. ``lrs``: the LR each grid point ran at (as its runs.jsonl row
    records it), so a record's tables do not depend on the optimizers this code defines now."""
    rows, best_test = [], {}
    for batch in batches:
        for label in labels:
            f = max(factors, key=lambda f: (mean(r["val"] for r in grid[label, batch, f]), -factors.index(f)))
            runs = grid[label, batch, f]  # the first of equal scores, as the grid ran
            te, gap = [r["test"] for r in runs], [r["gap"] for r in runs]
            best_test[label, batch] = te
            edge = ", grid edge" if len(factors) > 1 and f in (min(factors), max(factors)) else ""  # not bracketed
            rows.append((batch, runs[0]["steps"], label, f"{lrs[label, batch, f]:.3g} (×{f:g}{edge})", spread(te),
                         spread(gap, "{:+.4f}")))
    out.add_table(f"Digits, test accuracy and generalisation gap at the best LR per cell ({seeds} seeds, "
                  f"mean (min–max); {epochs} epochs, {groups} groups per step)",
                  table(["batch", "steps", "optimizer", "best LR (factor)", "test accuracy", "train − test"], rows))
    pyplot = plt()
    panels = {fam: [lb for lb in members if lb in labels] for fam, members in FAMILIES.items()}
    panels["other"] = [lb for lb in labels if not any(lb in members for members in FAMILIES.values())]
    panels = {fam: members for fam, members in panels.items() if members}  # a record's label the code lost: "other"
    fig, axes = pyplot.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (fam, members) in zip(axes[0], panels.items()):
        for lb in members:
            accs = [best_test[lb, b] for b in batches]
            ax.errorbar(batches, [mean(a) for a in accs], yerr=[[mean(a) - min(a) for a in accs],
                                                                [max(a) - mean(a) for a in accs]],
                        marker="o", capsize=3, label=lb)
        ax.set(xscale="log", xlabel="batch", ylabel="test accuracy (best LR)", title=fam)
        ax.legend(fontsize=7)
    out.savefig(fig, "collapse.png")


if __name__ == "__main__":
    main()
