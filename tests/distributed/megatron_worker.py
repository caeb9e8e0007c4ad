"""Cases for the VRGD family under megatron-core on CPU ranks (gloo), run in a rank pool of their
own (``test_megatron.py``): Megatron's ``DistributedDataParallel`` over a tensor-parallel model,
with and without the distributed optimizer and overlap, against the single-process optimizer on
the unsharded model.

megatron-core 0.16.1 assumes CUDA in three places; ``prepare`` patches them for these ranks
(``vrgd_ds.megatron.cpu_ranks``, applied only where no GPU is): ``torch.cuda.current_device`` answers ``"cpu"``, ``Tensor.type()``
reports a ``torch.cuda.*`` type (the distributed optimizer checks it), and tensor factories
asked for ``device="cuda"`` build on the CPU.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist


_POOL_GROUPS: set = set()  # the process groups the pool's ranks had before any case


def prepare(case: dict) -> dict:
    """Megatron's CUDA assumptions answered for these CPU ranks (``vrgd_ds/megatron/cpu_ranks.py``,
    what the Megatron job applies on CPU ranks too); the groups that outlive every case noted.
    What the rank holds now (torch, Megatron, the pool's groups: about 440,000 objects) is moved
    out of the collector's sight (``gc.freeze``), so that the collection and the scan that end
    every case (``release_model_parallel``) go over the case's own objects: 0.4 s a case less."""
    import gc
    import importlib

    from vrgd_ds.megatron import cpu_ranks

    for name in ("megatron.core.distributed", "megatron.core.parallel_state"):  # release_model_parallel's, frozen too
        importlib.import_module(name)

    cpu_ranks.apply()
    _POOL_GROUPS.update(dist.distributed_c10d._world.pg_map)
    gc.collect()
    gc.freeze()
    return {}


def live_groups(case: dict) -> dict:
    """This rank's process groups and gloo threads (``pt_gloo_runloop``, ``gloo_tcp_loop``)."""
    import gc
    import os

    gc.collect()
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as fh:
                names.append(fh.read().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return {"groups": len(dist.distributed_c10d._world.pg_map),
            "gloo_threads": sum(n.startswith(("pt_gloo", "gloo_")) for n in names)}


def release_model_parallel() -> None:
    """The end of a case: Megatron's ``destroy_model_parallel``, and what it leaves alive freed.
    Megatron only forgets the groups it lists, while torch keeps every group (each with 3 gloo
    threads on every rank) and ``parallel_state`` keeps a few more. Every ``DistributedDataParallel``
    lives on too: its gradient hooks, held by autograd's accumulators (C++), close over it, a cycle
    the collector cannot see. Over a run of cases a pool's ranks gathered thousands of threads,
    whose load slowed every process on the host, these tests and the ones after them. Here the
    groups are destroyed, Megatron's leftovers dropped and each model's hooks released, so the next
    collection frees them all."""
    import gc

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel

    ps.destroy_model_parallel()
    for group in [g for g in dist.distributed_c10d._world.pg_map if g not in _POOL_GROUPS]:
        dist.destroy_process_group(group)
    for name, value in vars(ps).items():
        if isinstance(value, dist.ProcessGroup) and value not in _POOL_GROUPS:
            setattr(ps, name, None)
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel):
            obj.grad_accs.clear()
    gc.collect()


@contextlib.contextmanager
def model_parallel(tp: int, pp: int = 1, vpp: int | None = None):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    try:
        yield ps
    finally:
        release_model_parallel()


def _config(tp: int, **kwargs):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                             tensor_model_parallel_size=tp, **kwargs)


class TwoLayers(torch.nn.Module):
    """A column-parallel then a row-parallel linear layer: weights split on either axis, a
    split bias (column) and a bias every tensor-parallel rank holds whole (row)."""

    def __init__(self, cfg) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        super().__init__()
        init = functools.partial(torch.nn.init.normal_, std=0.3)
        self.c = ColumnParallelLinear(8, 16, config=cfg, init_method=init, bias=True, gather_output=False)
        self.r = RowParallelLinear(16, 4, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                   skip_bias_add=False)

    def forward(self, x):
        h, _ = self.c(x)
        y, _ = self.r(torch.tanh(h))
        return y


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim)


def _full(model: TwoLayers, ps) -> list[torch.Tensor]:
    """The unsharded weights, in the reference model's order."""
    g = ps.get_tensor_model_parallel_group()
    return [_gather(model.c.weight.data, 0, g), _gather(model.c.bias.data, 0, g),
            _gather(model.r.weight.data, 1, g), model.r.bias.data.clone()]


def _batch(dp_rank: int, micro: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + 97 * step + 13 * dp_rank + micro)
    return torch.randn(6, 8, generator=gen) * (1.0 + 0.5 * micro)


