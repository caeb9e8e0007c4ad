"""Optimizer-step cost of the VRGD family against torch's AdamW, on CPU.

What is measured: the wall time of ``opt.step()`` alone, for ~50M fp32 parameters in
BERT-like tensor shapes (hidden 512, intermediate 2048, vocab 30522; the number of layers is
chosen to come closest to ``--params-millions``). Each optimizer owns its own copy of the
parameters. Before every step two backward passes run (outside the timed region), each
``loss = sum((p * z_i).sum())`` with a fixed random tensor ``z_i`` per parameter and group
index i, so every optimizer sees the same per-element varying gradients and the VRGD
optimizers see n = 2 gradient groups. After warm-up steps (which also build the fused C++
kernels on first use), the optimizers are timed round-robin, one step each per repeat, so
machine noise hits all of them alike; the table reports the median.

Memory: after the first step, the bytes of every non-scalar tensor in ``opt.state`` plus the
VRGD statistics buffers, in fp32 words per parameter; "extra" subtracts Adam's two words
(exp_avg, exp_avg_sq) for the Adam family and is the raw count for the others.

Run:  python benchmarks/optimizer_step.py [--params-millions 50] [--repeats 15] [--json out.json]
      python benchmarks/optimizer_step.py --only VRAdam VRLamb Lamb --placements   # each GSNR placement
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import vrgd_ds
from vrgd_ds.optim.adam import GSNR_PLACEMENTS

HIDDEN, INTER, VOCAB, POSITIONS, TYPES = 512, 2048, 30522, 512, 2
OURS = tuple(info.cls for info in vrgd_ds.REGISTRY.values())  # every member
FACTORIES = {
    "AdamW(foreach)": lambda ps: torch.optim.AdamW(ps, foreach=True),
    "AdamW(fused)": lambda ps: torch.optim.AdamW(ps, fused=True),
    **{cls.__name__: (lambda ps, cls=cls: cls(ps, fused=True)) for cls in OURS},
}
#: --placements: VRAdam and VRLamb once more per non-default GSNR placement (the default,
#: first_moment, is the plain "VRAdam"/"VRLamb" row)
PLACEMENT_FACTORIES = {
    f"{cls.__name__}({pl})": (lambda ps, cls=cls, pl=pl: cls(ps, fused=True, gsnr_placement=pl))
    for cls in (vrgd_ds.VRAdam, vrgd_ds.VRLamb) for pl in GSNR_PLACEMENTS[1:]
}
ADAM_FAMILY = ("AdamW(foreach)", "AdamW(fused)", "VRAdam", "VRLamb", "Lamb", "VRMerit", "Merit", *PLACEMENT_FACTORIES)


def bert_shapes(target: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a BERT encoder (embeddings, layers, pooler) with about ``target`` elements."""
    h, f = HIDDEN, INTER
    layer = 4 * [(h, h), (h,)] + [(h,), (h,)] + [(f, h), (f,), (h, f), (h,)] + [(h,), (h,)]  # q k v o, LN, FFN, LN
    per_layer = sum(torch.Size(s).numel() for s in layer)
    fixed = (POSITIONS + TYPES + 2 + h + 1) * h  # position, token type, embedding LN, pooler
    vocab = min(VOCAB, max(1000, (target - fixed - per_layer) // h))  # shrink only for tiny targets
    layers = max(1, round((target - fixed - vocab * h) / per_layer))
    return [(vocab, h), (POSITIONS, h), (TYPES, h), (h,), (h,)] + layer * layers + [(h, h), (h,)]


def backward_groups(params: list[torch.Tensor], noise: list[list[torch.Tensor]]) -> None:
    """One backward per noise set: each is one gradient group for the VRGD statistics."""
    for zs in noise:
        sum((p * z).sum() for p, z in zip(params, zs)).backward()


def state_words(opt: torch.optim.Optimizer, numel: int) -> float:
    """Optimizer state plus statistics buffers, in fp32 words per parameter."""
    nbytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                 if torch.is_tensor(v) and v.dim() > 0)
    stats = getattr(opt, "_hook_stats", None)
    return (nbytes + (stats.buffer_bytes() if stats is not None else 0)) / (4 * numel)


def other_cpu_s() -> float:
    """CPU seconds the whole machine has been busy, less this process's own (Linux; else 0)."""
    try:
        with open("/proc/stat") as fh:
            ticks = [int(x) for x in fh.readline().split()[1:8]]
    except OSError:
        return 0.0
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle, iowait
    own = os.times()
    return busy - own.user - own.system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params-millions", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="also write the results as JSON here")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these optimizers only (AdamW(fused) and "
                    "AdamW(foreach) are always run, and Lamb: the ratios refer to them; VRAdam/VRLamb bring their "
                    "--placements rows); each holds its own copy of the parameters, so fewer rows need less memory")
    ap.add_argument("--placements", action="store_true", help="add VRAdam/VRLamb rows for the other GSNR "
                    f"placements ({', '.join(GSNR_PLACEMENTS[1:])})")
    args = ap.parse_args()
    factories = {**FACTORIES, **(PLACEMENT_FACTORIES if args.placements else {})}
    if args.only:
        unknown = sorted(set(args.only) - set(factories))
        if unknown:
            ap.error(f"--only {unknown[0]}: not one of {', '.join(factories)}")
        factories = {k: v for k, v in factories.items()
                     if k.split("(")[0] in args.only or k in args.only or k.startswith("AdamW") or k == "Lamb"}

    torch.manual_seed(0)
    shapes = bert_shapes(int(args.params_millions * 1e6))
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"{numel:,} fp32 parameters in {len(shapes)} tensors; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.warmup} warm-up steps, {args.repeats} timed repeats")
    init = [torch.randn(s) * 0.02 for s in shapes]
    noise = [[torch.randn(s) * 1e-2 + 1e-3 for s in shapes] for _ in range(2)]
    runs = {}
    for name, make in factories.items():
        params = [t.clone().requires_grad_() for t in init]
        runs[name] = {"params": params, "opt": make(params), "times": [], "bwd": []}

    words = {}
    other0, wall0 = other_cpu_s(), time.perf_counter()
    for it in range(args.warmup + args.repeats):
        for name, run in runs.items():  # round-robin: one step of each optimizer per repeat
            opt = run["opt"]
            tb = time.perf_counter()
            backward_groups(run["params"], noise)  # with our optimizers, their statistics hooks
            t0 = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - t0
            if it == 0:
                words[name] = state_words(opt, numel)
                print(f"  first step {name:22s} {elapsed:7.3f} s")
            elif it >= args.warmup:
                run["times"].append(elapsed)
                run["bwd"].append(t0 - tb)
            opt.zero_grad(set_to_none=False)

    other = (other_cpu_s() - other0) / (time.perf_counter() - wall0)  # other processes' mean CPU use
    med = {name: statistics.median(run["times"]) for name, run in runs.items()}
    bwd = {name: statistics.median(run["bwd"]) for name, run in runs.items()}
    rows = []
    for name, run in runs.items():
        extra = words[name] - (2 if name in ADAM_FAMILY else 0)
        rows.append(dict(optimizer=name, median_s=med[name], min_s=min(run["times"]), max_s=max(run["times"]),
                         vs_adamw_fused=med[name] / med["AdamW(fused)"],
                         vs_adamw_foreach=med[name] / med["AdamW(foreach)"],
                         vs_lamb=med[name] / med["Lamb"] if "Lamb" in med else float("nan"),
                         backward_s=bwd[name], hooks_s=bwd[name] - bwd["AdamW(fused)"],
                         state_words_per_param=words[name], extra_words_per_param=extra,
                         skipped_steps=getattr(run["opt"], "skipped_steps", 0)))

    print(f"\n{'optimizer':22s} {'median ms':>10s} {'min ms':>8s} {'max ms':>8s} {'/fused':>7s} "
          f"{'/foreach':>8s} {'/Lamb':>6s} {'words':>6s} {'extra':>6s} {'skipped':>7s} {'bwd ms':>7s} {'hooks ms':>8s}")
    for r in rows:
        print(f"{r['optimizer']:22s} {1e3 * r['median_s']:10.1f} {1e3 * r['min_s']:8.1f} {1e3 * r['max_s']:8.1f} "
              f"{r['vs_adamw_fused']:7.2f} {r['vs_adamw_foreach']:8.2f} {r['vs_lamb']:6.2f} {r['state_words_per_param']:6.2f} "
              f"{r['extra_words_per_param']:6.2f} {r['skipped_steps']:7d} {1e3 * r['backward_s']:7.1f} "
              f"{1e3 * r['hooks_s']:8.1f}")
    print("bwd: the two backward passes before each step; hooks: their time beyond AdamW(fused)'s, i.e. the "
          "statistics hooks")
    print(f"other processes used {other:.2f} CPU cores on average during the run"
          + (" -- timings are disturbed, run again on a quiet machine" if other > 0.1 else ""))
    vr = next((r for r in rows if r["optimizer"] == "VRAdam"), None)
    time_ok = mem_ok = None
    if vr is not None:
        time_ok, mem_ok = vr["vs_adamw_fused"] <= 2.0, vr["extra_words_per_param"] <= 3.0
        print(f"\nVRAdam / AdamW(fused) = {vr['vs_adamw_fused']:.2f} (target <= 2.0: "
              f"{'met' if time_ok else 'NOT met'}); extra memory {vr['extra_words_per_param']:.2f} fp32 words/param "
              f"(target <= 3: {'met' if mem_ok else 'NOT met'})")

    if args.json:
        meta = dict(params=numel, tensors=len(shapes), threads=torch.get_num_threads(), torch=torch.__version__,
                    repeats=args.repeats, warmup=args.warmup, other_cpu_cores=other)
        result = dict(meta=meta, results=rows, vradam_vs_adamw_fused=vr["vs_adamw_fused"] if vr else None,
                      time_target_met=time_ok, memory_target_met=mem_ok)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
