"""torchtitan 0.3.0's own trainer with VRLamb selected by name (``vrgd_ds.fsdp.torchtitan``), on
2 CPU ranks (gloo): its llama3 debug model, FSDP over both ranks, 2 micro-batches per step, and a
checkpoint resumed by torchtitan's checkpointer. The trainer assumes a GPU; ``torchtitan_cpu.py``
(test code) stands in a CPU device module and eager attention, and writes the tokenizer and the
dataset from the embedded corpus."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")
HERE = Path(__file__).parent
STEP = re.compile(r"VRGD step: n=(\S+) gsnr_mean=(\S+) skipped=(\S+)")
LOSS = re.compile(r"step:\s+(\d+)\s+(?:\x1b\[[0-9;]*m)*loss:\s+(\S+)")


def _train(tmp: Path, assets: tuple[Path, Path], steps: int, seed_checkpoint: bool = False) -> str:
    """torchtitan's trainer on 2 ranks to ``steps``, or (``seed_checkpoint``) its seed checkpoint on one."""
    tokenizer, data = assets
    ranks = ["1"] if seed_checkpoint else ["2"]
    shape = (["--checkpoint.create_seed_checkpoint", "--parallelism.data_parallel_shard_degree", "1"] if seed_checkpoint
             else ["--parallelism.data_parallel_shard_degree", "2"])
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", *ranks, "-m", "torchtitan.train",
           "--module", "torchtitan_cpu", "--config", "llama3_debugmodel_vr_lamb_cpu", "--debug.seed", "7",
           "--training.steps", str(steps), "--training.seq_len", "128", "--training.local_batch_size", "2",
           "--training.global_batch_size", "8", *shape,
           # torchtitan's default spmd_types backend refuses the debug model's plain tensors on torch 2.13
           "--parallelism.spmd_backend", "partial_dtensor", "--hf_assets_path", str(tokenizer),
           "--dataloader.dataset_path", str(data), "--checkpoint.enable", "--checkpoint.interval", "2",
           "--dump_folder", str(tmp / "out")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    return out


@pytest.mark.exhaustive
def test_torchtitan_trains_the_debug_model_with_vr_lamb_and_resumes(tmp_path):
    """4 steps (checkpoints at 2 and 4), then a second run to 6 that torchtitan resumes from step
    4: every step a VRLamb step with n = 2 ranks × 2 micro-batches, nothing skipped, finite losses.
    (On CPU torchtitan's resumed losses differ from an uninterrupted run's with its own AdamW too,
    so the resume is checked for continuing, not for equal losses.) Fails on the first attach, which
    placed the parameters of torchtitan's grouped ``fully_shard([norm, output])`` twice (the modules
    share one FSDP state: "a parameter of shape (128,) is placed twice")."""
    import torchtitan_cpu

    assets = torchtitan_cpu.make_assets(tmp_path / "assets")
    first = _train(tmp_path, assets, 4)
    second = _train(tmp_path, assets, 6)
    assert "Loading the checkpoint from" in second and "Training starts at step 5" in second, second[-4000:]
    for out, steps in ((first, [1, 2, 3, 4]), (second, [5, 6])):
        stats = STEP.findall(out)
        assert [float(n) for n, _, _ in stats] == [4.0] * len(steps), out[-4000:]
        assert all(float(skipped) == 0.0 and math.isfinite(float(mean)) for _, mean, skipped in stats)
        losses = {int(s): float(v) for s, v in LOSS.findall(re.sub(r"\x1b\[[0-9;]*m", "", out))}
        assert sorted(losses) == steps and all(math.isfinite(v) and v < 9.0 for v in losses.values()), losses


@pytest.mark.exhaustive
def test_a_seed_checkpoint_made_with_vr_lamb_starts_the_training_run(tmp_path):
    """torchtitan's seed checkpoint on one rank (the model unsharded: no statistics, no step), then
    the 2-rank run, which loads it at step 0 and trains with n = 4. Fails on the old code: the
    seed run stopped at the container's attach ("needs a model sharded with
    torch.distributed.fsdp.fully_shard")."""
    import torchtitan_cpu

    assets = torchtitan_cpu.make_assets(tmp_path / "assets")
    seed = _train(tmp_path, assets, 2, seed_checkpoint=True)
    assert "Created seed checkpoint" in seed and "the VRGD optimizers are not attached" in seed, seed[-4000:]
    out = _train(tmp_path, assets, 2)
    assert "Loading the checkpoint from" in out and "step-0" in out, out[-4000:]
    assert [float(n) for n, _, _ in STEP.findall(out)] == [4.0, 4.0], out[-4000:]