def equals_unsharded(case: dict) -> dict:
    """3 steps of ``case["optimizer"]`` through ``vrgd_ds.megatron`` against the same member on
    the unsharded model in one process (one backward per micro-batch of every data-parallel
    rank, the mean gradient, Megatron's clipping). Returns the largest relative difference."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    from vrgd_ds.megatron import get_megatron_optimizer
    from vrgd_ds.optim.registry import REGISTRY

    tp, accumulation, steps = case["tp"], case["accumulation"], case.get("steps", 3)
    with model_parallel(tp) as ps:
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        cfg = _config(tp)
        torch.manual_seed(0)
        model = TwoLayers(cfg)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        with torch.no_grad():
            for p, w in zip(ref.parameters(), _full(model, ps)):
                p.copy_(w)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=case["overlap"],
            use_distributed_optimizer=case["distributed"], bucket_size=case.get("bucket_size", 40)), model)
        ocfg = OptimizerConfig(optimizer="adam", lr=case.get("lr", 1e-2), weight_decay=0.1,
                               use_distributed_optimizer=case["distributed"], clip_grad=case.get("clip", 1.0))
        kwargs = dict(case.get("kwargs", {}))
        opt = get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"], optimizer_kwargs=kwargs,
                                     squares=case.get("squares", "per_step"), node_size=case.get("node_size"))
        # the reference: the same member, groups and arguments on the unsharded model
        inner = opt.chained_optimizers[0].optimizer
        defaults = {k: v for k, v in inner.defaults.items() if k in REGISTRY[case["optimizer"]].accepted_params()}
        order = {id(p): i for i, p in enumerate(model.parameters())}
        full = list(ref.parameters())
        ref_groups = [{"params": [full[order[id(p)]] for p in g["params"]],
                       **{k: g[k] for k in ("lr", "weight_decay") if k in g}}
                      for g in _get_param_groups([ddp], ocfg, None) if g["params"]]
        ref_opt = REGISTRY[case["optimizer"]].cls(ref_groups, **defaults)
        # the same reference without variance reduction: how far the statistics move the result
        flat = copy.deepcopy(ref)
        twin = dict(zip(map(id, ref.parameters()), flat.parameters()))
        flat_groups = [{"params": [twin[id(p)] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"]}
                       for g in ref_opt.param_groups]
        flat_opt = REGISTRY[case["optimizer"]].cls(flat_groups, **{**defaults, "gamma": 1.0}) if inner.defaults.get(
            "gsnr") else None
        oks, metric_rel = [], None
        for step in range(steps):
            oks.append(megatron_step(ddp, opt, dp_rank, accumulation, step))
            for net, o in ((ref, ref_opt), (flat, flat_opt)):
                if o is not None:
                    reference_step(net, o, dp, accumulation, step, ocfg.clip_grad)
            if step == 0 and flat_opt is not None:  # the whole model's figures (TP pieces, DP shards joined)
                metrics, whole = inner.gsnr_metrics(), ref_opt.gsnr_metrics()  # from the same weights
                metric_rel = {k: abs(metrics[k] - whole[k]) / max(abs(whole[k]), 1e-12) for k in PIPELINE_METRICS}
        got = _full(model, ps)
        rel = relative(got, ref.parameters())
        contrast = None if flat_opt is None else relative(flat.parameters(), ref.parameters())
        source = opt.vrgd_sources[0]
        out = {"rel": rel, "contrast": contrast, "ok": oks, "n": source.n, "metric_rel": metric_rel,
               "collectives": source.counters.collectives, "bytes": source.counters.bytes_sent,
               "grad_bytes": source.counters.grad_bytes_fp32, "dp": dp, "memory": source.memory(),
               "intra_calls": getattr(source, "intra_calls", 0), "describe": source.describe()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out)
        return {"worst": max(o["rel"] for o in everyone), "ranks": everyone}


def relative(got, want) -> float:
    """``‖θ − θ_ref‖ / ‖θ_ref‖`` over all the tensors given (float64)."""
    got, want = list(got), list(want)
    diff = sum(float((a.double() - b.double()).pow(2).sum()) for a, b in zip(got, want))
    return (diff / sum(float(b.double().pow(2).sum()) for b in want)) ** 0.5


def megatron_step(ddp, opt, dp_rank: int, accumulation: int, step: int, rows=None, sync=None,
                  batch=_batch, scaled: bool = False) -> bool:
    """One step through Megatron: a backward per micro-batch (the last one synchronised), the
    gradient sync (``sync``, default the DDP's own), the optimizer. ``rows`` picks this rank's
    part of each micro-batch (sequence parallelism); ``scaled``: each micro-batch's loss times
    the optimizer's loss scale (fp16). Returns whether Megatron took the step."""
    ddp.zero_grad_buffer()
    opt.zero_grad()
    for m in range(accumulation):
        x = batch(dp_rank, m, step)
        with contextlib.nullcontext() if m == accumulation - 1 else ddp.no_sync():
            loss = ddp(x if rows is None else rows(x)).pow(2).sum() / accumulation
            (opt.scale_loss(loss) if scaled else loss).backward()
    (sync or ddp.finish_grad_sync)()
    ok, _, _ = opt.step()
    return bool(ok)


def _square_loss(net, x) -> torch.Tensor:
    return net(x).pow(2).sum()


def reference_step(net, opt, dp: int, accumulation: int, step: int, clip: float, batch=_batch,
                   loss=_square_loss) -> None:
    """One step of the single-process reference: a backward per micro-batch of every
    data-parallel rank (each one gradient group: one micro-batch's gradient, as on DeepSpeed,
    whatever Megatron divides each micro-batch's loss by; ``batch(dp_rank, micro, step)``, its loss
    ``loss(net, batch)``), the mean gradient, Megatron's clipping."""
    opt.zero_grad()
    for d in range(dp):
        for m in range(accumulation):
            loss(net, batch(d, m, step)).backward()
    for p in net.parameters():
        p.grad /= dp * accumulation
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    opt.step()


def _build(tp: int, distributed: bool, optimizer: str, kwargs: dict | None, micro_steps: str = "auto",
           overlap: bool = False, sequence_parallel: bool = False, fp16: bool = False, squares: str = "per_step",
           node_size: int | None = None, normed: bool | None = None, decoupled: bool = True,
           initial_loss_scale: float = 2.0 ** 4, decoupled_lr: float | None = None):
    """The test model (seed 0) under Megatron's DDP and ``optimizer`` through ``vrgd_ds.megatron``
    (with ``sequence_parallel``, or ``normed`` without it: ``_NormedTwoLayers``, its scale in a child module; with ``fp16``:
    the model in fp16 inside Megatron's ``Float16Module``, as the Megatron job trains it, and
    Megatron's dynamic loss scale from ``initial_loss_scale``; ``decoupled_lr``: the column layer's
    weight taken for an embedding, in a group of that ``max_lr``, Megatron's key otherwise the
    default group's)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module

    from vrgd_ds.megatron import get_megatron_optimizer

    half = {"fp16": True, "params_dtype": torch.float16} if fp16 else {}
    cfg = _config(tp, sequence_parallel=sequence_parallel, **half)
    torch.manual_seed(0)
    model = _NormedTwoLayers(cfg) if (sequence_parallel if normed is None else normed) else TwoLayers(cfg)
    if decoupled_lr is not None:
        model.c.weight.is_embedding_or_output_parameter = True
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, bucket_size=40,
        overlap_grad_reduce=overlap), Float16Module(cfg, model) if fp16 else model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                                                 use_distributed_optimizer=distributed, decoupled_weight_decay=decoupled,
                                                 decoupled_lr=decoupled_lr,
                                                 **(dict(half, initial_loss_scale=initial_loss_scale) if fp16 else {})),
                                 [ddp], optimizer=optimizer, optimizer_kwargs=kwargs, micro_steps=micro_steps,
                                 squares=squares, node_size=node_size)
    return model, ddp, opt


def fold_equals_hooks(case: dict) -> dict:
    """The statistics folded into Megatron's ``main_grad`` accumulation (one launch per tensor,
    Megatron's add skipped) against a separate hook beside Megatron's add: every step's Σg, Σg²,
    n and ``main_grad``, and the trained weights, bit for bit; and the launches per micro-batch."""
    with model_parallel(case["tp"]) as ps:
        out = {}
        for how in ("auto", "hooks"):
            model, ddp, opt = _build(case["tp"], case["distributed"], "VRLamb", {}, micro_steps=how,
                                     overlap=case.get("overlap", False))
            source = opt.vrgd_sources[0]
            seen, moments = [], source.moments

            def recording(params, moments=moments, seen=seen):
                g, sq = moments(params)
                seen.append(([x.detach().clone() for x in g], [x.detach().clone() for x in sq], source.n))
                return g, sq

            source.moments = recording
            mains = []
            for step in range(3):
                megatron_step(ddp, opt, ps.get_data_parallel_rank(), case["accumulation"], step,
                              sync=lambda ddp=ddp: (ddp.finish_grad_sync(), mains.append(
                                  [p.main_grad.detach().clone() for p in model.parameters()])))
            out[how] = dict(seen=seen, mains=mains, weights=[p.detach().clone() for p in model.parameters()],
                            launches=source.stat_counters.launches, hooks=source.stat_counters.hooks,
                            folded=source.stat_counters.folded)
        a, b = out["auto"], out["hooks"]
        same = all(na == nb and all(torch.equal(x, y) for x, y in zip(ga + qa, gb + qb))
                   for (ga, qa, na), (gb, qb, nb) in zip(a["seen"], b["seen"])) and len(a["seen"]) == len(b["seen"]) >= 3
        res = {"same_moments": same, "seen": [len(a["seen"]), len(b["seen"])],
               "same_main_grad": all(torch.equal(x, y) for ma, mb in zip(a["mains"], b["mains"]) for x, y in zip(ma, mb)),
               "same_weights": all(torch.equal(x, y) for x, y in zip(a["weights"], b["weights"])),
               "launches": [a["launches"], b["launches"]], "hooks": [a["hooks"], b["hooks"]],
               "folded": [a["folded"], b["folded"]],
               "tensors": sum(1 for p in model.parameters() if p.requires_grad)}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, res)
        return {"ranks": everyone}


def stepped_or_discarded(case: dict) -> dict:
    """3 steps of VRLamb through the chain, against the same 3 steps (``case["how"]``) taken through
    the chain's Megatron optimizer (``"inner"``), or after an accumulation thrown away before the
    first (``"discarded"``: two backward passes, then ``zero_grad_buffer`` and ``zero_grad`` and no
    step). Returns whether the weights agree bit for bit and each step's gradient groups."""
    with model_parallel(case["tp"]) as ps:
        dp_rank = ps.get_data_parallel_rank()
        weights, groups = {}, {}
        for how in ("chain", case["how"]):
            model, ddp, opt = _build(case["tp"], case["distributed"], "VRLamb", {})
            if how == "discarded":
                for m in range(2):
                    with ddp.no_sync():
                        (ddp(_batch(dp_rank, m, 99)).pow(2).sum() / 2).backward()
            target = opt.chained_optimizers[0] if how == "inner" else opt
            groups[how] = []
            for step in range(3):
                megatron_step(ddp, target, dp_rank, case["accumulation"], step)
                groups[how].append(opt.chained_optimizers[0].optimizer.gsnr_metrics()["gsnr/n"])
            weights[how] = _full(model, ps)
        return {"same": all(torch.equal(a, b) for a, b in zip(weights["chain"], weights[case["how"]])),
                "groups": groups}


def stepped_again(case: dict) -> dict:
    """A step, then ``optimizer.step()`` again with no backward pass (after ``zero_grad_buffer``
    when ``case["zeroed"]``): the error the second step raises, and whether the weights stayed."""
    with model_parallel(1) as ps:
        dp_rank = ps.get_data_parallel_rank()
        model, ddp, opt = _build(1, case["distributed"], "VRLamb", {})
        megatron_step(ddp, opt, dp_rank, 2, 0)
        before = _full(model, ps)
        if case["zeroed"]:
            ddp.zero_grad_buffer()
        try:
            opt.step()
        except RuntimeError as e:
            error = str(e)
        else:
            error = None
        kept = all(torch.equal(a, b) for a, b in zip(before, _full(model, ps)))
        megatron_step(ddp, opt, dp_rank, 2, 1)  # the next step with its backward passes is taken
        return {"error": error, "kept": kept, "n": opt.chained_optimizers[0].optimizer.gsnr_metrics()["gsnr/n"]}


def decay_mode(case: dict) -> dict:
    """3 steps of Lamb with ``OptimizerConfig.decoupled_weight_decay=False`` against Lamb with
    ``adam_w_mode=False`` given, and against the default (decoupled): whether the weights agree."""
    with model_parallel(1) as ps:
        dp_rank = ps.get_data_parallel_rank()
        weights = {}
        for how, decoupled, kwargs in (("config", False, {}), ("kwargs", True, {"adam_w_mode": False}),
                                       ("decoupled", True, {})):
            model, ddp, opt = _build(1, True, "Lamb", kwargs, decoupled=decoupled)
            for step in range(3):
                megatron_step(ddp, opt, dp_rank, 2, step)
            weights[how] = _full(model, ps)
        same = {how: all(torch.equal(a, b) for a, b in zip(weights["config"], weights[how]))
                for how in ("kwargs", "decoupled")}
        return same


def statistics_cost(case: dict) -> dict:
    """Lamb and VRLamb through ``vrgd_ds.megatron``, 2 steps each: their statistics sources, the
    tensor hooks on the model's parameters, and the collectives a step launches (Megatron's own
    included, counted at ``torch.distributed``)."""
    names = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "all_gather", "reduce_scatter")
    counts = {name: 0 for name in names}
    saved = {name: getattr(dist, name) for name in names}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] += 1
            return saved[name](*args, **kwargs)
        return call

    out = {}
    with model_parallel(case["tp"]) as ps:
        dp_rank = ps.get_data_parallel_rank()
        for optimizer in ("Lamb", "VRLamb"):
            model, ddp, opt = _build(case["tp"], case["distributed"], optimizer, {})
            megatron_step(ddp, opt, dp_rank, case["accumulation"], 0)  # the first step's one-time work aside
            counts.update(dict.fromkeys(names, 0))
            for name in names:
                setattr(dist, name, counting(name))
            inner, reads = opt.chained_optimizers[0], [0]
            real_scale = inner.get_loss_scale

            def read_scale():  # a device scalar on a GPU: reading it on the host waits for the device
                reads[0] += 1
                return real_scale()

            inner.get_loss_scale = read_scale
            try:
                for step in (1, 2):
                    megatron_step(ddp, opt, dp_rank, case["accumulation"], step)
            finally:
                for name in names:
                    setattr(dist, name, saved[name])
                del inner.get_loss_scale
            out[optimizer] = {"sources": len(opt.vrgd_sources), "collectives": sum(counts.values()),
                              "hooks": sum(len(p._backward_hooks or {}) for p in model.parameters()),
                              "scale_reads": reads[0]}
    return out


def fp16_loss_scales(case: dict) -> dict:
    """VRLamb in fp16 (``case``: tp, distributed, accumulation, kwargs) at each of
    ``case["scales"]`` (Megatron's dynamic loss scale from there, constant over 3 steps), with
    the loss scale's reads counted where autograd runs a backward node (a hook's) and elsewhere:
    per scale, the reads, and whether the weights and every step's metrics equal the first
    scale's bit for bit (a power of 2 multiplies exactly while no gradient is an fp16 subnormal),
    else their largest difference."""
    with model_parallel(case["tp"]) as ps:
        runs = {}
        for s in case["scales"]:
            model, ddp, opt = _build(case["tp"], case["distributed"], "VRLamb", case.get("kwargs", {}), fp16=True,
                                     initial_loss_scale=s)
            inner, reads = opt.chained_optimizers[0], {"backward": 0, "elsewhere": 0}
            real_scale = inner.get_loss_scale

            def read_scale(real_scale=real_scale, reads=reads):
                reads["backward" if torch._C._current_autograd_node() is not None else "elsewhere"] += 1
                return real_scale()

            inner.get_loss_scale = read_scale
            metrics = []
            for step in range(3):
                assert megatron_step(ddp, opt, ps.get_data_parallel_rank(), case["accumulation"], step, scaled=True)
                metrics.append(inner.optimizer.gsnr_metrics())
            runs[s] = (_full(model, ps), metrics, reads, float(real_scale()))
        first, out = runs[case["scales"][0]], {}
        for s, (weights, metrics, reads, final) in runs.items():
            out[str(s)] = {"reads": reads, "final_scale": final,
                           "same": all(torch.equal(a, b) for a, b in zip(weights, first[0]))
                           and json.dumps(metrics) == json.dumps(first[1]),
                           "diff": max(float((a.double() - b.double()).abs().max()) for a, b in zip(weights, first[0]))}
        return out


