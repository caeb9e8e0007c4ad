"""A small real training run of VR-LAMB against LAMB (same code with GSNR off).

A student MLP learns a noisy random teacher network with large batches split into
micro-batches (each micro-batch's backward is one gradient group). Prints the loss as it
goes, GSNR telemetry, and held-out loss before and after for both optimizers.

    python -m vrgd_ds.demo [--steps 150] [--micro-batches 16]
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import vrgd_ds


def make_data(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    teacher = nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, 1))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
        x = torch.randn(n, dim, generator=g)
        y = teacher(x) + 0.5 * torch.randn(n, 1, generator=g)  # label noise: gradients are noisy
    return x, y


def student(dim: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 1))


def train(name: str, x: torch.Tensor, y: torch.Tensor, xv: torch.Tensor, yv: torch.Tensor, args) -> float:
    torch.manual_seed(0)
    model = student(x.shape[1])
    cls = vrgd_ds.REGISTRY[name].cls
    opt = cls(vrgd_ds.param_groups(model, weight_decay=0.01), lr=args.lr, max_coeff=0.3)
    loss_fn = nn.MSELoss()
    with torch.no_grad():
        before = loss_fn(model(xv), yv).item()
    g = torch.Generator().manual_seed(1)
    batch = args.micro_batches * args.micro_batch_size
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, x.shape[0], (batch,), generator=g)
        for mb in idx.split(args.micro_batch_size):  # one backward per micro-batch = one gradient group
            (loss_fn(model(x[mb]), y[mb]) / args.micro_batches).backward()
        opt.step()
        opt.zero_grad()
        if step % args.log_every == 0 or step == 1:
            m = opt.gsnr_metrics(samples_per_group=args.micro_batch_size)
            with torch.no_grad():
                val = loss_fn(model(xv), yv).item()
            gsnr = (f" gsnr mean {m['gsnr/mean']:.3g} clip low/high {m['gsnr/clip_low_frac']:.2f}/"
                    f"{m['gsnr/clip_high_frac']:.2f} B_simple {m['noise_scale/b_simple']:.0f}"
                    ) if "gsnr/mean" in m else ""
            trust = m.get("trust_ratio/mean")  # none on a step skipped for non-finite gradients
            shown = "– (step skipped: non-finite gradients)" if trust is None else f"{trust:.3f}"
            print(f"  {name:7s} step {step:4d}  held-out MSE {val:.4f}  trust {shown}{gsnr}")
    with torch.no_grad():
        after = loss_fn(model(xv), yv).item()
    print(f"  {name}: held-out MSE {before:.4f} -> {after:.4f} in {time.perf_counter() - t0:.1f}s")
    return after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--micro-batches", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args()
    if args.micro_batches < 2:  # one backward per micro-batch is one gradient group
        ap.error(f"--micro-batches must be at least 2 (the GSNR needs two gradient groups a step), got "
                 f"{args.micro_batches}")
    for name in ("steps", "micro_batch_size", "log_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.lr > 0:
        ap.error(f"--lr must be positive, got {args.lr}")
    x, y = make_data(50_000, 32, seed=0)
    xv, yv = x[-5_000:], y[-5_000:]
    x, y = x[:-5_000], y[:-5_000]
    print(f"teacher-student regression: {x.shape[0]} train / {xv.shape[0]} held-out samples, "
          f"batch {args.micro_batches} x {args.micro_batch_size}, {args.steps} steps "
          "(the first run builds the fused CPU kernels, under a minute)")
    results = {name: train(name, x, y, xv, yv, args) for name in ("VRLamb", "Lamb")}
    print("held-out MSE after training: " + ", ".join(f"{k} {v:.4f}" for k, v in results.items())
          + " (noise floor 0.25)")


if __name__ == "__main__":
    main()
