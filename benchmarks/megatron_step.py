"""VRLamb against Lamb under megatron-core, side by side in one run: the step time (Megatron's
schedule over the micro-batches, then ``optimizer.step()``) and the extra bytes the GSNR
statistics send per optimizer step next to Megatron's own gradient reduction.

    torchrun --nproc_per_node 2 benchmarks/megatron_step.py [--accumulation 1 16] [--steps 12]

Both optimizers train their own copy of the same GPT (``launch/megatron/pretrain_gpt.py``'s
``build``, distributed optimizer on, data parallel over the ranks), their steps interleaved so
that load on the machine falls on both alike; the first 2 steps of each are not timed. Tokens
are random (time does not depend on them). Prints one table row per accumulation and, per
optimizer, the median step time; the ratio VRLamb/Lamb is of medians measured in this run.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "megatron"))
import pretrain_gpt  # noqa: E402

CONFIG = {
    "model": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 64, "vocab_size": 2000},
    "parallel": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1},
    "train": {"micro_batch_size": 4, "seed": 1},
    "optimizer": {"params": {"lr": 2e-3, "weight_decay": 0.01}, "use_distributed_optimizer": True,
                  "clip_grad": 1.0},
}


def megatron_bytes(ddp) -> int:
    """What Megatron's own reduction sends per optimizer step: every bucket once, in its dtype."""
    return sum(b.grad_data.numel() * b.grad_data.element_size() for buf in ddp.buffers for b in buf.buckets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accumulation", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    device = pretrain_gpt.init_distributed()
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = np.random.default_rng(0).integers(1, CONFIG["model"]["vocab_size"], 200_000).astype(np.uint16)
    rows = []
    for accumulation in args.accumulation:
        built = {}
        for name in ("VRLamb", "Lamb"):
            cfg = copy.deepcopy(CONFIG)
            cfg["optimizer"]["type"] = name
            built[name] = pretrain_gpt.build(cfg, device)
            ps.destroy_model_parallel()  # build() initialises; both copies use the same groups layout
        ps.initialize_model_parallel(1, 1)
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        forward_backward = get_forward_backward_func()
        times = {name: [] for name in built}
        step_times = {name: [] for name in built}

        def forward_step(batches, model):
            b = next(batches)
            out = model(b["tokens"], b["position_ids"], b["attention_mask"], labels=b["labels"])
            return out, lambda o: (o.float().mean(), {})

        for step in range(args.steps + 2):
            for name, (config, ddp, optimizer) in built.items():
                dist.barrier()
                start = time.perf_counter()
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                forward_backward(forward_step_func=forward_step,
                                 data_iterator=pretrain_gpt.micro_batches(data, CONFIG, step, accumulation, dp_rank,
                                                                          dp, device),
                                 model=ddp, num_microbatches=accumulation, seq_length=CONFIG["model"]["seq_length"],
                                 micro_batch_size=CONFIG["train"]["micro_batch_size"], forward_only=False)
                ddp.finish_grad_sync()
                before = time.perf_counter()
                optimizer.step()
                end = time.perf_counter()
                if step >= 2:
                    times[name].append(end - start)
                    step_times[name].append(end - before)
        _, ddp, vr = built["VRLamb"]
        source = vr.vrgd_sources[0]
        extra = source.counters.bytes_sent / (args.steps + 2)
        params = sum(p.numel() for p in ddp.parameters())
        med = {n: statistics.median(t) for n, t in times.items()}
        med_opt = {n: statistics.median(t) for n, t in step_times.items()}
        rows.append({"accumulation": accumulation, "ranks": dist.get_world_size(), "params": params,
                     "megatron_bytes_per_step": megatron_bytes(ddp), "extra_bytes_per_step": int(extra),
                     "extra_over_megatron": round(extra / megatron_bytes(ddp), 3),
                     "step_ms_vrlamb": round(1e3 * med["VRLamb"], 1), "step_ms_lamb": round(1e3 * med["Lamb"], 1),
                     "step_ratio": round(med["VRLamb"] / med["Lamb"], 3),
                     "optimizer_step_ms_vrlamb": round(1e3 * med_opt["VRLamb"], 2),
                     "optimizer_step_ms_lamb": round(1e3 * med_opt["Lamb"], 2)})
        ps.destroy_model_parallel()
    if dist.get_rank() == 0:
        print(f"megatron-core, {device}, {dist.get_world_size()} ranks, GPT {CONFIG['model']}")
        for r in rows:
            print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
