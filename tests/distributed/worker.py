"""DeepSpeed cases for the rank pool (``pool.py``): each ``run_*`` function builds its engines
in the pool's process group, runs on every rank and returns rank 0's result; the single-process
references are computed on rank 0 only. The case lists (``*_cases``) are what
``test_deepspeed.py`` parametrises over; ``matrix_design``/``perstep_design`` pick the covering
subsets that ``make test`` runs (every pair of factor levels at least once).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import sys

import torch

import vrgd_ds  # registers the names with DeepSpeed
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
    "VRMerit": dict(lr=1e-2, weight_decay=0.01),
}
# every other member of the registry: its base's arguments, else the registry's test arguments
for _name, _info in vrgd_ds.REGISTRY.items():
    OPT_KW.setdefault(_name, dict(OPT_KW.get(_info.base) or OPT_KW.get("VR" + _info.base) or _info.test_kwargs))
STEPS = int(os.environ.get("VRGD_TEST_STEPS", "3"))
if os.environ.get("VRGD_TEST_OPT_KW"):  # debugging: override the optimizer arguments
    OPT_KW = {k: {**v, **json.loads(os.environ["VRGD_TEST_OPT_KW"])} for k, v in OPT_KW.items()}
MICRO = 4


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """Tensor sizes (5·13+13, 13·7+7, 7) chosen so ZeRO partitions and buckets cut through tensors."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7),
                               torch.nn.LayerNorm(7))


