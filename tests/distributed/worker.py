"""Runs many DeepSpeed cases inside one 2-rank launch (one process group, engines built one
after another) and writes one JSON result per case. Launched by ``test_deepspeed.py``:

    deepspeed --num_gpus 2 tests/distributed/worker.py --suite matrix --out results.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import traceback

import torch

import vrgd_ds  # noqa: F401  (registers the names with DeepSpeed)
import deepspeed
import deepspeed.comm as dist

sys.path.insert(0, os.path.dirname(__file__))
from reference import Reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPT_KW = {
    "VRSGD": dict(lr=0.05),
    "VRAdam": dict(lr=1e-2, weight_decay=0.01),
    "VRLamb": dict(lr=1e-2, weight_decay=0.01),
    "VRLars": dict(lr=0.5, momentum=0.9, weight_decay=1e-3),
    "Lamb": dict(lr=1e-2, weight_decay=0.01),
}
STEPS = int(os.environ.get("VRGD_TEST_STEPS", "3"))
if os.environ.get("VRGD_TEST_OPT_KW"):  # debugging: override the optimizer arguments
    OPT_KW = {k: {**v, **json.loads(os.environ["VRGD_TEST_OPT_KW"])} for k, v in OPT_KW.items()}
MICRO = 4


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """Tensor sizes (5·13+13, 13·7+7, 7) chosen so ZeRO partitions and buckets cut through tensors."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7),
                               torch.nn.LayerNorm(7))


def loss_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    x, y = batch
    p = next(model.parameters())
    return torch.nn.functional.mse_loss(model(x.to(p.dtype)).float(), y)


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(MICRO, 5, generator=g), torch.randn(MICRO, 7, generator=g)


def config(case: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "steps_per_print": 10**9,
        "optimizer": {"type": case["opt"], "params": OPT_KW[case["opt"]]},
        "zero_optimization": {"stage": case["stage"], "reduce_bucket_size": case["bucket"],
                              "allgather_bucket_size": max(case["bucket"], 500),
                              "stage3_param_persistence_threshold": 0},
    }
    if case["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    if case["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    return cfg


def full_params(engine) -> list[torch.Tensor]:
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return [p.detach().float().clone() for p in params]
    return [p.detach().float().clone() for p in params]


def run_matrix_case(case: dict) -> dict:
    model = tiny_model()
    dtype = DTYPES[case["dtype"]]
    world, rank = dist.get_world_size(), dist.get_rank()
    cls = vrgd_ds.REGISTRY[case["opt"]].cls
    ref = Reference(model, lambda ps: cls(ps, **OPT_KW[case["opt"]]), dtype, case["stage"], case["gas"], world,
                    case["clip"])
    engine, *_ = deepspeed.initialize(model=model, config=config(case))
    ns, skipped = [], 0
    for step in range(STEPS):
        scale = float(getattr(engine.optimizer, "loss_scale", 1.0))
        for j in range(case["gas"]):
            loss = loss_fn(engine.module, batch(step, rank, j))
            engine.backward(loss)
            engine.step()
        m = engine.basic_optimizer.gsnr_metrics()
        ns.append(m.get("gsnr/n"))
        skipped += int(m.get("step/skipped_overflow", 0))
        ref.step([[batch(step, r, j) for j in range(case["gas"])] for r in range(world)], loss_fn, scale)
    got = full_params(engine)
    want = [p.detach().to(dtype).float() if dtype != torch.float32 else p.detach() for p in ref.master.parameters()]
    err = max(float(((a - b).abs() / (b.abs() + 1e-3)).max()) for a, b in zip(got, want))
    moved = max(float((b - a.detach().float()).abs().max()) for a, b in zip(tiny_model().parameters(), want))
    return dict(max_rel_err=err, moved=moved, n=ns, skipped=skipped)


def matrix_cases():
    for i, (stage, dtype, gas, clip, opt) in enumerate(itertools.product(
            (0, 1, 2, 3), ("fp32", "bf16", "fp16"), (1, 2), (0.0, 1.0), ("VRSGD", "VRAdam", "VRLamb", "VRLars"))):
        bucket = (40, 500)[i % 2]  # small buckets: many per step; large: one
        yield f"stage{stage}-{dtype}-gas{gas}-clip{clip:g}-{opt}-bucket{bucket}", dict(
            stage=stage, dtype=dtype, gas=gas, clip=clip, opt=opt, bucket=bucket)


def lamb_cases():
    for stage in (0, 1, 2, 3):
        yield f"lamb-stage{stage}", dict(stage=stage, dtype="fp32", gas=2, clip=1.0, opt="Lamb", bucket=40)


def run_suite(cases, runner, only: str | None) -> dict:
    out = {}
    for name, case in cases:
        if only and only not in name:
            continue
        try:
            res = runner(case)
            res["case"] = case
        except Exception as e:  # recorded per case; the test shows it
            res = dict(case=case, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc())
        out[name] = res
        if dist.get_rank() == 0:
            print(f"[worker] {name}: {json.dumps({k: v for k, v in res.items() if k != 'trace'})}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", action="append", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=None)
    args, _ = ap.parse_known_args()
    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for suite in args.suite:
        if suite == "matrix":
            results.update(run_suite(matrix_cases(), run_matrix_case, args.only))
        elif suite == "lamb":
            results.update(run_suite(lamb_cases(), run_matrix_case, args.only))
        else:
            raise SystemExit(f"unknown suite {suite}")
    if dist.get_rank() == 0:
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
