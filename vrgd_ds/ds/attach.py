"""Attaches VRGD statistics to an engine after DeepSpeed built its optimizer wrapper."""
from __future__ import annotations

import contextlib
import functools
import logging
import types
from typing import Any

import deepspeed.comm as dist

from vrgd_ds.ds import local, paths, pipeline, sources
from vrgd_ds.ds.config import auto_scheme, reduction_config
from vrgd_ds.ds.internals import UnsupportedConfiguration, model_groups
from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.stats.layout import ModelTensors
from vrgd_ds.optim._impl import select_for

logger = logging.getLogger(__name__)


def attach(engine: Any) -> sources.ReductionStats | None:
    """Feeds ``engine.basic_optimizer`` (a VRGD optimizer) from DeepSpeed's gradient reduction.

    The layout (per-tensor sums across partitions) is attached for every member; the fused
    ``[g | g²]`` reduction only when a param group has ``gsnr`` on (``Lamb``/``Lars`` send
    exactly DeepSpeed's bytes)."""
    opt: GSNROptimizer = engine.basic_optimizer
    wrapper = engine.optimizer
    stage = int(engine.zero_optimization_stage())
    world = dist.get_world_size(group=engine.seq_data_parallel_group)
    gas = int(engine.gradient_accumulation_steps())
    options = reduction_config(getattr(engine._config, "_param_dict", {}) or {})
    scheme = options.scheme(stage)
    if scheme == "auto" and any(g["gsnr"] for g in opt.param_groups):
        scheme = _auto(engine, options, stage, world)
    wants_stats = any(g["gsnr"] for g in opt.param_groups)
    if scheme == "per_micro_step":  # its fused [g | g²] collective has no ḡ of its own and no micro-step reads
        for key, default in (("gbar", "auto"), ("micro_steps", "auto")):
            if getattr(options, key) != default:
                raise UnsupportedConfiguration(
                    f"vrgd.{key}: {getattr(options, key)!r} applies to squares 'per_step' and 'hierarchical'; the "
                    f"scheme here is 'per_micro_step' (" + {None: "the default on ZeRO-3", "auto": "'auto' picks it on "
                                                            "ZeRO-3"}.get(options.squares, "configured")
                    + f"): remove vrgd.{key} or set vrgd.squares")
    if wants_stats:  # fail before training, not at the first step
        sources.check_groups(opt.name, world, gas, stage, scheme)
        if stage == 3 and not engine.zero_contiguous_gradients():
            raise UnsupportedConfiguration(
                "vrgd_ds: 'zero_optimization.contiguous_gradients' is not supported with VRGD optimizers: false "
                "makes ZeRO-3 reduce buckets of several gradients outside its contiguous buffer, which the "
                "statistics do not read; set it to true (or 'gsnr': false)")
        if (getattr(engine, "torch_autocast_z0_gradscaler", None) is not None
                or getattr(engine.optimizer, "torch_autocast_gradscaler", None) is not None):
            raise UnsupportedConfiguration(
                f"vrgd_ds: 'torch_autocast' fp16 with zero_optimization.stage {stage} is not supported with VRGD "
                "optimizers' statistics: DeepSpeed scales the loss there by a torch GradScaler whose changing scale "
                "the statistics do not divide out; use bf16 autocast, the 'fp16' block (its loss scale is divided "
                "out), or 'gsnr': false")
        if not engine.managed_gradient_accumulation():
            raise UnsupportedConfiguration(
                "vrgd_ds: 'managed_gradient_accumulation' false is not supported with VRGD optimizers: the caller's "
                "step() then ends a step after any number of backward passes, while DeepSpeed still divides each "
                "loss by gradient_accumulation_steps and stage 0/1 reduce their sum once, so the statistics' "
                "groups and the engine's gradient disagree; remove the key and set gradient_accumulation_steps "
                "(or 'gsnr': false)")
        sparse = sparse_embeddings(engine, opt)
        if sparse:
            raise UnsupportedConfiguration(
                f"vrgd_ds: {sparse[0]} has sparse=True in a param group with GSNR on: VRGD statistics do not support "
                "sparse gradients (DeepSpeed reduces them apart from the buckets and hooks the statistics read); use "
                "sparse=False (or 'gsnr': false for its param group)")
        warn_ignored_comm_dtype(engine, scheme)

    path = paths.for_engine(engine, stage)  # checks the path's DeepSpeed internals
    path.configure(opt)
    tensors = ModelTensors.of(engine.module)
    layout = path.layout(tensors, next(engine.module.parameters()).device)
    if pipeline.is_pipeline(engine):
        pipeline.check_group_counts(engine, opt)
        pipeline.check_tied(engine, opt)
        layout.stages = pipeline.stage_group(engine)
        layout.replicated = pipeline.replicated(engine, tensors.keys, layout.num_keys)
    stats = None
    if wants_stats:
        gbar = options.gbar_for(reduction_dtype(engine))
        hooks_only = options.micro_steps == "hooks"
        if scheme == "hierarchical":  # every engine path has node_buffers; pipelines are refused in pipeline.check
            stats = local.attach_hierarchical(engine, path, world, gbar, select_for(opt), options.node_size, hooks_only)
        elif scheme == "per_step":
            stats = local.attach(engine, path, world, gbar, options.torch_squares_dtype, select_for(opt),
                                 hooks_only=hooks_only)
        else:
            stats = sources.attach(engine, path, world, options.torch_squares_dtype)
    if stats is not None and stage == 3:
        path.refuse_late_gradients(tensors)
    opt.set_statistics_source(stats, layout)
    # DeepSpeed skips a step when the gradients it checked are not finite: with an fp16 dynamic
    # loss scaler that is an overflow (the scale drops), otherwise the gradients are non-finite.
    _hook_step(wrapper, opt, stats, "step/skipped_overflow" if engine.fp16_enabled() else "step/skipped_nonfinite")
    engine.vrgd_stats = stats
    keep_wiring_on_universal_load(engine, opt)
    if stats is not None:
        guard_accumulation(engine)
    logger.info("vrgd_ds: %s attached to DeepSpeed (stage %d, %s, %s)", opt.name, stage,
                type(wrapper).__name__,
                f"n={sources.expected_groups(world, gas, stage, scheme)} groups per step, squares {scheme}"
                + (f", {stats.describe()}" if hasattr(stats, "describe") else "")
                + f"; {cost_line(stats, scheme, options, tensors.numel, gas)}"
                if stats else "no GSNR statistics")
    return stats


