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
