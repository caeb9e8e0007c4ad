"""The Megatron GPT job (``launch/megatron/pretrain_gpt.py``) end to end on 2 CPU ranks under
torchrun: Megatron's schedule and gradient finalisation, the distributed optimizer, VR-LAMB from
``vrgd_ds.megatron``; and its configuration errors naming the key."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import launching
import pytest

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "launch" / "megatron" / "pretrain_gpt.py"
CONFIG = ROOT / "configs" / "megatron" / "gpt_tiny_cpu_vr_lamb.json"


def _config(tmp_path: Path, corpus: Path, **train) -> Path:
    cfg = json.loads(CONFIG.read_text())
    cfg["data"]["path"] = str(corpus)
    cfg["train"].update(train)
    path = tmp_path / "gpt.json"
    path.write_text(json.dumps(cfg))
    return path


def test_gpt_job_trains_with_vr_lamb_on_two_ranks(tmp_path, corpus):
    run_dir = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    res = launching.run([torchrun, "--nproc_per_node", "2", "--master_port", str(launching.free_port()), JOB,
                         "--config", _config(tmp_path, corpus, steps=6), "--run-dir", run_dir],
                        timeout=420, marker=run_dir)
    assert res.returncode == 0, res.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert all(r["ok"] for r in records)
    # global batch 32 = 2 ranks × 4 micro-batches of 4: n = 8 gradient groups per step
    assert {r["gsnr/n"] for r in records} == {8.0}
    assert all(0.0 < r["gsnr/scale_mean"] < 1.0 for r in records)  # the GSNR damps
    assert records[-1]["loss"] < records[0]["loss"]
    # the statistics' extra bytes: one fp32 gradient (with the buckets' padding) per step
    assert len({r["extra_bytes_per_step"] for r in records}) == 1


def test_gpt_job_config_error_names_the_key(tmp_path, corpus):
    cfg = json.loads(_config(tmp_path, corpus).read_text())
    cfg["train"]["global_batch"] = 64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cfg))
    res = launching.run([sys.executable, JOB, "--config", bad], timeout=60)
    assert res.returncode != 0
    assert "unknown key(s) ['global_batch'] in 'train'" in res.stderr, res.stderr[-2000:]


def _train(tmp_path: Path, corpus: Path, **train) -> list[dict]:
    run_dir = tmp_path / "run"
    torchrun = Path(sys.executable).parent / "torchrun"
    res = launching.run([torchrun, "--nproc_per_node", "2", "--master_port", str(launching.free_port()), JOB,
                         "--config", _config(tmp_path, corpus, **train), "--run-dir", run_dir],
                        timeout=420, marker=run_dir)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.exhaustive
def test_gpt_job_in_bf16(tmp_path, corpus):
    """bf16 as Megatron trains it: the model in bf16 inside ``Float16Module``, gradients reduced in
    fp32, fp32 main parameters in the optimizer; the statistics read the same fp32 buffers."""
    records = _train(tmp_path, corpus, steps=6, precision="bf16")
    assert all(r["ok"] for r in records) and {r["gsnr/n"] for r in records} == {8.0}
    assert all(0.0 < r["gsnr/scale_mean"] < 1.0 for r in records)
    assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.exhaustive
def test_gpt_job_in_fp16_scales_the_loss_and_skips_overflowing_steps(tmp_path, corpus):
    """fp16 with Megatron's dynamic loss scale (initial 2^32): the first steps overflow, are skipped
    (no GSNR statistics are consumed) and lower the scale; once it fits, steps are taken with the
    statistics of all 8 groups, the loss scale taken out of them. Fails without the job handing the
    optimizer's ``scale_loss`` to Megatron's schedule (``grad_scale_func``): the loss was then never
    scaled, every gradient was divided by 2^32 on the way to the optimizer, nothing overflowed and
    every step was taken with a zero gradient (grad norm 0.0)."""
    records = _train(tmp_path, corpus, steps=20, precision="fp16")
    taken = [r for r in records if r["ok"]]
    skipped = [r for r in records if not r["ok"]]
    assert skipped and taken and records.index(taken[0]) == len(skipped), [r["ok"] for r in records]
    scales = [r["loss_scale"] for r in records]
    assert scales[0] == 2.0**32 and scales[-1] < 2.0**32 and scales == sorted(scales, reverse=True)
    assert all(r["gsnr/n"] == 8.0 and 0.0 < r["gsnr/scale_mean"] < 1.0 and r["grad_norm"] > 0.0 for r in taken)