def guard_accumulation(engine: Any) -> None:
    """Refuses, when entered, DeepSpeed's contexts that sum several backward passes into one
    reduction the statistics would read as one micro-batch per rank: ``coalesce_grad_reduction()``
    (one reduction for the block), and ``no_sync()`` with ``gradient_accumulation_steps`` 1 (each
    loss undivided, the sum reduced by the backward after the block). ``no_sync()`` with
    accumulation is left alone: stage 0/1 reduce only at the boundary anyway, where Accelerate
    enters it on the micro-steps before."""
    no_sync = engine.no_sync

    @contextlib.contextmanager
    def checked_no_sync():
        if int(engine.gradient_accumulation_steps()) == 1:
            raise UnsupportedConfiguration(
                "vrgd_ds: engine.no_sync() with gradient_accumulation_steps 1 is not supported with VRGD "
                "optimizers: the backward passes in it and the one after are summed and reduced once, one group "
                "per rank to the statistics; set gradient_accumulation_steps to the backward passes per step "
                "and call engine.step() after each (or 'gsnr': false)")
        with no_sync():
            yield

    @contextlib.contextmanager
    def checked_coalesce():
        raise UnsupportedConfiguration(
            "vrgd_ds: engine.coalesce_grad_reduction() is not supported with VRGD optimizers: its backward passes "
            "are reduced once, at the block's end, which the statistics would count as one micro-batch per rank; "
            "set gradient_accumulation_steps and call engine.backward() and engine.step() per micro-batch "
            "(or 'gsnr': false)")
        yield  # a generator for contextmanager: never reached

    engine.no_sync, engine.coalesce_grad_reduction = checked_no_sync, checked_coalesce


