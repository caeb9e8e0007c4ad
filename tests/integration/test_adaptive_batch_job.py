"""The pretraining job with an adaptive global batch on 2 CPU ranks (gloo, ZeRO-2, VR-LAMB):
the batch changes between optimizer steps (only the accumulation), every sample of the
phase's stream is read exactly once, and a run killed (SIGKILL) in the middle of the
adaptation resumes on the uninterrupted run's trajectory — batches, losses and all."""
from __future__ import annotations

import json
import os
from pathlib import Path

import launching
import pytest
from jobs import command, kill_after_checkpoint, records, write_config

from vrgd_ds.data_pipeline.sampler import PretrainingSampler

pytestmark = pytest.mark.slow

CONFIG = {
    "optimizer": {"type": "VRLamb", "params": {"weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 200000},
    "gradient_clipping": 1.0,
    "job": {
        "model": {"size": "tiny"},
        "data": {"vocab_size": 2000, "eval_samples": 32},
        "total_steps": 16,
        "checkpoint_every": 2,
        "keep_checkpoints": 5,
        "phases": [
            # tiny BERT's noise scale is ~15-30 samples: a target of 8 x B_simple grows 16 -> 32 -> 64
            {"seq_len": 64, "fraction": 0.75, "global_batch": 16, "micro_batch": 4, "lr": 2e-3,
             "warmup_fraction": 0.0,
             "adaptive_batch": {"target_ratio": 8.0, "min_batch": 8, "max_batch": 64, "every": 2,
                                "smoothing": 0.5, "lr_rule": "sqrt", "measure_cosine_every": 1}},
            {"seq_len": 128, "fraction": 0.25, "global_batch": 16, "micro_batch": 4, "lr": 1e-3},
        ],
    },
}


def traces(trace: Path) -> dict[int, dict[int, list]]:
    """rank -> step -> keys read; a step traced twice (before a kill and after the resume)
    keeps its last record."""
    out: dict[int, dict[int, list]] = {}
    for rank in (0, 1):
        steps: dict[int, list] = {}
        for line in (trace / f"samples.rank{rank}.jsonl").read_text().splitlines():
            rec = json.loads(line)
            steps[rec["step"]] = [tuple(k) for k in rec["keys"]]
        out[rank] = steps
    return out


@pytest.fixture(scope="module")
def full(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adaptive")
    path = write_config(tmp, CONFIG, corpus)
    run, trace = tmp / "full", tmp / "trace_full"
    trace.mkdir()
    proc = launching.run(command(path, run), timeout=900, marker=run, env={**os.environ, "VRGD_TRACE_SAMPLES": str(trace)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp, path, run, trace


@pytest.mark.exhaustive
def test_batch_changes_between_steps_and_the_stream_is_read_exactly_once(full):
    tmp, _, run, trace = full
    rec = records(run)
    steps = sorted(s for s in rec if s > 0)
    batches = [rec[s]["train/global_batch"] for s in steps]
    phase = [rec[s]["phase"] for s in steps]
    first = [b for b, p in zip(batches, phase) if p == 0]
    assert sum(first) == 12 * 16  # the phase's samples, whatever the batches
    assert len({b for b in first}) >= 3, first  # changed at least twice
    assert first[:2] == [16, 16] and first[2] > 16
    assert all(rec[s]["train/accumulation"] == rec[s]["train/global_batch"] / 8 for s in steps)
    assert all(rec[s]["gsnr/n"] == rec[s]["train/accumulation"] * 2 for s in steps)
    assert [b for b, p in zip(batches, phase) if p == 1] == [16] * 4  # the fixed phase after it
    for s in steps:
        if phase[s - 1] == 0:
            for key in ("adaptive/b_simple", "adaptive/implied_similarity", "adaptive/measured_similarity"):
                assert 0 < rec[s][key] < float("inf"), (s, key)
    # every key the steps read, in order, is the phase's stream [0, samples): none lost or repeated
    seen = traces(trace)
    for index, total in ((0, 12 * 16), (1, 4 * 16)):
        got = sorted(k for r in (0, 1) for s, keys in seen[r].items() if phase[s - 1] == index for k in keys)
        want = []
        for r in (0, 1):
            sampler = PretrainingSampler(len_of(tmp, index), micro_batch_size=4, rank=r, world_size=2,
                                         seed=1234 + index, max_samples=total)
            want += [k for mb in sampler for k in mb]
        assert len(got) == total and sorted(want) == got and len(set(got)) == total
    # the LR follows the samples (sqrt rule at twice the batch: x 1.41 of the fixed schedule's value)
    two = next(s for s in steps if rec[s]["train/global_batch"] == 32)
    assert rec[two]["train/lr"] > rec[1]["train/lr"] * 0.5


def len_of(tmp: Path, index: int) -> int:
    """Training samples of the phase's sequence length (the job's own split)."""
    from vrgd_ds.train.config import load_config
    from vrgd_ds.train.data import prepare_data

    _, job = load_config(tmp / "config.json")
    data = prepare_data(job, tmp / "probe", 0, lambda: None, [job.phases[index].seq_len])
    train, _ = data.split(job.phases[index].seq_len)
    return len(train)


@pytest.mark.exhaustive
def test_killed_mid_adaptation_resumes_on_the_same_trajectory(full):
    """SIGKILL after the step-4 checkpoint (the batch changed after steps 2 and 4), restart:
    the controller's state, the accumulation, the sampler position and the LR come back, and
    batches, losses and the keys each step read equal the uninterrupted run's."""
    tmp, path, run_full, trace_full = full
    run, trace = tmp / "killed", tmp / "trace_killed"
    trace.mkdir()
    env = {**os.environ, "VRGD_TRACE_SAMPLES": str(trace)}
    kill_after_checkpoint(command(path, run), run, env=env)
    resumed = launching.run(command(path, run), timeout=900, marker=run, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    want, got = records(run_full), records(run)
    assert sorted(got) == sorted(want)
    assert launching.resumed_at(resumed.stdout + resumed.stderr) >= 4  # not a fresh start writing the same records
    for step in sorted(s for s in want if s > 0):
        for key in ("train/global_batch", "train/loss", "train/lr", "adaptive/b_simple", "gsnr/mean"):
            assert got[step].get(key) == want[step].get(key), (step, key)
    assert traces(trace) == traces(trace_full)


@pytest.mark.exhaustive
def test_an_adaptive_phase_made_fixed_is_refused_as_such(full):
    """Resumed at step 4 (96 samples into the adaptive phase) with that phase fixed at a batch
    of 64, of which 96 is no multiple: the job names the dropped adaptive batch, as
    ``--check-resume`` does (the adaptive phases are checked before the position), not the
    position, and starts no step."""
    tmp, path, _, _ = full
    run = tmp / "made_fixed"
    kill_after_checkpoint(command(path, run), run)
    fixed = json.loads(json.dumps(CONFIG))
    del fixed["job"]["phases"][0]["adaptive_batch"]
    fixed["job"]["phases"][0]["global_batch"] = 64
    fixed["job"]["data"]["path"] = json.loads(path.read_text())["job"]["data"]["path"]
    other = tmp / "made_fixed.json"
    other.write_text(json.dumps(fixed))
    refused = launching.run(command(other, run), timeout=900, marker=run)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr[-3000:]
    assert "phase 0 ran with adaptive_batch, the config has none there" in refused.stderr, refused.stderr[-3000:]
    assert "multiple" not in refused.stderr.split("phase 0 ran with adaptive_batch")[0][-500:]
    assert not any(s > 4 for s in records(run)), sorted(records(run))