def rebuilt_on_the_same_chunks(case: dict) -> dict:
    """3 steps of VRLamb built once, against 3 steps of VRLamb built on chunks that already have a
    VRAdam from ``vrgd_ds.megatron`` (kept alive): whether the weights agree bit for bit, and what
    stepping the earlier optimizer raises."""
    from megatron.core.optimizer import OptimizerConfig

    from vrgd_ds.megatron import get_megatron_optimizer

    with model_parallel(case["tp"]) as ps:
        dp_rank = ps.get_data_parallel_rank()
        weights = {}
        for how in ("once", "again"):
            model, ddp, opt = _build(case["tp"], case["distributed"], "VRAdam" if how == "again" else "VRLamb", {})
            first = opt
            if how == "again":
                opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                                                             use_distributed_optimizer=case["distributed"]),
                                             [ddp], optimizer="VRLamb")
            for step in range(3):
                megatron_step(ddp, opt, dp_rank, case["accumulation"], step)
            weights[how] = _full(model, ps)
        try:
            megatron_step(ddp, first, dp_rank, case["accumulation"], 3)
            raised = None
        except RuntimeError as e:
            raised = str(e)
        return {"same": all(torch.equal(a, b) for a, b in zip(weights["once"], weights["again"])), "raised": raised}


def _train(case: dict, optimizer: str, kwargs: dict, ps) -> list[torch.Tensor]:
    """3 steps of ``optimizer`` through ``vrgd_ds.megatron`` on the test model; the unsharded weights."""
    model, ddp, opt = _build(case["tp"], case["distributed"], optimizer, kwargs)
    dp_rank = ps.get_data_parallel_rank()
    for step in range(3):
        megatron_step(ddp, opt, dp_rank, case["accumulation"], step)
    return _full(model, ps)


def late_collectives_case(case: dict) -> dict:
    """The same fp16 run twice (``case``: tp, distributed, accumulation, squares, node_size), the
    second with its statistics' collectives landing late (``worker.LateCollectives``), over 3
    steps of which Megatron skips the second (a NaN input on every rank: the loss scaler finds
    the overflow): whether the weights and the metrics of every step agree bit for bit, each
    step's ``step/skipped`` and whether the weights are finite, per rank."""
    from worker import LateCollectives

    def nan_at_step_1(dp_rank: int, micro: int, step: int) -> torch.Tensor:
        x = _batch(dp_rank, micro, step)
        return x * float("nan") if step == 1 else x

    with model_parallel(case["tp"]) as ps:
        runs = []
        for late in (False, True):
            model, ddp, opt = _build(case["tp"], case["distributed"], "VRLamb", {}, fp16=True,
                                     squares=case.get("squares", "per_step"), node_size=case.get("node_size"))
            if late:
                source = opt.vrgd_sources[0]
                source.comm = LateCollectives(source.comm)
            inner, metrics = opt.chained_optimizers[0].optimizer, []
            for step in range(3):
                megatron_step(ddp, opt, ps.get_data_parallel_rank(), case["accumulation"], step,
                              batch=nan_at_step_1, scaled=True)
                metrics.append(inner.gsnr_metrics())
            runs.append((_full(model, ps), metrics))
        (p1, m1), (p2, m2) = runs
        out = {"same": all(torch.equal(a, b) for a, b in zip(p1, p2)) and json.dumps(m1) == json.dumps(m2),
               "skipped": [m.get("step/skipped") for m in m2], "overflow": [m.get("step/skipped_overflow") for m in m2],
               "finite": all(bool(torch.isfinite(p).all()) for p in p2),
               "gsnr_mean": [m.get("gsnr/mean") for m in m2]}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out)
        return {"ranks": everyone}


def gamma_one_equals_base(case: dict) -> dict:
    """A member with ``gamma=1`` and its base (``Lamb``; ``VRAdam``/``VRSGD`` with ``gsnr=False``)
    take the same steps, bit for bit."""
    with model_parallel(case["tp"]) as ps:
        vr = _train(case, case["optimizer"], {"gamma": 1.0}, ps)
        from vrgd_ds.optim.registry import REGISTRY

        base_name = REGISTRY[case["optimizer"]].base
        base = _train(case, base_name, {"gsnr": False} if base_name == case["optimizer"] else {}, ps)
        vr_on = _train(case, case["optimizer"], {}, ps)
        return {"equal": all(torch.equal(a, b) for a, b in zip(vr, base)),
                "differs_with_gsnr": max((a - b).abs().max().item() for a, b in zip(vr_on, base))}


class _Stage(torch.nn.Module):
    def __init__(self, layer, tanh: bool) -> None:
        super().__init__()
        self.layer, self.tanh = layer, tanh

    def forward(self, x):
        y, _ = self.layer(x)
        return torch.tanh(y) if self.tanh else y


def _pipeline_micro_steps(ddp, stage: int, step: int, accumulation: int, dp_rank: int = 0,
                          dtype: torch.dtype = torch.float32, scale_loss=None, spoiled=None) -> None:
    """One step's micro-batches (data-parallel rank ``dp_rank``'s) through two pipeline stages (the
    column layer's output and its gradient sent between them by hand in ``dtype``, to the other
    stage of this rank's pipeline), the last one synchronising, then the gradients' sync.
    ``scale_loss``: the last stage's loss through it (fp16's loss scale); ``spoiled``: the
    ``(step, micro)`` whose gradient the last stage sends back as NaN."""
    from megatron.core import parallel_state as ps

    other = ps.get_pipeline_model_parallel_next_rank()  # with 2 stages, also the previous one
    for m in range(accumulation):
        with contextlib.nullcontext() if m == accumulation - 1 else ddp.no_sync():
            if stage == 0:
                h = ddp(_batch(dp_rank, m, step))
                dist.send(h.detach().contiguous(), other)
                grad_h = torch.empty_like(h)
                dist.recv(grad_h, other)
                h.backward(grad_h)
            else:
                h = torch.empty(6, 16, dtype=dtype)
                dist.recv(h, other)
                h.requires_grad_(True)
                loss = ddp(h).pow(2).sum() / accumulation
                (loss if scale_loss is None else scale_loss(loss)).backward()
                dist.send((h.grad * float("nan") if (step, m) == spoiled else h.grad).contiguous(), other)
    ddp.finish_grad_sync()


def pipeline_equals_unsharded(case: dict) -> dict:
    """Two pipeline stages (the column layer, then the row layer), activations and their
    gradients sent between them by hand, each stage's optimizer from ``vrgd_ds.megatron``: the
    parameters after 3 steps against the single-process optimizer on the whole model. LAMB's
    pre-normalisation norm and the skip flag span the stages."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from vrgd_ds.megatron import get_megatron_optimizer
    from vrgd_ds.optim.registry import REGISTRY

    accumulation = case["accumulation"]
    with model_parallel(1, pp=2) as ps:
        stage = ps.get_pipeline_model_parallel_rank()
        cfg = _config(1)
        torch.manual_seed(0)
        whole = TwoLayers(cfg)
        ref = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        with torch.no_grad():
            for p, w in zip(ref.parameters(), whole.parameters()):
                p.copy_(w)
        mine = _Stage(whole.c if stage == 0 else whole.r, tanh=stage == 0)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=case["distributed"], bucket_size=40), mine)
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                               use_distributed_optimizer=case["distributed"])
        opt = get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"], optimizer_kwargs=case.get("kwargs", {}))
        defaults = {k: v for k, v in opt.chained_optimizers[0].optimizer.defaults.items()
                    if k in REGISTRY[case["optimizer"]].accepted_params()}
        # Megatron's groups differ by wd_mult only (no scheduler applies it here): weights, biases
        ref_opt = REGISTRY[case["optimizer"]].cls([{"params": [ref[0].weight, ref[2].weight]},
                                                   {"params": [ref[0].bias, ref[2].bias]}], **defaults)
        for step in range(3):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            _pipeline_micro_steps(ddp, stage, step, accumulation)
            ok, _, _ = opt.step()
            reference_step(ref, ref_opt, 1, accumulation, step, ocfg.clip_grad)
        got = list(mine.parameters())
        want = list((ref[0] if stage == 0 else ref[2]).parameters())
        rel = relative(got, want)
        metrics = opt.chained_optimizers[0].optimizer.gsnr_metrics(per_tensor=True)
        whole = ref_opt.gsnr_metrics(per_tensor=True)  # its groups are one micro-batch's gradient, as Megatron's figures
        metric_rel = {k: abs(metrics[k] - whole[k]) / max(abs(whole[k]), 1e-12) for k in PIPELINE_METRICS}
        rows = sorted({k.split("/")[1] for k in metrics if k.startswith("tensor/")})
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"rel": rel, "ok": bool(ok), "n": opt.vrgd_sources[0].n,
                                          "metric_rel": metric_rel, "rows": rows})
        return {"worst": max(o["rel"] for o in everyone), "ranks": everyone}


class _Chunk(torch.nn.Module):
    """One virtual pipeline stage: a linear layer on activations [seq, micro-batch, hidden], its
    input handed over by Megatron's schedule (``set_input_tensor``) past the model's first chunk,
    tanh after every layer but the model's last."""

    def __init__(self, layer, first: bool, last: bool) -> None:
        from megatron.core.enums import ModelType

        super().__init__()
        self.layer, self.first, self.last, self.input_tensor = layer, first, last, None
        self.model_type = ModelType.encoder_or_decoder  # what the schedule asks every chunk

    def set_input_tensor(self, tensors) -> None:
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, x):
        y, _ = self.layer(x if self.first else self.input_tensor)
        return y if self.last else torch.tanh(y)


