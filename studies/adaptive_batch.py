"""Fixed vs adaptive global batch in the real pretraining job, LAMB and VR-LAMB, at one sample
budget: held-out MLM loss, optimizer steps taken, the batch trajectory, and what the
controller costs per step.

Four runs per corpus and seed, on the runs of ``studies/bert_batch.py`` (tiny BERT, ZeRO-2
fp32, ``--ranks`` CPU ranks, one phase at seq 64, micro-batch 8): LAMB and VR-LAMB at a fixed
batch, and both with ``job.phases[0].adaptive_batch`` starting from that batch. "Adaptive
LAMB" is VR-LAMB with ``gamma = 1`` (LAMB's step bit for bit; the statistics the controller
reads are still gathered). The peak LR is the same for all four at the first batch; the
adaptive runs scale it with ``lr_rule`` as the batch moves.

    python studies/adaptive_batch.py --corpus embedded --corpus wikitext=WIKITEXT2_DIR
    python studies/adaptive_batch.py --quick       # 4 short runs on the embedded corpus

Runs a committed record holds (``--reuse docs/studies/adaptive_batch``, checked to have the same
settings) are read back, not run again: a second seed is ``--seed 1 --seed 2 --reuse ...``.
"""
from __future__ import annotations

import argparse
import itertools
import platform
from pathlib import Path
from statistics import mean, median

from bert_batch import (carried_runs, data_fingerprint, end_on_sigterm, finish, keep_carried, load_reused, prepare,
                        carried_recipe, recipe, run_key, run_one, set_aside_other_data, steps)
from common import DOCS, Output, plt, table

