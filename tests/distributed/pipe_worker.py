"""DeepSpeed ``PipelineEngine`` cases for the rank pool (``pool.py``): ``worker.py``'s tiny model
cut into pipeline stages (``PipelineModule``), trained by ``engine.train_batch`` and compared
with ``reference.py``'s single-process optimizer on the whole model, which sees every
micro-batch of every data-parallel rank as one group (the per-step scheme: n = data-parallel
ranks × micro-batches)."""
from __future__ import annotations

import os
import sys

import torch

import vrgd_ds  # noqa: F401  (registers the names with DeepSpeed)
import deepspeed
import deepspeed.comm as dist
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from vrgd_ds.ds.names import engine_spelling, resolve

sys.path.insert(0, os.path.dirname(__file__))
from reference import Reference  # noqa: E402
from worker import MICRO, OPT_KW, STEPS, batch, l2_err, tiny_model  # noqa: E402
from worker import config as worker_config  # noqa: E402


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y)


def pipe_model(stages: int) -> PipelineModule:
    """The tiny model's layers, uniformly over ``stages`` (2: Linear+Tanh | Linear+LayerNorm);
    every rank builds the same seeded layers and keeps its stage's."""
    return PipelineModule(layers=list(tiny_model()), num_stages=stages, loss_fn=mse, partition_method="uniform")


def config(case: dict) -> dict:
    """``worker.config`` (fp32 unless the case names a dtype) with the per-step scheme unless the case
    names one, and ``opt_kw``."""
    cfg = worker_config(dict(case, bucket=40, dtype=case.get("dtype", "fp32"), scheme=case.get("scheme", "per_step")))
    cfg["optimizer"]["params"] = opt_kw(case)
    return cfg


def opt_kw(case: dict) -> dict:
    return dict(OPT_KW[case["opt"]], **case.get("kw", {}))


def _restore_groups():
    """``PipelineModule`` sets deepspeed.utils.groups' module globals; the pool's next case needs them as
    they were."""
    from deepspeed.utils import groups

    kept = groups.mpu, groups.mesh_device

    def restore():
        groups.mpu, groups.mesh_device = kept

    return restore


def run_pipe_case(case: dict) -> dict:
    """Trains ``STEPS`` steps with ``train_batch`` on ``case['stages']`` stages × the remaining data-
    parallel ranks and returns rank 0's comparison with the reference (and with the same reference
    at gamma = 1, where the member has a GSNR)."""
    restore = _restore_groups()
    try:
        return _run(case)
    finally:
        restore()