def _interleaved_batch(m: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(2000 + 97 * step + m)
    return torch.randn(3, 2, 8, generator=gen) * (1.0 + 0.5 * m)  # [seq, micro-batch, hidden]


def _interleaved_chunks(ps, distributed: bool, layers: int = 4, batched: bool = False, frozen: tuple = ()):
    """The interleaved case's model: ``layers`` linear layers (seed 0) over 2 stages of 2 chunks
    (chunk v of stage s: layer v × stages + s), one Megatron DDP per chunk of this stage. Returns
    ``(every layer, this stage's layer indices, its DDPs)``. ``batched``: megatron-core's
    default exchange (refused with chunks on 2 stages); ``frozen``: layers whose parameters are
    frozen before their DDP is built (which then holds no buffer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    stage = ps.get_pipeline_model_parallel_rank()
    cfg = TransformerConfig(num_layers=layers, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                            pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                            pipeline_dtype=torch.float32, batch_p2p_comm=batched)
    # batch_p2p_comm=False: with 2 stages the batched exchange (megatron-core's default) posts a send
    # and a receive for each direction, to and from the same rank, in the same order on both ranks;
    # messages between two ranks match in the order posted, so each stage's gradient met the other's
    # activation receive (seen: every micro-batch from the third on trained on the wrong input).
    # The unbatched exchange orders them by the rank's parity.
    torch.manual_seed(0)
    init = functools.partial(torch.nn.init.normal_, std=0.3)
    whole = [ColumnParallelLinear(8, 8, config=cfg, init_method=init, bias=True, gather_output=False)
             for _ in range(layers)]
    held = [stage, stage + 2]
    for i in frozen:
        whole[i].requires_grad_(False)
    ddps = [DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, bucket_size=40),
        _Chunk(whole[i], first=i == 0, last=i == layers - 1)) for i in held]
    cfg.no_sync_func = [d.no_sync for d in ddps]
    return whole, held, ddps


def interleaved_batched_exchange(case: dict) -> dict:
    """The interleaved case with megatron-core's batched exchange: the refusal's message (None: built)."""
    from megatron.core.optimizer import OptimizerConfig

    from vrgd_ds.megatron import get_megatron_optimizer

    with model_parallel(1, pp=2, vpp=2) as ps:
        _, _, ddps = _interleaved_chunks(ps, case["distributed"], batched=True)
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=case["distributed"])
        try:
            get_megatron_optimizer(ocfg, ddps, optimizer=case["optimizer"])
        except ValueError as e:
            return {"refusal": str(e)}
        return {"refusal": None}


def interleaved_first_chunk_frozen(case: dict) -> dict:
    """The interleaved case with layer 0 frozen (stage 0's first chunk then has no buffer): every
    rank's outcome of building the optimizer, None where it was built."""
    from megatron.core.optimizer import OptimizerConfig

    from vrgd_ds.megatron import get_megatron_optimizer

    with model_parallel(1, pp=2, vpp=2) as ps:
        _, _, ddps = _interleaved_chunks(ps, case["distributed"], frozen=(0,))
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=case["distributed"])
        try:
            get_megatron_optimizer(ocfg, ddps, optimizer="VRLamb")
            outcome = None
        except Exception as e:  # noqa: BLE001 (returned to the test)
            outcome = f"{type(e).__name__}: {e}"
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"buffers": [len(d.buffers) for d in ddps], "outcome": outcome})
        return {"ranks": everyone}


def interleaved_pipeline_equals_unsharded(case: dict) -> dict:
    """The interleaved schedule (virtual pipeline parallelism): 4 layers over 2 pipeline stages of
    2 model chunks each (stage s holds layers s and s + 2, Megatron's assignment), one Megatron
    DDP per chunk, ``vrgd_ds.megatron`` over both chunks of a stage, the micro-batches run by
    Megatron's ``forward_backward_pipelining_with_interleaving``: the parameters after 3 steps
    against the single-process optimizer on the whole model, and every stage's metrics against the
    whole model's."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from vrgd_ds.megatron import get_megatron_optimizer
    from vrgd_ds.optim.registry import REGISTRY

    accumulation, layers = case["accumulation"], 4
    with model_parallel(1, pp=2, vpp=2) as ps:
        whole, held, ddps = _interleaved_chunks(ps, case["distributed"], layers)
        ref = torch.nn.Sequential(*[m for i in range(layers)
                                    for m in (torch.nn.Linear(8, 8), torch.nn.Tanh())][:-1])
        ref_linear = [m for m in ref if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for mine, theirs in zip(whole, ref_linear):
                theirs.weight.copy_(mine.weight)
                theirs.bias.copy_(mine.bias)
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                               use_distributed_optimizer=case["distributed"])
        opt = get_megatron_optimizer(ocfg, ddps, optimizer=case["optimizer"], optimizer_kwargs=case.get("kwargs", {}))
        inner = opt.chained_optimizers[0].optimizer
        defaults = {k: v for k, v in inner.defaults.items() if k in REGISTRY[case["optimizer"]].accepted_params()}
        ref_opt = REGISTRY[case["optimizer"]].cls([{"params": [m.weight for m in ref_linear]},
                                                   {"params": [m.bias for m in ref_linear]}], **defaults)
        flat = copy.deepcopy(ref)  # the reference at gamma = 1: how far the statistics move the result
        flat_linear = [m for m in flat if isinstance(m, torch.nn.Linear)]
        flat_opt = REGISTRY[case["optimizer"]].cls([{"params": [m.weight for m in flat_linear]},
                                                    {"params": [m.bias for m in flat_linear]}], **{**defaults, "gamma": 1.0})
        forward_backward = get_forward_backward_func()
        seen = []

        def forward_step(data, model):
            m, x = next(data)
            seen.append([next(i for i, d in enumerate(ddps) if d is model), m])  # (chunk, micro-batch)
            return model(x), lambda out: (out.pow(2).sum(), {})  # the schedule divides by the micro-batches

        for step in range(3):
            for d in ddps:
                d.zero_grad_buffer()
            opt.zero_grad()
            batches = [iter([(m, _interleaved_batch(m, step)) for m in range(accumulation)]) for _ in ddps]
            forward_backward(forward_step_func=forward_step, data_iterator=batches, model=ddps,
                             num_microbatches=accumulation, seq_length=3, micro_batch_size=2)
            for d in ddps:
                d.finish_grad_sync()
            ok, _, _ = opt.step()
            for net, o in ((ref, ref_opt), (flat, flat_opt)):
                reference_step(net, o, 1, accumulation, step, ocfg.clip_grad,
                               batch=lambda d, m, s: _interleaved_batch(m, s))
        got = [p for d in ddps for p in d.module.parameters()]
        want = [p for i in held for p in (ref_linear[i].weight, ref_linear[i].bias)]
        metrics = inner.gsnr_metrics(per_tensor=True)
        theirs = ref_opt.gsnr_metrics(per_tensor=True)
        metric_rel = {k: abs(metrics[k] - theirs[k]) / max(abs(theirs[k]), 1e-12) for k in PIPELINE_METRICS}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {
            "rel": relative(got, want), "contrast": relative(flat.parameters(), ref.parameters()), "ok": bool(ok),
            "n": opt.vrgd_sources[0].n, "metric_rel": metric_rel,
            "rows": sorted({k.split("/")[1] for k in metrics if k.startswith("tensor/")}),
            "order": seen[:2 * accumulation]})
        return {"worst": max(o["rel"] for o in everyone), "ranks": everyone}


def fp16_pipeline_case(case: dict) -> dict:
    """Two pipeline stages in fp16, each in Megatron's ``Float16Module``, VRLamb with Megatron's
    dynamic loss scale from each of ``case["scales"]``, 3 steps of ``case["accumulation"]``
    micro-batches (activations and their gradients sent between the stages by hand, in fp16); in
    step 1's first micro-batch the gradient stage 1 sends back is NaN, so that only stage 0's
    gradients overflow. Per scale and stage: each step's ``step/skipped``, the final scale, whether
    the weights are finite, and whether the weights and every step's metrics equal the first
    scale's bit for bit."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.module import Float16Module

    from vrgd_ds.megatron import get_megatron_optimizer

    with model_parallel(1, pp=2) as ps:
        stage = ps.get_pipeline_model_parallel_rank()
        runs = {}
        for scale in case["scales"]:
            half = {"fp16": True, "params_dtype": torch.float16}
            cfg = _config(1, **half)
            torch.manual_seed(0)
            whole = TwoLayers(cfg)
            mine = _Stage(whole.c if stage == 0 else whole.r, tanh=stage == 0)
            ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=case["distributed"], bucket_size=40),
                Float16Module(cfg, mine))
            opt = get_megatron_optimizer(OptimizerConfig(
                optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0, initial_loss_scale=scale,
                use_distributed_optimizer=case["distributed"], **half), [ddp], optimizer="VRLamb",
                optimizer_kwargs=case.get("kwargs", {}))
            inner, metrics = opt.chained_optimizers[0], []
            for step in range(3):
                ddp.zero_grad_buffer()
                opt.zero_grad()  # (Float16Module casts the first stage's input to fp16)
                _pipeline_micro_steps(ddp, stage, step, case["accumulation"], dtype=torch.float16,
                                      scale_loss=opt.scale_loss, spoiled=(1, 0))
                opt.step()
                metrics.append(inner.optimizer.gsnr_metrics())
            runs[scale] = (list(mine.parameters()), metrics, float(inner.get_loss_scale()))
        first, out = runs[case["scales"][0]], {}
        for scale, (weights, metrics, final) in runs.items():
            out[str(scale)] = {"skipped": [m.get("step/skipped") for m in metrics], "final_scale": final,
                               "finite": all(bool(torch.isfinite(w).all()) for w in weights),
                               "same": all(torch.equal(a, b) for a, b in zip(weights, first[0]))
                               and json.dumps(metrics) == json.dumps(first[1])}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out)
        return {"stages": everyone}


class _TiedOutput(torch.nn.Module):
    """The last stage of the tied case: its copy of the first stage's weight W used transposed
    (``tanh(h W + c)``, as an output layer tied to a word embedding), then a linear layer of its own.
    Megatron marks a tied copy on the last stage ``shared`` and ``shared_embedding``."""

    def __init__(self, tied: torch.Tensor, cfg) -> None:
        from megatron.core.tensor_parallel import ColumnParallelLinear

        super().__init__()
        self.tied = torch.nn.Parameter(tied.detach().clone())
        self.tied.shared = self.tied.shared_embedding = True
        self.c = torch.nn.Parameter(torch.linspace(-0.2, 0.2, tied.shape[1]))
        init = functools.partial(torch.nn.init.normal_, std=0.3)
        self.out = ColumnParallelLinear(tied.shape[1], 4, config=cfg, init_method=init, bias=True, gather_output=False)

    def forward(self, h):
        y, _ = self.out(torch.tanh(h @ self.tied + self.c))
        return y