def loss_fn(model: torch.nn.Module, batch, dtype: torch.dtype) -> torch.Tensor:
    """``model``: the engine itself (its forward runs DeepSpeed's per-micro-step logic) or a module."""
    x, y = batch
    return torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def batch(step: int, rank: int, micro: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(MICRO, 5, generator=g), torch.randn(MICRO, 7, generator=g)


def config(case: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": case["gas"],
        "gradient_clipping": case["clip"],
        "steps_per_print": 10**9,
        "optimizer": {"type": case["opt"], "params": dict(OPT_KW[case["opt"]])},
        "zero_optimization": {"stage": case["stage"], "reduce_bucket_size": case["bucket"],
                              "allgather_bucket_size": max(case["bucket"], 500),
                              "stage3_param_persistence_threshold": 0},
    }
    cfg["vrgd"] = {"squares": case.get("scheme", "per_micro_step"), "gbar": case.get("gbar", "auto")}
    if case.get("node_size"):
        cfg["vrgd"]["node_size"] = case["node_size"]
    if case.get("sq_dtype"):
        cfg["vrgd"]["squares_dtype"] = case["sq_dtype"]
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
    from vrgd_ds.ds.names import engine_spelling, resolve

    cls = resolve(engine_spelling(case["opt"]))  # what the config's "type" builds ("Lamb": FusedLamb's defaults)
    gbar = case.get("gbar", "auto")
    if gbar == "auto":
        gbar = "engine" if dtype == torch.float32 else "local"
    # the hierarchical scheme reduces the per-step scheme's sums, the same statistics
    squares = case.get("scheme", "per_micro_step")
    scheme = dict(squares="per_step" if squares == "hierarchical" else squares, gbar=gbar)
    first = rank == 0  # the references run once, on rank 0
    ref = Reference(model, lambda ps: cls(ps, **OPT_KW[case["opt"]]), dtype, case["stage"], case["gas"], world,
                    case["clip"], **scheme) if first else None
    plain = None  # the same run without variance reduction: how far apart a GSNR mistake would land
    if first and REGISTRY_GSNR(case["opt"]):
        plain = Reference(model, lambda ps: cls(ps, **{**OPT_KW[case["opt"]], "gamma": 1.0}), dtype, case["stage"],
                          case["gas"], world, case["clip"], **scheme)
    engine, *_ = deepspeed.initialize(model=model, config=config(case))
    ns, skipped, gsnr_means = [], 0, []
    early = case.get("micro_steps")  # micro-steps per step, a step ending early where fewer than gas
    for step in range(STEPS):
        scale = float(getattr(engine.optimizer, "loss_scale", 1.0))
        micro = case["gas"] if early is None else early[step % len(early)]
        for j in range(micro):
            if early is not None:  # as accelerate sets it (HF Trainer's last step of an epoch)
                engine.set_gradient_accumulation_boundary(j == micro - 1)
            loss = loss_fn(engine, batch(step, rank, j), dtype)
            engine.backward(loss)
            engine.step()
        m = engine.basic_optimizer.gsnr_metrics()
        ns.append(m.get("gsnr/n"))
        skipped += int(m.get("step/skipped_overflow", 0))
        for rf in (ref, plain):
            if rf is not None:
                rf.step([[batch(step, r, j) for j in range(micro)] for r in range(world)],
                        lambda mod, b: loss_fn(mod, b, dtype), scale)
        gsnr_means.append([m.get("gsnr/mean"), ref.opt.gsnr_metrics().get("gsnr/mean") if first else None])
    stats = getattr(engine, "vrgd_stats", None)
    bytes_ratio = stats.counters.bytes_sent / stats.counters.grad_bytes_fp32 if stats is not None else None
    got = full_params(engine)  # every rank (ZeRO-3 gathers)
    if not first:
        return {}
    want = [p.detach().to(dtype).float() if dtype != torch.float32 else p.detach() for p in ref.master.parameters()]
    init = [p.detach().to(dtype).float() for p in tiny_model().parameters()]
    err, ulps, l2 = rel_err(got, want, init, dtype), ulp_err(got, want, dtype), l2_err(got, want, init)
    contrast = contrast_ulps = contrast_l2 = None
    if plain is not None:
        other = [p.detach().to(dtype).float() for p in plain.master.parameters()]
        contrast, contrast_ulps = rel_err(other, want, init, dtype), ulp_err(other, want, dtype)
        contrast_l2 = l2_err(other, want, init)
        if os.environ.get("VRGD_TEST_DEBUG") and dist.get_rank() == 0:
            print("[debug] got vs plain (ulps):", ulp_err(got, other, dtype))
    return dict(max_rel_err=err, ulps=ulps, l2=l2, contrast=contrast, contrast_ulps=contrast_ulps,
                contrast_l2=contrast_l2, n=ns, skipped=skipped, gsnr_means=gsnr_means, bytes_ratio=bytes_ratio,
                collectives=stats.counters.collectives if stats is not None else None)


def l2_err(got, want, init) -> float:
    """``‖a - b‖ / ‖b - b0‖`` over all parameters: the error as a fraction of the reference's movement."""
    num = sum(float((a - b).double().square().sum()) for a, b in zip(got, want))
    den = sum(float((b - b0).double().square().sum()) for b, b0 in zip(want, init))
    return (num / den) ** 0.5


def ulp_err(got, want, dtype) -> float:
    """Largest per-tensor ``max|a - b|`` in units of the dtype's epsilon at the tensor's largest value."""
    return max(float((a - b).abs().max()) / (float(b.abs().max()) * torch.finfo(dtype).eps) for a, b in zip(got, want))


def rel_err(got, want, init, dtype) -> float:
    """Largest per-tensor ``max|a - b|`` as a fraction of how far the reference tensor moved
    from its initial value (at least one unit in the last place of the dtype at the
    tensor's largest value, so a tensor that did not move compares in ulps)."""
    out = 0.0
    for a, b, b0 in zip(got, want, init):
        ulp = float(b.abs().max()) * torch.finfo(dtype).eps
        moved = max(float((b - b0).abs().max()), ulp)
        out = max(out, float((a - b).abs().max()) / moved)
        if os.environ.get("VRGD_TEST_DEBUG") and dist.get_rank() == 0:
            print(f"[debug] shape={tuple(b.shape)} |a-b|={float((a - b).abs().max()):.3g} moved_ref="
                  f"{float((b - b0).abs().max()):.3g} moved_got={float((a - b0).abs().max()):.3g} ulp={ulp:.3g}")
    return out


def REGISTRY_GSNR(name: str) -> bool:
    return vrgd_ds.REGISTRY[name].vr


MATRIX_FACTORS = dict(stage=(0, 1, 2, 3), dtype=("fp32", "bf16", "fp16"), gas=(1, 2), clip=(0.0, 1.0),
                      opt=("VRSGD", "VRAdam", "VRLamb", "VRLars", "VRMerit"), bucket=(40, 500))  # 40: many buckets
PERSTEP_FACTORS = dict(stage=(0, 1, 2, 3), dtype=("fp32", "bf16", "fp16"), gas=(1, 2, 4), opt=("VRAdam", "VRLamb"))
GBAR_FACTORS = dict(stage=(0, 1, 2, 3), dtype=("fp32", "bf16"), gbar=("engine", "local"))


def matrix_name(c: dict) -> str:
    return f"stage{c['stage']}-{c['dtype']}-gas{c['gas']}-clip{c['clip']:g}-{c['opt']}-bucket{c['bucket']}"


def matrix_case(**c) -> tuple[str, dict]:
    return matrix_name(c), dict(c)


def perstep_case(**c) -> tuple[str, dict]:
    return (f"perstep-stage{c['stage']}-{c['dtype']}-gas{c['gas']}-{c['opt']}",
            dict(c, clip=1.0, bucket=40, scheme="per_step"))


def gbar_case(**c) -> tuple[str, dict]:
    return (f"perstep-{c['gbar']}-stage{c['stage']}-{c['dtype']}",
            dict(c, gas=2, clip=1.0, opt="VRLamb", bucket=40, scheme="per_step"))


def covering(factors: dict[str, tuple]) -> list[dict]:
    """A covering design: rows in which every pair of levels of any two factors appears at
    least once (allpairspy's greedy construction; deterministic). fp16 on stage 0, which
    DeepSpeed refuses (a case of its own in ``bad_cases``), is left out of the pairs."""
    from allpairspy import AllPairs

    names = list(factors)

    def admissible(row: list) -> bool:
        picked = dict(zip(names, row))
        return not (picked.get("stage") == 0 and picked.get("dtype") == "fp16")

    return [dict(zip(names, row)) for row in AllPairs(list(factors.values()), filter_func=admissible)]


def matrix_cases():
    """The full product (the bucket alternates: small, large) and the covering rows."""
    seen = set()
    for i, levels in enumerate(itertools.product(*(v for k, v in MATRIX_FACTORS.items() if k != "bucket"))):
        c = dict(zip([k for k in MATRIX_FACTORS if k != "bucket"], levels), bucket=(40, 500)[i % 2])
        seen.add(matrix_name(c))
        yield matrix_case(**c)
    for c in covering(MATRIX_FACTORS):
        if matrix_name(c) not in seen:
            yield matrix_case(**c)


def matrix_design() -> set[str]:
    """The matrix cases ``make test`` runs: the covering rows, plus stage 0 in fp16 (refused)."""
    return {matrix_name(c) for c in covering(MATRIX_FACTORS)} | {"stage0-fp16-gas1-clip0-VRSGD-bucket40"}


def perstep_cases():
    """The per-step scheme: DeepSpeed's reduction untouched, n = ranks × micro-steps on every stage."""
    for levels in itertools.product(*PERSTEP_FACTORS.values()):
        yield perstep_case(**dict(zip(PERSTEP_FACTORS, levels)))
    for levels in itertools.product(*GBAR_FACTORS.values()):
        yield gbar_case(**dict(zip(GBAR_FACTORS, levels)))


def perstep_design() -> set[str]:
    """The per-step cases ``make test`` runs: covering rows of both families, plus the ZeRO-2 bf16
    pair whose engine/local ḡ contrast a test reads."""
    rows = [perstep_case(**c)[0] for c in covering(PERSTEP_FACTORS)] + [gbar_case(**c)[0] for c in covering(GBAR_FACTORS)]
    return set(rows) | {"perstep-engine-stage2-bf16", "perstep-local-stage2-bf16"}


def squares_cases():
    """bf16 squares ("vrgd": {"squares_dtype": "bf16"}) against the fp32-squares reference."""
    for stage in (0, 1, 2, 3):
        for opt in ("VRAdam", "VRLamb"):
            yield f"squares-bf16-stage{stage}-{opt}", dict(stage=stage, dtype="fp32", gas=2, clip=0.0, opt=opt,
                                                          bucket=40, sq_dtype="bf16")
            yield f"squares-fp32-stage{stage}-{opt}", dict(stage=stage, dtype="fp32", gas=2, clip=0.0, opt=opt,
                                                          bucket=40)


def family_cases():
    """Every member of the registry the matrix does not cover (the base variants, which send
    exactly DeepSpeed's bytes, and the rest), on every stage: sharded equals unsharded."""
    for name in vrgd_ds.REGISTRY:
        if name not in MATRIX_FACTORS["opt"]:
            for stage in (0, 1, 2, 3):
                yield (f"{name.lower()}-stage{stage}",
                       dict(stage=stage, dtype="fp32", gas=2, clip=1.0, opt=name, bucket=40))


def merit_cut_cases():
    """MERIT's row and column maxima on tensors ZeRO cuts mid-row (every column is cut too):
    the tiny model's 7x13 weight is split at element 17 on 2 ranks under ZeRO-1/2 (its flat
    partition boundary) and every tensor in halves under ZeRO-3."""
    for name in ("Merit", "VRMerit"):
        for stage in (1, 2, 3):
            yield f"cut-{name.lower()}-stage{stage}", dict(stage=stage, dtype="fp32", gas=2, clip=0.0, opt=name,
                                                          bucket=40)


def run_checkpoint_case(case: dict) -> dict:
    """Uninterrupted run vs. save at step 2, a fresh engine (other initial weights), load, go on."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[case["dtype"]]
    total, cut = 4, 2

    def train(engine, steps):
        out = []
        for step in steps:
            for j in range(case["gas"]):
                engine.backward(loss_fn(engine, batch(step, rank, j), dtype))
                engine.step()
            out.append(full_params(engine))
        return out

    engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(case))
    straight = train(engine, range(total))
    path = os.path.join(case["dir"], f"stage{case['stage']}-{case.get('scheme', 'per_micro_step')}")
    engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(case))
    train(engine, range(cut))
    engine.save_checkpoint(path, tag="cut")
    engine, *_ = deepspeed.initialize(model=tiny_model(seed=7), config=config(case))
    engine.load_checkpoint(path, tag="cut")
    opt = engine.basic_optimizer
    keys = sorted({k for st in opt.state.values() for k in st})
    resumed = train(engine, range(cut, total))
    diff = max(float((a - b).abs().max()) for x, y in zip(straight[cut:], resumed) for a, b in zip(x, y))
    moved = max(float((a - b).abs().max()) for a, b in zip(straight[cut], straight[-1]))
    return dict(max_abs_diff=diff, moved=moved, state_keys=keys, world=world)


def run_zero3_weights_case(case: dict) -> dict:
    """ZeRO-3: checkpoints ``step1`` and ``step2``, ``latest`` naming ``step2`` (a newer checkpoint
    the resume passed over), then ``step1`` loaded into a fresh engine without its optimizer states,
    as the job's ``reset_if_incompatible`` plan loads it (``case["pinned"]``: under
    ``zero3_weights_of``). Returns how far the loaded weights are from each checkpoint's."""
    from vrgd_ds.train.engines.deepspeed import zero3_weights_of

    rank = dist.get_rank()
    path = os.path.join(case["dir"], "zero3-weights")
    engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(case))
    saved = {}
    for step, tag in enumerate(("step1", "step2")):
        for j in range(case["gas"]):
            engine.backward(loss_fn(engine, batch(step, rank, j), torch.float32))
            engine.step()
        engine.save_checkpoint(path, tag=tag, save_latest=False)
        saved[tag] = full_params(engine)
        if rank == 0:
            with open(os.path.join(path, "latest"), "w") as f:
                f.write(tag)
        dist.barrier()
    engine, *_ = deepspeed.initialize(model=tiny_model(seed=7), config=config(case))
    with zero3_weights_of("step1") if case["pinned"] else contextlib.nullcontext():
        engine.load_checkpoint(path, tag="step1", load_optimizer_states=False, load_lr_scheduler_states=False)
    got = full_params(engine)
    return {tag: max(float((a - b).abs().max()) for a, b in zip(got, w)) for tag, w in saved.items()}


