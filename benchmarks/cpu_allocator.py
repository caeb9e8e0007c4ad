"""Step time of the pretraining job on one CPU rank under each memory allocator, side by side.

A study run on CPUs (``studies/bert_batch.py``: one rank, ``--groups 8``) at a batch of
thousands has micro-batches of hundreds of samples, whose activations (tens to hundreds of MB
each) glibc's ``malloc`` takes from fresh ``mmap``s and returns at every free: each step then
faults in and zeroes gigabytes of pages again (a 16× run at batch 12,736 took about 300,000 minor
faults a second, a third of its CPU time in the kernel). This runs the real job (``deepspeed
--num_gpus 1 --module vrgd_ds.train``, ZeRO-2 fp32, BERT "tiny", the embedded corpus, seq 64,
8 micro-steps a step) under each variant in turn, for ``--rounds`` rounds, and prints per
variant the median step time after the first step, the ratio to glibc's defaults, the rank's
minor page faults per step after the first (start-up and data preparation left out), its peak
resident memory, and whether its per-step losses equal the defaults' bit for bit
(an allocator changes where tensors live, never what is computed).

Variants: glibc's defaults; glibc with ``GLIBC_TUNABLES`` mmap and trim thresholds of 16 GiB
(freed blocks stay in glibc's heap); tcmalloc (``LD_PRELOAD``: ``cpu_allocator`` in
``studies/bert_batch.py``, what the study gives its runs) where ``libtcmalloc_minimal`` is
installed (Debian: ``libtcmalloc-minimal4``).

    python benchmarks/cpu_allocator.py [--batch 3184] [--steps 4] [--rounds 2] [--optimizer Lamb]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from pretrain_pipeline import run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))
from bert_batch import cpu_allocator  # noqa: E402

#: glibc's malloc keeps freed blocks of any size in its heap instead of unmapping them
GLIBC_KEEP = "glibc.malloc.mmap_threshold=17179869184:glibc.malloc.trim_threshold=17179869184"


def variants() -> dict[str, dict[str, str]]:
    """Name -> the environment variables the variant sets."""
    out = {"glibc defaults": {}, "glibc, 16 GiB thresholds": {"GLIBC_TUNABLES": GLIBC_KEEP}}
    if cpu_allocator():
        out["tcmalloc"] = cpu_allocator()
    return out


class RankSampler:
    """Samples /proc every 0.2 s while in the ``with`` block (Linux only): ``peak``, the largest
    resident set (bytes) of any process whose command line names ``marker``; ``faults``, the
    (time, minor faults) of the job's rank, its process with ``--local_rank`` whose parent is not
    one (its DataLoader workers are forks of it)."""

    def __init__(self, marker: str) -> None:
        self.marker, self.peak, self._done = marker.encode(), 0, threading.Event()
        self.faults: list[tuple[float, int]] = []

    def _sample(self) -> None:
        while not self._done.wait(0.2):
            ranks = {}  # pid -> (parent, minor faults)
            for entry in Path("/proc").iterdir():
                try:
                    if not entry.name.isdigit():
                        continue
                    cmdline = (entry / "cmdline").read_bytes()
                    if self.marker not in cmdline:
                        continue
                    rss = next(int(line.split()[1]) for line in (entry / "status").read_text().splitlines()
                               if line.startswith("VmRSS:"))
                    self.peak = max(self.peak, rss * 1024)
                    if b"--local_rank" in cmdline:
                        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                        ranks[int(entry.name)] = (int(fields[1]), int(fields[7]))  # ppid, minflt
                except (OSError, StopIteration):
                    continue
            rank = [faults for parent, faults in ranks.values() if parent not in ranks]
            if len(rank) == 1:
                self.faults.append((time.time(), rank[0]))

    def faults_per_step(self, records: list[dict]) -> float:
        """The rank's minor faults per step from the end of step 1 to the end of the last (the
        records' times), so that start-up, data preparation and the first step are left out."""
        def at(t: float) -> int:
            return max((f for when, f in self.faults if when <= t), default=0)

        first, last = records[0], records[-1]
        return (at(last["time"]) - at(first["time"])) / max(last["step"] - first["step"], 1)

    def __enter__(self) -> RankSampler:
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def config(batch: int, groups: int, steps: int, optimizer: str, data_dir: str) -> dict:
    params = {"lr": 1e-3, "weight_decay": 0.01}
    if optimizer == "VRLamb":
        params |= {"gamma": 0.1, "beta3": 0.9}
    return {
        "optimizer": {"type": optimizer, "params": params},
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 1.0,
        "job": {
            "model": {"size": "tiny"},
            "data": {"path": data_dir, "prepare": True, "vocab_size": 8000, "eval_samples": 32, "workers": 1},
            "total_steps": steps, "eval_every": 0, "checkpoint_every": 0,
            "phases": [{"seq_len": 64, "fraction": 1.0, "global_batch": batch, "micro_batch": batch // groups,
                        "lr": 1e-3, "warmup_fraction": 0.1}],
            "telemetry": {"tensorboard": False},
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=3184, help="global batch (4x the noise scale of the study)")
    ap.add_argument("--groups", type=int, default=8, help="micro-steps a step (the study's --groups)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--optimizer", choices=("Lamb", "VRLamb"), default="Lamb")
    args = ap.parse_args()
    if args.batch % args.groups:
        sys.exit(f"--batch {args.batch} is not a multiple of --groups {args.groups}")
    names = variants()
    step_s: dict[str, list[float]] = {n: [] for n in names}
    faults: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[list[float]]] = {n: [] for n in names}
    peak: dict[str, list[int]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cfg = config(args.batch, args.groups, args.steps, args.optimizer, str(tmp / "data"))
        for r in range(args.rounds):
            for i, (name, extra) in enumerate(names.items()):
                env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")} | extra
                with RankSampler(str(tmp / f"r{r}v{i}")) as sampler:
                    recs = run(tmp, f"r{r}v{i}", cfg, 29640 + i, ranks=1, env=env)
                peak[name].append(sampler.peak)
                faults[name].append(sampler.faults_per_step(recs))
                step_s[name] += [x["train/step_time_s"] for x in recs if x["step"] > 1]
                losses[name].append([x["train/loss"] for x in recs])
    base = statistics.median(step_s["glibc defaults"])
    reference = losses["glibc defaults"][0]
    print(f"\n1 CPU rank ({os.cpu_count()} cores), ZeRO-2 fp32, {args.optimizer}, BERT tiny, embedded corpus, seq 64, "
          f"batch {args.batch} in {args.groups} micro-steps of {args.batch // args.groups}, {args.steps} steps x "
          f"{args.rounds} rounds, variants in turn; step time: median after step 1")
    print(f"{'allocator':<26s} {'step s':>7s} {'speed-up':>8s} {'faults/step':>12s} {'peak RSS':>9s} {'losses':>10s}")
    for name in names:
        same = all(run_losses == reference for run_losses in losses[name])
        print(f"{name:<26s} {statistics.median(step_s[name]):>7.2f} {base / statistics.median(step_s[name]):>7.2f}x "
              f"{statistics.median(faults[name]):>12,.0f} {max(peak[name]) / 2**30:>7.2f} G "
              f"{'identical' if same else 'DIFFER':>10s}")


if __name__ == "__main__":
    main()