class _TiedReference(torch.nn.Module):
    """The tied case unsharded, in one process: one W used by both layers."""

    def __init__(self, first: _Stage, last: _TiedOutput) -> None:
        super().__init__()
        copy_of = lambda t: torch.nn.Parameter(t.detach().clone())  # noqa: E731
        self.W, self.b0 = copy_of(first.layer.weight), copy_of(first.layer.bias)
        self.c, self.Lw, self.Lb = copy_of(last.c), copy_of(last.out.weight), copy_of(last.out.bias)

    def forward(self, x):
        return torch.tanh(torch.tanh(x @ self.W.T + self.b0) @ self.W + self.c) @ self.Lw.T + self.Lb


def _tied_model(cfg):
    """The tied case's two stages (seed 0): the first's column layer (W [16, 8], b0, tanh), marked
    as Megatron marks a tied word embedding, and the last stage's ``_TiedOutput`` on a copy of W."""
    torch.manual_seed(0)
    first = _Stage(TwoLayers(cfg).c, tanh=True)
    first.layer.weight.shared_embedding = True
    return first, _TiedOutput(first.layer.weight, cfg)


def _tied_micro_steps(ddp, tied, stage: int, step: int, accumulation: int, dp_rank: int = 0) -> None:
    """One step's micro-batches through the tied case's two stages (as ``_pipeline_micro_steps``),
    then the tied copies' gradients summed across the stages, as Megatron's
    ``finalize_model_grads`` does after the data-parallel reduction."""
    from megatron.core import parallel_state as ps

    _pipeline_micro_steps(ddp, stage, step, accumulation, dp_rank)
    dist.all_reduce(tied.main_grad, group=ps.get_pipeline_model_parallel_group())


class _CondFirst(_Stage):
    """The first stage of the conditional-embedder case: the column layer, then ``tanh(· + e)``
    with ``e`` [16] an embedder's output (a diffusion model's timestep embedding), a copy on every
    stage, marked ``pipeline_parallel`` as Megatron's diffusion models mark theirs."""

    def __init__(self, layer, e: torch.Tensor) -> None:
        super().__init__(layer, tanh=False)
        self.e = torch.nn.Parameter(e.detach().clone())
        self.e.pipeline_parallel = True

    def forward(self, x):
        y, _ = self.layer(x)
        return torch.tanh(y + self.e)


class _CondLast(_CondFirst):
    """The last stage: its copy of ``e`` added to its input, then its own linear layer."""

    def forward(self, h):
        y, _ = self.layer(torch.tanh(h + self.e))
        return y


class _CondReference(torch.nn.Module):
    """The conditional-embedder case in one process: one ``e`` used on both stages."""

    def __init__(self, first: _CondFirst, last: _CondLast) -> None:
        super().__init__()
        copy_of = lambda t: torch.nn.Parameter(t.detach().clone())  # noqa: E731
        self.W, self.b0, self.e = copy_of(first.layer.weight), copy_of(first.layer.bias), copy_of(first.e)
        self.Lw, self.Lb = copy_of(last.layer.weight), copy_of(last.layer.bias)

    def forward(self, x):
        return torch.tanh(torch.tanh(x @ self.W.T + self.b0 + self.e) + self.e) @ self.Lw.T + self.Lb


def _cond_model(cfg):
    """The conditional-embedder case's two stages (seed 0): the column layer and ``e`` (16 values
    in [-0.3, 0.3]), then a column layer 16 → 4 on the last stage, each stage with a copy of ``e``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    torch.manual_seed(0)
    e = torch.linspace(-0.3, 0.3, 16)
    init = functools.partial(torch.nn.init.normal_, std=0.3)
    first = _CondFirst(TwoLayers(cfg).c, e)
    last = _CondLast(ColumnParallelLinear(16, 4, config=cfg, init_method=init, bias=True, gather_output=False), e)
    return first, last


def tied_across_stages_equals_unsharded(case: dict) -> dict:
    """A weight tied across 2 pipeline stages (an embedding and an output layer, each stage a copy,
    their gradients summed across the stages after the data-parallel reduction, as Megatron's
    ``finalize_model_grads`` does), ``get_megatron_optimizer(..., tied_across_stages="gsnr_off")``:
    the parameters after 3 steps against the single-process optimizer on the untied-in-memory
    model (one W used twice) with W in a ``gsnr=False`` group, and against the same with the GSNR on
    W (how far switching it off moves the result); whether every rank's copy of W is the same bit
    for bit; every stage's metrics against the reference's. On 4 ranks, 2 data-parallel ranks each
    run the two stages on micro-batches of their own. ``case["kind"]`` ``"cond"``: a diffusion
    model's conditional embedder instead (``e``, a copy on each stage, ``has_cond_embedder``), its
    copies summed by Megatron's own ``_allreduce_conditional_embedding_grads``; without clipping,
    since Megatron's grad norm counts such a tensor on every stage (the reference counts it once)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_conditional_embedding_grads
    from megatron.core.optimizer import OptimizerConfig

    from vrgd_ds.megatron import get_megatron_optimizer
    from vrgd_ds.optim.registry import REGISTRY

    accumulation, cond = case["accumulation"], case.get("kind") == "cond"
    with model_parallel(1, pp=2) as ps:
        stage = ps.get_pipeline_model_parallel_rank()
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        cfg = _config(1)
        cfg.has_cond_embedder = cond  # not a TransformerConfig field: a diffusion model's config sets it
        first, last = (_cond_model if cond else _tied_model)(cfg)
        mine = first if stage == 0 else last
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=case["distributed"], bucket_size=40), mine)
        tied = mine.e if cond else first.layer.weight if stage == 0 else last.tied
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0 if cond else 1.0,
                               use_distributed_optimizer=case["distributed"])
        opt = get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"], optimizer_kwargs=case.get("kwargs", {}),
                                     tied_across_stages="gsnr_off")
        inner = opt.chained_optimizers[0].optimizer
        defaults = {k: v for k, v in inner.defaults.items() if k in REGISTRY[case["optimizer"]].accepted_params()}

        def reference(w_gsnr: bool):
            net = (_CondReference if cond else _TiedReference)(first, last)
            off = {} if w_gsnr else {"gsnr": False}
            groups = ([{"params": [net.W, net.Lw]}, {"params": [net.e], **off}, {"params": [net.b0, net.Lb]}] if cond
                      else [{"params": [net.Lw]}, {"params": [net.W], **off}, {"params": [net.b0, net.c, net.Lb]}])
            return net, REGISTRY[case["optimizer"]].cls(groups, **defaults)

        refs = [reference(False), reference(True)]
        for step in range(3):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            if cond:
                _pipeline_micro_steps(ddp, stage, step, accumulation, dp_rank)
                _allreduce_conditional_embedding_grads([ddp], cfg, ps.get_pipeline_model_parallel_group())
            else:
                _tied_micro_steps(ddp, tied, stage, step, accumulation, dp_rank)
            ok, _, _ = opt.step()
            for net, o in refs:
                reference_step(net, o, dp, accumulation, step, ocfg.clip_grad)
        (want, ref_opt), (gsnr_on_w, _) = refs
        if cond:
            names = ["W", "b0", "e"] if stage == 0 else ["e", "Lw", "Lb"]
            got = [first.layer.weight, first.layer.bias, first.e] if stage == 0 else [last.e, last.layer.weight,
                                                                                       last.layer.bias]
        else:
            names = ["W", "b0"] if stage == 0 else ["W", "c", "Lw", "Lb"]
            got = [first.layer.weight, first.layer.bias] if stage == 0 else [last.tied, last.c, last.out.weight,
                                                                               last.out.bias]
        theirs = [getattr(want, n) for n in names]
        copies = [None] * dist.get_world_size()
        dist.all_gather_object(copies, tied.detach().clone())
        metrics, expected = inner.gsnr_metrics(), ref_opt.gsnr_metrics()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {
            "rel": relative(got, theirs), "contrast": relative([getattr(gsnr_on_w, n) for n in names], theirs),
            "ok": bool(ok), "n": opt.vrgd_sources[0].n, "copies_equal": all(torch.equal(copies[0], w) for w in copies),
            "twin": [len(g["params"]) for g in inner.param_groups if g.get("tp_partial_grads")],
            "metric_rel": {k: abs(metrics[k] - expected[k]) / max(abs(expected[k]), 1e-12) for k in PIPELINE_METRICS}})
        return {"worst": max(o["rel"] for o in everyone), "ranks": everyone}


def gpt_tied_marking(case: dict) -> dict:
    """megatron-core's own GPT (local layer spec, 2 layers) on ``case["pp"]`` stages, its embeddings
    tied or not (``case["tied"]``): what ``stage_tied_tensors`` finds on each rank, by name and
    kind, from the attributes Megatron's ``LanguageModule`` sets (its copy of the embedding on the
    last stage is filled from the first stage's after a ``.cuda()``, which ``cpu_ranks`` answers)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vrgd_ds.megatron.optimizer import stage_tied_tensors

    with model_parallel(1, pp=case["pp"]) as ps:
        cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True,
                                pipeline_model_parallel_size=case["pp"], pipeline_dtype=torch.float32,
                                mtp_num_layers=case.get("mtp"))
        spec = get_gpt_layer_local_spec()
        mtp = get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False) if case.get("mtp") else None
        model = GPTModel(cfg, spec, vocab_size=16, max_sequence_length=8,
                         pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                         share_embeddings_and_output_weights=case["tied"], mtp_block_spec=mtp)
        found = sorted(f"{kind} {name}" for kind, name in stage_tied_tensors([model]).values())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, found)
        return {"ranks": everyone}


def _mtp_gpt(cfg, pre: bool, post: bool):
    """megatron-core's GPT with one multi-token prediction layer (local layer spec, rotary
    positions: a learned position table would be a second, untied copy on the last stage)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec

    spec = get_gpt_layer_local_spec()
    return GPTModel(cfg, spec, vocab_size=16, max_sequence_length=8, pre_process=pre, post_process=post,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    mtp_block_spec=get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False))