def groups_cases():
    """Two param groups (decay / no decay, as vrgd_ds.param_groups builds and the job uses)."""
    for stage in (0, 1, 2, 3):
        # the default scheme (per_step on stages 0-2): n = ranks x micro-steps = 4. With per_micro_step,
        # stages 0/1 estimate from n = 2 groups, where r = ((a + b) / (a - b))^2 per element and the
        # mean is decided by the elements with a ~ b: a last-bit difference in the reduction order
        # moved it by 0.16% on an AVX-512 machine (ill-conditioned, not a metrics question)
        yield f"groups-stage{stage}", dict(stage=stage, dtype="fp32", gas=2, clip=1.0, opt="VRLamb", bucket=40,
                                           scheme="per_step" if stage < 3 else "per_micro_step")
    # the first group (decay) with the GSNR off: its call of the step records no gradient groups
    yield "groups-stage2-first-off", dict(stage=2, dtype="fp32", gas=2, clip=1.0, opt="VRLamb", bucket=40,
                                          scheme="per_step", first_off=True)


def run_groups_case(case: dict) -> dict:
    """The metrics of an engine step must cover every param group: ZeRO-1/2 step the basic
    optimizer once per group, and each call used to start the step's metrics afresh."""
    model = tiny_model()
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = None
    from vrgd_ds.ds.names import resolve

    cls = resolve("VRLamb")  # what the config's "type" builds (DeepSpeed FusedLamb's defaults)

    def groups(params):
        out = vrgd_ds.param_groups(params, 0.01)
        if case.get("first_off"):
            out[0]["gsnr"] = False
        return out

    if rank == 0:  # the reference runs once
        ref = Reference(model, lambda ps: cls(ps, **OPT_KW["VRLamb"]), torch.float32, case["stage"],
                        case["gas"], world, case["clip"], squares=case["scheme"], gbar="engine")  # fp32: auto = engine
        ref.opt = cls(groups(ref.master), **OPT_KW["VRLamb"])  # the same two groups
        ref.opt.set_statistics_source(ref.stats)
    cfg = config(case)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups(model), config=cfg)
    for step in range(STEPS):
        for j in range(case["gas"]):
            engine.backward(loss_fn(engine, batch(step, rank, j), torch.float32))
            engine.step()
        if ref is not None:
            ref.step([[batch(step, r, j) for j in range(case["gas"])] for r in range(world)],
                     lambda mod, b: loss_fn(mod, b, torch.float32), 1.0)
    m = engine.basic_optimizer.gsnr_metrics(per_tensor=True)
    if ref is None:
        return {}
    want = ref.opt.gsnr_metrics()
    return dict(groups=len(engine.basic_optimizer.param_groups),
                tensors=sorted({k.split("/")[1] for k in m if k.startswith("tensor/")}),
                names=sorted(n for n, _ in model.named_parameters()),
                adapted="trust_ratio/mean" in m, gsnr_mean=m.get("gsnr/mean"), ref_gsnr_mean=want.get("gsnr/mean"),
                gsnr_n=m.get("gsnr/n"), ref_gsnr_n=want.get("gsnr/n"),
                b_simple=m.get("noise_scale/b_simple_groups"), ref_b_simple=want.get("noise_scale/b_simple_groups"))


def bytes_cases():
    for stage, gas in itertools.product((0, 1, 2, 3), (1, 2, 4)):
        yield f"bytes-stage{stage}-gas{gas}", dict(stage=stage, dtype="fp32", gas=gas, clip=1.0, opt="VRLamb",
                                                   bucket=40, scheme="per_step")
    for stage in (0, 2, 3):
        yield f"bytes-bf16sq-stage{stage}-gas4", dict(stage=stage, dtype="fp32", gas=4, clip=1.0, opt="VRLamb",
                                                      bucket=40, scheme="per_step", sq_dtype="bf16")


def bytes_design() -> set[str]:
    """``make test``'s traffic cases: every stage without accumulation and with 4 micro-steps,
    bf16 squares on ZeRO-3; the 2-micro-step cases and the other bf16-squares stages are exhaustive."""
    return {f"bytes-stage{stage}-gas{gas}" for stage in (0, 1, 2, 3) for gas in (1, 4)} | {"bytes-bf16sq-stage3-gas4"}


class CommCount:
    """Every collective deepspeed.comm issues, by function, and torch's own reduce-scatter (which the
    statistics call by its current name, ``reduce_scatter_single``): calls and input bytes. A call
    counts once, at the outermost wrapper (deepspeed.comm's reduce-scatter calls torch's)."""

    NAMES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_fn", "reduce_scatter", "all_gather_into_tensor",
             "all_gather", "allgather_fn", "reduce_scatter_coalesced", "broadcast")
    TORCH_NAMES = ("reduce_scatter_single",)
    SECOND = ("reduce_scatter_tensor", "reduce_scatter_fn", "all_gather_into_tensor", "allgather_fn",
              "reduce_scatter_single")

    def __init__(self) -> None:
        self.calls = self.bytes = 0
        self.originals = {}
        self._depth = 0
        modules = [(dist, n) for n in self.NAMES] + [(torch.distributed, n) for n in self.TORCH_NAMES]
        for module, name in modules:
            fn = getattr(module, name, None)
            if fn is None:
                continue
            self.originals[(module, name)] = fn

            def counted(*args, _fn=fn, _name=name, **kwargs):
                t = kwargs.get("tensor", kwargs.get("input_tensor", kwargs.get("input", args[1] if _name in self.SECOND
                                                                                and len(args) > 1 else
                                                                                args[0] if args else None)))
                if torch.is_tensor(t) and self._depth == 0:
                    self.calls += 1
                    self.bytes += t.numel() * t.element_size()
                self._depth += 1
                try:
                    return _fn(*args, **kwargs)
                finally:
                    self._depth -= 1

            setattr(module, name, counted)

    def restore(self) -> None:
        for (module, name), fn in self.originals.items():
            setattr(module, name, fn)


def run_bytes_case(case: dict) -> dict:
    """Bytes and calls per optimizer step, VR-LAMB with per-step squares against our LAMB (GSNR
    off) on the same batches: DeepSpeed's own traffic (everything but the statistics and the
    small per-tensor tables) must be the same, and the statistics one fp32 gradient per step."""
    rank = dist.get_rank()
    out = {}
    for name, extra in (("vr", {}), ("lamb", {"gsnr": False})):
        cfg = config(case)
        cfg["optimizer"]["params"].update(extra)
        engine, *_ = deepspeed.initialize(model=tiny_model(), config=cfg)
        for j in range(case["gas"]):  # a first step: buffers allocated, partitions built
            engine.backward(loss_fn(engine, batch(0, rank, j), torch.float32))
            engine.step()
        layout = engine.basic_optimizer._layout
        stats = getattr(engine, "vrgd_stats", None)
        before = (layout.counters.bytes_sent, stats.counters.bytes_sent if stats else 0, stats.counters.collectives if stats else 0,
                  layout.counters.collectives)
        count = CommCount()
        try:
            for j in range(case["gas"]):
                engine.backward(loss_fn(engine, batch(1, rank, j), torch.float32))
                engine.step()
        finally:
            count.restore()
        tables = layout.counters.bytes_sent - before[0]
        ours = (stats.counters.bytes_sent - before[1]) if stats else 0
        ours_calls = (stats.counters.collectives - before[2]) if stats else 0
        out[name] = dict(total_bytes=count.bytes, total_calls=count.calls, table_bytes=tables,
                         table_calls=layout.counters.collectives - before[3], stats_bytes=ours, stats_calls=ours_calls,
                         deepspeed_bytes=count.bytes - tables - ours,
                         deepspeed_calls=count.calls - (layout.counters.collectives - before[3]) - ours_calls,
                         grad_bytes_fp32=4 * sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
                         n=engine.basic_optimizer.gsnr_metrics().get("gsnr/n"))
    return out


RECORD_FACTORS = dict(stage=(0, 1, 2, 3), dtype=("fp32", "bf16", "fp16"), gas=(1, 2, 4), overlap=(False, True),
                      bucket=(40, 500))