def keep_wiring_on_universal_load(engine: Any, opt: GSNROptimizer) -> None:
    """DeepSpeed 0.19.8's universal loader (``load_universal_checkpoint``) sets the saved param
    groups' options on the optimizer, ``gsnr`` among them, and its state, without its
    ``load_state_dict``: ``engine.load_checkpoint`` runs inside ``opt.loaded_elsewhere()`` then, so
    the wiring stays as built and the GSNR momentum is started or dropped as for any load. Under
    ZeRO-3 it is refused: DeepSpeed's ZeRO-3 universal loader reads ``fp32``, ``exp_avg`` and
    ``exp_avg_sq`` only (the GSNR momentum and SGD's momentum would restart unseen) and gives every
    param group the options of the first."""
    load = engine.load_checkpoint

    @functools.wraps(load)
    def load_checkpoint(*args: Any, **kwargs: Any) -> Any:
        if not engine.load_universal_checkpoint():
            return load(*args, **kwargs)
        if engine.zero_optimization_stage() == 3:
            raise UnsupportedConfiguration(
                f"vrgd_ds: \"checkpoint\": {{\"load_universal\": true}} under ZeRO-3 is not supported with {opt.name}: "
                "DeepSpeed's ZeRO-3 universal loader restores exp_avg and exp_avg_sq only, so the GSNR momentum "
                "(gsnr_avg) and SGD's momentum_buffer would restart unseen, and it gives every param group the "
                "first one's options. Resume on the number of ranks that saved the checkpoint, without "
                "load_universal")
        with opt.loaded_elsewhere():
            return load(*args, **kwargs)

    engine.load_checkpoint = load_checkpoint


def sparse_embeddings(engine: Any, opt: GSNROptimizer) -> list[str]:
    """The ``nn.Embedding``/``nn.EmbeddingBag`` modules with ``sparse=True`` whose weight is in a
    param group with ``gsnr`` on (the model's tensors of each group: ``model_groups``), named as in
    the engine's module."""
    import torch

    watched = {id(p) for g, params in zip(opt.param_groups, model_groups(engine, opt)) if g["gsnr"] for p in params}
    return [f"{name or 'the model'} ({type(m).__name__})" for name, m in engine.module.named_modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and id(m.weight) in watched]


def reduction_dtype(engine: Any) -> Any:
    """fp32 where DeepSpeed's reduced gradient is fp32 throughout: an fp32 model accumulating
    (``data_types.grad_accum_dtype``) and reducing (``communication_data_type``) in fp32, without
    a ``torch_autocast`` that gives parameters a low-precision ``comm_dtype``; else the low dtype
    in play."""
    import torch

    low = [d for d in (*engine.get_data_types(), engine.communication_data_type,
                       engine.torch_autocast_dtype() if engine.torch_autocast_enabled() else None)
           if d in (torch.bfloat16, torch.float16)]
    return low[0] if low else torch.float32


def warn_ignored_comm_dtype(engine: Any, scheme: str) -> bool:
    """Warns when the scheme in use (``"auto"`` resolved) replaces DeepSpeed's gradient reduction
    by the fused fp32 ``[g | g²]`` one, so that a ``communication_data_type`` other than fp32 and
    the model's dtype is not what the gradients travel in. Returns whether it warned."""
    import torch

    comm = engine.communication_data_type
    if scheme != "per_micro_step" or comm in (engine.get_data_types()[0], torch.float32):
        return False
    logger.warning("vrgd_ds: communication_data_type %s is ignored for gradients: the fused [g | g²] reduction "
                   "(\"squares\": \"per_micro_step\") is fp32", comm)
    return True


def least_free(device: Any, group: Any) -> int | None:
    """The least free device memory (bytes) over ``group``'s ranks, which ``"squares": "auto"``
    decides on (each rank's own would let ranks pick different schemes, whose collectives differ:
    a hang); None off CUDA, on every rank alike."""
    import torch
    import torch.distributed

    if device.type != "cuda":
        return None
    on = device if torch.distributed.get_backend(group) == "nccl" else "cpu"
    free = torch.tensor([torch.cuda.mem_get_info(device)[0]], dtype=torch.int64, device=on)
    torch.distributed.all_reduce(free, op=torch.distributed.ReduceOp.MIN, group=group)
    return int(free.item())