def _mtp_batch(m: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(3000 + 97 * step + m)
    tokens = torch.randint(0, 16, (2, 8), generator=gen)
    return {"input_ids": tokens, "position_ids": torch.arange(8).expand(2, 8),
            "attention_mask": torch.triu(torch.ones(8, 8, dtype=torch.bool), 1)[None, None],
            "labels": torch.roll(tokens, -1, dims=1)}


def mtp_across_stages_equals_unsharded(case: dict) -> dict:
    """megatron-core's GPT with multi-token prediction on 2 pipeline stages: the embedding on the
    first stage, the copy MTP embeds with on the last, their gradients summed by Megatron's own
    ``finalize_model_grads``; the micro-batches run by Megatron's 1F1B schedule;
    ``get_megatron_optimizer(..., tied_across_stages="gsnr_off")``. Against the same model whole
    (one stage, one embedding), built first on every rank from the same seed, stepped by the
    single-process optimizer with the embedding in a ``gsnr=False`` group (and with its GSNR on,
    how far that moves the result): per stage, the parameters after 3 steps, whether the two
    copies are equal bit for bit, ``n``, what the twin groups hold, every stage's metrics against the
    reference's, and the default's refusal."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler
    from megatron.core.transformer.transformer_config import TransformerConfig

    from vrgd_ds.megatron import get_megatron_optimizer
    from vrgd_ds.optim.registry import REGISTRY

    accumulation, embedding = case["accumulation"], "embedding.word_embeddings.weight"
    settings = dict(num_layers=2, hidden_size=8, num_attention_heads=2, use_cpu_initialization=True, mtp_num_layers=1,
                    hidden_dropout=0.0, attention_dropout=0.0)
    ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                           use_distributed_optimizer=case["distributed"])

    def whole():  # the model on one stage, the same on every rank
        torch.manual_seed(0)
        return _mtp_gpt(TransformerConfig(**settings), pre=True, post=True)

    with model_parallel(1):
        start = {k: v.detach().clone() for k, v in whole().state_dict().items() if isinstance(v, torch.Tensor)}
    with model_parallel(1, pp=2) as ps:
        stage = ps.get_pipeline_model_parallel_rank()
        cfg = TransformerConfig(**settings, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32,
                                batch_p2p_comm=False)  # see interleaved_pipeline_equals_unsharded
        model = _mtp_gpt(cfg, pre=stage == 0, post=stage == 1)
        # stage s's decoder layer i is the whole model's layer s + i (one layer a stage)
        name_in_whole = lambda n: n.replace("decoder.layers.0.", f"decoder.layers.{stage}.")  # noqa: E731
        model.load_state_dict({k: start[name_in_whole(k)] for k, v in model.state_dict().items()
                               if isinstance(v, torch.Tensor)}, strict=False)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=case["distributed"], bucket_size=4000), model)
        cfg.no_sync_func, cfg.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
        try:  # the default
            get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"], optimizer_kwargs=case.get("kwargs", {}))
            refusal = None
        except ValueError as e:
            refusal = str(e)
        opt = get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"], optimizer_kwargs=case.get("kwargs", {}),
                                     tied_across_stages="gsnr_off")
        inner = opt.chained_optimizers[0].optimizer
        defaults = {k: v for k, v in inner.defaults.items() if k in REGISTRY[case["optimizer"]].accepted_params()}

        def forward_step(data, model):
            batch = next(data)
            return model(**batch), lambda out: (out.float().mean(), {})  # the schedule divides by the micro-batches

        for step in range(3):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            get_forward_backward_func()(forward_step_func=forward_step,
                                        data_iterator=iter([_mtp_batch(m, step) for m in range(accumulation)]),
                                        model=[ddp], num_microbatches=accumulation, seq_length=8, micro_batch_size=2)
            ok, _, _ = opt.step()
        mine = {name_in_whole(n): p.detach().clone() for n, p in model.named_parameters()}
        twin = [len(g["params"]) for g in inner.param_groups if g.get("tp_partial_grads")]
        n, metrics = opt.vrgd_sources[0].n, inner.gsnr_metrics()
        copies = [None] * dist.get_world_size()
        dist.all_gather_object(copies, mine[embedding])

    def reference(w_gsnr: bool) -> tuple[dict, dict]:
        net = whole()
        params = dict(net.named_parameters())
        opt = REGISTRY[case["optimizer"]].cls([
            {"params": [params[embedding]], **({} if w_gsnr else {"gsnr": False})},
            {"params": [p for n, p in params.items() if n != embedding]}], **defaults)
        for step in range(3):  # each micro-batch's loss whole, its MTP term's gradient scaled by 1 as Megatron's
            MTPLossAutoScaler.set_loss_scale(torch.ones(1))
            reference_step(net, opt, 1, accumulation, step, ocfg.clip_grad, batch=lambda d, m, s: _mtp_batch(m, s),
                           loss=lambda net, batch: net(**batch).float().mean())
        return {k: v.detach() for k, v in net.named_parameters()}, opt.gsnr_metrics()

    with model_parallel(1):
        (want, expected), (gsnr_on, _) = reference(False), reference(True)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {
        "rel": relative(mine.values(), [want[k] for k in mine]),
        "contrast": relative([gsnr_on[k] for k in mine], [want[k] for k in mine]), "ok": bool(ok), "n": n,
        "copies_equal": all(torch.equal(copies[0], w) for w in copies), "twin": twin, "refusal": refusal,
        "metric_rel": {k: abs(metrics[k] - expected[k]) / max(abs(expected[k]), 1e-12) for k in PIPELINE_METRICS}})
    return {"worst": max(o["rel"] for o in everyone), "ranks": everyone}


def tied_checkpoint_case(case: dict) -> dict:
    """The tied case (``tied_across_stages="gsnr_off"``) saved to a dist checkpoint after one step,
    the last stage's copy of W saved as a replica of the first stage's tensor (as Megatron's
    ``tie_embeddings_and_output_weights_state_dict`` does), and loaded back into a fresh build:
    per stage, the difference between the step after the load and the same step without it, the
    same with the model's tensors loaded alone (a fresh optimizer state), and whether the two
    copies of W are equal after the whole load."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.utils import sharded_state_dict_default

    from vrgd_ds.megatron import get_megatron_optimizer

    with model_parallel(1, pp=2) as ps:
        stage = ps.get_pipeline_model_parallel_rank()
        cfg = _config(1)
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                               use_distributed_optimizer=case["distributed"])
        groups = {"dp_cp_group": ps.get_data_parallel_group()}

        def build():
            first, last = _tied_model(cfg)
            mine = first if stage == 0 else last
            ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=case["distributed"], bucket_size=40), mine)
            opt = get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"],
                                         optimizer_kwargs=case.get("kwargs", {}), tied_across_stages="gsnr_off")
            return mine, (first.layer.weight if stage == 0 else last.tied), ddp, opt

        def state(mine, opt, is_loading):
            if stage == 0:
                model_sd = sharded_state_dict_default(mine.layer, "embedding.", (), groups,
                                                      tp_group=ps.get_tensor_model_parallel_group())
            else:
                model_sd = {"tied": ShardedTensor.from_rank_offsets("embedding.weight", mine.tied, replica_id=1),
                            "c": ShardedTensor.from_rank_offsets("output.c", mine.c),
                            **sharded_state_dict_default(mine.out, "output.out.", (), groups,
                                                         tp_group=ps.get_tensor_model_parallel_group())}
            return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading)}

        def train(ddp, tied, opt, step):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            _tied_micro_steps(ddp, tied, stage, step, 2)
            opt.step()

        mine, tied, ddp, opt = build()
        train(ddp, tied, opt, 0)
        Path(case["save"]).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(state(mine, opt, False), case["save"])
        train(ddp, tied, opt, 1)
        straight = [p.detach().clone() for p in mine.parameters()]
        out = {}
        for what in ("model", "both"):  # the model alone: how far the optimizer state's load moves the step
            mine, tied, ddp, opt = build()
            request = state(mine, opt, True)
            loaded = dist_checkpointing.load(request if what == "both" else {"model": request["model"]}, case["save"],
                                             strict=StrictHandling.ASSUME_OK_UNEXPECTED)
            # the model's tensors were loaded in place (dist-checkpointing's torch_dist strategy fills the
            # ShardedTensors' own tensors; the step after the load tells if they were not)
            for mopt in opt.chained_optimizers:
                if hasattr(mopt, "reload_model_params"):
                    mopt.reload_model_params()
            if what == "both":
                opt.load_state_dict(loaded["optimizer"])
            train(ddp, tied, opt, 1)
            out[what] = relative(list(mine.parameters()), straight)
        copies = [None] * dist.get_world_size()
        dist.all_gather_object(copies, tied.detach().clone())
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"rel": out["both"], "model_only": out["model"],
                                          "copies_equal": torch.equal(copies[0], copies[1])})
        return {"ranks": everyone}


#: the whole model's metrics every pipeline stage reports (``Layout.join_stages``)
PIPELINE_METRICS = ("gsnr/mean", "gsnr/tensor_mean_min", "gsnr/tensor_mean_max", "gsnr/clip_low_frac",
                    "gsnr/scale_mean", "noise_scale/trace_cov", "noise_scale/grad_sq")


