"""One rank, ZeRO-2, VR-LAMB on the tiny model of worker.py for a few steps; writes the final
parameters. Run by test_gpu.py twice: on the GPU (NCCL, Triton kernels) and on the CPU (gloo,
C++ kernels), same seeds and batches.

    deepspeed --num_gpus 1 tests/distributed/gpu_worker.py --out params.pt
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

import vrgd_ds  # noqa: F401  (registers the names with DeepSpeed)
import deepspeed

sys.path.insert(0, os.path.dirname(__file__))
from worker import MICRO, batch, loss_fn, tiny_model  # noqa: E402

STEPS, GAS = 3, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    cuda = os.environ.get("DS_ACCELERATOR") != "cpu" and torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    model = tiny_model()
    initial = [p.detach().clone().float() for p in model.parameters()]
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "zero_optimization": {"stage": 2, "reduce_bucket_size": 40},
           "optimizer": {"type": "VRLamb", "params": {"lr": 1e-2, "weight_decay": 0.01}}}
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    for step in range(STEPS):
        for j in range(GAS):
            x, y = batch(step, 0, j)
            engine.backward(loss_fn(engine, (x.to(engine.device), y.to(engine.device)), torch.float32))
            engine.step()
    kernels = engine.basic_optimizer.kernels().name  # the implementation that ran (a fallback shows)
    final = [p.detach().float().cpu().clone() for p in engine.module.parameters()]
    torch.save({"initial": initial, "final": final, "kernels": kernels,
                "metrics": engine.basic_optimizer.gsnr_metrics()}, args.out)


if __name__ == "__main__":
    main()
