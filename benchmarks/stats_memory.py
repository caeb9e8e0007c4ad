"""What each statistics scheme holds per rank and sends per step, measured on 4 CPU ranks grouped as
2 "nodes" × 2 (``"vrgd": {"node_size": 2}``): the bytes per model parameter of the statistics'
live buffers on a rank (``memory()``: the buffers mirroring the model's gradients, the partition
sums the optimizer reads, the transient bucket buffers), next to the bytes their collectives
take per optimizer step, within a node and across nodes, in fp32 gradients.

A BERT (``--model tiny``: hidden 128, 2 layers, 30,522-token vocabulary, 4.4M parameters) under
DeepSpeed stage 0, ZeRO-2 and ZeRO-3, two optimizer steps per engine, the second
counted. ``per_step``'s collective spans the nodes; ``hierarchical``'s intra-node reductions run
every micro-step, its cross-node one once per step; ``per_micro_step``'s replaces DeepSpeed's own
reduction at every micro-step.

    python benchmarks/stats_memory.py [--gas 4] [--dtype bf16]     (launches deepspeed --num_gpus 4)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

MODELS = {"tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
          "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048)}
CASES = [(0, "per_step"), (0, "hierarchical"), (2, "per_step"), (2, "hierarchical"), (2, "per_micro_step"),
         (3, "per_step"), (3, "hierarchical"), (3, "per_micro_step")]


def worker(args: argparse.Namespace) -> None:
    import torch
    import transformers

    import vrgd_ds  # noqa: F401  (registers the optimizer names)
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    cfg = transformers.BertConfig(vocab_size=30522, max_position_embeddings=128, **MODELS[args.model])
    rows = []
    for stage, scheme in CASES:
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(cfg)
        numel = sum(p.numel() for p in model.parameters())
        ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": args.gas, "steps_per_print": 10**9,
              "optimizer": {"type": "VRLamb", "params": {"lr": 1e-4, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket},
              "vrgd": {"squares": scheme, **({"node_size": 2} if scheme == "hierarchical" else {})}}
        if args.dtype == "bf16":
            ds["bf16"] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, config=ds)
        stats = engine.vrgd_stats
        g = torch.Generator().manual_seed(rank)
        before = {}
        for step in range(2):
            if step == 1:
                before = dict(intra=getattr(stats, "intra_bytes", 0), sent=stats.counters.bytes_sent)
            for _ in range(args.gas):
                ids = torch.randint(0, cfg.vocab_size, (2, args.seq), generator=g)
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
        memory = stats.memory() if hasattr(stats, "memory") else {"partition": stats.buffer_bytes()}
        sent = stats.counters.bytes_sent - before["sent"]
        intra = getattr(stats, "intra_bytes", 0) - before["intra"]
        within, across = intra, sent  # per_step's and per_micro_step's collectives span the nodes
        rows.append((stage, scheme, numel, memory, within, across, stats.describe() if hasattr(stats, "describe")
                     else ""))
        del engine, model
    if rank != 0:
        return
    print(f"\nBERT-{args.model}, {args.dtype}, 4 CPU ranks as 2 nodes x 2, accumulation {args.gas}, "
          f"reduce_bucket_size {args.bucket:,}; bytes per model parameter on rank 0; collectives' input bytes "
          f"per optimizer step in fp32 gradients\n")
    print("| ZeRO | scheme | local B/param | partition B/param | transient B/param | total B/param "
          "| within a node per step | across nodes per step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for stage, scheme, numel, memory, within, across, _ in rows:
        grad = 4 * numel
        total = sum(memory.values())
        print(f"| {stage} | {scheme} | {memory.get('local', 0) / numel:.2f} | {memory.get('partition', 0) / numel:.2f} "
              f"| {memory.get('transient', 0) / numel:.2f} | {total / numel:.2f} | {within / grad:.2f}x "
              f"| {across / grad:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--gas", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--bucket", type=int, default=500_000)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()
    if args.worker or os.environ.get("RANK") is not None:
        worker(args)
        return
    deepspeed = Path(sys.executable).parent / "deepspeed"
    sys.exit(subprocess.call([str(deepspeed), "--num_gpus", "4", "--master_port", "29621", __file__, "--worker",
                              *sys.argv[1:]]))


if __name__ == "__main__":
    main()
