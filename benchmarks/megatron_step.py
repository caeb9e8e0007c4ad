"""VRLamb against Lamb under megatron-core, side by side in one run: the step time (Megatron's
schedule over the micro-batches, then ``optimizer.step()``) and the extra bytes the GSNR
statistics send per optimizer step next to Megatron's own gradient reduction.

    torchrun --nproc_per_node 2 benchmarks/megatron_step.py [--accumulation 1 16] [--steps 12]

Both optimizers train their own copy of the same GPT (the Megatron job's ``build_gpt``,
``vrgd_ds/train/engines/megatron.py``; distributed optimizer on, data parallel over the ranks), their steps interleaved so
that load on the machine falls on both alike; the first 2 steps of each are not timed. Tokens
are random (time does not depend on them). Prints one table row per accumulation and, per
optimizer, the median step time; the ratio VRLamb/Lamb is of medians measured in this run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from vrgd_ds.train.engines.megatron import MegatronBlock, build_gpt, init_process_group

BLOCK = MegatronBlock.model_validate({"model": {"num_layers": 4, "hidden_size": 128, "num_attention_heads": 4},
                                      "use_distributed_optimizer": True, "clip_grad": 1.0})
# on a GPU the Triton kernels or an error (fused=None would time the reference after a kernel failed)
PARAMS = {"lr": 2e-3, "weight_decay": 0.01, **({"fused": True} if torch.cuda.is_available() else {})}
SEQ, MICRO_BATCH, VOCAB, SEED = 64, 4, 2048, 1


def micro_batches(data: np.ndarray, step: int, micro: int, dp_rank: int, dp: int, device: torch.device):
    """This data-parallel rank's micro-batches of the step: windows of SEQ + 1 tokens."""
    windows = (len(data) - 1) // (SEQ + 1)
    causal = torch.tril(torch.ones(1, 1, SEQ, SEQ, device=device)) < 0.5
    position = torch.arange(SEQ, device=device).expand(MICRO_BATCH, SEQ)
    for i in range(micro):
        first = ((step * micro + i) * dp + dp_rank) * MICRO_BATCH
        rows = [(first + j) % windows for j in range(MICRO_BATCH)]
        block = torch.from_numpy(np.stack([data[r * (SEQ + 1):(r + 1) * (SEQ + 1)] for r in rows]).astype(np.int64))
        block = block.to(device)
        yield {"tokens": block[:, :-1], "labels": block[:, 1:], "position_ids": position, "attention_mask": causal}


def megatron_bytes(ddp) -> int:
    """What Megatron's own reduction sends per optimizer step: every bucket once, in its dtype."""
    return sum(b.grad_data.numel() * b.grad_data.element_size() for buf in ddp.buffers for b in buf.buckets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--accumulation", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    device = init_process_group(None, datetime.timedelta(minutes=10))
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = np.random.default_rng(0).integers(1, VOCAB, 200_000).astype(np.uint16)
    rows = []
    for accumulation in args.accumulation:
        built = {}
        for name in ("VRLamb", "Lamb"):
            built[name] = build_gpt(BLOCK, {"type": name, "params": PARAMS}, VOCAB, SEQ, SEED, device)
            ps.destroy_model_parallel()  # build_gpt() initialises; both copies use the same groups layout
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
            for name, (config, (ddp,), optimizer) in built.items():
                synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                ddp.zero_grad_buffer()
                optimizer.zero_grad()
                forward_backward(forward_step_func=forward_step,
                                 data_iterator=micro_batches(data, step, accumulation, dp_rank, dp, device),
                                 model=ddp, num_microbatches=accumulation, seq_length=SEQ,
                                 micro_batch_size=MICRO_BATCH, forward_only=False)
                ddp.finish_grad_sync()
                synchronize(device)
                before = time.perf_counter()
                optimizer.step()
                synchronize(device)  # the step's kernels (and the distributed optimizer's all-gather) are queued
                end = time.perf_counter()
                if step >= 2:
                    times[name].append(end - start)
                    step_times[name].append(end - before)
        _, (ddp,), vr = built["VRLamb"]
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
        print(f"megatron-core, {device.type}, {dist.get_world_size()} ranks, GPT {BLOCK.model.model_dump()}")
        for r in rows:
            print(json.dumps(r))
    dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work, where the host's clock would otherwise stop early."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    main()