def _run(case: dict) -> dict:
    world = dist.get_world_size()
    dp = world // case["stages"]
    cls = resolve(engine_spelling(case["opt"]))  # what the config's "type" builds ("Lamb": FusedLamb's defaults)
    model = pipe_model(case["stages"])
    engine, *_ = deepspeed.initialize(model=model, config=config(case),
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    dp_rank = engine.grid.get_data_parallel_rank()
    ns = []
    for step in range(STEPS):
        engine.train_batch(data_iter=iter([batch(step, dp_rank, j) for j in range(case["gas"])]))
        ns.append(engine.basic_optimizer.gsnr_metrics().get("gsnr/n"))
    got = {name: p.detach().clone() for name, p in model.named_parameters()}
    last = engine.basic_optimizer.gsnr_metrics(per_tensor=True)
    rows = sorted(k.split("/")[1] for k in last if k.endswith("/gsnr_mean"))
    # every rank's stage parameters on rank 0 (DP rank 0 of each stage: its copy is the stage's)
    gathered: list[tuple | None] = [None] * world
    dist.all_gather_object(gathered, (engine.grid.get_stage_id(), got if dp_rank == 0 else {},
                                      (rows, last.get("gsnr/mean"))))
    if dist.get_rank() != 0:
        return {}
    metrics = [m for *_, m in gathered]
    gathered = [(stage, part) for stage, part, _ in gathered]
    got = {k: v for _, part in gathered for k, v in part.items()}
    # DeepSpeed 0.19.8's stage-0 clipping (clip_grad_norm_ with the grid as mpu) counts the
    # gradients of model-parallel rank 0 only, which under PipelineEngine is the first stage
    names = [k for k, _ in tiny_model().named_parameters()]
    first = {k for stage, part in gathered if stage == 0 for k in part}
    clip_norm_of = {i for i, k in enumerate(names) if k in first} if case["stage"] == 0 else None

    def reference(gamma: float | None, gsnr: bool = True) -> Reference:
        kw = dict(opt_kw(case), **({} if gamma is None else {"gamma": gamma}))
        if not gsnr:  # the base optimizer: the same class with the GSNR off
            kw = {k: v for k, v in kw.items() if k != "gamma"} | {"gsnr": False}
        ref = Reference(tiny_model(), lambda ps: cls(ps, **kw), torch.float32, case["stage"], case["gas"], dp,
                        case["clip"], squares="per_step", gbar="engine", clip_norm_of=clip_norm_of)
        for step in range(STEPS):
            ref.step([[batch(step, r, j) for j in range(case["gas"])] for r in range(dp)],
                     lambda mod, b: mse(mod(b[0]), b[1]), 1.0)
        return ref

    want = dict(reference(None, gsnr=not case.get("against_base")).master.named_parameters())
    init = dict(tiny_model().named_parameters())
    names = sorted(want)
    if sorted(got) != names:
        raise AssertionError(f"stage parameters {sorted(got)} are not the model's {names}")
    out = dict(n=ns, rows=[m[0] for m in metrics], gsnr_mean=[m[1] for m in metrics], tensors=len(names),
               l2=l2_err([got[k] for k in names], [want[k].detach() for k in names],
                               [init[k].detach() for k in names]), contrast_l2=None)
    if vrgd_ds.REGISTRY[case["opt"]].vr:
        plain = dict(reference(1.0).master.named_parameters())
        out["contrast_l2"] = l2_err([plain[k].detach() for k in names], [want[k].detach() for k in names],
                                    [init[k].detach() for k in names])
    return out


def run_pipe_nonfinite(case: dict) -> dict:
    """2 stages, 3 steps of ``train_batch``, one gradient of the last stage made NaN in step 1
    (a tensor hook ahead of the statistics'): per stage, how far its parameters moved at each
    step, each step's ``step/skipped_nonfinite`` and whether they stay finite (every rank's, on
    rank 0)."""
    restore = _restore_groups()
    try:
        model = pipe_model(2)
        on = [False]
        if model.stage_id == 1:
            next(model.parameters()).register_hook(lambda g: g * float("nan") if on[0] else g)
        engine, *_ = deepspeed.initialize(model=model, config=config(case),
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
        moved, skipped = [], []
        for step in range(3):
            on[0] = step == 1
            before = [p.detach().float().clone() for p in model.parameters()]
            engine.train_batch(data_iter=iter([(x.to(dtype), y) for x, y in (batch(step, 0, j)
                                                                              for j in range(case["gas"]))]))
            moved.append(sum(float((p.detach().float() - b).norm()) for p, b in zip(model.parameters(), before)))
            skipped.append(engine.basic_optimizer.gsnr_metrics().get("step/skipped_nonfinite", 0.0))
        mine = dict(stage=model.stage_id, moved=moved, skipped=skipped,
                    finite=all(bool(torch.isfinite(p).all()) for p in model.parameters()))
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}
    finally:
        restore()


class Embed(torch.nn.Module):
    """A weight used by the first stage as a layer and by the last one as an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(7, 5) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def tied_model(stages: int) -> PipelineModule:
    torch.manual_seed(0)
    # 2 stages: Embed, Linear, Tanh | Linear, Embed: each stage holds a tied and an untied tensor, so
    # both have the same param groups (DeepSpeed's ZeRO-1 takes one grad-norm collective per group);
    # more: a Linear(7, 7) more for each stage between, which holds no tied module (4 stages: Embed,
    # Linear | Tanh, Linear | Linear, Linear | Embed)
    layers = [TiedLayerSpec("embed", Embed), LayerSpec(torch.nn.Linear, 7, 7), LayerSpec(torch.nn.Tanh),
              *[LayerSpec(torch.nn.Linear, 7, 7) for _ in range(stages - 2)], LayerSpec(torch.nn.Linear, 7, 5),
              TiedLayerSpec("embed", Embed)]
    return PipelineModule(layers=layers, num_stages=stages, loss_fn=mse, partition_method="uniform")


def run_bad_pipe_case(case: dict) -> dict:
    """``deepspeed.initialize`` of a refused pipeline configuration; the exception, or none. With
    ``tied_gsnr_off`` the tied weights go to a param group with ``gsnr: false``, which is
    accepted and trains one step."""
    restore = _restore_groups()
    try:
        stages = case.get("stages", 2)
        model = tied_model(stages) if case.get("tied") else pipe_model(stages)
        params: list = [p for p in model.parameters() if p.requires_grad]
        if case.get("uneven_groups") and model.stage_id == 0:  # a second group on the first stage only
            params = [{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}]
        if case.get("tied_gsnr_off"):
            tied = {id(w) for w, _ in model.get_tied_weights_and_groups()}
            params = [{"params": [p for p in params if id(p) not in tied]},
                      {"params": [p for p in params if id(p) in tied], "gsnr": False}]
            params = [g for g in params if g["params"]]
        try:
            engine, *_ = deepspeed.initialize(model=model, config=config(case), model_parameters=params)
        except Exception as e:
            out = dict(raised=type(e).__name__, message=str(e))
            if case.get("every_rank"):  # what each rank raised, by stage
                ranks: list = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, dict(out, stage=model.stage_id))
                out["ranks"] = ranks
            return out
        dp_rank = engine.grid.get_data_parallel_rank()
        dtype = torch.bfloat16 if case.get("dtype") == "bf16" else torch.float32
        micro = [(torch.randn(MICRO, 5), torch.randn(MICRO, 7)) if case.get("tied") else batch(0, dp_rank, j)
                 for j in range(case["gas"])]
        engine.train_batch(data_iter=iter([(x.to(dtype), y) for x, y in micro]))
        n = engine.basic_optimizer.gsnr_metrics().get("gsnr/n")
        return dict(raised=None, message="", n=n, parts=list(model.parts))
    finally:
        restore()


class TiedNet(torch.nn.Module):
    """``tied_model``'s layers as one module, its tied weight one tensor used twice."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.first, self.last = Embed(), torch.nn.Linear(7, 7), torch.nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(self.last(torch.tanh(self.first(self.embed(x)))))


#: ``tied_model``'s parameter names (either stage) -> ``TiedNet``'s
TIED_NAMES = {"tied_modules.embed.weight": "embed.weight", "1.weight": "first.weight", "1.bias": "first.bias",
              "3.weight": "last.weight", "3.bias": "last.bias"}


def _whole(model: PipelineModule) -> dict[str, torch.Tensor]:
    """Every stage's tensors, by ``TiedNet``'s names (the tied weight from the first stage)."""
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {TIED_NAMES[k]: p.detach().clone() for k, p in model.named_parameters()})
    whole: dict[str, torch.Tensor] = {}
    for part in parts:
        for k, v in part.items():
            whole.setdefault(k, v)
    return whole


