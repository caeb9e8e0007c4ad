"""The pretraining job end to end on 2 CPU ranks (``deepspeed --num_gpus 2``, gloo): VR-LAMB
through ZeRO-2 over both phases on the embedded corpus (the session's, ``conftest.corpus``), and a run killed (SIGKILL) after its
step-4 checkpoint that, restarted with the same command, repeats the uninterrupted run's
losses exactly (fp32; dropout on, data order, masks and LR all restored)."""
from __future__ import annotations


import launching
import pytest
from jobs import command, kill_after_checkpoint, records, write_config

from vrgd_ds.ds import shm

pytestmark = pytest.mark.slow

CONFIG = {
    "optimizer": {"type": "VRLamb", "params": {"weight_decay": 0.01, "gamma": 0.1, "beta3": 0.9}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 200000},
    "gradient_clipping": 1.0,
    "job": {
        "model": {"size": "tiny"},
        "data": {"vocab_size": 2000, "eval_samples": 64},
        "total_steps": 10,
        "log_every": 2,
        "eval_every": 5,
        "checkpoint_every": 4,
        "phases": [
            {"seq_len": 64, "fraction": 0.8, "global_batch": 32, "micro_batch": 8, "lr": 2e-3,
             "warmup_fraction": 0.25},
            {"seq_len": 128, "fraction": 0.2, "global_batch": 16, "micro_batch": 4, "lr": 1e-3},
        ],
    },
}


@pytest.fixture(scope="module")
def setup(corpus, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pretrain")
    path = write_config(tmp, CONFIG, corpus)
    full = tmp / "full"
    port = launching.free_port()
    proc = launching.run(command(path, full, port=port), timeout=900, marker=full, unlink_shm=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # DeepSpeed's CPU all-reduce segments (69 MB each) are not left in /dev/shm by the job
    left = sorted(p.name for p in shm.SHM_DIR.glob(shm.segment_name("127.0.0.1", port)))
    assert not left, left
    return tmp, path, full, proc.stdout


def test_two_rank_run_trains_both_phases_with_vr_lamb(setup):
    """A few steps of VR-LAMB through ZeRO-2: both phases run with their own sequence length,
    n = 2 ranks x 2 micro-steps in each, and the summary, plots and checkpoint exist. Records
    come every 2 steps, at the phase end (8) and at the evaluation of step 5, which is no log
    step (the code before evaluated only on log steps: none at 5)."""
    _, _, full, stdout = setup
    rec = records(full)
    logged = [2, 4, 5, 6, 8, 10]
    assert sorted(k for k in rec if k > 0) == logged
    assert [rec[s]["train/seq_len"] for s in logged] == [64] * 5 + [128]
    assert all(rec[s]["gsnr/n"] == 4.0 for s in logged)
    assert all(rec[s]["train/loss"] == rec[s]["train/loss"] for s in logged)  # finite, not NaN
    assert {"eval/mlm_loss", "eval/mlm_acc"} <= rec[0].keys() and "eval/mlm_loss" in rec[5]
    assert rec[10]["eval/mlm_loss"] < rec[0]["eval/mlm_loss"]
    assert "held-out MLM loss" in stdout
    assert (full / "checkpoints" / "latest").read_text().strip() == "step00000010"
    assert {p.name for p in (full / "plots").glob("*.png")} >= {"loss.png", "gsnr.png", "lr.png"}


@pytest.mark.exhaustive  # make test: the engine's checkpoints resumed exactly (test_deepspeed.py), the job's
# resume decisions on a stand-in engine (test_job_spine.py), the sampler's stream (test_data_sampler.py)
def test_killed_run_resumes_on_the_same_trajectory(setup):
    """SIGKILL after the step-4 checkpoint, restart with the same command: the job resumes
    by itself (model, optimizer with GSNR state, sampler position, LR, dropout RNG) and its
    losses and held-out figures equal the uninterrupted run's exactly, across the phase change."""
    tmp, path, full, _ = setup
    run = tmp / "killed"
    kill_after_checkpoint(command(path, run), run)
    killed_at = max(records(run))
    resumed = launching.run(command(path, run), timeout=900, marker=run)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    want, got = records(full), records(run)
    assert killed_at >= 4 and 4 <= launching.resumed_at(resumed.stdout + resumed.stderr) <= killed_at
    assert sorted(got) == sorted(want)
    for step in (s for s in want if s > 0):
        assert got[step]["train/loss"] == want[step]["train/loss"], step
        assert got[step]["gsnr/mean"] == want[step]["gsnr/mean"], step
    assert got[10]["eval/mlm_loss"] == want[10]["eval/mlm_loss"]