def record_case(**c) -> tuple[str, dict]:
    name = "record-stage{stage}-{dtype}-gas{gas}-{ov}-bucket{bucket}".format(ov="overlap" if c["overlap"] else "serial",
                                                                            **c)
    return name, dict(c, clip=1.0, opt="VRLamb", scheme="per_step")


def record_cases():
    """The per-step statistics read from DeepSpeed's buckets against the tensor hooks: every
    stage, dtype, accumulation, overlap_comm, and a bucket (40 elements) smaller than two of the
    model's weights (65 and 91 elements: DeepSpeed reduces each alone) or holding all of them."""
    for levels in itertools.product(*RECORD_FACTORS.values()):
        c = dict(zip(RECORD_FACTORS, levels))
        if not (c["stage"] == 0 and c["dtype"] == "fp16"):
            yield record_case(**c)


def record_design() -> set[str]:
    return {record_case(**c)[0] for c in covering(RECORD_FACTORS)}


def run_record_case(case: dict) -> dict:
    """Two engines on the same batches, the statistics read by ``"micro_steps": "auto"`` (buckets
    where they hold a micro-step) and by ``"hooks"``: every step's Σg, Σg² and n as the optimizer
    received them, the trained parameters, and each source's counters."""
    dtype = DTYPES[case["dtype"]]
    rank = dist.get_rank()
    out = {}
    for how in ("auto", "hooks"):
        cfg = config(case)
        cfg["vrgd"]["micro_steps"] = how
        cfg["zero_optimization"]["overlap_comm"] = case["overlap"]
        engine, *_ = deepspeed.initialize(model=tiny_model(), config=cfg)
        stats = engine.vrgd_stats
        seen = []
        moments = stats.moments

        def recording(params, moments=moments, seen=seen):
            g, sq = moments(params)
            seen.append(([x.detach().clone() for x in g], [x.detach().clone() for x in sq], stats.n))
            return g, sq

        stats.moments = recording
        calls = {"reductions": 0}
        zopt = engine.optimizer
        if hasattr(zopt, "average_tensor"):
            average = zopt.average_tensor

            def counted(tensor, *a, _f=average, **k):
                # buckets with gradients only: ZeRO-1 without accumulation also "reduces" an empty
                # bucket once per step, where the statistics have nothing to launch
                calls["reductions"] += tensor.numel() > 0
                return _f(tensor, *a, **k)

            zopt.average_tensor = counted
        for step in range(STEPS):
            for j in range(case["gas"]):
                engine.backward(loss_fn(engine, batch(step, rank, j), dtype))
                engine.step()
        out[how] = dict(seen=seen, params=full_params(engine), launches=stats.stat_counters.launches,
                        hooks=stats.stat_counters.hooks, tables=stats.stat_counters.tables_built,
                        reductions=calls["reductions"], describe=stats.describe())
    a, b = out["auto"], out["hooks"]
    same = len(a["seen"]) == len(b["seen"]) and all(
        na == nb and all(torch.equal(x, y) for x, y in zip(ga + qa, gb + qb))
        for (ga, qa, na), (gb, qb, nb) in zip(a["seen"], b["seen"]))
    return dict(same_moments=same, same_params=all(torch.equal(x, y) for x, y in zip(a["params"], b["params"])),
                n=[[n for *_, n in x["seen"]] for x in (a, b)], checked=sum(len(g) for g, _, _ in a["seen"]),
                **{f"{k}_{how}": out[how][k] for how in out for k in ("launches", "hooks", "tables", "reductions",
                                                                      "describe")})