def tied_equals_unsharded(case: dict) -> dict:
    """``tied_model`` on 2 stages, the base ``Lamb`` with NVLAMB pre-normalisation (a global
    gradient norm over the stages), against the same optimizer on ``TiedNet`` in one process:
    the tied weight's copy on the last stage must not count twice in the norm."""
    restore = _restore_groups()
    try:
        model = tied_model(2)
        init = _whole(model)
        engine, *_ = deepspeed.initialize(model=model, config=config(case),
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        gen = torch.Generator().manual_seed(7)
        steps = [[(torch.randn(MICRO, 5, generator=gen), torch.randn(MICRO, 7, generator=gen))
                  for _ in range(case["gas"])] for _ in range(STEPS)]
        for micro in steps:
            engine.train_batch(data_iter=iter(micro))
        got = _whole(model)
        ref = TiedNet()
        ref.load_state_dict(init)
        opt = resolve(engine_spelling(case["opt"]))(ref.parameters(), **opt_kw(case))
        for micro in steps:
            opt.zero_grad()
            for x, y in micro:
                (mse(ref(x), y) / case["gas"]).backward()
            opt.step()
        want = dict(ref.named_parameters())
        names = sorted(want)
        return dict(l2=l2_err([got[k] for k in names], [want[k].detach() for k in names], [init[k] for k in names]))
    finally:
        restore()


def run_pipe_universal(case: dict) -> dict:
    """2 stages, ZeRO-1: one step, a checkpoint, then rank 0 asks ``vrgd_ds.ds.universal.convert``
    for its universal form; returns what the conversion raised and what it left in its output folder."""
    from vrgd_ds.ds.universal import convert

    restore = _restore_groups()
    try:
        model = pipe_model(2)
        engine, *_ = deepspeed.initialize(model=model, config=config(case),
                                          model_parameters=[p for p in model.parameters() if p.requires_grad])
        dp_rank = engine.grid.get_data_parallel_rank()
        engine.train_batch(data_iter=iter([batch(0, dp_rank, j) for j in range(case["gas"])]))
        engine.save_checkpoint(os.path.join(case["dir"], "ckpt"), tag="t1")
        dist.barrier()
        if dist.get_rank() != 0:
            return {}
        out = os.path.join(case["dir"], "ckpt", "t1_universal")
        try:
            convert(os.path.join(case["dir"], "ckpt", "t1"), out)
            raised = None
        except NotImplementedError as e:
            raised = str(e)
        return dict(raised=raised, left=sorted(os.listdir(out)) if os.path.exists(out) else None)
    finally:
        restore()