VR = {"gamma": 0.1, "beta3": 0.9, "gsnr_placement": "first_moment"}
RUNS = {  # label -> (optimizer params, adaptive?)
    "LAMB fixed": ({"gsnr": False}, False),
    "VR-LAMB fixed": (VR, False),
    "LAMB adaptive": ({"gamma": 1.0}, True),
    "VR-LAMB adaptive": (VR, True),
}
#: the controller's smoothing of the noise scale's moments in every adaptive run (in the recipe)
SMOOTHING = 0.9
#: the settings that make two runs with the same label, corpus and seed the same run (``--reuse`` checks them)
SETTINGS = ("batch", "lr", "samples", "target_ratio", "min_batch", "max_batch", "every", "lr_rule", "seq_len",
            "micro_batch", "ranks", "vocab_size", "quick")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="embedded corpus, 512 samples, 1 seed, a 2,000-piece "
                    "vocabulary")
    ap.add_argument("--corpus", action="append", default=None, metavar="NAME[=PATH]")
    ap.add_argument("--seed", type=int, action="append", default=None, help="repeatable (default 1)")
    ap.add_argument("--batch", type=int, default=64, help="the fixed batch and the adaptive runs' first batch")
    ap.add_argument("--lr", type=float, default=4e-3, help="peak LR at --batch")
    ap.add_argument("--samples", type=int, default=10240)
    ap.add_argument("--target-ratio", type=float, default=2.0, help="B / B_simple (2: half-batch similarity 1/2)")
    ap.add_argument("--min-batch", type=int, default=16)
    ap.add_argument("--max-batch", type=int, default=1024)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--lr-rule", choices=("linear", "sqrt", "none"), default="sqrt")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--port", type=int, default=None,
                    help="master port of the runs; default: one the OS has free at each run's start")
    ap.add_argument("--work", type=Path, default=Path("runs/studies/adaptive_batch"))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--reuse", type=Path, action="append", default=[], metavar="DIR",
                    help="a committed record of this study whose runs are read, not run again (same settings, "
                         "checked); repeatable")
    args = ap.parse_args()
    end_on_sigterm()
    if args.quick:
        args.corpus, args.seed, args.samples, args.every = ["embedded"], [1], 512, 2
        args.vocab_size = min(args.vocab_size, 2000)  # a smoke run: the tokenizer trains in a few seconds
        args.work = args.work / "quick"
    specs = args.corpus or ["embedded"]
    seeds = args.seed or [1]
    config = {k: v for k, v in vars(args).items() if k not in ("work", "out", "port", "reuse")} | {
        "corpora": specs, "recipe": recipe({label: params for label, (params, _) in RUNS.items()},
                                           {"adaptive_batch": {"smoothing": SMOOTHING}})}
    args.reused, sources, shorter = load_reused(args.reuse, config, SETTINGS)  # before Output: --out may be one
    out_dir = args.out or (args.work if args.quick else DOCS / "adaptive_batch")
    carried = carried_runs(args.reuse, out_dir)
    config["recipe"] = carried_recipe(config["recipe"], carried, out_dir)
    out = Output(out_dir, "adaptive_batch", config)
    if sources:
        out.meta["reused"] = sources
    if shorter:
        out.meta["not_reused_other_steps"] = len(shorter)
        print(f"--reuse: {len(shorter)} recorded run(s) took another number of steps (another --samples or "
              "--batch); they stay in their records, unused here", flush=True)
    args.failed = []  # the runs that failed (bert_batch.Runner): the others go on, the study exits 1 at the end
    # bert_batch.run_one's knobs: the LR is base_lr at base_batch (factor 1, no rule: one batch)
    args.base_lr, args.base_batch, args.lr_rule_fixed = args.lr, args.batch, "linear"
    results = []
    for spec in specs:
        name, _, path = spec.partition("=")
        data = prepare(name, path or None, args.work, args.seq_len, args.vocab_size)
        other = set_aside_other_data(args.reused, name, lambda seed: data_fingerprint(data, seed),
                                     platform.python_version())
        if other:
            out.meta["not_reused_other_data"] = out.meta.get("not_reused_other_data", 0) + len(other)
            print(f"--reuse: {len(other)} recorded run(s) of corpus {name!r} read other data than this study's (another "
                  "tokenizer, shards or seed; for the embedded corpus, another Python release); they stay in their "
                  "records and run again here", flush=True)
        for seed in seeds:
            for label, (params, adaptive) in RUNS.items():
                extra = {"adaptive_batch": {"target_ratio": args.target_ratio, "min_batch": args.min_batch,
                                            "max_batch": args.max_batch, "every": args.every, "smoothing": SMOOTHING,
                                            "lr_rule": args.lr_rule}} if adaptive else None
                r = run_one(label, name, data, args.batch, 1.0, seed, study_args(args),
                            params=params, phase_extra=extra)
                if r is None:  # failed: named with its log's end, in meta.json too
                    continue
                if "reused_from" not in r:  # a reused record holds its trajectory already
                    r.update(trajectory(args.work / r["run_dir"]))  # recorded under --work
                out.log_run(r)
                results.append(r)
    rows = []
    for r in results:
        batches = chosen(r["batches"])
        rows.append((r["corpus"], r["seed"], r["optimizer"], f"{r['mlm_loss']:.4f}", f"{r['mlm_acc']:.4f}",
                     r["optimizer_steps"], f"{batches[0]:.0f} / {min(batches):.0f}–{max(batches):.0f} / {median(batches):.0f}",
                     changes(r["batches"]), "–" if r["b_simple"] is None else f"{r['b_simple']:.0f}",
                     "–" if r["controller_ms"] is None else f"{r['controller_ms']:.2f} ms ({r['controller_share']:.2%})"))
    out.add_table(f"Fixed vs adaptive batch at {args.samples} samples per run (first batch {args.batch}, peak LR "
                  f"{args.lr:g}; adaptive: B → {args.target_ratio:g} × B_simple in [{args.min_batch}, {args.max_batch}],"
                  f" every {args.every} steps, LR {args.lr_rule})",
                  table(["corpus", "seed", "run", "MLM loss", "MLM accuracy", "optimizer steps", "batch: first / range / median",
                         "changes", "B_simple (2nd half)", "controller per step"], rows)
                  + "\nBatch range, median and changes are the controller's: a last step smaller than the one "
                    "before takes what is left of the sample budget and is left out of them.\n")
    pyplot = plt()
    fig, axes = pyplot.subplots(1, len(specs), figsize=(5 * len(specs), 3.6), squeeze=False)
    for ax, spec in zip(axes[0], specs):
        name = spec.partition("=")[0]
        for r in results:
            if r["corpus"] == name and r["seed"] == seeds[0]:
                ax.step(r["samples_at"], r["batches"], where="post", label=r["optimizer"])
        ax.set(xlabel="samples", ylabel="global batch", yscale="log", title=f"{name} (seed {seeds[0]})")
        ax.legend(fontsize=7)
    out.savefig(fig, "batch_trajectory.png")
    keep_carried(out, carried, {(run_key(r), r["steps"]) for r in results})
    finish(out, results, args)


def study_args(args: argparse.Namespace) -> argparse.Namespace:
    ns = argparse.Namespace(**vars(args))  # its failed list is args's own
    ns.lr_rule = "linear"  # bert_batch's LR rule: base_lr at base_batch = the batch here, factor 1
    return ns


def chosen(batches: list[float]) -> list[float]:
    """The batches the controller chose: a last step smaller than the one before takes the budget's remainder
    (the job's loop cuts it to what is left), not a size the controller picked."""
    return batches[:-1] if len(batches) > 1 and batches[-1] < batches[-2] else batches


def changes(batches: list[float]) -> int:
    """How many times the controller changed the batch."""
    return sum(1 for a, b in itertools.pairwise(chosen(batches)) if a != b)


def trajectory(run_dir: Path) -> dict:
    """Per-step global batch, the samples before each step, the controller's time share."""
    batches, at, ctrl, step_s, done = [], [], [], [], 0
    for rec in steps(Path(run_dir)):
        if "train/global_batch" not in rec:
            continue
        batches.append(rec["train/global_batch"])
        at.append(done)
        done += rec["train/global_batch"]
        step_s.append(rec["train/step_time_s"])
        if "adaptive/controller_s" in rec:
            ctrl.append(rec["adaptive/controller_s"])
    return {"batches": batches, "samples_at": at, "optimizer_steps": len(batches),
            "controller_ms": 1e3 * mean(ctrl) if ctrl else None,
            "controller_share": sum(ctrl) / sum(step_s) if ctrl else None}


if __name__ == "__main__":
    main()
