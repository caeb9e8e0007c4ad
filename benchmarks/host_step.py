"""The host's share of ``opt.step()`` on the Triton path, measured without a GPU: every Triton
launch is made a no-op, so what is timed is the Python and torch work the step does around its
kernels (plans, tables, arguments, torch operations), for the BERT-large tensor count.

On a GPU the step's launches are asynchronous, and a per-tensor step whose host work outlasts its
kernels leaves the GPU waiting (docs/benchmarks.md, "On a GPU"). The GPU's own host time adds the
CUDA launch costs to this. Tensors here hold 2 elements each: the host work depends on the number of
tensors, not their size. The statistics come from ``n = 4`` groups already reduced, as in
``gpu_optimizer_step.py``, whose shapes and statistics source this reuses. Members are measured
side by side in one run: a median of ``--iters`` steps after 3 warm-up steps.

    python benchmarks/host_step.py [--iters 20] [--only VRAdam Lamb]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors take the interpreter's launcher, patched below

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_optimizer_step import ReducedStats, bert_shapes, flat_layout  # noqa: E402

import vrgd_ds  # noqa: E402

MEMBERS = ["VRAdam", "Lamb", "VRLamb", "VRSGD", "VRMomentum", "VRLars", "Lars"]


class NoLaunch:
    """Counts Triton launches and runs none of them."""

    def __init__(self) -> None:
        self.count = 0
        self._run = interpreter.InterpretedFunction.run

    def __enter__(self) -> "NoLaunch":
        def run(fn, *args, **kwargs):
            self.count += 1

        interpreter.InterpretedFunction.run = run
        return self

    def __exit__(self, *exc) -> None:
        interpreter.InterpretedFunction.run = self._run


def build(name: str, count: int, flat: bool):
    torch.manual_seed(0)
    if flat:
        params = [torch.nn.Parameter(torch.randn(2 * count))]
    else:
        params = [torch.nn.Parameter(torch.randn(2)) for _ in range(count)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = vrgd_ds.REGISTRY[name].cls(params, lr=1e-3, weight_decay=0.01, fused="triton")
    layout = flat_layout(params[0], [f"t{i}" for i in range(count)], [2] * count) if flat else None
    opt.set_statistics_source(ReducedStats(params, 4) if vrgd_ds.REGISTRY[name].vr else None, layout)
    return opt


def host_ms(opt, iters: int, launches: NoLaunch) -> tuple[float, int]:
    for _ in range(3):
        opt.step()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    before = launches.count
    opt.step()
    return statistics.median(times) * 1e3, launches.count - before


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--only", nargs="+", choices=MEMBERS)
    args = ap.parse_args()
    count = len(bert_shapes(1024, 24, 4096))
    print(f"host ms per step with Triton launches as no-ops, {count} tensors (BERT-large), "
          f"torch {torch.__version__}, {os.cpu_count()} CPU cores\n")
    print("| optimizer | per-tensor host ms | launches | flat partition host ms | launches |\n|---|---|---|---|---|")
    with NoLaunch() as launches:
        for name in args.only or MEMBERS:
            row = [host_ms(build(name, count, flat), args.iters, launches) for flat in (False, True)]
            print(f"| {name} | {row[0][0]:.2f} | {row[0][1]} | {row[1][0]:.2f} | {row[1][1]} |", flush=True)


if __name__ == "__main__":
    main()
