"""What a seed fixes on every device. The same job and seed read the same samples and MLM masks
(numpy generators keyed by seed, epoch and sample: ``data_pipeline``) and start from the same
weights (drawn on the CPU under ``torch.manual_seed(seed)``) on a GPU and on a CPU; their dropout
masks differ, since torch's CUDA generator is another stream than its CPU generator for the same
seed. Here the other device's stream is stood in for by shifting every micro-batch seed
(``shifted_stream_job.py``): with dropout off the run is the same run to the last bit (nothing
else draws from torch), so a GPU run and a CPU run of it differ in arithmetic only; with dropout
on, another stream is another run."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import launching
import pytest
from jobs import records, write_config

pytestmark = [pytest.mark.slow, pytest.mark.exhaustive]
HERE = Path(__file__).parent

CONFIG = {
    "optimizer": {"type": "VRLamb", "params": {"lr": 2e-3, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2},
    "gradient_clipping": 1.0,
    "job": {
        "model": {"size": "tiny"},
        "data": {"vocab_size": 2000, "eval_samples": 32},
        "total_steps": 3, "eval_every": 3, "checkpoint_every": 0,
        "phases": [{"seq_len": 64, "fraction": 1.0, "global_batch": 16, "micro_batch": 8, "lr": 2e-3}],
    },
}
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def losses(tmp: Path, corpus: Path, shift: int, dropout_off: bool) -> list[float]:
    """Each step's training loss and the held-out loss after the last, ``shift`` = 0: the job's stream."""
    cfg = json.loads(json.dumps(CONFIG))
    if dropout_off:
        cfg["job"]["model"]["overrides"] = NO_DROPOUT
    name = f"shift{shift}-{'off' if dropout_off else 'on'}"
    (tmp / name).mkdir()
    run_dir = tmp / name / "run"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_port",
           str(launching.free_port()), str(HERE / "shifted_stream_job.py"),
           "--config", str(write_config(tmp / name, cfg, corpus)), "--run-dir", str(run_dir)]
    proc = launching.run(cmd, timeout=600, marker=run_dir, env={**os.environ, "SHIFT": str(shift)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = records(run_dir)
    return [rec[s]["train/loss"] for s in (1, 2, 3)] + [rec[3]["eval/mlm_loss"]]


def test_without_dropout_the_run_draws_nothing_from_torch_after_its_initial_weights(corpus, tmp_path):
    """Dropout off: another torch stream gives the same losses, bit for bit. Dropout on: other
    losses from the first step (the check can fail)."""
    assert losses(tmp_path, corpus, 0, True) == losses(tmp_path, corpus, 7, True)
    on, moved = losses(tmp_path, corpus, 0, False), losses(tmp_path, corpus, 7, False)
    assert on[0] != moved[0] and on[-1] != moved[-1]
