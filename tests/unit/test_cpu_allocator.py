"""``benchmarks/cpu_allocator.py``: what its faults-per-step column counts."""
from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from cpu_allocator import RankSampler  # noqa: E402


def test_faults_per_step_leave_out_the_start_up_and_the_first_step():
    """The rank's faults sampled over a run: 360,000 in its start-up (imports, data preparation,
    the first step), then 17,000 a step: the column reads 17,000. Fails on the old benchmark,
    which divided every fault of the run (the launcher's and the rank's, from its start) by the
    steps."""
    sampler = RankSampler("run")
    sampler.faults = [(0.0, 0), (5.0, 200_000), (10.0, 360_000), (12.0, 370_000), (15.0, 377_000),
                      (18.0, 386_000), (20.0, 394_000), (21.0, 394_000)]
    records = [{"step": 1, "time": 10.1}, {"step": 2, "time": 15.2}, {"step": 3, "time": 20.5}]
    assert sampler.faults_per_step(records) == (394_000 - 360_000) / 2