class Tensors(torch.nn.Module):
    """``count`` parameter tensors of ``total // count`` elements each, every one used: the same
    model size cut into few or many tensors."""

    def __init__(self, count: int, total: int = 8192) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(total // count, generator=g) * 0.1)
                                          for _ in range(count)])

    def forward(self, x):
        out = x.new_zeros(())
        for i, p in enumerate(self.ps):
            z = x.flatten()[: p.numel()] if x.numel() >= p.numel() else x.flatten().repeat(-(-p.numel() // x.numel()))
            out = out + ((p * z[: p.numel()]).sin() * (1 + 0.01 * i)).sum()
        return out


class AtenCount:
    """Every aten operation dispatched while it is active (views included), by name."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                outer.ops += 1
                return func(*args, **(kwargs or {}))

        self.ops, self.mode = 0, Mode()


def run_counts_case(case: dict) -> dict:
    """What the statistics cost on the backward path, counted: for ``VRLamb`` (per-step
    statistics) and ``Lamb`` (no statistics) on the same model and batches, per micro-step of a
    steady step, the aten operations dispatched during ``backward()`` (every kind, views too),
    DeepSpeed's bucket reductions, the statistics' launches and table builds, and the parameter
    hooks the statistics hold."""
    rank = dist.get_rank()
    out = {}
    for name, extra in (("vr", {}), ("lamb", {"gsnr": False})):
        cfg = config(dict(case, clip=1.0, opt="VRLamb", scheme="per_step"))
        cfg["optimizer"]["params"].update(extra)
        cfg["zero_optimization"]["overlap_comm"] = False
        engine, *_ = deepspeed.initialize(model=Tensors(case["tensors"]), config=cfg)
        zopt = engine.optimizer
        calls = {"reductions": 0}
        reducer = "average_tensor" if case["stage"] in (1, 2) else "allreduce_bucket"
        owner = zopt if case["stage"] in (1, 2) else engine
        original = getattr(owner, reducer)

        def counted(*a, _f=original, **k):
            calls["reductions"] += 1
            return _f(*a, **k)

        setattr(owner, reducer, counted)
        stats = getattr(engine, "vrgd_stats", None)

        def micro_steps(step: int, count: AtenCount | None) -> None:
            for j in range(case["gas"]):
                loss = engine(batch(step, rank, j)[0])
                if count is not None:
                    with count.mode:
                        engine.backward(loss)
                else:
                    engine.backward(loss)
                engine.step()

        micro_steps(0, None)  # the first step: buffers, partitions and tables built
        before = (stats.stat_counters.launches, stats.stat_counters.tables_built) if stats else (0, 0)
        calls["reductions"] = 0
        count = AtenCount()
        micro_steps(1, count)
        out[name] = dict(aten_per_micro_step=count.ops / case["gas"],
                         reductions_per_micro_step=calls["reductions"] / case["gas"],
                         launches_per_micro_step=((stats.stat_counters.launches - before[0]) / case["gas"]) if stats
                         else 0, tables_built=(stats.stat_counters.tables_built - before[1]) if stats else 0,
                         hooks=stats.stat_counters.hooks if stats else 0, n=engine.basic_optimizer.gsnr_metrics().get(
                             "gsnr/n"), describe=stats.describe() if stats else "")
    return out


HIER_FACTORS = dict(stage=(0, 1, 2, 3), dtype=("fp32", "bf16"), gas=(1, 4))


def hierarchical_design() -> set[str]:
    """``make test``'s cases of the hierarchical scheme against the reference (4 ranks each): the
    ZeRO-1/2 and ZeRO-3 paths, both dtypes and both accumulations between them, each pair of levels
    once (stage 0's path runs in
    ``test_hierarchical_statistics_on_stage_0_gather_the_whole_sums_at_the_step``); the other 14
    are exhaustive."""
    return {"hier-stage2-bf16-gas1", "hier-stage3-fp32-gas4"}


def hierarchical_cases():
    """The hierarchical scheme on 4 ranks as 2 nodes × 2 (``node_size``), against the reference."""
    for levels in itertools.product(*HIER_FACTORS.values()):
        c = dict(zip(HIER_FACTORS, levels))
        yield ("hier-stage{stage}-{dtype}-gas{gas}".format(**c),
               dict(c, clip=1.0, opt="VRLamb", bucket=40, scheme="hierarchical", node_size=2))


def run_scheme_costs(case: dict) -> dict:
    """The same engine with ``per_step`` and ``hierarchical`` statistics: per rank, the bytes the
    statistics hold (live buffers) and, per optimizer step, the collectives and bytes within the
    node and across nodes."""
    rank = dist.get_rank()
    out = {}
    for scheme in ("per_step", "hierarchical"):
        c = dict(case, scheme=scheme, node_size=case["node_size"] if scheme == "hierarchical" else None)
        engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(c))
        stats = engine.vrgd_stats
        reductions = [0]
        owner, name = (engine, "allreduce_bucket") if case["stage"] == 0 else (engine.optimizer, "average_tensor")

        def counted(*a, _f=getattr(owner, name), **k):
            reductions[0] += 1
            return _f(*a, **k)

        setattr(owner, name, counted)
        for j in range(case["gas"]):
            engine.backward(loss_fn(engine, batch(0, rank, j), DTYPES[case["dtype"]]))
            engine.step()
        intra, intra_calls = getattr(stats, "intra_bytes", 0), getattr(stats, "intra_calls", 0)
        inter, calls = stats.counters.bytes_sent, stats.counters.collectives
        reductions[0] = 0
        for j in range(case["gas"]):  # the second step, counted
            engine.backward(loss_fn(engine, batch(1, rank, j), DTYPES[case["dtype"]]))
            engine.step()
        numel = sum(p.numel() for p in engine.module.parameters())
        out[scheme] = dict(buffer_bytes=stats.buffer_bytes(), memory=stats.memory(), numel=numel,
                           intra_bytes=getattr(stats, "intra_bytes", 0) - intra,
                           intra_calls=getattr(stats, "intra_calls", 0) - intra_calls, reductions=reductions[0],
                           inter_bytes=stats.counters.bytes_sent - inter, step_collectives=stats.counters.collectives - calls,
                           launches=stats.stat_counters.launches, grad_bytes=stats.counters.grad_bytes_fp32,
                           n=engine.basic_optimizer.gsnr_metrics().get("gsnr/n"), describe=stats.describe())
    return out


def run_step_copy_case(case: dict) -> dict:
    """ZeRO-3 under the per-step scheme, one step: the statistics' ``memory()``, and the most bytes
    one call of DeepSpeed's coalesced reduce-scatter (the statistics' step collective) had
    allocated, measured: its low-precision inputs (copies made for it) and what its ``torch.cat``
    returned (the padded, interleaved copy)."""
    from vrgd_ds.ds import zero3

    rank, calls = dist.get_rank(), []
    get = zero3._reduce_scatter_coalesced

    def measured():
        helper = get()

        def call(tensors, group=None):
            cat, made = torch.cat, [sum(t.numel() * t.element_size() for t in tensors if t.dtype != torch.float32)]

            def counted(*a, **k):
                out = cat(*a, **k)
                made.append(out.numel() * out.element_size())
                return out

            torch.cat = counted
            try:
                return helper(tensors, group)
            finally:
                torch.cat = cat
                calls.append(sum(made))
        return call

    zero3._reduce_scatter_coalesced = measured
    try:
        engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(dict(case, scheme="per_step")))
        for j in range(case["gas"]):
            engine.backward(loss_fn(engine, batch(0, rank, j), DTYPES[case["dtype"]]))
            engine.step()
    finally:
        zero3._reduce_scatter_coalesced = get
    return dict(memory=engine.vrgd_stats.memory(), calls=calls)


def checkpoint_cases(tmp: str):
    for stage in (0, 1, 2, 3):
        yield f"checkpoint-stage{stage}", dict(stage=stage, dtype="fp32", gas=2, clip=1.0, opt="VRLamb", bucket=40,
                                              dir=tmp)
        yield f"checkpoint-perstep-stage{stage}", dict(stage=stage, dtype="fp32", gas=2, clip=1.0, opt="VRLamb",
                                                      bucket=40, dir=tmp, scheme="per_step")


def run_scheduler_case(case: dict) -> dict:
    """A torch LR scheduler on the engine's optimizer, built by DeepSpeed (``lr_scheduler`` a
    callable, as HF Trainer passes one) and by hand after ``initialize``: 2 steps of 2 micro-steps
    each; the learning rates the scheduler set and the statistics' n."""
    from torch.optim.lr_scheduler import LambdaLR

    halve = lambda opt: LambdaLR(opt, lambda s: 0.5 ** s)  # noqa: E731
    out = {}
    for how in ("deepspeed", "by_hand"):
        cfg = config(dict(case, gas=2, clip=0.0, opt="VRLamb", bucket=200, dtype="fp32", scheme="per_step"))
        model = tiny_model()
        try:
            engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters(),
                                              **({"lr_scheduler": halve} if how == "deepspeed" else {}))
            scheduler = engine.lr_scheduler if how == "deepspeed" else halve(engine.basic_optimizer)
        except Exception as e:
            out[how] = dict(raised=f"{type(e).__name__}: {e}")
            continue
        rank, lrs, ns = dist.get_rank(), [], []
        for step in range(2):
            for j in range(2):
                engine.backward(loss_fn(engine, batch(step, rank, j), torch.float32))
                engine.step()
            if how == "by_hand":
                scheduler.step()
            lrs.append(engine.basic_optimizer.param_groups[0]["lr"])
            ns.append(engine.basic_optimizer.gsnr_metrics()["gsnr/n"])
        out[how] = dict(lrs=lrs, n=ns)
    return out


def run_auto_on_unequal_memory(case: dict) -> dict:
    """``"squares": "auto"`` decided on each rank of 2 whose GPUs have ``case["free_gb"][rank]``
    free (``torch.cuda.mem_get_info`` stood in for), for a 1.3B-parameter bf16 ZeRO-2 engine of
    16 ranks in nodes of 8 (an engine stood in for: only what ``_auto`` reads)."""
    import types

    from vrgd_ds.ds import attach
    from vrgd_ds.ds.config import reduction_config

    rank = dist.get_rank()
    param = types.SimpleNamespace(requires_grad=True, numel=lambda: 1_300_000_000, device=torch.device("cuda", 0))
    engine = types.SimpleNamespace(
        seq_data_parallel_group=None, module=types.SimpleNamespace(parameters=lambda: iter([param])),
        get_data_types=lambda: (torch.bfloat16, torch.float32), communication_data_type=torch.bfloat16,
        torch_autocast_enabled=lambda: False, torch_autocast_dtype=lambda: None)
    real = torch.cuda.mem_get_info
    torch.cuda.mem_get_info = lambda device=None: (int(case["free_gb"][rank] * 1e9), int(80e9))
    try:
        scheme = attach._auto(engine, reduction_config({"vrgd": {"squares": "auto", "node_size": 8}}), 2, 16)
    finally:
        torch.cuda.mem_get_info = real
    schemes = [None] * dist.get_world_size()
    dist.all_gather_object(schemes, scheme)
    return dict(schemes=schemes)


def with_settings(cfg: dict, settings: dict) -> dict:
    """``cfg`` with each dotted key of ``settings`` set."""
    for key, value in settings.items():
        node = cfg
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = value
    return cfg


def run_bad_case(case: dict) -> dict:
    cfg = with_settings(config(case), case.get("set", {}))
    kwargs = {}
    if case.get("client"):
        kwargs["optimizer"] = vrgd_ds.VRSGD(tiny_model().parameters(), lr=0.1)
    if case.get("callable"):  # DeepSpeed calls it on the model's parameters
        import functools

        if not case.get("config_too"):
            cfg.pop("optimizer")
        kwargs["optimizer"] = functools.partial(vrgd_ds.VRSGD, lr=0.1)
    model = (moe_model() if case.get("moe") else bert_model() if case.get("bert") else SparseInput()
             if case.get("sparse") else tiny_model())
    if case.get("frozen"):  # a frozen first layer, in the optimizer's params as DeepSpeed passes them
        model[0].weight.requires_grad_(False)
    if case.get("mpu"):
        kwargs["mpu"] = TensorParallelMpu()
    if case.get("groups"):  # two param groups: decayed weights, then biases and norms
        kwargs["model_parameters"] = vrgd_ds.param_groups(model, 0.01)
    from deepspeed.utils import groups

    from deepspeed.runtime import torch_autocast

    kept = groups.mpu, groups.mesh_device  # module globals an mpu or AutoTP sets: the pool's next case needs them
    # and the ones a torch_autocast config sets (every later ZeRO-1/2 engine would take its GradScaler)
    kept_autocast = torch_autocast.TORCH_AUTOCAST_INITIALIZED, torch_autocast.TORCH_AUTOCAST_DTYPE
    env = {k: os.environ.get(k) for k in case.get("env", {})}
    os.environ.update(case.get("env", {}))
    warned: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("vrgd_ds").addHandler(catch)
    try:
        engine, *_ = deepspeed.initialize(model=model, config=cfg, **kwargs)
    except Exception as e:
        return dict(raised=type(e).__name__, message=str(e), warnings=warned)
    finally:
        logging.getLogger("vrgd_ds").removeHandler(catch)
        groups.mpu, groups.mesh_device = kept
        torch_autocast.TORCH_AUTOCAST_INITIALIZED, torch_autocast.TORCH_AUTOCAST_DTYPE = kept_autocast
        for k, v in env.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    stats = getattr(engine, "vrgd_stats", None)
    return dict(raised=None, message="", describe=stats.describe() if hasattr(stats, "describe") else "",
                warnings=warned, gbar=getattr(stats, "gbar", None))


