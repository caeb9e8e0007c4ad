"""Attaches VRGD statistics to an engine after DeepSpeed built its optimizer wrapper."""
from __future__ import annotations

import logging
from typing import Any

import deepspeed.comm as dist

from vrgd_ds.ds import local, sources
from vrgd_ds.ds.config import reduction_config
from vrgd_ds.ds.internals import UnsupportedConfiguration
from vrgd_ds.ds.internals import require as _require
from vrgd_ds.ds.layout import Layout
from vrgd_ds.optim.base import MIN_GROUPS, GSNROptimizer

logger = logging.getLogger(__name__)


def _names(engine: Any) -> tuple[list[str], dict[int, int], list[int], list[tuple[int, ...]]]:
    names, keys, numel, shapes = [], {}, [], []
    for name, p in engine.module.named_parameters():
        if p.requires_grad and id(p) not in keys:
            keys[id(p)] = len(names)
            names.append(name)
            numel.append(int(getattr(p, "ds_numel", p.numel())))
            shapes.append(tuple(getattr(p, "ds_shape", p.shape)))  # ZeRO-3 empties p; ds_shape is the model's
    return names, keys, numel, shapes


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
    names, keys, numel, shapes = _names(engine)
    device = next(engine.module.parameters()).device
    wrapped = type(wrapper).__name__
    options = reduction_config(getattr(engine._config, "_param_dict", {}) or {})
    kernels = opt.kernels()
    gbar = options.gbar_for(engine.get_data_types()[0])

    scheme = options.scheme(stage)
    if any(g["gsnr"] for g in opt.param_groups):  # fail before training, not at the first step
        n = sources.expected_groups(world, gas, stage, scheme)
        if n < MIN_GROUPS:
            raise UnsupportedConfiguration(
                f"{type(opt).__name__}: GSNR needs >= {MIN_GROUPS} gradient groups per step, this run has n={n} "
                f"({world} data-parallel rank(s), gradient_accumulation_steps={gas}, ZeRO stage {stage}: groups are "
                + ("ranks x micro-steps" if stage >= 2 or scheme == "per_step" else "ranks") + "). Use more ranks"
                + (", or gradient_accumulation_steps >= 2" if stage >= 2 or scheme == "per_step"
                   else ", or \"vrgd\": {\"squares\": \"per_step\"} with gradient_accumulation_steps >= 2")
                + ", or set 'gsnr': false.")

    wants_stats = any(g["gsnr"] for g in opt.param_groups)
    stats = None
    if stage == 0:
        if wrapped == "FP16_UnfusedOptimizer":
            _require(wrapper, ("fp16_groups", "fp32_groups", "loss_scale"), "FP16_UnfusedOptimizer")
            pairs = [(p, m) for lp, hp in zip(wrapper.fp16_groups, wrapper.fp32_groups) for p, m in zip(lp, hp)]
        elif wrapper is opt:
            pairs = [(p, p) for g in opt.param_groups for p in g["params"]]
        else:
            raise UnsupportedConfiguration(f"vrgd_ds: DeepSpeed wrapped the VRGD optimizer in {wrapped}, which the "
                                           "hooks do not cover (stage 0 supports fp32, fp16 and bf16)")
        layout = Layout(names, numel, group=None, device=device, shapes=shapes)
        for p, m in pairs:
            layout.add(m, [(0, m.numel(), keys[id(p)])])
        if wants_stats:
            stats = (local.attach_stage0(engine, pairs, world, gbar, options.torch_squares_dtype, kernels)
                     if scheme == "per_step" else sources.attach_stage0(engine, pairs, world))
    elif stage in (1, 2):
        _require(wrapper, ("gradient_reduction_w_predivide", "_add_full_reduction_to_compact_grad_partition",
                           "grad_start_offset", "grad_partition_insertion_offset", "single_partition_of_fp32_groups",
                           "bit16_groups", "ipg_buckets", "partition_size", "real_dp_process_group",
                           "dp_process_group", "loss_scale", "get_param_id"), wrapped)
        layout = Layout(names, numel, group=wrapper.dp_process_group, device=device, shapes=shapes)
        for i, flat in enumerate(wrapper.single_partition_of_fp32_groups):
            layout.add(flat, [(dst, num, keys[id(p)], src) for p, src, dst, num in sources.zero12_pieces(wrapper, i)])
        if wants_stats:
            stats = (local.attach_zero12(engine, wrapper, world, gbar, options.torch_squares_dtype, kernels)
                     if scheme == "per_step" else sources.attach_zero12(engine, wrapper, world, stage))
        # DeepSpeedZeroOptimizer._optimizer_step calls step() once per param group (param_groups
        # narrowed to that group): one engine step's metrics merge over the calls.
        opt.merge_step_records = True
        if len(opt.param_groups) > 1 and any(g.get("grad_pre_normalization") for g in opt.param_groups):
            raise UnsupportedConfiguration(
                "vrgd_ds: grad_pre_normalization under ZeRO-1/2 with more than one param group is not supported: "
                "ZeRO-1/2 step the param groups one at a time, so the global gradient norm would be per group")
    elif stage == 3:
        _require(wrapper, (sources._AVG_SCATTER, "fp32_partitioned_groups_flat", "fp16_groups", "grad_position",
                           "get_param_id", "_get_param_partition_group", "gradient_accumulation_dtype",
                           "loss_scale"), wrapped)
        if len(wrapper.fp16_groups) > 1 and any(g.get("grad_pre_normalization") for g in opt.param_groups):
            raise UnsupportedConfiguration(
                "vrgd_ds: grad_pre_normalization under ZeRO-3 with more than one sub-group (param groups or "
                "zero_optimization.sub_group_size) is not supported: ZeRO-3 steps sub-groups one at a time")
        layout = Layout(names, numel, group=wrapper.dp_process_group, device=device, shapes=shapes)
        for i, flat in enumerate(wrapper.fp32_partitioned_groups_flat):
            layout.add(flat, [(off, valid, keys[id(p)], sources.zero3_tensor_offset(wrapper, p))
                              for p, off, valid in sources.zero3_pieces(wrapper, i)])
        if wants_stats:
            if scheme == "per_step":
                pieces = {id(p): (i, off, valid) for i in range(len(wrapper.fp32_partitioned_groups_flat))
                          for p, off, valid in sources.zero3_pieces(wrapper, i)}
                stats = local.attach_zero3(engine, wrapper, world, gbar, options.torch_squares_dtype, kernels,
                                           pieces)
            else:
                stats = sources.attach_zero3(engine, wrapper, world)
        opt.merge_step_records = True  # one optimizer.step() per sub-group
    else:
        raise UnsupportedConfiguration(f"vrgd_ds: unknown ZeRO stage {stage}")

    if stats is not None:
        stats.squares_dtype = options.torch_squares_dtype
    opt.set_statistics_source(stats, layout)
    # DeepSpeed skips a step when the gradients it checked are not finite: with an fp16 dynamic
    # loss scaler that is an overflow (the scale drops), otherwise the gradients are non-finite.
    _hook_step(wrapper, opt, stats, "step/skipped_overflow" if engine.fp16_enabled() else "step/skipped_nonfinite")
    engine.vrgd_stats = stats
    logger.info("vrgd_ds: %s attached to DeepSpeed (stage %d, %s, %s)", type(opt).__name__, stage, wrapped,
                f"n={sources.expected_groups(world, gas, stage, scheme)} groups per step, squares {scheme}"
                if stats else "no GSNR statistics")
    return stats


def _hook_step(wrapper: Any, opt: GSNROptimizer, stats: sources.ReductionStats | None, skip_reason: str) -> None:
    """Statistics end with the engine's step, taken or skipped (``skip_reason``)."""
    step = wrapper.step

    def vrgd_step(*args, **kwargs):
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

    wrapper.step = vrgd_step
