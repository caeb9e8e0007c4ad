"""VR-LAMB vs LAMB under DeepSpeed ZeRO-2 on 2 CPU ranks: step time and reduction traffic.

A BERT masked-LM of ~30M parameters (transformers ``BertConfig``: hidden 512, 4 layers,
intermediate 2048, vocab 30522; nothing downloaded), fp32, sequence length 128. Two engines
are built in one 2-rank process group, ``VRLamb`` and ``Lamb`` (the same code with GSNR off:
DeepSpeed's own reduction, no statistics), and trained round-robin on the same random
batches, one optimizer step each per repeat, so machine noise hits both alike. Reported:
the median wall time of a whole step (forward, backward with its gradient reduction,
optimizer step), their ratio, and per step the number of ``all_reduce`` calls and their bytes
(counted by wrapping ``deepspeed.comm.all_reduce``), so the fused path's extra bytes can be
compared with the fp32 gradient (target: exactly 1x, one collective per bucket unchanged).

Run:  python benchmarks/zero2_step.py [--repeats 8] [--micro-batch 8] [--json out.json]
(it launches ``deepspeed --num_gpus 2`` on itself).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def launch(argv: list[str]) -> int:
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", "29611", __file__, "--worker", *argv]
    return subprocess.call(cmd)


def worker(args: argparse.Namespace) -> None:
    import torch
    import transformers

    import vrgd_ds  # noqa: F401  (registers the optimizer names)
    import deepspeed
    import deepspeed.comm as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    calls = {"n": 0, "bytes": 0}
    all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *a, **kw):
        calls["n"] += 1
        calls["bytes"] += tensor.numel() * tensor.element_size()
        return all_reduce(tensor, *a, **kw)

    dist.all_reduce = counting_all_reduce
    cfg = transformers.BertConfig(vocab_size=30522, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                                  intermediate_size=2048, max_position_embeddings=512)
    engines = {}
    for name in ("VRLamb", "Lamb"):
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(cfg)
        ds_cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
                  "gradient_clipping": 1.0, "steps_per_print": 10**9,
                  "optimizer": {"type": name, "params": {"lr": 1e-4, "weight_decay": 0.01}},
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": args.bucket}}
        engines[name], *_ = deepspeed.initialize(model=model, config=ds_cfg)
    numel = sum(p.numel() for p in engines["Lamb"].module.parameters())
    g = torch.Generator().manual_seed(rank)
    times = {k: [] for k in engines}
    phases = {k: [] for k in engines}  # (forward, backward incl. reduction, step)
    comm = {k: [] for k in engines}
    for it in range(args.warmup + args.repeats):
        ids = torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq), generator=g)
        for name, engine in engines.items():
            dist.barrier()
            calls.update(n=0, bytes=0)
            t0 = time.perf_counter()
            loss = engine(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            engine.backward(loss)
            t2 = time.perf_counter()
            backward_calls = dict(calls)
            engine.step()
            t3 = time.perf_counter()
            if it >= args.warmup:
                times[name].append(t3 - t0)
                phases[name].append((t1 - t0, t2 - t1, t3 - t2))
                comm[name].append((backward_calls["n"], backward_calls["bytes"], calls["n"] - backward_calls["n"]))
    if rank != 0:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    stats = engines["VRLamb"].vrgd_stats
    per_step = {k: comm[k][-1] for k in comm}
    grad_bytes = 4 * numel
    extra = per_step["VRLamb"][1] - per_step["Lamb"][1]
    print(f"\n{numel:,} parameters, ZeRO-2, fp32, 2 ranks x {torch.get_num_threads()} thread(s), micro-batch "
          f"{args.micro_batch} x seq {args.seq}, reduce_bucket_size {args.bucket:,}, {args.repeats} repeats")
    print(f"{'optimizer':8s} {'median s':>9s} {'min s':>7s} {'fwd s':>6s} {'bwd s':>6s} {'step s':>6s} "
          f"{'bucket all_reduce':>17s} {'MB':>7s} {'small all_reduce in step':>25s}")
    for k in engines:
        f, b, st = (statistics.median(x[i] for x in phases[k]) for i in range(3))
        print(f"{k:8s} {med[k]:9.3f} {min(times[k]):7.3f} {f:6.3f} {b:6.3f} {st:6.3f} {per_step[k][0]:17d} "
              f"{per_step[k][1] / 1e6:7.1f} {per_step[k][2]:25d}")
    ratio = med["VRLamb"] / med["Lamb"]
    print(f"\nstep time VRLamb / Lamb = {ratio:.3f} (target <= 1.10: {'met' if ratio <= 1.10 else 'NOT met'})")
    print(f"extra bytes per step = {extra / 1e6:.1f} MB = {extra / grad_bytes:.3f} x the fp32 gradient "
          f"({grad_bytes / 1e6:.1f} MB); fused-reduction counters: {stats.counters.collectives} collectives, "
          f"{stats.counters.bytes_sent / max(stats.counters.grad_bytes_fp32, 1):.3f} x fp32 gradient bytes since "
          "start")
    print(f"gradient all-reduces per step (backward): VRLamb {per_step['VRLamb'][0]}, Lamb {per_step['Lamb'][0]}"
          f" ({'unchanged' if per_step['VRLamb'][0] == per_step['Lamb'][0] else 'DIFFERENT'})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(params=numel, median_s=med, ratio=ratio, per_step_allreduce=per_step,
                           extra_bytes=extra, grad_bytes_fp32=grad_bytes, times=times), fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--bucket", type=int, default=5_000_000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        argv = [a for a in sys.argv[1:]]
        sys.exit(launch(argv))


if __name__ == "__main__":
    main()
