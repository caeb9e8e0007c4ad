"""Throughput of the pretraining job on 2 CPU ranks and the share of step time spent waiting
for data.

Runs the real job (``deepspeed --num_gpus 2 --module vrgd_ds.train``, ZeRO-2, fp32, VR-LAMB,
BERT "tiny") on WikiText-2 from ``../shared/data/wikitext-2`` (or the embedded corpus with
``--embedded``), once per DataLoader setting (``job.data.workers`` 0 and 1), one after the
other in this invocation, and reads the per-step ``train/tokens_per_s``,
``train/step_time_s`` and ``train/data_time_s`` (time in ``next(loader)``) from each run's
``metrics.jsonl``. Reported: medians over the steps after the first (which builds the fused
kernels and warms the allocator), per phase. Target: data loading < 5% of step time.

    python benchmarks/pretrain_pipeline.py [--steps 40] [--embedded]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "wikitext-2"


def config(steps: int, inputs: list[str], workers: int, data_dir: str) -> dict:
    return {
        "optimizer": {"type": "VRLamb", "params": {"weight_decay": 0.01, "gamma": 0.1, "beta3": 0.9}},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "job": {
            "model": {"size": "tiny"},
            "data": {"path": data_dir, "prepare": True, "inputs": inputs, "format": "wikitext" if inputs else "auto",
                     "vocab_size": 8000, "eval_samples": 32, "workers": workers},
            "total_steps": steps,
            "phases": [
                {"seq_len": 128, "fraction": 0.9, "global_batch": 64, "micro_batch": 16, "lr": 2e-3,
                 "warmup_fraction": 0.1},
                {"seq_len": 512, "fraction": 0.1, "global_batch": 32, "micro_batch": 8, "lr": 1e-3},
            ],
            "telemetry": {"tensorboard": False},
        },
    }


def run(tmp: Path, name: str, cfg: dict, port: int, ranks: int = 2, env: dict | None = None) -> list[dict]:
    """The job's per-step metrics records, run with ``cfg`` on ``ranks`` CPU ranks (``env``: the
    launcher's environment, which its ranks inherit)."""
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    run_dir = tmp / name
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", str(ranks), "--master_port", str(port), "--module", "vrgd_ds.train",
           "--config", str(path), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        sys.exit(f"{name}: the job failed\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if "train/step_time_s" in r]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--embedded", action="store_true", help="the embedded corpus instead of WikiText-2")
    args = ap.parse_args()
    inputs = []
    if not args.embedded:
        files = sorted(SHARED.glob("*.txt"))
        if not files:
            sys.exit(f"{SHARED} not found: run with --embedded, or place the shared data beside the repository")
        inputs = [str(f) for f in files]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        results = {}
        for i, workers in enumerate((0, 1)):
            results[workers] = run(tmp, f"workers{workers}", config(args.steps, inputs, workers, str(tmp / "data")),
                                   29650 + i)
    corpus = "embedded corpus" if args.embedded else "WikiText-2 (" + ", ".join(Path(f).name for f in inputs) + ")"
    print(f"\n2 CPU ranks (gloo), ZeRO-2 fp32, VR-LAMB, BERT tiny, {corpus}, {args.steps} steps "
          "(phase 1: seq 128, global batch 64; phase 2: seq 512, global batch 32); medians after each phase's first step")
    print(f"{'loader workers':>14s} {'phase':>5s} {'steps':>5s} {'tokens/s':>9s} {'step s':>7s} {'data s':>7s} "
          f"{'data / step':>11s}")
    for workers, recs in results.items():
        for phase in sorted({r["phase"] for r in recs}):
            rs = [r for r in recs if r["phase"] == phase]
            rs = [r for r in rs if r["step"] > rs[0]["step"]]  # each phase's first step builds for its shapes
            if not rs:
                print(f"{workers:>14d} {phase:>5d} {0:>5d}  (one step only: more --steps)")
                continue
            tok = statistics.median(r["train/tokens_per_s"] for r in rs)
            st = statistics.median(r["train/step_time_s"] for r in rs)
            dt = statistics.median(r["train/data_time_s"] for r in rs)
            frac = statistics.median(r["train/data_time_s"] / r["train/step_time_s"] for r in rs)
            print(f"{workers:>14d} {phase:>5d} {len(rs):>5d} {tok:>9,.0f} {st:>7.3f} {dt:>7.4f} {frac:>10.2%}")


if __name__ == "__main__":
    main()
