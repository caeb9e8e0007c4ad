"""DeepSpeed's ``PipelineEngine`` (a ``PipelineModule`` given to ``deepspeed.initialize``): each
stage is a data-parallel engine of its own layers on stage 0 or ZeRO-1 (DeepSpeed refuses ZeRO-2/3
with pipelines), so the stage-0 and ZeRO-1 paths apply unchanged per stage (docs/design.md §3).

What the pipeline adds, and where it is handled:

* the statistics: the per-step scheme only. Every micro-batch's backward on a stage fires the
  parameter hooks of that stage's tensors once, so n = data-parallel ranks × micro-batches on
  every stage; DeepSpeed's ``ReduceGrads`` instruction (``allreduce_gradients``) stays its own;
* whole-model scalars (the pre-normalisation gradient norm, the non-finite skip flag): the
  layout's ``all_reduce_stages`` sums/maxes them over the grid's ``get_pipe_parallel_group()``, as
  DeepSpeed's gradient norm spans stages, a tied weight counted once (``replicated``);
* tied modules (``TiedLayerSpec``) on several stages: each stage's micro-batch gradient is a
  partial one, summed over the stages only once per step (``_exec_reduce_tied_grads``); the
  square of a partial is not part of the square, so GSNR on them is refused, naming the module.
  A param group with ``"gsnr": false`` holding them steps them as the base optimizer does.

Everything read from DeepSpeed 0.19.8 here is checked before use (``require``).
"""
from __future__ import annotations

import logging
from typing import Any

from vrgd_ds.ds.internals import UnsupportedConfiguration, model_groups, require
from vrgd_ds.stats.layout import key_mask

logger = logging.getLogger(__name__)

_GRID = ("get_pipe_parallel_world_size", "get_pipe_parallel_group")  # engine.mpu: the module's grid
_MODULE = ("tied_comms", "_recursive_getattr")


def is_pipeline(engine: Any) -> bool:
    return bool(getattr(engine, "pipeline_parallelism", False))


def check(engine: Any, scheme: str) -> None:
    """At ``initialize``: what the pipeline path does not cover, refused naming the key."""
    if int(engine.zero_optimization_stage()) == 0 and engine.gradient_clipping() > 0:
        logger.warning("vrgd_ds: with pipeline parallelism on ZeRO stage 0, DeepSpeed 0.19.8 clips gradients by the "
                       "norm of the first stage's gradients only (clip_grad_norm_ counts model-parallel rank 0, "
                       "which its pipeline grid makes stage 0), for every optimizer; ZeRO-1 clips by the norm over "
                       "all stages")
    if scheme != "per_step":
        raise UnsupportedConfiguration(
            f"vrgd_ds: 'vrgd.squares': '{scheme}' is not supported with pipeline parallelism "
            "(PipelineModule): DeepSpeed reduces a stage's gradients once per step, after the tied-module sum; use "
            "\"vrgd\": {\"squares\": \"per_step\"} (the default on ZeRO stages 0 and 1)")


def stage_group(engine: Any) -> Any | None:
    """The group across this rank's pipeline stages, or None with one stage."""
    grid = engine.mpu  # set before the optimizer is configured (engine.grid is set after)
    require(grid, _GRID, "PipelineParallelGrid")
    if int(grid.get_pipe_parallel_world_size()) <= 1:
        return None
    return grid.get_pipe_parallel_group()


def check_group_counts(engine: Any, opt: Any) -> None:
    """Refuses param groups that differ in number between the stages (each stage builds the
    optimizer from its own layers: a stage with no bias or norm gets no no-decay group): each
    group takes collectives over the stages (ZeRO-1's gradient norm, the optimizer's whole-model
    sums), so the ranks would wait on each other forever at the first step. One gather at
    ``initialize``, every rank then raising alike."""
    group = stage_group(engine)
    if group is None:
        return
    import torch
    import torch.distributed as dist

    device = next(engine.module.parameters()).device
    mine = torch.tensor([len(opt.param_groups)], dtype=torch.int64, device=device)
    counts = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(counts, mine, group=group)
    counts = [int(c) for c in counts]
    if len(set(counts)) > 1:
        raise UnsupportedConfiguration(
            f"vrgd_ds: the pipeline stages' optimizers have {', '.join(map(str, counts))} param groups (stages 0.."
            f"{len(counts) - 1}): every stage needs the same number, since each group takes collectives over the "
            "stages (ZeRO-1's gradient norm, the optimizer's whole-model sums) and the ranks would wait on each other "
            "forever. Build every stage's optimizer with the same param groups")


def replicated(engine: Any, keys: dict[int, int], num_keys: int) -> Any | None:
    """The keys of the tied weights' copies on stages after the first (``ds_pipe_replicated``,
    set by ``PipelineModule``): each holds the whole, stage-summed gradient, which the first stage
    already counts in whole-model sums."""
    return key_mask(keys, num_keys, (p for p in engine.module.parameters() if getattr(p, "ds_pipe_replicated", False)))


def check_tied(engine: Any, opt: Any) -> None:
    """Refuses GSNR on a tied module's weights held by more than one stage, on every rank alike:
    only the stages holding the module find it (``tied_comms``), and a stage between them that went
    on would wait at the engine's first collective for ranks that have stopped."""
    module = engine.module
    require(module, _MODULE, "PipelineModule")
    groups = model_groups(engine, opt)
    refused = None
    for key, comm in module.tied_comms.items():
        if len(comm["ranks"]) <= 1:  # every use on this stage: the gradient is whole per micro-batch
            continue
        for attr in comm["weight_attr"]:
            weight = module._recursive_getattr(comm["module"], attr)
            i = next((i for i, params in enumerate(groups) if any(q is weight for q in params)), None)
            if i is not None and opt.param_groups[i]["gsnr"] and refused is None:
                refused = (f"the tied module {key!r} (TiedLayerSpec) is used on {len(comm['ranks'])} pipeline stages "
                           f"(ranks {comm['ranks']}) and its weight {attr!r} is in a param group with GSNR on")
    group = stage_group(engine)
    if group is not None:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([refused is not None], dtype=torch.int64, device=next(module.parameters()).device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag) and refused is None:
            refused = ("a tied module (TiedLayerSpec) used on several pipeline stages, not this one, has a weight in "
                       "a param group with GSNR on (the stages holding it name it)")
    if refused is not None:
        raise UnsupportedConfiguration(
            f"vrgd_ds: {refused}: each stage holds only a partial gradient per micro-batch, summed over the stages "
            "once per step, so its squares would be wrong. Put its parameters in a param group with 'gsnr': false, "
            "or keep the tied layers on one stage")
