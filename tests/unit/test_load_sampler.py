"""``benchmarks/load_sampler.py``: the GPU suite's view of what bounds the study's runs (the GPU,
the host's cores), sampled beside them."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from load_sampler import busy_share, cpu_times, gpu_sample, summary  # noqa: E402


def test_busy_share_counts_idle_and_iowait_as_not_busy():
    """Two ``/proc/stat`` readings: user 100, system 50 busy of 1,000 jiffies, then 150 more busy
    of 800 more (idle 600 and iowait 50 of them); guest time (fields 9-10) is inside user already."""
    first = cpu_times("cpu  100 0 50 800 50 0 0 0 7 0\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    second = cpu_times("cpu  200 0 100 1400 100 0 0 0 9 0\n")
    assert first == (150, 1000) and second == (300, 1800)
    assert busy_share(first, second) == 150 / 800
    assert busy_share(second, second) is None


def test_summary_gives_median_and_deciles_and_says_when_no_gpu_was_sampled():
    rows = [{"cpu_busy": c / 100, "gpu_util": g, "gpu_mem_mib": 2048.0} for c, g in zip(range(10, 101, 10),
                                                                                       range(0, 91, 10))]
    assert summary(rows, 16) == ("load over 10 samples: GPU busy 45% (9%–81%), memory 2.0 (2.0–2.0) GiB; "
                                 "host CPU busy 55% (19%–91%) of 16 cores")
    cpu_only = [dict(r, gpu_util=None, gpu_mem_mib=None) for r in rows[:1]]
    assert summary(cpu_only, 2) == ("load over 1 samples: GPU utilisation not sampled (no nvidia-smi, no GPU, or "
                                    "no number for it); host CPU busy 10% of 2 cores")


def test_the_sampler_writes_a_row_per_interval_and_a_summary(tmp_path):
    out = tmp_path / "load.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_sampler.py"), "--out", str(out),
                           "--interval", "0.3", "--seconds", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    lines = out.read_text().splitlines()
    assert lines[0] == "seconds,cpu_busy,gpu_util,gpu_mem_mib" and 3 <= len(lines) - 1 <= 5
    assert all(0.0 <= float(line.split(",")[1]) <= 1.0 for line in lines[1:])
    has_gpu = (gpu_sample() or (None,))[0] is not None
    assert ("GPU busy" in proc.stdout) == has_gpu and f"load over {len(lines) - 1} samples" in proc.stdout


def test_a_gpu_field_that_is_no_number_is_left_empty_not_a_crash(tmp_path, monkeypatch):
    """``nvidia-smi`` prints "[N/A]" or "[Not Supported]" for a field it cannot read (utilisation
    under MIG, say): the sampler stopped there with a ValueError, before any row or its summary."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho '[N/A], 1024'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert gpu_sample() == (None, 1024.0)
    out = tmp_path / "load.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "load_sampler.py"), "--out", str(out),
                           "--interval", "0.2", "--seconds", "0.5"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text().splitlines()[1].endswith(",,1024.000")
    assert "GPU utilisation not sampled (no nvidia-smi, no GPU, or no number for it), memory 1.0" in proc.stdout
