"""On a GPU machine (marked ``cuda``, skipped without one): a 1-rank NCCL DeepSpeed ZeRO-2 run
of VR-LAMB (Triton kernels) equals the same run on the CPU (gloo, C++ kernels) for the same
seeds and batches. Tolerance: the fp32 matrix's, 1e-3 of the distance trained
(``‖θ_gpu − θ_cpu‖ / ‖θ_cpu − θ_0‖``): the arithmetic is the same op for op, only summation
orders differ (NCCL vs gloo, cuBLAS vs CPU GEMMs in the model, Triton vs C++ reductions)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import launching
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
HERE = Path(__file__).parent


def launch(tmp: Path, name: str, cuda: bool) -> dict:
    out = tmp / f"{name}.pt"
    env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not cuda:  # the launcher sets CUDA_VISIBLE_DEVICES itself: the accelerator is chosen by name
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "1", "--master_port",
           str(launching.free_port()), str(HERE / "gpu_worker.py"), "--out", str(out)]
    proc = launching.run(cmd, timeout=900, marker=out, env=env, cwd=tmp)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


def test_nccl_zero2_run_equals_the_cpu_gloo_run(tmp_path):
    """Checks which kernels ran, after the run (a fallback to the reference shows). First run on an
    H100 it failed, rightly: the "CPU" run had run on the GPU too (``deepspeed --num_gpus`` sets
    ``CUDA_VISIBLE_DEVICES`` itself, so hiding the GPUs through it did nothing and the two runs were
    equal, distance 0.0); the CPU run now names its accelerator (``DS_ACCELERATOR=cpu``)."""
    gpu, cpu = launch(tmp_path, "gpu", True), launch(tmp_path, "cpu", False)
    assert (gpu["kernels"], cpu["kernels"]) == ("triton", "fused")
    num = sum(float((a - b).double().square().sum()) for a, b in zip(gpu["final"], cpu["final"]))
    den = sum(float((b - b0).double().square().sum()) for b, b0 in zip(cpu["final"], cpu["initial"]))
    assert (num / den) ** 0.5 <= 1e-3, (num / den) ** 0.5
    assert gpu["metrics"]["gsnr/n"] == cpu["metrics"]["gsnr/n"] == 4.0
