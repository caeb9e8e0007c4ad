"""VR-LAMB vs LAMB under DeepSpeed ZeRO-2 on 2 CPU ranks: step time and reduction traffic.

A BERT masked-LM of ~30M parameters (transformers ``BertConfig``: hidden 512, 4 layers,
intermediate 2048, vocab 30522; nothing downloaded), fp32, sequence length 128. Two engines
are built in one 2-rank process group, ``VRLamb`` and ``Lamb`` (the same code with GSNR off:
DeepSpeed's own reduction, no statistics), and trained round-robin on the same random
batches, one optimizer step each per repeat, so machine noise hits both alike. Reported:
the median wall time of a whole step (forward, backward with its gradient reduction,
optimizer step), their ratios, and per optimizer step the collectives and their bytes (counted
by wrapping ``deepspeed.comm``'s all-reduce, reduce-scatter and all-gather), so each scheme's
extra bytes can be compared with the fp32 gradient. ``VRLamb`` runs the default per-step
squares (one reduction of Σg² per optimizer step), ``VRLamb/micro`` the per-micro-step fused
``[g | g²]`` reduction; targets: extra bytes <= 1.0x the fp32 gradient at every accumulation,
step time VRLamb / Lamb <= 1.05 at accumulation 16.

Run:  python benchmarks/zero2_step.py [--repeats 8] [--micro-batch 8] [--json out.json]
(it launches ``deepspeed --num_gpus 2`` on itself). On a GPU machine, one NCCL rank:
      python benchmarks/zero2_step.py --ranks 1 --gas 2 --dtype bf16 --model base --bf16-squares
(one rank needs ``--gas >= 2``: ZeRO-2 groups are ranks x micro-steps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


MODELS = {  # BERT shapes; "small" is the ~30M-parameter CPU default
    "small": dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, intermediate_size=2048),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def launch(argv: list[str]) -> int:
    deepspeed = Path(sys.executable).parent / "deepspeed"
    ranks = "1" if "--ranks" in argv and argv[argv.index("--ranks") + 1] == "1" else "2"
    cmd = [str(deepspeed), "--num_gpus", ranks, "--master_port", "29611", __file__, "--worker", *argv]
    return subprocess.call(cmd)


def worker(args: argparse.Namespace) -> None:
    import torch
    import transformers

    import vrgd_ds  # noqa: F401  (registers the optimizer names)
    import deepspeed
    import deepspeed.comm as dist

    cuda = torch.cuda.is_available()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
    calls = {"n": 0, "bytes": 0, "depth": 0}

    def counting(fn, which):  # the input tensor of each collective: argument `which`; counted once, outermost
        def counted(*a, **kw):
            t = a[which] if len(a) > which else next(iter(kw.values()), None)
            if torch.is_tensor(t) and calls["depth"] == 0:
                calls["n"] += 1
                calls["bytes"] += t.numel() * t.element_size()
            calls["depth"] += 1
            try:
                return fn(*a, **kw)
            finally:
                calls["depth"] -= 1
        return counted

    for name, which in (("all_reduce", 0), ("reduce_scatter_tensor", 1), ("reduce_scatter_fn", 1),
                        ("all_gather_into_tensor", 1), ("allgather_fn", 1)):
        if hasattr(dist, name):
            setattr(dist, name, counting(getattr(dist, name), which))
    # the statistics call torch's reduce-scatter by its current name (vrgd_ds/stats/comm.py)
    if hasattr(torch.distributed, "reduce_scatter_single"):
        torch.distributed.reduce_scatter_single = counting(torch.distributed.reduce_scatter_single, 1)
    cfg = transformers.BertConfig(vocab_size=30522, max_position_embeddings=512, **MODELS[args.model])
    # "Lamb" is VRLamb with gsnr off: our Lamb, on every accelerator ("type": "Lamb" is
    # DeepSpeed's FusedLamb on CUDA).
    # VRLamb: the default scheme (per-step squares on ZeRO-2); VRLamb/micro: the fused per-micro-step one.
    variants = {"VRLamb": ({}, "fp32"), "VRLamb/micro": ({}, "fp32"), "Lamb": ({"gsnr": False}, "fp32")}
    if args.bf16_squares:
        variants["VRLamb/bf16sq"] = ({}, "bf16")
    if args.hooks:  # the per-step statistics read by a tensor hook per parameter, as before the buckets
        variants["VRLamb/hooks"] = ({}, "fp32")
    # The GPU anchors (--anchors): DeepSpeed's FusedLamb ("type": "Lamb" on CUDA, JIT-built; not in
    # DeepSpeed's ZERO_SUPPORTED_OPTIMIZERS, hence zero_allow_untested_optimizer) and torch's fused
    # AdamW through DeepSpeed's torch_adam switch.
    anchors = {"FusedLamb": {"type": "Lamb", "params": {"lr": 1e-4, "weight_decay": 0.01}},
               "AdamW(fused)": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01, "torch_adam": True,
                                                            "fused": True}}}
    if args.anchors:
        if not cuda:
            raise SystemExit("--anchors needs CUDA: DeepSpeed's FusedLamb and fused AdamW are GPU kernels")
        variants.update({k: (v, None) for k, v in anchors.items()})
    engines = {}
    for name, (extra, squares) in variants.items():
        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(cfg)
        ds_cfg = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.gas,
                  "gradient_clipping": 1.0, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": 2, "reduce_bucket_size": args.bucket}}
        if squares is None:  # an anchor
            ds_cfg.update(optimizer=extra, zero_allow_untested_optimizer=True)
        else:
            # on a GPU the Triton kernels or an error: with fused=None a kernel that failed would hand the
            # timed steps to the reference implementation, with one warning
            fused = {"fused": True} if torch.cuda.is_available() else {}
            ds_cfg.update(optimizer={"type": "VRLamb", "params": {"lr": 1e-4, "weight_decay": 0.01, **fused, **extra}},
                          vrgd={"squares_dtype": squares,
                                "squares": "per_micro_step" if name == "VRLamb/micro" else "per_step",
                                "micro_steps": "hooks" if name == "VRLamb/hooks" else "auto"})
        if args.dtype == "bf16":
            ds_cfg["bf16"] = {"enabled": True}
        elif args.dtype == "fp16":
            ds_cfg["fp16"] = {"enabled": True, "initial_scale_power": 12}
        t_init = time.perf_counter()
        try:
            engines[name], *_ = deepspeed.initialize(model=model, config=ds_cfg)
        except Exception as exc:  # an anchor that does not build here is reported, the others still run
            if squares is not None:
                raise
            print(f"{name} not measured: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        else:  # progress, so that a run stopped by its time limit still says where the time went
            if rank == 0:
                print(f"[{name}] engine built in {time.perf_counter() - t_init:.1f} s", flush=True)
    numel = sum(p.numel() for p in engines["Lamb"].module.parameters())
    g = torch.Generator().manual_seed(rank)
    times = {k: [] for k in engines}
    phases = {k: [] for k in engines}  # (forward, backward incl. reduction, step)
    comm = {k: [] for k in engines}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    losses = {}
    for it in range(args.warmup + args.repeats):
        batches = [torch.randint(0, cfg.vocab_size, (args.micro_batch, args.seq), generator=g).to(device)
                   for _ in range(args.gas)]
        for name, engine in engines.items():
            dist.barrier()
            sync()
            calls.update(n=0, bytes=0)
            t0 = time.perf_counter()
            t_fwd = t_bwd = 0.0
            for ids in batches:  # DeepSpeed steps the optimizer at the accumulation boundary
                ta = time.perf_counter()
                loss = engine(input_ids=ids, labels=ids).loss
                sync()
                tb = time.perf_counter()
                engine.backward(loss)
                sync()
                losses[name] = float(loss.detach())
                t_fwd, t_bwd = t_fwd + tb - ta, t_bwd + time.perf_counter() - tb
                ts = time.perf_counter()
                engine.step()
                sync()
            step_calls = dict(calls)
            t3 = time.perf_counter()
            if rank == 0:
                print(f"[{name}] {'warm-up' if it < args.warmup else 'repeat'} {it + 1} of "
                      f"{args.warmup + args.repeats}: {t3 - t0:.3f} s", flush=True)
            if it >= args.warmup:
                times[name].append(t3 - t0)
                phases[name].append((t_fwd, t_bwd, t3 - ts))
                comm[name].append((step_calls["n"], step_calls["bytes"]))  # every collective of the optimizer step
    counted = {k: (e.vrgd_stats.stat_counters.hooks, e.vrgd_stats.stat_counters.launches,
                   e.vrgd_stats.stat_counters.tables_built, e.vrgd_stats.describe())
               for k, e in engines.items() if hasattr(getattr(e, "vrgd_stats", None), "stat_counters")}
    # aten operations one steady micro-step's backward dispatches (every kind, views too), per engine:
    # what the statistics add is the difference to Lamb's (the device's kernels are a subset)
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Count.ops += 1
            return func(*args, **(kwargs or {}))

    aten = {}
    for name, engine in engines.items():
        for j, ids in enumerate(batches):
            loss = engine(input_ids=ids, labels=ids).loss
            if j == 0:
                _Count.ops = 0
                with _Count():
                    engine.backward(loss)
                aten[name] = _Count.ops
            else:
                engine.backward(loss)
            engine.step()
    if rank != 0:
        return
    med = {k: statistics.median(v) for k, v in times.items()}
    stats = engines["VRLamb"].vrgd_stats
    per_step = {k: comm[k][-1] for k in comm}
    grad_bytes = 4 * numel  # one fp32 gradient
    extra = per_step["VRLamb"][1] - per_step["Lamb"][1]
    where = (f"{torch.cuda.get_device_name()} (NCCL)" if cuda else f"CPU x {torch.get_num_threads()} thread(s) (gloo)")
    print(f"\n{numel:,} parameters ({args.model}), ZeRO-2, {args.dtype}, {dist.get_world_size()} rank(s) on {where}, "
          f"micro-batch {args.micro_batch} x seq {args.seq} x GAS {args.gas}, reduce_bucket_size {args.bucket:,}, "
          f"{args.repeats} repeats")
    print(f"{'optimizer':13s} {'median s':>9s} {'min s':>7s} {'fwd s':>6s} {'bwd s':>6s} {'step s':>6s} "
          f"{'collectives':>11s} {'MB':>8s} {'extra / fp32 grad':>17s}")
    for k in engines:
        f, b, st = (statistics.median(x[i] for x in phases[k]) for i in range(3))
        extra_k = (per_step[k][1] - per_step["Lamb"][1]) / grad_bytes
        print(f"{k:13s} {med[k]:9.3f} {min(times[k]):7.3f} {f:6.3f} {b:6.3f} {st:6.3f} {per_step[k][0]:11d} "
              f"{per_step[k][1] / 1e6:8.1f} {extra_k:17.3f}")
    ratio = med["VRLamb"] / med["Lamb"]
    print(f"\nstep time VRLamb (per-step squares) / Lamb = {ratio:.3f}; with per-micro-step squares "
          f"{med['VRLamb/micro'] / med['Lamb']:.3f}")
    for k in ("VRLamb", "VRLamb/micro"):
        extra_k = per_step[k][1] - per_step["Lamb"][1]
        print(f"  {k:13s} extra bytes per optimizer step (every collective, against Lamb) = {extra_k / 1e6:.1f} MB "
              f"= {extra_k / grad_bytes:.3f} x the fp32 gradient ({grad_bytes / 1e6:.1f} MB), accumulation {args.gas}")
    print(f"step time VRLamb / Lamb = {ratio:.3f} (target <= 1.05: {'met' if ratio <= 1.05 else 'NOT met'})")
    if "VRLamb/hooks" in med:
        print(f"step time VRLamb with a hook per parameter / Lamb = {med['VRLamb/hooks'] / med['Lamb']:.3f}")
    if "FusedLamb" in med:
        r = med["VRLamb"] / med["FusedLamb"]
        print(f"step time VRLamb / DeepSpeed FusedLamb = {r:.3f} (target <= 1.10: {'met' if r <= 1.10 else 'NOT met'});"
              f" Lamb / FusedLamb = {med['Lamb'] / med['FusedLamb']:.3f}")
    if "AdamW(fused)" in med:
        print(f"step time VRLamb / AdamW(fused) = {med['VRLamb'] / med['AdamW(fused)']:.3f}")
    if cuda and args.profile:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        launch = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
        syncs = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
        print("optimizer step only (engine.step at the boundary), per step: kernel launches, host syncs")
        for k, engine in engines.items():
            for ids in batches[:-1]:
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()
            engine.backward(engine(input_ids=batches[-1], labels=batches[-1]).loss)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            ev = prof.events()
            print(f"  {k:13s} launches {sum(e.name in launch for e in ev):6d}  syncs {sum(e.name in syncs for e in ev):5d}")
        # Where the backward's time goes: until backward() returns (the host's part: autograd, DeepSpeed's
        # gradient hooks, the statistics' hook), against the GPU's kernel time in it.
        print(f"one micro-step's backward: ms until it returns (median of {args.gas - 1}: the accumulation's "
              "micro-steps before its boundary), GPU kernel ms, launches, host ms in "
              "the parameters' gradient nodes (their hooks: the statistics' and DeepSpeed's)")
        grad_nodes = ("torch::autograd::AccumulateGrad", "autograd::engine::evaluate_function: torch::autograd::"
                      "AccumulateGrad")
        for k, engine in engines.items():
            returned = []
            for ids in batches[:-1]:  # every micro-step of the accumulation but the boundary's, profiled below
                loss = engine(input_ids=ids, labels=ids).loss
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                engine.backward(loss)
                returned.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                engine.step()  # not a boundary: DeepSpeed counts the micro-step
            loss = engine(input_ids=batches[-1], labels=batches[-1]).loss
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                engine.backward(loss)
                torch.cuda.synchronize()
            engine.step()  # the accumulation boundary: the engine is left where it began
            ev = prof.events()
            kernel_ms = sum(e.time_range.elapsed_us() for e in ev if e.device_type == DeviceType.CUDA) / 1e3
            hooks_ms = sum(a.self_cpu_time_total for a in prof.key_averages() if a.key in grad_nodes) / 1e3
            print(f"  {k:13s} returns {statistics.median(returned or [math.nan]) * 1e3:7.1f}  GPU {kernel_ms:6.1f}  launches "
                  f"{sum(e.name in launch for e in ev):6d}  gradient nodes {hooks_ms:6.1f}")
    if "VRLamb/bf16sq" in med:
        sq = engines["VRLamb/bf16sq"].vrgd_stats.counters
        print(f"step time VRLamb with bf16 squares / Lamb = {med['VRLamb/bf16sq'] / med['Lamb']:.3f}; its "
              f"reduction sent {sq.bytes_sent / max(sq.grad_bytes_fp32, 1):.3f} x fp32 gradient bytes in "
              f"{sq.collectives} calls")
    # the per-step scheme sends the fp32 squares, and with gbar "local" (what "auto" takes in bf16/fp16
    # training, docs/deepspeed.md) the fp32 sum of gradients beside them
    words = 2 if getattr(stats, "gbar", "engine") == "local" else 1
    print(f"statistics counters (per-step scheme, gbar {getattr(stats, 'gbar', '?')}): {stats.counters.collectives} "
          f"collectives since start, {stats.counters.bytes_sent / max(stats.counters.grad_bytes_fp32, 1):.3f} x fp32 "
          f"gradient bytes each; target <= {words}.0x per step at every accumulation: "
          f"{'met' if extra <= 1.02 * words * grad_bytes else 'NOT met'}")
    print(f"collectives per optimizer step: VRLamb {per_step['VRLamb'][0]}, Lamb {per_step['Lamb'][0]} "
          f"(VRLamb adds the statistics' one and a few small per-tensor tables)")
    micro = (args.warmup + args.repeats) * args.gas
    for k, (hooks, launches, tables, how) in counted.items():
        print(f"{k:13s} statistics on the backward path: {hooks} parameter hooks, {launches / micro:.1f} launches per "
              f"micro-step, {tables} segment tables built in {micro} micro-steps ({how})")
    print("aten operations in one micro-step's backward: " + ", ".join(
        f"{k} {n} ({n - aten['Lamb']:+d} against Lamb)" for k, n in aten.items()))
    for k, e in engines.items():
        m = e.basic_optimizer.gsnr_metrics() if hasattr(e.basic_optimizer, "gsnr_metrics") else {}
        shown = {key: round(m[key], 4) for key in ("gsnr/n", "gsnr/mean", "gsnr/clip_low_frac", "trust_ratio/mean",
                                                    "step/skipped_total") if key in m}
        print(f"{k:13s} last loss {losses[k]:.4f}  {shown}")
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
    ap.add_argument("--ranks", type=int, choices=(1, 2), default=2)
    ap.add_argument("--gas", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    ap.add_argument("--model", choices=sorted(MODELS), default="small")
    ap.add_argument("--bf16-squares", action="store_true", help="also time VRLamb with bf16 squares")
    ap.add_argument("--hooks", action="store_true", help="also time VRLamb with a tensor hook per parameter "
                    "(\"micro_steps\": \"hooks\"), the path before the statistics read DeepSpeed's buckets")
    ap.add_argument("--anchors", action="store_true", help="also time DeepSpeed's FusedLamb and fused AdamW (CUDA; "
                    "on H100 export TORCH_CUDA_ARCH_LIST=9.0 first)")
    ap.add_argument("--profile", action="store_true",
                    help="count kernel launches and host syncs of each step, and profile one backward (CUDA)")
    args = ap.parse_args()
    if args.worker or os.environ.get("RANK") is not None:  # launched (deepspeed, torchrun), or one rank by hand
        worker(args)
        from vrgd_ds.run import leave_together

        leave_together()  # NCCL's teardown otherwise waits, gloo's can abort
    else:
        argv = [a for a in sys.argv[1:]]
        sys.exit(launch(argv))


if __name__ == "__main__":
    main()
