"""What bounds the runs beside it: every ``--interval`` seconds, the GPU's utilisation and memory
(``nvidia-smi``) and the share of all the host's cores that is busy (``/proc/stat``), one CSV row
each, until it is stopped (SIGTERM or SIGINT) or ``--seconds`` pass; then one summary line: the
median and the 10th-90th percentiles of each. Beside the study's runs (``benchmarks/gpu_suite.sh``)
it says, with each run's ``data_wait``, whether the GPU, the host processes or the data limit them:
a GPU near 100% bounds them; an idle GPU beside busy cores points at the host.

    python3 benchmarks/load_sampler.py --out LOAD.csv [--interval 5] [--seconds S]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path
from statistics import quantiles

GPU_QUERY = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]


def cpu_times(stat: str) -> tuple[int, int]:
    """(busy, total) jiffies of all cores from ``/proc/stat``'s first line: idle and iowait are
    not busy; guest time is already in user and nice, so only the first 8 fields count."""
    fields = [int(x) for x in stat.splitlines()[0].split()[1:9]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float | None:
    """The share of all cores busy between two ``cpu_times``; None when no time passed."""
    total = after[1] - before[1]
    return None if total <= 0 else (after[0] - before[0]) / total


def number(field: str) -> float | None:
    """A field of ``nvidia-smi``'s CSV, None where it prints no number ("[N/A]", "[Not Supported]")."""
    try:
        return float(field)
    except ValueError:
        return None


def gpu_sample() -> tuple[float | None, float | None] | None:
    """(utilisation %, memory used MiB) of the first GPU, each None where ``nvidia-smi`` gives no
    number for it; None without ``nvidia-smi`` or a GPU."""
    try:
        out = subprocess.run(GPU_QUERY, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[:1]
    fields = first[0].split(",") if first else []
    if len(fields) != 2:
        return None
    return number(fields[0]), number(fields[1])


def deciles(values: list[float], fmt: str) -> str:
    """Median (10th-90th percentile) of ``values``, or '–' for none."""
    if not values:
        return "–"
    if len(values) == 1:
        return fmt.format(values[0])
    q = quantiles(values, n=10, method="inclusive")
    return f"{fmt.format(q[4])} ({fmt.format(q[0])}–{fmt.format(q[8])})"


def summary(rows: list[dict], cores: int) -> str:
    cpu = [100 * r["cpu_busy"] for r in rows if r["cpu_busy"] is not None]
    util = [r["gpu_util"] for r in rows if r["gpu_util"] is not None]
    mem = [r["gpu_mem_mib"] / 1024 for r in rows if r["gpu_mem_mib"] is not None]
    gpu = (f"GPU busy {deciles(util, '{:.0f}%')}" if util
           else "GPU utilisation not sampled (no nvidia-smi, no GPU, or no number for it)")
    gpu += f", memory {deciles(mem, '{:.1f}')} GiB" if mem else ""
    return f"load over {len(rows)} samples: {gpu}; host CPU busy {deciles(cpu, '{:.0f}%')} of {cores} cores"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="the CSV of samples")
    ap.add_argument("--interval", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=None, help="stop after this long (default: when stopped)")
    args = ap.parse_args()
    stopped = False

    def stop(*_):
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    rows: list[dict] = []
    start = time.monotonic()
    before = cpu_times(Path("/proc/stat").read_text())
    with args.out.open("w") as f:
        f.write("seconds,cpu_busy,gpu_util,gpu_mem_mib\n")
        while not stopped and (args.seconds is None or time.monotonic() - start < args.seconds):
            end = time.monotonic() + args.interval
            while not stopped and time.monotonic() < end:
                time.sleep(min(0.2, max(0.0, end - time.monotonic())))
            after = cpu_times(Path("/proc/stat").read_text())
            gpu = gpu_sample()
            row = {"seconds": time.monotonic() - start, "cpu_busy": busy_share(before, after),
                   "gpu_util": None if gpu is None else gpu[0], "gpu_mem_mib": None if gpu is None else gpu[1]}
            before = after
            rows.append(row)
            f.write(",".join("" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
                             for v in row.values()) + "\n")
            f.flush()
    print(summary(rows, os.cpu_count() or 1), flush=True)


if __name__ == "__main__":
    main()