def run_accumulation_case(case: dict) -> dict:
    """Backward passes summed into one step by a DeepSpeed context (``case["how"]``: ``no_sync``
    around the first of two micro-steps, or ``coalesce`` around both), then a step: what was
    raised, or n and the trained parameters' finiteness when the context was accepted."""
    from vrgd_ds.ds.internals import UnsupportedConfiguration

    rank = dist.get_rank()
    engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(case))
    if case["how"] == "boundary":  # accumulation by hand: the boundary set False on the first micro-step
        try:
            for j in range(2):
                engine.set_gradient_accumulation_boundary(j == 1)
                engine.backward(loss_fn(engine, batch(0, rank, j), torch.float32))
                engine.step()
        except UnsupportedConfiguration as e:
            return dict(raised=type(e).__name__, message=str(e))
        return dict(raised=None, n=engine.basic_optimizer.gsnr_metrics().get("gsnr/n"),
                    finite=all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()))
    context = {"no_sync": engine.no_sync, "coalesce": engine.coalesce_grad_reduction}[case["how"]]
    try:
        with context():
            engine.backward(loss_fn(engine, batch(0, rank, 0), torch.float32))
            if case["how"] == "coalesce":
                engine.backward(loss_fn(engine, batch(0, rank, 1), torch.float32))
        if case["how"] == "no_sync":
            engine.step()  # accepted (accumulation): the first micro-step's step() is no boundary
            engine.backward(loss_fn(engine, batch(0, rank, 1), torch.float32))
        engine.step()
    except UnsupportedConfiguration as e:
        return dict(raised=type(e).__name__, message=str(e))
    return dict(raised=None, n=engine.basic_optimizer.gsnr_metrics().get("gsnr/n"),
                finite=all(bool(torch.isfinite(p).all()) for p in engine.module.parameters()))


class _LateHead(torch.nn.Module):
    """``tiny_model`` and a head used only when asked (``late=True``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = tiny_model(), torch.nn.Linear(7, 7)

    def forward(self, x, late=False):
        y = self.body(x)
        return y + self.head(y) if late else y


def run_late_gradient_case(case: dict) -> dict:
    """Two steps of ``case["gas"]`` micro-batches of ``_LateHead``, its head used in the last
    micro-batch of each step (``case["use"]`` ``"last_micro"``) or in the first step only
    (``"first_step"``): what was raised, or n of the last step."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=_LateHead(), config=config(case))
    try:
        for step in range(2):
            for j in range(case["gas"]):
                x, y = batch(step, rank, j)
                late = j == case["gas"] - 1 if case["use"] == "last_micro" else step == 0
                loss = torch.nn.functional.mse_loss(engine(x, late=late), y)
                engine.backward(loss)
                engine.step()
    except Exception as e:  # noqa: BLE001 (the message is the result)
        return dict(raised=type(e).__name__, message=str(e))
    return dict(raised=None, n=engine.basic_optimizer.gsnr_metrics().get("gsnr/n"))


def run_steps_case(case: dict) -> dict:
    """Two steps of the config's optimizer (``case["opt"]``) through ``deepspeed.initialize``:
    whether they ran and left finite, moved parameters (or what they raised)."""
    rank = dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(case))
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    try:
        for step in range(2):
            for j in range(case["gas"]):
                engine.backward(loss_fn(engine, batch(step, rank, j), dtype))
                engine.step()
    except Exception as e:  # noqa: BLE001 (the message is the result)
        return dict(raised=f"{type(e).__name__}: {e}")
    after = [p.detach().float() for p in engine.module.parameters()]
    return dict(raised=None, finite=all(bool(torch.isfinite(p).all()) for p in after),
                moved=any(not torch.equal(a, b) for a, b in zip(before, after)))


def run_stepped_grads_case(case: dict) -> dict:
    """One step of ``case["gas"]`` micro-steps under the case's config (``case["set"]``): the
    gradient the basic optimizer steps with (this rank's fp32 partition), flat, as a list."""
    rank = dist.get_rank()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[case["dtype"]]
    engine, *_ = deepspeed.initialize(model=tiny_model(), config=with_settings(config(case), case.get("set", {})))
    opt, seen = engine.basic_optimizer, []
    step = opt.step

    def recording_step(*args, **kwargs):
        seen.extend(p.grad.detach().float().reshape(-1).clone() for g in opt.param_groups for p in g["params"]
                    if p.grad is not None)
        return step(*args, **kwargs)

    opt.step = recording_step
    for j in range(case["gas"]):
        engine.backward(loss_fn(engine, batch(0, rank, j), dtype))
        engine.step()
    return dict(grads=torch.cat(seen).tolist())


