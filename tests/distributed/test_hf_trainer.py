"""``transformers.Trainer`` with ``TrainingArguments(deepspeed=...)`` whose config names a VRGD
optimizer (``"optimizer": {"type": "VRLamb"}``), ZeRO-2, on 2 CPU ranks: HF/Accelerate hand
DeepSpeed a ``DummyOptim`` placeholder and DeepSpeed builds VRLamb from the config.

One ``deepspeed --num_gpus 2`` launch of ``hf_trainer_worker.py`` (a tiny BERT masked-LM on
random tokens, 6 optimizer steps, micro-batch 4, gradient accumulation 2) feeds every test here.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import launching
import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers.Trainer needs it for DeepSpeed

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WORKER = HERE / "hf_trainer_worker.py"
RANKS, GAS, STEPS = 2, 2, 6

# "lazy": the worker only does `import vrgd_ds` before transformers (what users write);
# "eager" would call vrgd_ds.register() explicitly.
REGISTER = "lazy"


pytestmark = pytest.mark.exhaustive  # one HF Trainer launch (20 s); make test-all

def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def launch(tmp: Path, *extra: str) -> dict:
    """One ``deepspeed --num_gpus 2`` launch of the worker; what rank 0 saw."""
    out = tmp / "r.json"
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", str(RANKS), "--master_port", str(launching.free_port()), str(WORKER),
           "--register", REGISTER, "--out", str(out), "--output_dir", str(tmp / "hf_out"), *extra]
    proc = launching.run(cmd, timeout=600, marker=out, env=_env(), cwd=tmp)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"deepspeed launch failed (rc={proc.returncode}):\n{proc.stdout[-6000:]}\n"
                           f"{proc.stderr[-6000:]}")
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    return launch(tmp_path_factory.mktemp("hf"))


def test_vrlamb_built_from_config_under_zero2(result):
    assert result["registered"]
    assert result["engine"] == "DeepSpeedEngine"
    assert result["basic_optimizer"] == "VRLamb"
    assert result["wrapped_optimizer"] == "DeepSpeedZeroOptimizer"
    assert result["zero_stage"] == 2
    assert result["world_size"] == RANKS
    assert result["gradient_accumulation_steps"] == GAS
    assert result["global_steps"] == STEPS


def test_trains(result):
    losses = result["losses"]
    assert len(losses) == STEPS, result["log_history"]
    assert all(math.isfinite(x) for x in losses), losses
    assert result["params_changed"], result["param_delta_norm"]
    # every parameter moves, except key biases, whose true gradient is 0 (softmax is invariant to them)
    still = [n for n, d in result["param_delta_norm"].items() if d == 0 and not n.endswith(".self.key.bias")]
    assert not still, still
    m = result["gsnr_metrics"]
    for key in ("trust_ratio/mean", "trust_ratio/min", "trust_ratio/max"):
        assert key in m and math.isfinite(m[key]), m
    assert 0 < m["trust_ratio/min"] <= m["trust_ratio/mean"] <= m["trust_ratio/max"], m
    assert m["step/skipped_total"] == 0
    assert len(result["step_metrics"]) == STEPS
    assert all("trust_ratio/mean" in row for row in result["step_metrics"])


def test_gradient_groups_per_step(result):
    # ZeRO-2 reduces every micro-step: ranks x gradient accumulation groups per optimizer step
    assert result["gsnr_metrics"]["gsnr/n"] == RANKS * GAS
    assert [row["gsnr/n"] for row in result["step_metrics"]] == [RANKS * GAS] * STEPS


def test_import_vrgd_ds_then_transformers_registers():
    code = ("import vrgd_ds\n"
            "from transformers import Trainer\n"
            "import deepspeed\n"
            "from vrgd_ds.ds import integration\n"
            "print('REGISTERED', integration._registered)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env(),
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "REGISTERED True" in proc.stdout, proc.stdout[-2000:]


def test_an_epochs_short_last_step_has_the_same_gsnr_from_the_engines_mean_as_from_the_groups(tmp_path):
    """56 samples on 2 ranks at micro-batch 4: 7 micro-batches a rank per epoch, so with accumulation
    2 the 4th step of each epoch has 1 micro-step (the Trainer turns DeepSpeed's division off and
    scales that step's loss as it scales its others'). Every group of that step then carries one
    factor other than the accumulation's division the statistics assume, and so does Σg read from
    DeepSpeed's mean
    (``gbar="engine"``) as from the groups (``gbar="local"``): the statistics the step uses are
    the same both ways (the GSNR scale it applies, ``|G|²`` and ``tr(Σ)``; not the mean GSNR,
    which at n = 2 is a few near-zero variances' and differs by orders of magnitude in rounding).
    On the old code Σg from the engine had half the groups' factor while the squares had it whole,
    and that step's statistics came out others. Fails on the old code."""
    rows = {}
    for gbar in ("engine", "local"):
        (tmp_path / gbar).mkdir()
        rows[gbar] = launch(tmp_path / gbar, "--samples", "56", "--gbar", gbar)["step_metrics"]
    assert [r["gsnr/n"] for r in rows["engine"]] == [4, 4, 4, 2, 4, 4] == [r["gsnr/n"] for r in rows["local"]]
    keys = ("gsnr/scale_mean", "noise_scale/grad_sq", "noise_scale/trace_cov")
    for engine, local in zip(rows["engine"], rows["local"]):
        assert [engine[k] for k in keys] == pytest.approx([local[k] for k in keys], rel=1e-3), (engine, local)


def test_a_resumed_trainer_run_is_the_uninterrupted_one_and_the_optimizer_follows_the_schedule(tmp_path):
    """6 steps with a checkpoint every 3 (warmup 2, then the linear decay), against the same run
    resumed from its step-3 checkpoint: steps 4-6 and the final weights equal bit for bit, the
    GSNR momentum (``gsnr_avg``) included, so the Trainer's checkpoint carries the optimizer's
    whole state through DeepSpeed; and at every step the optimizer's LR is the scheduler's."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    whole = launch(tmp_path / "a", "--save-steps", "3", "--warmup", "2")
    resumed = launch(tmp_path / "b", "--save-steps", "3", "--warmup", "2",
                     "--resume", str(tmp_path / "a" / "hf_out" / "checkpoint-3"))
    assert [r["step"] for r in resumed["step_metrics"]] == [4, 5, 6], resumed["step_metrics"]
    keys = ("gsnr_avg_sq", "gsnr/n", "gsnr/mean", "lr")
    assert [[r[k] for k in keys] for r in resumed["step_metrics"]] == [
        [r[k] for k in keys] for r in whole["step_metrics"][3:]]
    assert resumed["params"] == whole["params"]
    assert all(r["gsnr_avg_sq"] > 0 for r in whole["step_metrics"])
    lrs = [r["lr"] for r in whole["step_metrics"]]
    assert lrs == [r["scheduler_lr"] for r in whole["step_metrics"]]
    assert lrs[1] == max(lrs) and lrs[0] < lrs[1] and lrs[1] > lrs[2] > lrs[3] > lrs[4] > lrs[5], lrs
