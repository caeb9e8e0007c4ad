"""Optimizer step on one CUDA GPU: the VRGD family's Triton kernels against the fused anchors,
measured side by side in one run.

What is timed: ``opt.step()`` alone on BERT-base or BERT-large parameter shapes (~400 tensors
for large), fp32 parameters and gradients already in place, VRGD statistics from ``n`` groups
already reduced (what the DeepSpeed hooks hand over). Anchors: ``torch.optim.AdamW(fused=True)``,
DeepSpeed 0.19.8's ``FusedLamb`` (JIT-built: on H100 set ``TORCH_CUDA_ARCH_LIST="9.0"``, see
docker/README.md) and apex's ``FusedLAMB`` when apex is importable (the image in docker/ builds it).

``--flat`` gives every optimizer but AdamW what it sees under ZeRO-1/2 on one rank: one flat
fp32 partition; ours cut into per-tensor segments by a ``Layout`` (per-tensor trust ratios),
DeepSpeed's FusedLamb then computes ONE trust ratio for the whole partition (a speed floor, not
the same algorithm).

Per optimizer: median wall ms and GPU kernel ms (CUDA events / torch.profiler), kernel launches
and host synchronisations per step (torch.profiler), the synchronisations torch's sync-debug
mode reports, and the achieved GB/s against the fp32 words each step must move
(``WORDS``, from ../shared/gpu-notes.md). Then the ratios the targets are stated in.

    python benchmarks/gpu_optimizer_step.py --model large [--flat] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

import vrgd_ds
from vrgd_ds.stats.layout import Layout

SHAPES = {"base": (768, 12, 3072), "large": (1024, 24, 4096)}
#: fp32 words read + written per parameter by a fused step (the memory floor)
WORDS = {"AdamW(fused)": 7, "VRAdam": 13, "Lamb": 10, "VRLamb": 16, "VRSGD": 6, "VRMomentum": 8, "VRLars": 10,
         "Lars": 7, "DS FusedLamb": 10, "apex FusedLAMB": 13}
#: (a, b, target of a / b, where the target is set: per-tensor lists, one flat partition, or both)
TARGETS = [("VRLamb", "DS FusedLamb", 1.7, "flat"), ("VRLamb", "apex FusedLAMB", 1.3, "both"),
           ("VRAdam", "AdamW(fused)", 1.9, "per-tensor"), ("Lamb", "DS FusedLamb", 1.1, "both")]
LAUNCH = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx"}
SYNC = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}


def bert_shapes(h: int, layers: int, ff: int, vocab: int = 30522) -> list[tuple[str, tuple[int, ...]]]:
    out = [("word", (vocab, h)), ("position", (512, h)), ("token_type", (2, h)), ("emb.ln.w", (h,)), ("emb.ln.b", (h,))]
    for i in range(layers):
        for name, shape in (("q.w", (h, h)), ("q.b", (h,)), ("k.w", (h, h)), ("k.b", (h,)), ("v.w", (h, h)),
                            ("v.b", (h,)), ("attn_out.w", (h, h)), ("attn_out.b", (h,)), ("attn_ln.w", (h,)),
                            ("attn_ln.b", (h,)), ("ffn_in.w", (ff, h)), ("ffn_in.b", (ff,)), ("ffn_out.w", (h, ff)),
                            ("ffn_out.b", (h,)), ("ln.w", (h,)), ("ln.b", (h,))):
            out.append((f"layer{i}.{name}", shape))
    return out + [("head.w", (h, h)), ("head.b", (h,)), ("head.ln.w", (h,)), ("head.ln.b", (h,)), ("decoder.b", (vocab,))]


class ReducedStats:
    """A statistics source holding ``Σg``, ``Σg²`` of ``n`` groups, as the DeepSpeed hooks leave them."""

    def __init__(self, params: list[torch.Tensor], n: int) -> None:
        self.n = n
        self._sums = {id(p): (p.grad * n, p.grad.square() * n + 1e-6 * torch.rand_like(p.grad)) for p in params}

    def moments(self, params):
        return [self._sums[id(p)][0] for p in params], [self._sums[id(p)][1] for p in params]

    def reset(self) -> None:  # kept: every timed step sees the same statistics
        pass


def make_params(shapes, flat: bool) -> list[torch.nn.Parameter]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = [torch.Size(s).numel() for _, s in shapes]
    if flat:
        p = torch.nn.Parameter(torch.randn(sum(sizes), device="cuda", generator=gen) * 0.02)
        p.grad = torch.randn(p.shape, device="cuda", generator=gen) * 1e-3
        return [p]
    out = []
    for _, s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen) * 0.02)
        p.grad = torch.randn(s, device="cuda", generator=gen) * 1e-3
        out.append(p)
    return out


def check_triton(opt, name: str) -> None:
    """Refuses to time anything but the Triton kernels. With ``fused=None`` they come inside the
    fallback wrapper, whose ``name`` is the implementation in use (the reference once a kernel failed)."""
    if opt.kernels().name != "triton":
        raise RuntimeError(f"{name} is not running the Triton kernels: {opt.kernels().name}")


def build(name: str, params, shapes, flat: bool, groups: int):
    kw = dict(lr=1e-3, weight_decay=0.01)
    if name == "AdamW(fused)":
        return torch.optim.AdamW(params, fused=True, **kw)
    if name == "DS FusedLamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb(params, **kw)
    if name == "apex FusedLAMB":
        from apex.optimizers import FusedLAMB

        return FusedLAMB(params, **kw)
    opt = vrgd_ds.REGISTRY[name].cls(params, **kw)
    check_triton(opt, name)
    layout = None
    if flat:
        layout = flat_layout(params[0], [n for n, _ in shapes], [torch.Size(s).numel() for _, s in shapes])
    opt.set_statistics_source(ReducedStats(params, groups) if vrgd_ds.REGISTRY[name].vr else None, layout)
    return opt


def flat_layout(flat: torch.Tensor, names: list[str], sizes: list[int]) -> Layout:
    """The ``Layout`` of one flat partition holding the named tensors back to back, as ZeRO's
    flat fp32 partition holds them: each tensor its own segment (per-tensor trust ratios)."""
    layout = Layout(names, sizes, group=None, device=flat.device.type)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    layout.add(flat, [(starts[i], sizes[i], i) for i in range(len(sizes))])
    return layout


def measure(opt, warmup: int, iters: int) -> dict[str, float]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):  # also compiles the Triton kernels
        opt.step()
    torch.cuda.synchronize()
    wall, gpu, host = [], [], []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        start.record()
        opt.step()
        host.append(time.perf_counter() - t0)  # until step() returned: the host's share (launches are async)
        end.record()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
        gpu.append(start.elapsed_time(end) / 1e3)
    k = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(k):
            opt.step()
        torch.cuda.synchronize()
    events = prof.events()
    launches = sum(e.name in LAUNCH for e in events) / k
    syncs = sum(e.name in SYNC for e in events) / k
    kernel_ms = sum(e.time_range.elapsed_us() for e in events if e.device_type == DeviceType.CUDA) / 1e3 / k
    by_kernel: dict[str, float] = {}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            by_kernel[e.name[:60]] = by_kernel.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 1e3 / k
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
        torch.cuda.current_stream().synchronize()
    torch.cuda.set_sync_debug_mode("default")
    debug_syncs = sum("synchroniz" in str(w.message) for w in caught)
    top = dict(sorted(by_kernel.items(), key=lambda kv: -kv[1])[:6])
    return dict(wall_ms=statistics.median(wall) * 1e3, gpu_ms=statistics.median(gpu) * 1e3, kernel_ms=kernel_ms,
                host_ms=statistics.median(host) * 1e3, launches=launches, syncs=syncs, debug_syncs=debug_syncs,
                kernels=top)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 28, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 10 * 2 * x.numel() * 4 / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="large")
    ap.add_argument("--flat", action="store_true", help="one flat partition, as ZeRO-1/2 hands it over")
    ap.add_argument("--groups", type=int, default=4, help="GSNR groups n of the statistics")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", nargs="+", default=list(WORDS), choices=list(WORDS))
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--kernels", action="store_true", help="print each optimizer's GPU time by kernel")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_optimizer_step.py needs a CUDA GPU (the CPU figures: benchmarks/optimizer_step.py)")
    shapes = bert_shapes(*SHAPES[args.model])
    numel = sum(torch.Size(s).numel() for _, s in shapes)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bw:.0f} GB/s; BERT-{args.model}: {numel:,} parameters in "
          f"{len(shapes)} tensors; flat={args.flat}; n={args.groups}")
    print(f"{'optimizer':16s} {'wall ms':>8s} {'GPU ms':>8s} {'host ms':>8s} {'launches':>9s} {'syncs':>6s} "
          f"{'debug':>6s} {'GB/s':>7s} {'floor ms':>9s}")
    results = {}
    for name in args.only:
        params = make_params(shapes, args.flat and name != "AdamW(fused)")
        try:
            opt = build(name, params, shapes, args.flat, args.groups)
        except Exception as exc:  # apex absent, FusedLamb not built, ...
            print(f"{name:16s} not measured: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        r = measure(opt, args.warmup, args.iters)
        if name in vrgd_ds.REGISTRY:
            check_triton(opt, name)  # still: a kernel that failed at run time hands over to the reference
        r["gbps"] = WORDS[name] * 4 * numel / (r["gpu_ms"] / 1e3) / 1e9
        r["floor_ms"] = WORDS[name] * 4 * numel / bw / 1e6
        results[name] = r
        print(f"{name:16s} {r['wall_ms']:8.2f} {r['gpu_ms']:8.2f} {r['host_ms']:8.2f} {r['launches']:9.0f} "
              f"{r['syncs']:6.0f} {r['debug_syncs']:6d} {r['gbps']:7.0f} {r['floor_ms']:9.2f}")
        if args.kernels:
            print("    GPU ms by kernel: " + "; ".join(f"{k} {v:.2f}" for k, v in r["kernels"].items()))
        del opt, params
        torch.cuda.empty_cache()
    print()
    layout = "flat" if args.flat else "per-tensor"
    for a, b, target, where in TARGETS:
        if a in results and b in results:
            ratio = results[a]["wall_ms"] / results[b]["wall_ms"]
            verdict = ("met" if ratio <= target else "NOT met") if where in (layout, "both") else "no target here"
            print(f"{a} / {b}: {ratio:.2f} (target <= {target} on {where}: {verdict})")
        else:
            print(f"{a} / {b}: not measured ({', '.join(x for x in (a, b) if x not in results)} missing)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_gbps=bw, model=args.model, flat=args.flat,
                           results=results), fh, indent=2)


if __name__ == "__main__":
    main()