class SparseInput(torch.nn.Module):
    """``tiny_model`` after a sparse embedding of the input's rounded magnitudes (an
    ``nn.Embedding(sparse=True)``, as recommender and word-embedding models have)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = tiny_model()
        self.emb = torch.nn.Embedding(11, 5, sparse=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x + self.emb((x.abs() * 3).long().clamp(max=10)).sum(-1))


def bert_model() -> torch.nn.Module:
    """A one-layer BERT from transformers (AutoTP finds its policy only for such models)."""
    from transformers import BertConfig, BertModel

    return BertModel(BertConfig(vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=16, max_position_embeddings=16))


def moe_model() -> torch.nn.Module:
    """The tiny model with a DeepSpeed mixture-of-experts layer of two experts (one expert group)."""
    from deepspeed.moe.layer import MoE

    model = tiny_model()
    model.moe = MoE(hidden_size=7, expert=torch.nn.Linear(7, 7), num_experts=2, ep_size=1, k=1)
    return model


class TensorParallelMpu:
    """A Megatron-style ``mpu`` (the object Megatron-DeepSpeed passes ``deepspeed.initialize``):
    every rank in one tensor-parallel group, each rank its own data-parallel group."""

    def __init__(self) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp = dist.new_group(list(range(world)))
        self.dp = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
        self.rank = rank

    def get_model_parallel_rank(self): return self.rank  # noqa: E704 (Megatron's interface)
    def get_model_parallel_world_size(self): return dist.get_world_size()  # noqa: E704
    def get_model_parallel_group(self): return self.tp  # noqa: E704
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group
    def get_tensor_model_parallel_src_rank(self): return 0  # noqa: E704
    def get_data_parallel_rank(self): return 0  # noqa: E704
    def get_data_parallel_world_size(self): return 1  # noqa: E704
    def get_data_parallel_group(self): return self.dp  # noqa: E704
    def get_data_parallel_group_ranks(self): return [self.rank]  # noqa: E704


def bad_cases():
    base = dict(stage=2, dtype="fp32", gas=1, clip=0.0, opt="VRLamb", bucket=500)
    yield "bad-offload", dict(base, set={"zero_optimization.offload_optimizer": {"device": "cpu"}})
    yield "bad-contiguous", dict(base, set={"zero_optimization.contiguous_gradients": False})
    # before: accepted, then the first backward raised in the ZeRO-3 bucket path
    yield "bad-contiguous-zero3", dict(base, stage=3, set={"zero_optimization.contiguous_gradients": False})
    yield "bad-quantized-gradients", dict(base, set={"zero_optimization.zero_quantized_gradients": True})
    yield "bad-predivide", dict(base, set={"gradient_predivide_factor": 2.0})
    # before: a callable client optimizer skipped every check (attach ran on an unchecked engine)
    yield "bad-fp16-stage0-callable-client", dict(base, stage=0, dtype="fp16", callable=True)
    yield "bad-fp16-stage0", dict(base, stage=0, dtype="fp16")
    yield "bad-client-and-config", dict(base, client=True)
    # before: accepted, the config's optimizer dropped without a word
    # before: accepted, the config's optimizer (DeepSpeed's Adam) dropped without a word
    yield "bad-callable-client-and-config", dict(base, callable=True, config_too=True,
                                                 set={"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}})
    # before: accepted and ignored (ZeRO-3's default scheme, squares unset, reads no gbar)
    yield "bad-gbar-zero3-default", dict(base, stage=3, scheme=None, set={"vrgd.gbar": "local"})
    yield "bad-unknown-param", dict(base, set={"optimizer.params.gama": 0.1})
    yield "bad-squares-dtype", dict(base, set={"vrgd.squares_dtype": "fp8"})
    yield "bad-vrgd-key", dict(base, set={"vrgd.square_dtype": "bf16"})
    yield "bad-autotp", dict(base, bert=True, set={"tensor_parallel.autotp_size": 2})
    yield "bad-moe", dict(base, moe=True)
    yield "bad-tensor-parallel-mpu", dict(base, mpu=True)
    yield "bad-node-size", dict(base, set={"vrgd.squares": "hierarchical", "vrgd.node_size": 3})
    yield "bad-launcher-local-size", dict(base, set={"vrgd.squares": "hierarchical"}, env={"LOCAL_WORLD_SIZE": "1"})
    # before: accepted, the steps' backward passes reduced together and counted as one micro-batch
    # before: accepted; the statistics read the GradScaler-scaled gradients, not knowing its scale
    yield "bad-autocast-fp16-stage0", dict(base, stage=0, set={"torch_autocast": {"enabled": True, "dtype": "fp16"}})
    # before: accepted on ZeRO-1/2/3, whose GradScaler's scale was in Σg and Σg² (the noise scale off by its square)
    yield "bad-autocast-fp16-zero2", dict(base, stage=2, set={"torch_autocast": {"enabled": True, "dtype": "fp16"}})
    yield "bad-unmanaged-accumulation", dict(base, set={"managed_gradient_accumulation": False})
    # before: accepted, then the first step raised torch's "Cannot access data pointer of Tensor that doesn't have
    # storage" (stage 0, accumulation 1) or "unsupported memory format option Contiguous" (accumulation 2)
    yield "bad-sparse-embedding", dict(base, stage=0, gas=2, sparse=True, set={"vrgd.squares": "per_step"})
    # before: not refused where DeepSpeed had replaced the param groups' tensors (ZeRO-1/2's flat partitions, stage
    # 0 bf16's fp32 copies) by attach time: the check compared the model's weight with those
    yield "bad-sparse-embedding-zero2", dict(base, stage=2, gas=2, sparse=True, set={"vrgd.squares": "per_step"})
    yield "bad-sparse-embedding-bf16", dict(base, stage=0, dtype="bf16", gas=2, sparse=True,
                                            set={"vrgd.squares": "per_step"})
    # before: accepted and unread ("auto" never picks 'hierarchical' on ZeRO-3, and reads no node size there)
    yield "bad-node-size-auto-zero3", dict(base, stage=3, scheme="auto", set={"vrgd.node_size": 2})
    # before: accepted; its checkpoints then failed to load (AssertionError, KeyError 'base_optimizer_state_step') and
    # to convert
    yield "bad-elastic-checkpoint", dict(base, set={"zero_optimization.elastic_checkpoint": True})
    # before: accepted; a NaN in one param group's gradient then skipped that group and stepped those before it
    # (ZeRO-1/2 step the groups one call at a time, and DeepSpeed checked nothing first)
    yield "bad-bf16-nonfinite-unchecked", dict(base, dtype="bf16", groups=True, set={"bf16.check_grad_overflow": False})
    yield "bad-fp32-nonfinite-unchecked", dict(base, stage=1, groups=True,
                                               set={"zero_optimization.compute_grad_norm": False})
    yield "bad-hierarchical-bf16-squares", dict(base, set={"vrgd.squares": "hierarchical", "vrgd.squares_dtype": "bf16"})


def full_state(engine, key: str) -> dict[str, torch.Tensor]:
    """Every model tensor's piece of optimizer state ``key``, assembled over ranks (ZeRO-1/2)."""
    from vrgd_ds.ds.zero12 import pieces as zero12_pieces

    zopt, opt = engine.optimizer, engine.basic_optimizer
    names = {p: n for n, p in engine.module.named_parameters()}
    mine = []
    for i, flat in enumerate(zopt.single_partition_of_fp32_groups):
        st = opt.state[flat][key]
        mine += [(names[p], tuple(p.shape), src, st[dst:dst + num].clone()) for p, src, dst, num in zero12_pieces(zopt, i)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for name, shape, src, values in (x for part in everyone for x in part):
        full = out.setdefault(name, torch.full((int(torch.Size(shape).numel()),), float("nan")))
        full[src:src + values.numel()] = values
    return out


def universal_case(tmp: str) -> dict:
    return dict(stage=2, dtype="fp32", gas=2, clip=1.0, opt="VRLamb", bucket=40, dir=tmp)


def run_universal_save(case: dict) -> dict:
    """2 ranks: train, save, convert to universal (keeping gsnr_avg), remember the full state."""
    from vrgd_ds.ds.universal import convert

    rank = dist.get_rank()
    engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(case))
    for step in range(2):
        for j in range(case["gas"]):
            engine.backward(loss_fn(engine, batch(step, rank, j), torch.float32))
            engine.step()
    engine.save_checkpoint(os.path.join(case["dir"], "ckpt"), tag="t2")
    states = {key: full_state(engine, key) for key in ("gsnr_avg", "exp_avg", "exp_avg_sq")}
    keys = None
    if rank == 0:
        torch.save(states, os.path.join(case["dir"], "states.pt"))
        keys = convert(os.path.join(case["dir"], "ckpt", "t2"), os.path.join(case["dir"], "ckpt", "t2_universal"))
    dist.barrier()
    return dict(kept=keys)


def run_universal_load(case: dict) -> dict:
    """1 rank: resume from the universal checkpoint; the state must be the 2-rank run's."""
    cfg = config(case)
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=tiny_model(seed=3), config=cfg)
    engine.load_checkpoint(os.path.join(case["dir"], "ckpt"))
    want = torch.load(os.path.join(case["dir"], "states.pt"), weights_only=False)
    diffs = {}
    for key, per_param in want.items():
        got = full_state(engine, key)
        diffs[key] = max(float((got[n] - v).abs().max()) for n, v in per_param.items())
    for j in range(case["gas"]):  # training goes on with the restored state on one rank
        engine.backward(loss_fn(engine, batch(2, 0, j), torch.float32))
        engine.step()
    m = engine.basic_optimizer.gsnr_metrics()
    return dict(max_abs_diff=diffs, n_after=m.get("gsnr/n"), step=int(engine.global_steps))


def run_universal_switch(case: dict) -> dict:
    """1 rank, in a script of one's own (not the job): the universal checkpoint loaded into another
    member of the family (``case["load_opt"]``), then a step: its ``gsnr`` as built, and the state
    keys it kept."""
    cfg = config(dict(case, opt=case["load_opt"]))
    cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=tiny_model(seed=3), config=cfg)
    engine.load_checkpoint(os.path.join(case["dir"], "ckpt"))
    opt = engine.basic_optimizer
    gsnr = [bool(g["gsnr"]) for g in opt.param_groups]
    keys = sorted({k for st in opt.state.values() for k in st})
    for j in range(case["gas"]):
        engine.backward(loss_fn(engine, batch(2, 0, j), torch.float32))
        engine.step()
    return dict(gsnr=gsnr, keys=keys, n_after=opt.gsnr_metrics().get("gsnr/n"))


def run_single_rank_n1(case: dict) -> dict:
    return run_bad_case(dict(case, stage=1, gas=4))


