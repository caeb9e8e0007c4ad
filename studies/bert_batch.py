"""LAMB vs VR-LAMB (each GSNR placement) in the real pretraining job as the global batch
grows at a fixed sample budget: held-out MLM loss and accuracy.

Every run is ``vrgd-pretrain`` on ``--ranks`` CPU ranks (``deepspeed --num_gpus R``), ZeRO-2
fp32, a tiny BERT, one phase at ``--seq-len``, ``--samples`` training samples in all, so a larger
batch takes proportionally fewer steps. The batch grows through accumulation (micro-batch
fixed), so the GSNR groups grow with it: n = ranks × accumulation. The peak LR follows
``--lr-rule`` from ``--base-lr`` at ``--base-batch`` (linear or square-root scaling), with
10% linear warmup and the job's polynomial decay.

Each corpus is prepared once (``vrgd-data prepare``) under ``--out``; runs that finished
before are read back, not repeated, so the command can be stopped and started again.

    python studies/bert_batch.py --corpus embedded --corpus wikitext=../shared/data/wikitext-2 \\
        --batch 64 --batch 1024 --seed 1 --seed 2

prints a Markdown table (mean over seeds, with the spread min-max) and writes every run's
figures to ``<out>/results.jsonl``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean

from vrgd_ds.optim.adam import GSNR_PLACEMENTS

#: optimizer label -> the job's ``optimizer.params`` besides lr
OPTIMIZERS: dict[str, dict] = {
    "LAMB": {"gsnr": False},
    **{f"VR-LAMB {pl}": {"gamma": 0.1, "beta3": 0.9, "gsnr_placement": pl} for pl in GSNR_PLACEMENTS},
}
def base_config(seq_len: int, micro_batch: int, ranks: int, workers: int) -> dict:
    return {
        "optimizer": {"type": "VRLamb", "params": {"weight_decay": 0.01, "betas": [0.9, 0.999], "eps": 1e-6}},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "job": {
            "model": {"size": "tiny"},
            "data": {"eval_samples": 512, "workers": workers},
            "total_steps": 1, "log_every": 1, "eval_every": 0, "checkpoint_every": 0, "keep_checkpoints": 1,
            "telemetry": {"tensorboard": False, "per_layer_group": False},
            "phases": [{"seq_len": seq_len, "fraction": 1.0, "global_batch": micro_batch * ranks,
                        "micro_batch": micro_batch, "lr": 1e-3, "warmup_fraction": 0.1}],
        },
    }


def prepare(name: str, source: str | None, out: Path, seq_len: int, vocab: int) -> Path:
    data = out / "data" / name  # vrgd-data prepare is idempotent: a second call checks and reuses
    cmd = [sys.executable, "-m", "data_pipeline", "prepare", str(data), "--vocab-size", str(vocab),
           "--seq-len", str(seq_len), "--seed", "1", "--no-progress"]
    if source:
        src = Path(source)
        files = sorted(src.glob("*.txt")) if src.is_dir() else [src]
        if not files:
            raise SystemExit(f"--corpus {name}={source}: no .txt files there")
        cmd += [str(f) for f in files] + ["--format", "wikitext" if "wikitext" in name else "auto"]
    print(f"[prepare] {name}: {' '.join(cmd[3:])}", flush=True)
    subprocess.run(cmd, check=True)
    return data


def lr_for(batch: int, args: argparse.Namespace) -> float:
    ratio = batch / args.base_batch
    return args.base_lr * (ratio if args.lr_rule == "linear" else math.sqrt(ratio))


def final_eval(run_dir: Path) -> dict | None:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        if "eval/mlm_loss" in rec:
            last = rec
    return last


def run_one(label: str, corpus: str, data: Path, batch: int, seed: int, args: argparse.Namespace) -> dict:
    run_dir = args.out / "runs" / corpus / f"b{batch}" / label.replace(" ", "_") / f"seed{seed}"
    steps = args.samples // batch
    done = run_dir / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    if run_dir.exists():  # an interrupted run: start it again from scratch
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cfg = base_config(args.seq_len, args.micro_batch, args.ranks, args.workers)
    lr = lr_for(batch, args)
    cfg["optimizer"]["params"].update(OPTIMIZERS[label])
    cfg["job"].update(seed=seed, total_steps=steps)
    cfg["job"]["data"]["path"] = str(data)
    cfg["job"]["phases"][0].update(global_batch=batch, lr=lr)
    (run_dir / "study_config.json").write_text(json.dumps(cfg, indent=2))
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(args.ranks), "--master_port",
           str(args.port), "--module", "vrgd_ds.train", "--config", str(run_dir / "study_config.json"),
           "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): see {run_dir / 'log.txt'}")
    ev = final_eval(run_dir)
    result = {"corpus": corpus, "batch": batch, "optimizer": label, "seed": seed, "steps": steps, "lr": lr,
              "groups": batch // args.micro_batch, "ranks": args.ranks, "samples": steps * batch,
              "mlm_loss": ev["eval/mlm_loss"], "mlm_acc": ev["eval/mlm_acc"],
              "wall_s": round(time.perf_counter() - t0, 1)}
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the figures are what the study keeps
    done.write_text(json.dumps(result))
    with open(args.out / "results.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")
    print(f"[{corpus} b{batch} {label} seed {seed}] loss {result['mlm_loss']:.4f} acc {result['mlm_acc']:.4f} "
          f"lr {lr:.3g} ({result['wall_s']:.0f} s)", flush=True)
    return result


def table(results: list[dict], labels: list[str]) -> str:
    rows = ["| corpus | batch | steps | n | LR | " + " | ".join(labels) + " |",
            "| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in labels) + " |"]
    keys = sorted({(r["corpus"], r["batch"]) for r in results}, key=lambda k: (k[0], k[1]))
    for corpus, batch in keys:
        cell = [r for r in results if r["corpus"] == corpus and r["batch"] == batch]
        first = cell[0]
        out = []
        for label in labels:
            rs = [r for r in cell if r["optimizer"] == label]
            if not rs:
                out.append("–")
                continue
            ls, acc = [r["mlm_loss"] for r in rs], [r["mlm_acc"] for r in rs]
            out.append(f"{mean(ls):.3f} ({min(ls):.3f}–{max(ls):.3f}) / {mean(acc):.3f}")
        rows.append(f"| {corpus} | {batch} | {first['steps']} | {first['groups']} | {first['lr']:.3g} | "
                    + " | ".join(out) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", action="append", default=None, metavar="NAME[=PATH]",
                    help="'embedded' (Python's documentation) or NAME=PATH of text files; repeatable")
    ap.add_argument("--batch", type=int, action="append", default=None, help="global batch; repeatable")
    ap.add_argument("--seed", type=int, action="append", default=None, help="repeatable")
    ap.add_argument("--optimizer", action="append", default=None, choices=list(OPTIMIZERS))
    ap.add_argument("--samples", type=int, default=20480, help="training samples per run (fixed budget)")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8, help="also the samples per GSNR group (ZeRO-2: "
                    "every micro-batch of every rank is one group)")
    ap.add_argument("--ranks", type=int, default=1, help="CPU ranks per run (the groups do not depend on it)")
    ap.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--base-lr", type=float, default=4e-3)
    ap.add_argument("--base-batch", type=int, default=64)
    ap.add_argument("--lr-rule", choices=("linear", "sqrt"), default="linear")
    ap.add_argument("--port", type=int, default=29671)
    ap.add_argument("--out", type=Path, default=Path("runs/studies/bert_batch"))
    args = ap.parse_args()
    corpora = args.corpus or ["embedded"]
    labels = args.optimizer or list(OPTIMIZERS)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in corpora:
        name, _, path = spec.partition("=")
        data = prepare(name, path or None, args.out, args.seq_len, args.vocab_size)
        for batch in args.batch or [64, 1024]:
            if batch % (args.ranks * args.micro_batch):
                raise SystemExit(f"--batch {batch}: not a multiple of ranks x micro-batch = "
                                 f"{args.ranks * args.micro_batch}")
            for seed in args.seed or [1, 2]:
                for label in labels:
                    results.append(run_one(label, name, data, batch, seed, args))
    print(f"\nheld-out MLM loss, mean over seeds (min–max) / accuracy; {args.samples} samples per run, "
          f"seq {args.seq_len}, LR {args.lr_rule} from {args.base_lr:g} at batch {args.base_batch}\n")
    print(table(results, labels))


if __name__ == "__main__":
    main()