def _auto(engine: Any, options: Any, stage: int, world: int) -> str:
    """The scheme ``"squares": "auto"`` picks for this engine (``vrgd_ds.ds.config.auto_scheme``)."""
    node_size = options.node_size
    if node_size is not None and (stage not in (1, 2) or pipeline.is_pipeline(engine)):
        where = "a pipeline" if pipeline.is_pipeline(engine) else f"ZeRO stage {stage}"
        raise UnsupportedConfiguration(
            f"vrgd.node_size: {node_size} has no effect here: on {where} \"squares\": \"auto\" picks "
            f"{auto_scheme(stage, pipeline.is_pipeline(engine), world, node_size, 0, None)!r}, never 'hierarchical' "
            "(ZeRO-1/2 only), and reads no node size; remove vrgd.node_size")
    if node_size is not None and world % node_size:  # whatever auto then picks (it would pick by memory)
        raise UnsupportedConfiguration(f"vrgd.node_size: {node_size} does not divide the {world} data-parallel ranks")
    if node_size is None and stage in (1, 2) and not pipeline.is_pipeline(engine):
        try:
            node_size = local.host_node_size(engine.seq_data_parallel_group, world)
        except ValueError as e:  # every rank judged the same gathered hosts: every rank falls back alike
            logger.warning("vrgd_ds: \"squares\": \"auto\" chose per_step: the hierarchical scheme needs nodes "
                           "of equally many consecutive ranks (%s)", e)
            return "per_step"
    params = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters() if p.requires_grad)
    words = 2 if options.gbar_for(reduction_dtype(engine)) == "local" else 1
    device = next(engine.module.parameters()).device
    free = least_free(device, engine.seq_data_parallel_group)
    # where hierarchical would read each micro-step by a tensor hook per parameter (local.attach_hierarchical)
    hooks = options.micro_steps == "hooks" or (stage == 1 and engine.gradient_accumulation_steps() > 1)
    scheme = auto_scheme(stage, pipeline.is_pipeline(engine), world, node_size or 0, 4 * words * params, free, hooks)
    logger.info("vrgd_ds: \"squares\": \"auto\" chose %s (ZeRO stage %d, %d rank(s), node size %s, per_step's "
                "buffer %.2f GB, free device memory %s)", scheme, stage, world, node_size, 4 * words * params / 1e9,
                "n/a" if free is None else f"{free / 1e9:.1f} GB")
    return scheme


def cost_line(stats: Any, scheme: str, options: Any, numel: list[int], gas: int) -> str:
    """What the statistics hold on this rank, from its live buffers, per model parameter, and the
    bytes they send, in fp32 gradients (docs/deepspeed.md)."""
    params = max(1, sum(numel))
    memory = stats.memory() if hasattr(stats, "memory") else {"partition": stats.buffer_bytes()}
    held = ", ".join(f"{k} {v / params:.2f}" for k, v in memory.items() if v)
    local = getattr(stats, "gbar", "engine") == "local"
    per_step = (0.5 if options.squares_dtype == "bf16" else 1.0) + (1.0 if local else 0.0)
    if scheme == "per_micro_step":
        sent = f"{2 * gas:.0f}x the fp32 gradient per step in place of DeepSpeed's reduction ({gas} micro-steps)"
    elif scheme == "hierarchical":
        sent = (f"{per_step:.1f}x across nodes per step (as per_step), about {2.0 if local else 1.0:.0f}x within the "
                "node per micro-step")
    else:
        sent = f"{per_step:.1f}x per step"
    return f"statistics hold {held} B/param on this rank (plus one bucket's while it is read), send {sent}"


def _hook_step(wrapper: Any, opt: GSNROptimizer, stats: sources.ReductionStats | None, skip_reason: str) -> None:
    """Statistics end with the engine's step, taken or skipped (``skip_reason``)."""
    step = wrapper.step

    def vrgd_step(_wrapper: Any, *args, **kwargs):  # a method of the wrapper, as torch's LR schedulers ask
        # (they rewrap ``optimizer.step.__func__``; on stage 0 in fp32 the wrapper is the optimizer itself)
        opt.begin_step_records()
        calls = opt.step_calls
        if stats is not None and hasattr(stats, "start"):
            stats.start()  # per_step: every micro-step is in; launch the step's one reduction
        try:
            return step(*args, **kwargs)
        finally:
            n = stats.n if stats is not None else 0
            if stats is not None:
                stats.end_step()
            if opt.step_calls == calls:  # DeepSpeed skipped the step before calling ours
                opt.record_skipped(skip_reason, n)

    wrapper.step = types.MethodType(vrgd_step, wrapper)