def prepare_process(case: dict) -> dict:
    """Once per pool: DeepSpeed's CPU accelerator admits fp16 only where oneDNN has native fp16
    kernels (AVX512-FP16 / AMX-FP16; cpu_accelerator.is_fp16_supported). torch computes fp16 on
    any CPU, just slower; these cases check the hooks' fp16 arithmetic, not its speed."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    native = accel.is_fp16_supported()
    if not native:
        accel.is_fp16_supported = lambda: True
    return dict(native_fp16=native)


def run_device_tables_case(case: dict) -> dict:
    """``case["opt"]`` (VRLamb, VRLars) on the Triton kernels (interpreted on CPU) over each rank's flat partition of three
    model tensors, the middle one cut across the two ranks, per-tensor sums completed by the
    layout's all-reduce: three steps with the tables built by the device kernels and three with
    torch operations, the second step with a NaN on rank 1 only (both ranks skip it). Returns
    whether the runs are equal bit for bit on every rank."""
    from vrgd_ds.stats.layout import Layout

    cls = vrgd_ds.REGISTRY[case["opt"]].cls
    kwargs = {"VRLamb": dict(lr=0.05, weight_decay=0.01),
              "VRLars": dict(lr=0.5, weight_decay=0.01, clip=True, beta3=0.5)}[case["opt"]]

    rank, sizes = dist.get_rank(), [1500, 1200, 900]
    bounds = (0, 1800, 3600)
    lo, hi = bounds[rank], bounds[rank + 1]
    pieces, at = [], 0
    for key, n in enumerate(sizes):
        a, b = max(at, lo), min(at + n, hi)
        if b > a:
            pieces.append((a - lo, b - a, key, a - at))
        at += n

    class Given:
        n = 3

        def moments(self, params):
            return [self.sums[0]], [self.sums[1]]

        def reset(self):
            pass

    runs = []
    for device_tables in (True, False):
        cls.device_tables = device_tables
        flat = torch.nn.Parameter(torch.randn(3600, generator=torch.Generator().manual_seed(5))[lo:hi].clone())
        layout = Layout(["a", "b", "c"], sizes, group=torch.distributed.group.WORLD)
        layout.add(flat, pieces)
        opt = cls([flat], fused="triton", **kwargs)
        source = Given()
        opt.set_statistics_source(source, layout)
        metrics = []
        for i in range(3):
            gs = torch.randn(3, 3600, generator=torch.Generator().manual_seed(9 + i))[:, lo:hi] + 0.2
            if i == 1 and rank == 1:
                gs[0, 17] = float("nan")
            source.sums = (gs.sum(0), gs.square().sum(0))
            flat.grad = gs.mean(0)
            opt.step()
            metrics.append(opt.gsnr_metrics(per_tensor=True))
        runs.append((flat.detach().clone(), opt.state_dict()["state"].get(0, {}), metrics, opt.skipped_steps,
                     opt.kernels().counts["launches"]))
    cls.device_tables = True
    (p1, s1, m1, k1, l1), (p2, s2, m2, k2, l2) = runs
    same = (torch.equal(p1, p2) and all(torch.equal(v, s2[k]) for k, v in s1.items())
            and m1 == m2 and k1 == k2 == 1 and m1[1]["step/skipped"] == 1.0 and m1[2]["step/skipped"] == 0.0)
    flag = torch.tensor([1.0 if same else 0.0])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return {"same": bool(flag.item()), "launches": (l1, l2), "gsnr_mean": m1[2].get("gsnr/mean")}


class LateCollectives:
    """A communication module whose asynchronous collectives land as late as NCCL may land them:
    each reads its input at launch, but writes its output only when it is waited for or when the
    next collective on its group is launched (NCCL runs a communicator's collectives in order on
    its stream; another group's stream does not wait for them). Everything else is the wrapped
    module's."""

    def __init__(self, inner) -> None:
        self.inner, self.pending = inner, []  # [(group, work)] in launch order

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def land(self, group) -> None:
        for g, work in list(self.pending):
            if g is group:
                work.wait()

    def _late(self, group, out: torch.Tensor, result: torch.Tensor):
        pending = self.pending

        class Work:
            def wait(self) -> bool:
                if (group, self) in pending:
                    pending.remove((group, self))
                    out.copy_(result)
                return True

        work = Work()
        pending.append((group, work))
        return work

    def all_reduce(self, t, group=None, async_op=False, **kw):
        self.land(group)
        if not async_op:
            return self.inner.all_reduce(t, group=group, **kw)
        result = t.clone()
        self.inner.all_reduce(result, group=group, **kw)
        return self._late(group, t, result)

    def reduce_scatter_single(self, out, inp, group=None, async_op=False):
        from vrgd_ds.stats.comm import reduce_scatter
        self.land(group)
        if not async_op:
            return reduce_scatter(self.inner, out, inp, group, async_op=False)
        result = torch.empty_like(out)
        reduce_scatter(self.inner, result, inp.clone(), group, async_op=False)
        return self._late(group, out, result)

    def all_gather_single(self, out, inp, group=None, async_op=False):
        from vrgd_ds.stats.comm import all_gather
        self.land(group)
        return all_gather(self.inner, out, inp, group, async_op=async_op)


def run_nonfinite_group_case(case: dict) -> dict:
    """Two param groups (``vrgd_ds.param_groups``: the decayed weights first, then biases and
    norms) stepped one at a time by ZeRO-1/2, 3 steps; at the second, a NaN in the gradient of one
    bias of the second group, on rank 1 only. Returns whether each group moved at each step, the
    skip metrics after each, and whether the parameters end finite."""
    rank = dist.get_rank()
    model = tiny_model()
    groups = [list(g["params"]) for g in vrgd_ds.param_groups(model, 0.01)]  # before ZeRO-3 partitions them
    bias = model[2].bias
    assert len(groups) == 2 and any(p is bias for p in groups[1]), "the NaN's bias is in the second group"
    engine, *_ = deepspeed.initialize(model=model, model_parameters=vrgd_ds.param_groups(model, 0.01),
                                      config=with_settings(config(case), case.get("set", {})))
    bias.register_hook(lambda g: g * float("nan") if engine.global_steps == 1 and rank == 1 else g)

    def weights(i):
        ps = groups[i]
        if engine.zero_optimization_stage() == 3:
            with deepspeed.zero.GatheredParameters(ps):
                return [p.detach().float().clone() for p in ps]
        return [p.detach().float().clone() for p in ps]

    moved, metrics = [], []
    for step in range(3):
        before = [weights(0), weights(1)]
        for j in range(case["gas"]):
            engine.backward(loss_fn(engine, batch(step, rank, j), DTYPES[case["dtype"]]))
            engine.step()
        moved.append([any(not torch.equal(a, b) for a, b in zip(before[i], weights(i))) for i in (0, 1)])
        m = engine.basic_optimizer.gsnr_metrics()
        metrics.append({k: m.get(k) for k in ("step/skipped", "step/skipped_total")})
    return {"moved": moved, "metrics": metrics,
            "finite": all(bool(torch.isfinite(p).all()) for g in (weights(0), weights(1)) for p in g)}


def run_late_collectives_case(case: dict) -> dict:
    """The same engine twice, the second with its statistics' collectives landing late
    (``LateCollectives``), over 3 steps of which DeepSpeed skips the second (a NaN loss on every
    rank): whether the parameters and the metrics of every step agree bit for bit."""
    rank = dist.get_rank()
    dtype = DTYPES[case["dtype"]]
    runs = []
    for late in (False, True):
        engine, *_ = deepspeed.initialize(model=tiny_model(), config=config(case))
        if late:
            engine.vrgd_stats.comm = LateCollectives(engine.vrgd_stats.comm)
        metrics = []
        for step in range(3):
            for j in range(case["gas"]):
                loss = loss_fn(engine, batch(step, rank, j), dtype)
                engine.backward(loss * float("nan") if step == 1 else loss)
                engine.step()
            metrics.append(engine.basic_optimizer.gsnr_metrics())
        runs.append((full_params(engine), metrics))
    (p1, m1), (p2, m2) = runs
    same = all(torch.equal(a, b) for a, b in zip(p1, p2)) and json.dumps(m1) == json.dumps(m2)
    return {"same": same, "skipped": [m.get("step/skipped") for m in m2],
            "finite": all(bool(torch.isfinite(p).all()) for p in p2), "gsnr_mean": [m.get("gsnr/mean") for m in m2]}