def pipeline_checkpoint_case(case: dict) -> dict:
    """Two pipeline stages whose parameters fall in different Megatron param groups (the column
    layer with a bias, then the row layer without one: no bias group on stage 1), saved to a dist
    checkpoint after one step and loaded back: the inner optimizers' group counts on each stage,
    beside those of Megatron's own optimizer, and the weights of the step after the load against
    the same step without it."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer import get_megatron_optimizer as megatrons
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.utils import sharded_state_dict_default

    from vrgd_ds.megatron import get_megatron_optimizer

    with model_parallel(1, pp=2) as ps:
        stage = ps.get_pipeline_model_parallel_rank()
        cfg = _config(1)
        init = functools.partial(torch.nn.init.normal_, std=0.3)
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, use_distributed_optimizer=case["distributed"])

        def build(optimizer=None):
            torch.manual_seed(0)
            layer = (ColumnParallelLinear(8, 16, config=cfg, init_method=init, bias=True, gather_output=False)
                     if stage == 0 else RowParallelLinear(16, 4, config=cfg, init_method=init, bias=False,
                                                          input_is_parallel=True, skip_bias_add=False))
            mine = _Stage(layer, tanh=stage == 0)
            ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=case["distributed"]), mine)
            opt = (get_megatron_optimizer(ocfg, [ddp], optimizer=optimizer, optimizer_kwargs=case.get("kwargs", {}))
                   if optimizer else megatrons(ocfg, [ddp]))
            return mine, ddp, opt

        def train(mine, ddp, opt, step):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            _pipeline_micro_steps(ddp, stage, step, 2)  # two micro-batches: two gradient groups
            opt.step()

        def state(mine, opt, is_loading):
            model_sd = sharded_state_dict_default(mine.layer, f"layer{stage}.", (),
                                                  {"dp_cp_group": ps.get_data_parallel_group()},
                                                  tp_group=ps.get_tensor_model_parallel_group())
            return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading)}

        groups = {"megatron": len(build()[2].chained_optimizers[0].optimizer.param_groups)}
        mine, ddp, opt = build(case["optimizer"])
        groups["vrgd"] = len(opt.chained_optimizers[0].optimizer.param_groups)
        train(mine, ddp, opt, 0)
        Path(case["save"]).mkdir(parents=True, exist_ok=True)
        dist_checkpointing.save(state(mine, opt, False), case["save"])
        train(mine, ddp, opt, 1)
        straight = [p.detach().clone() for p in mine.parameters()]
        mine, ddp, opt = build(case["optimizer"])
        loaded = dist_checkpointing.load(state(mine, opt, True), case["save"], strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        mine.layer.load_state_dict(loaded["model"], strict=False)
        for mopt in opt.chained_optimizers:
            if hasattr(mopt, "reload_model_params"):
                mopt.reload_model_params()
        opt.load_state_dict(loaded["optimizer"])
        train(mine, ddp, opt, 1)
        rel = relative(list(mine.parameters()), straight)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {"groups": groups, "rel": rel})
        return {"ranks": everyone}


class _Scaled(TwoLayers):
    """``TwoLayers`` after an elementwise scale ``s`` that every tensor-parallel rank holds whole and
    applies to its own rows (a sequence-parallel LayerNorm's weight, in small); under sequence
    parallelism the row-parallel bias is added to each rank's rows too: both hold partial
    gradients per rank, which Megatron sums over TP once per step."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.s = torch.nn.Parameter(1.0 + 0.2 * torch.randn(8))
        self.s.sequence_parallel = cfg.sequence_parallel  # as Megatron marks its LayerNorm weights

    def forward(self, x):
        return super().forward(x * self.s)


class _ScaledRef(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.r = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.s = torch.nn.Parameter(torch.ones(8))

    def ordered(self) -> list[torch.Tensor]:
        """In ``_full``'s order, then ``s`` (``parameters()`` yields a module's own first)."""
        return [self.c.weight, self.c.bias, self.r.weight, self.r.bias, self.s]

    def forward(self, x):
        return self.r(torch.tanh(self.c(x * self.s)))


def sequence_parallel_equals_unsharded(case: dict) -> dict:
    """3 steps on TP2 with sequence parallelism (each rank holds half of every micro-batch's rows;
    Megatron's ``finalize_model_grads`` sums the partial gradients over TP): the tensors with a
    partial gradient step with GSNR off, the others with it, as the same member on the unsharded
    model with those two tensors in ``gsnr=False`` groups. Returns the largest relative
    difference, the distance to the reference with GSNR on for every tensor, and the names of
    the tensors switched off."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig

    from vrgd_ds.megatron import get_megatron_optimizer
    from vrgd_ds.optim.registry import REGISTRY

    accumulation = case["accumulation"]
    with model_parallel(2) as ps:
        tp_rank = ps.get_tensor_model_parallel_rank()
        cfg = _config(2, sequence_parallel=True)
        torch.manual_seed(0)
        model = _Scaled(cfg)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=case["distributed"], bucket_size=40), model)
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=1.0,
                               use_distributed_optimizer=case["distributed"])
        opt = get_megatron_optimizer(ocfg, [ddp], optimizer=case["optimizer"])
        inner = opt.chained_optimizers[0].optimizer
        names = {id(p): n for n, p in model.named_parameters()}
        off = sorted(names[id(p)] for g in inner.param_groups if not g["gsnr"] for p in g["params"]
                     if id(p) in names) if not case["distributed"] else None
        defaults = {k: v for k, v in inner.defaults.items() if k in REGISTRY[case["optimizer"]].accepted_params()}
        refs = {}
        for label, partial_off in (("exact", True), ("all-on", False)):
            ref = _ScaledRef()
            with torch.no_grad():
                for p, w in zip(ref.ordered(), _full(model, ps) + [model.s.data.clone()]):
                    p.copy_(w)
            # Megatron's groups carry wd_mult, which its LR scheduler applies (none here): the member's
            # own weight decay applies to every group, as in equals_unsharded's reference
            groups = [{"params": [ref.c.weight, ref.r.weight]}, {"params": [ref.c.bias]},
                      {"params": [ref.r.bias, ref.s], "gsnr": not partial_off}]
            refs[label] = (ref, REGISTRY[case["optimizer"]].cls(groups, **defaults))
        for step in range(3):  # finalize: the DP sync, then the sequence-parallel gradients summed over TP
            megatron_step(ddp, opt, 0, accumulation, step, rows=lambda x: x.chunk(2)[tp_rank],
                          sync=lambda: finalize_model_grads([ddp]))
            for ref, ref_opt in refs.values():
                reference_step(ref, ref_opt, 1, accumulation, step, ocfg.clip_grad)
        got = _full(model, ps) + [model.s.data.clone()]
        out = {"rel": relative(got, refs["exact"][0].ordered()),
               "all_on": relative(got, refs["all-on"][0].ordered()), "off": off, "n": opt.vrgd_sources[0].n}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, out)
        return {"worst": max(o["rel"] for o in everyone), "ranks": everyone}


class _Norm(torch.nn.Module):
    """A sequence-parallel elementwise scale in a child module of its own, as Megatron's LayerNorms
    are (dist-checkpointing saves a module's own tensors replicated over TP)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.2 * torch.randn(8))
        self.weight.sequence_parallel = cfg.sequence_parallel


class _NormedTwoLayers(TwoLayers):
    """``_Scaled`` with its scale in a child module (``norm``), so that it can be checkpointed."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.norm = _Norm(cfg)

    def forward(self, x):
        return super().forward(x * self.norm.weight)


GLOBAL_MICRO_BATCHES = 4  # per step, whatever the data-parallel size: n = 4 on every layout


def checkpoint_case(case: dict) -> dict:
    """Megatron dist-checkpointing of a VRGD optimizer on this pool's layout (TP2 × the ranks left
    for DP): builds the model and ``vrgd_ds.megatron`` optimizer, loads ``case["load"]`` (model and
    optimizer, ``sharded_state_dict`` + ``dist_checkpointing.load``), trains ``case["steps"]``,
    saves to ``case["save"]``, trains ``case["more"]`` (``case["strict"]``: Megatron's
    ``StrictHandling`` value for the load). Each step takes the same 4 micro-batches
    on any data-parallel size (rank d's micro-batch m is global micro-batch d·acc + m), so the
    statistics' groups match across layouts. ``case["sequence_parallel"]``: the model with a
    sequence-parallel scale, each rank fed its half of every micro-batch's rows, the partial
    gradients summed over TP by ``finalize_model_grads``; ``case["fp16"]``: the model in fp16
    (``Float16OptimizerWithFloat16Params`` without the distributed optimizer); ``case["normed"]``: that model without
    sequence parallelism (its scale then steps with the GSNR on). Returns the unsharded weights after every
    step (the scale last, under sequence parallelism), the state keys, each inner param
    group's ``gsnr`` after the load, and what the load and the save left of the GSNR momentum."""
    from megatron.core import dist_checkpointing
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.transformer.utils import sharded_state_dict_default

    sp = case.get("sequence_parallel", False)
    with model_parallel(case["tp"]) as ps:
        dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        acc = GLOBAL_MICRO_BATCHES // dp
        model, ddp, opt = _build(case["tp"], case["distributed"], case["optimizer"], case.get("kwargs"),
                                 sequence_parallel=sp, normed=case.get("normed", sp), fp16=case.get("fp16", False),
                                 decoupled_lr=case.get("decoupled_lr"))
        built_groups = [(g["max_lr"], len(g["params"])) for g in opt.chained_optimizers[0].optimizer.param_groups]
        tp_rank = ps.get_tensor_model_parallel_rank()
        sharded = dict(rows=lambda x: x.chunk(case["tp"])[tp_rank], sync=lambda: finalize_model_grads([ddp])) \
            if sp else {}

        def state(is_loading: bool) -> dict:
            meta = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
            model_sd = {}
            for name, child in model.named_children():  # a module of its own (the scale): replicated over TP
                model_sd.update(sharded_state_dict_default(child, f"{name}.", (), meta,
                                                           tp_group=ps.get_tensor_model_parallel_group()))
            return {"model": model_sd, "optimizer": opt.sharded_state_dict(model_sd, is_loading)}

        if case.get("load"):
            from megatron.core.dist_checkpointing.validation import StrictHandling

            loaded = dist_checkpointing.load(state(True), case["load"],
                                             strict=StrictHandling(case.get("strict", "assume_ok_unexpected")))
            model.load_state_dict({k: v for k, v in loaded["model"].items()}, strict=False)
            for mopt in opt.chained_optimizers:  # the fp32 main weights follow the model (the wrappers' own rule)
                if hasattr(mopt, "reload_model_params"):
                    mopt.reload_model_params()
            opt.load_state_dict(loaded["optimizer"])
        weights = []
        inner = opt.chained_optimizers[0].optimizer
        flags = [g["gsnr"] for g in inner.param_groups]
        loaded_groups = [(g["max_lr"], len(g["params"])) for g in inner.param_groups]

        def gsnr_avg_left() -> dict:
            """The states of the tensors stepping with the GSNR on: how many lack the GSNR momentum
            (the first step builds it at p̂ = 1) and how many hold it all zero (every rank)."""
            on = [inner.state[p] for g in inner.param_groups if g["gsnr"] for p in g["params"] if p in inner.state]
            mine = [sum("gsnr_avg" not in st for st in on),
                    sum("gsnr_avg" in st and not st["gsnr_avg"].any() for st in on)]
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            return {"absent": sum(e[0] for e in everyone), "zero": sum(e[1] for e in everyone)}

        gsnr_avg_after_load = gsnr_avg_left()

        def train(steps):
            for step in steps:
                megatron_step(ddp, opt, dp_rank, acc, step,
                              batch=lambda d, m, s: _batch(0, d * acc + m, s), **sharded)
                weights.append([t.tolist() for t in _full(model, ps) + ([model.norm.weight.data] if sp else [])])

        train(case.get("steps", []))
        if case.get("save"):
            Path(case["save"]).mkdir(parents=True, exist_ok=True)
            dist_checkpointing.save(state(False), case["save"])
        gsnr_avg_after_save = gsnr_avg_left()
        train(case.get("more", []))
        keys = sorted({k for st in inner.state.values() for k in st})
        return {"weights": weights, "dp": dp, "state_keys": keys, "gsnr": flags, "gsnr_avg_after_load": gsnr_avg_after_load,
                "gsnr_avg_after_save": gsnr_avg_after_save, "built_groups": built_groups,
                "loaded_groups": loaded_groups}


#: what each refused configuration changes, and the option its message must name
REFUSED = {
    "gradient-accumulation-fusion": ("model", {"gradient_accumulation_fusion": True}, "gradient_accumulation_fusion"),
    "moe": ("model", {"num_moe_experts": 2}, "num_moe_experts"),
    "distributed-optimizer-instances": ("ddp", {"num_distributed_optimizer_instances": 2},
                                        "num_distributed_optimizer_instances"),
    "megatron-fsdp": ("ddp", {"use_megatron_fsdp": True}, "use_megatron_fsdp"),
    "bf16-grad-reduce": ("optimizer", {"bf16": True}, "grad_reduce_in_fp32"),
    # before: accepted; finalize_model_grads divided main_grad by the tokens after the squares were taken
    "per-token-loss": ("model", {"calculate_per_token_loss": True}, "calculate_per_token_loss"),
    "cpu-offload": ("optimizer", {"optimizer_cpu_offload": True}, "optimizer_cpu_offload"),
    "precision-aware": ("optimizer", {"use_precision_aware_optimizer": True}, "use_precision_aware_optimizer"),
    "merit-tensor-parallel": ("name", "VRMerit", "VRMerit with tensor parallelism"),
    # before: Merit (GSNR off) returned before this check and stepped row/column maxima of TP shards
    "merit-base-tensor-parallel": ("name", "Merit", "Merit with tensor parallelism"),
    "overlap-param-gather-with-step": ("optimizer", {"overlap_param_gather_with_optimizer_step": True},
                                       "overlap_param_gather_with_optimizer_step"),
    "unknown-name": ("name", "VRAdamax", "unknown optimizer 'VRAdamax'"),
    "adam-checkpoint": ("checkpoint", "save_parameter_state", "DistributedOptimizer.save_parameter_state"),
    "adam-checkpoint-format": ("checkpoint-format", "fully_reshardable", "checkpoint format 'fully_reshardable'"),
    "context-parallel": ("parallel", {"context_parallel_size": 2}, "context_parallel_size"),
    "tied-embeddings-across-stages": ("parallel", {"pipeline_model_parallel_size": 2},
                                      'Set share_embeddings_and_output_weights=False, or tied_across_stages="gsnr_off"'),
    # the tied weight on the first stage only (as on the first and last of 3 or more): before, the
    # other stage went on into Megatron's gather of the param groups and waited there
    "tied-embedding-on-one-stage": ("parallel", {"pipeline_model_parallel_size": 2},
                                    "share_embeddings_and_output_weights"),
    # before: accepted; finalize_model_grads summed the embedders' main_grad over the stages after the squares
    "cond-embedder-across-stages": ("parallel", {"pipeline_model_parallel_size": 2}, "TransformerConfig.has_cond_embedder"),
    # before: named share_embeddings_and_output_weights, which such a model may not set
    "mtp-across-stages": ("parallel", {"pipeline_model_parallel_size": 2}, "multi-token prediction "
                          "(TransformerConfig.mtp_num_layers) across pipeline stages"),
    "megatron-core-version": ("version", "0.15.0", "supports megatron-core 0.16.1, found 0.15.0"),
    "squares-unknown": ("squares", {"squares": "per_micro_step"}, "squares='per_micro_step': use 'per_step' or"),
    "tied-across-stages-unknown": ("squares", {"tied_across_stages": "auto"},
                                   "tied_across_stages='auto': use 'refuse' or 'gsnr_off'"),
    "hierarchical-without-distributed-optimizer": ("squares", {"squares": "hierarchical", "distributed": False},
                                                   "squares='hierarchical' needs the distributed optimizer"),
    "hierarchical-tensor-parallel": ("squares", {"squares": "hierarchical"},
                                     "squares='hierarchical' needs the data-parallel group to be every rank"),
    "hierarchical-node-size": ("squares", {"squares": "hierarchical", "node_size": 3},
                               "node_size 3 does not divide the 2 data-parallel ranks"),
    "node-size-without-hierarchical": ("squares", {"node_size": 2}, "node_size applies to squares='hierarchical'"),
    # before: accepted, and the optimizer stepped with decoupled decay (AdamW) where the config asked for Adam's L2
    "adam-l2-decay": ("optimizer", {"decoupled_weight_decay": False, "weight_decay": 0.1},
                      "decoupled_weight_decay=False is not supported with a VRGD optimizer: the GSNR scales"),
    # before: "(or the GSNR off: Adam's L2 mode)", which VRAdam has not (the next refusal says so)
    "adam-l2-decay-vradam": ("optimizer", {"decoupled_weight_decay": False, "weight_decay": 0.1,
                                           "optimizer_name": "VRAdam"},
                             "Set decoupled_weight_decay=True, or use Lamb (which takes it as adam_w_mode=False)"),
    "adam-l2-decay-base": ("optimizer", {"decoupled_weight_decay": False, "weight_decay": 0.1,
                                         "optimizer_name": "Merit"},
                           "decoupled_weight_decay=False is not supported with a VRGD optimizer: Merit decouples"),
    # before: accepted; the optimizer stepped whole on reduce-scattered main_grads, the replicas drifted apart
    "distributed-optimizer-mismatch": ("optimizer", {"use_distributed_optimizer": False},
                                       "OptimizerConfig.use_distributed_optimizer is False but the model's "
                                       "DistributedDataParallelConfig.use_distributed_optimizer is True"),
}


def refused(case: dict) -> dict:
    """Builds a configuration the statistics do not cover; returns the error's type and message.
    Options the CPU ranks cannot build for real (the fused gradient kernel, MoE layers, several
    optimizer instances, FSDP) are set on the built configuration objects the check reads."""
    from megatron.core import package_info
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from vrgd_ds.megatron import get_megatron_optimizer

    where, change, _ = REFUSED[case["name"]]
    tp = 2 if case["name"] in ("merit-tensor-parallel", "merit-base-tensor-parallel",
                               "hierarchical-tensor-parallel") else 1
    extra = {k: v for k, v in change.items() if k != "distributed"} if where == "squares" else {}
    distributed = change.get("distributed", True) if where == "squares" else True
    sizes = change if where == "parallel" else {}
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, **sizes)
    saved_version = package_info.__version__
    try:
        cfg = _config(tp)
        torch.manual_seed(0)
        if case["name"] in ("tied-embeddings-across-stages", "tied-embedding-on-one-stage", "cond-embedder-across-stages",
                            "mtp-across-stages"):
            model = _Stage(TwoLayers(cfg).c, tanh=False)
            if case["name"] == "mtp-across-stages":  # multi-token prediction: the embedding copied to the last stage
                cfg.mtp_num_layers = 1
                model.layer.weight.shared = model.layer.weight.shared_embedding = True
            elif case["name"] == "cond-embedder-across-stages":  # a diffusion model's embedder, a copy per stage
                cfg.has_cond_embedder = True
                model.layer.weight.pipeline_parallel = True
            elif case["name"] == "tied-embeddings-across-stages" or ps.get_pipeline_model_parallel_rank() == 0:
                model.layer.weight.shared_embedding = True  # what Megatron marks on a tied word embedding
            if case.get("frozen"):  # the marked weight frozen: no gradient of it, nothing to refuse
                model.layer.weight.requires_grad_(False)
        else:
            model = TwoLayers(cfg)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
            grad_reduce_in_fp32=where == "squares", use_distributed_optimizer=distributed), model)
        ocfg = OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=distributed)
        name = change.get("optimizer_name", "VRLamb") if isinstance(change, dict) else "VRLamb"
        for key, value in (change.items() if isinstance(change, dict) else ()):
            if key == "optimizer_name":
                continue
            target = {"model": ddp.config, "ddp": ddp.ddp_config, "optimizer": ocfg}.get(where)
            if target is not None:
                setattr(target, key, value)
        if where == "name":
            name = change
        if where == "version":
            package_info.__version__ = change
        try:
            opt = get_megatron_optimizer(ocfg, [ddp], optimizer=name, optimizer_kwargs=case.get("kwargs"), **extra)
            if where == "checkpoint":
                getattr(opt.chained_optimizers[0], change)({})
            if where == "checkpoint-format":
                opt.sharded_state_dict({}, metadata={"distrib_optim_sharding_type": change})
        except Exception as e:  # noqa: BLE001 (the message is the result)
            result = {"type": type(e).__name__, "message": str(e)}
        else:
            result = {"type": None, "message": "not refused"}
        # every rank's outcome: a rank left inside one of Megatron's collectives would take this gather for it
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, result["type"])
        return {**result, "ranks": everyone}
    finally:
        package_info.__version__ = saved_version
        release_model_parallel()


def gpt_weight_decay(case: dict) -> dict:
    """The Megatron job's GPT and optimizer (``build_gpt``) on this pool's ranks: each param group's
    ``wd_mult`` and weight decay, and the names of the model's tensors in it (the non-distributed
    optimizer's groups hold the model's tensors; the distributed one's hold fp32 shards)."""
    import torch

    from vrgd_ds.train.engines.megatron import MegatronBlock, build_gpt

    block = MegatronBlock(model={"num_layers": 1, "hidden_size": 8, "num_attention_heads": 2},
                          tensor_model_parallel_size=case["tp"], use_distributed_optimizer=case["distributed"])
    try:
        _, (ddp,), opt = build_gpt(block, {"type": "VRLamb", "params": {"weight_decay": case["weight_decay"]}},
                                   128, 16, 0, torch.device("cpu"))
        names = {p: n for n, p in ddp.module.named_parameters()}
        return {"groups": [{"wd_mult": g.get("wd_mult"), "weight_decay": g["weight_decay"], "eps": g["eps"],
                            "betas": list(g["betas"]), "names": sorted(names[p] for p in g["params"] if p in names)}
                           for chained in opt.chained_optimizers for g in chained.optimizer.param_groups]}
    finally:
        release_model_parallel()
