"""The VRGD family under PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``; docs/fsdp.md)::

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = VRLamb(model.parameters(), lr=1e-3)
    vrgd_ds.fsdp.attach(model, optimizer)

A sharded parameter is a DTensor outside the autograd graph, so a tensor hook on it never fires;
the statistics are taken at FSDP's own reduce-scatter instead (``vrgd_ds/fsdp/stats.py``), sharded
like the parameters. The optimizer steps the local shards and keeps its state as DTensors
(``GSNROptimizer``'s ``LocalState``), which DCP saves and reshards. Per-tensor quantities (the
GSNR mean, LAMB/LARS trust ratios, MERIT's row and column maxima) are completed over every rank by
one small batched collective per use (``vrgd_ds/stats/layout.py``): shards over data and tensor parallelism
add up, and a copy (a tensor replicated over a tensor-parallel dimension, HSDP's replicas) is
counted once, on the lowest rank that holds it. Every rank of the default process group trains
the model (FSDP, HSDP, FSDP + tensor parallelism; no pipeline stages).
"""
from __future__ import annotations

import itertools
import logging
import math
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from vrgd_ds.fsdp.internals import UnsupportedFSDPConfiguration, check_version, require
from vrgd_ds.fsdp.stats import FSDPStats, ReduceScatterWithSquares
from vrgd_ds.optim.base import MIN_GROUPS, GSNROptimizer
from vrgd_ds.optim.registry import info_of, vrgd_optimizer
from vrgd_ds.stats.layout import Layout, ModelTensors
from vrgd_ds.optim._impl import select_for

logger = logging.getLogger(__name__)

#: what attach reads of torch 2.13's FSDP2 (``torch/distributed/fsdp/_fully_shard/``)
_STATE = ("_fsdp_param_groups",)
_GROUP = ("fsdp_params", "mesh_info", "mp_policy", "post_backward", "reduce_grads", "reduce_scatter_unused_params",
          "force_sum_reduction_for_comms", "gradient_divide_factor", "_reduce_scatter_comm", "_all_reduce_hook",
          "_reduce_scatter_process_group", "all_reduce_grads")
_PARAM = ("sharded_param", "padded_sharded_param_size", "fsdp_placement", "offload_to_cpu",
          "unsharded_accumulated_grad")
_SQUARES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _refuse(option: str, why: str) -> UnsupportedFSDPConfiguration:
    return UnsupportedFSDPConfiguration(f"vrgd_ds.fsdp: {option} is not supported: {why}")


def _fsdp_groups(model: torch.nn.Module, required: bool = True) -> list[tuple[torch.nn.Module, Any]]:
    """``(module, FSDP parameter group)`` of every FSDP module of ``model``; none found is an error
    where ``required``."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:  # fully_shard([a, b]): the modules share one state and its groups
            continue
        seen.add(id(state))
        require(state, _STATE, "FSDPState")
        groups = state._fsdp_param_groups
        if len(groups) > 1:
            raise _refuse("a module with several FSDP parameter groups (shard_placement_fn with per-parameter "
                          "meshes)", "FSDP's custom reduce-scatter, where the statistics are taken, takes one group")
        for group in groups:
            require(group, _GROUP, "FSDPParamGroup")
            for fp in group.fsdp_params:
                require(fp, _PARAM, "FSDPParam")
            out.append((module, group))
    if not out and required:
        raise TypeError("vrgd_ds.fsdp.attach needs a model sharded with torch.distributed.fsdp.fully_shard (no "
                        "FSDPModule holding parameters was found)")
    return out


def shard_degree(model: torch.nn.Module) -> int | None:
    """The fewest ranks an FSDP parameter group of ``model`` is sharded over (HSDP: its shard
    dimension), None where no FSDP module of ``model`` holds parameters."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    groups = _fsdp_groups(model, required=False)
    if not groups:
        return None
    return min(g.mesh_info.shard_mesh_size if isinstance(g.mesh_info, FSDPMeshInfo) else 1 for _, g in groups)


def _check_group(group: Any, gsnr: bool) -> tuple[Any, Any | None]:
    """The shard and (HSDP) replicate process groups of an FSDP parameter group, after the checks
    that it reduces where the statistics see it (``gsnr``: the optimizer takes statistics, which
    replace FSDP's reduce-scatter; a base optimizer leaves it as it is)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    info = group.mesh_info
    if not isinstance(info, FSDPMeshInfo) or (gsnr and info.shard_mesh_size < 2):
        raise _refuse("a parameter group that is not sharded over >= 2 ranks", "FSDP does not reduce-scatter it, "
                      "so no statistics are taken there; shard over >= 2 ranks, or replicate the model with torch's "
                      "DistributedDataParallel and vrgd_ds.ddp.attach")
    comm = group._reduce_scatter_comm
    if gsnr and isinstance(comm, ReduceScatterWithSquares) and comm.stats is not None:
        raise _refuse("a second attach to one model", "its statistics are already taken at FSDP's reduce-scatter "
                      "for another optimizer, still alive (one VRGD optimizer with the GSNR per FSDP model; a base "
                      "optimizer beside it is fine)")
    if gsnr and type(comm) not in (DefaultReduceScatter, ReduceScatterWithSquares):
        raise _refuse(f"FSDP's reduce-scatter replaced by {type(group._reduce_scatter_comm).__name__} "
                      "(set_custom_reduce_scatter, set_symm_mem_for_comm, allocation from the process group)",
                      "the statistics replace it themselves; leave FSDP's default reduce-scatter in place")
    if gsnr and group._all_reduce_hook is not None:
        raise _refuse("set_all_reduce_hook", "it changes the reduced gradient after the statistics read it")
    for fp in group.fsdp_params:
        if fp.offload_to_cpu:
            raise _refuse("CPU offload (offload_policy=CPUOffloadPolicy())",
                          "the optimizer and its statistics step on the parameters' device; drop the offload policy")
    replicate = info.replicate_process_group if isinstance(info, HSDPMeshInfo) else None
    return info.shard_process_group, replicate


def _contiguous(p: Any) -> bool:
    """Whether a DTensor's local shard is one contiguous range of its whole tensor: every
    placement that shards it shards dim 0 (FSDP's default; colwise tensor parallelism)."""
    return all(getattr(pl, "dim", 0) == 0 for pl in p.placements)


def _piece(p: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offset, local shape) of a DTensor's local shard."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(int(o) for o in offset), tuple(int(s) for s in shape)


def _flat_offset(p: Any, offset: tuple[int, ...]) -> int:
    """Where the first element of a shard at ``offset`` lies in its whole tensor, flat."""
    strides = [math.prod(p.shape[i + 1:]) for i in range(len(p.shape))]
    return sum(o * s for o, s in zip(offset, strides))


def _runs(p: Any, offset: tuple[int, ...], shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """``(start in the shard, length, start in the whole tensor)`` of each contiguous run of a
    shard at ``offset`` (a ``Shard(1)`` shard of a matrix: one run per row). The dims after the
    last one the shard cuts are whole, so a run spans them."""
    cut = max((d for d in range(len(shape)) if shape[d] != p.shape[d]), default=0)
    strides = [math.prod(p.shape[d + 1:]) for d in range(len(p.shape))]
    length = shape[cut] * strides[cut] if shape else 1
    out = []
    for i, index in enumerate(itertools.product(*(range(n) for n in shape[:cut]))):
        start = sum((o + j) * st for o, j, st in zip(offset, index, strides)) + offset[cut] * strides[cut]
        out.append((i * length, length, start))
    return out


def _copies(pieces: list[tuple[int, tuple, tuple]]) -> list[bool]:
    """For each of this rank's ``(key, offset, shape)``, whether a lower rank holds the same piece
    (a copy: tensor-parallel replication, HSDP replicas), which then counts it. One gather of
    the ranks' piece lists at attach: every rank of the default group trains the model."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, pieces)
    me = dist.get_rank()
    seen = {piece for rank in range(me) for piece in everyone[rank]}
    return [piece in seen for piece in pieces]


def attach(model: torch.nn.Module, optimizer: GSNROptimizer, squares_dtype: str = "fp32") -> FSDPStats | None:
    """Feeds ``optimizer`` (built on ``model.parameters()``, after ``fully_shard``) with statistics
    of ``model``'s training under FSDP2 or HSDP; call once, before the first backward.

    n = shard ranks × replicate ranks × reductions per step: every backward reduces by default;
    under ``set_requires_gradient_sync(False)`` a rank's accumulated gradient is one group. Every
    parameter must be reduced equally often in a step (refused at ``step()`` otherwise). On gloo, a
    gradient divide factor other than the ranks' (torchtitan's) needs
    ``set_force_sum_reduction_for_comms(True)`` on every module: gloo has no ``PREMUL_SUM``. ``squares_dtype``: ``"fp32"``
    (default) or ``"bf16"``, the dtype the squares travel in. Returns the statistics source
    (``counters``: the extra collectives and bytes; ``stat_counters``: launches), or None for an
    optimizer without GSNR (``Lamb``, ``Lars``, ``Merit``: they need the per-tensor sums across
    shards only, and FSDP's reduce-scatter stays its own)."""
    check_version()
    optimizer = vrgd_optimizer(optimizer, "vrgd_ds.fsdp.attach")
    if squares_dtype not in _SQUARES:
        raise ValueError(f"vrgd_ds.fsdp.attach: squares_dtype={squares_dtype!r}: use 'fp32' or 'bf16'")
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("foreach"):
            raise _refuse(f"fused={group.get('fused')!r}/foreach={group.get('foreach')!r} in a param group (as "
                          "torchtitan injects)", "the VRGD optimizers select their own kernels (the optimizer's "
                          "fused= argument); drop the keys from the param groups")
    groups = _fsdp_groups(model)
    merit = info_of(optimizer).row_col_maxima
    checked = [_check_group(g, any(pg["gsnr"] for pg in optimizer.param_groups)) for _, g in groups]
    dp_groups = {tuple(dist.get_process_group_ranks(s)) + (() if r is None else tuple(dist.get_process_group_ranks(r)))
                 for s, r in checked}
    if len(dp_groups) != 1:
        raise _refuse("FSDP modules sharded over different meshes (expert parallelism shards the experts on a mesh "
                      "of their own)", "n counts the gradient groups of one data-parallel mesh; shard every module "
                      "over the same mesh")
    shard, replicate = checked[0]
    world = shard.size() * (1 if replicate is None else replicate.size())
    if any(g["gsnr"] for g in optimizer.param_groups) and world < MIN_GROUPS:
        raise ValueError(f"{optimizer.name} with gsnr=True under FSDP needs >= {MIN_GROUPS} data-parallel "
                         f"ranks, got {world}")
    if any(g["gsnr"] for g in optimizer.param_groups):
        # as FSDPParam.init_dtype_attrs sets them at the first forward: reduce_dtype, else param_dtype, else
        # the parameter's own
        reduced = {g.mp_policy.reduce_dtype or g.mp_policy.param_dtype or fp.sharded_param.dtype
                   for _, g in groups for fp in g.fsdp_params if fp.sharded_param.requires_grad}
        low = sorted(str(d).removeprefix("torch.") for d in reduced if d != torch.float32)
        if low:
            raise _refuse(f"gradients reduced in {' and '.join(low)} (MixedPrecisionPolicy reduce_dtype, or its "
                          "param_dtype when reduce_dtype is None)", "the mean gradient of the statistics is FSDP's "
                          "reduced one, and Σg² - (Σg)²/n cancels in low precision; set "
                          "MixedPrecisionPolicy(reduce_dtype=torch.float32) (torchtitan: "
                          "mixed_precision_reduce = 'float32'), or gsnr=False")

    if any(g["gsnr"] for g in optimizer.param_groups):
        # the statistics count the reductions from here on, and the step's gradient would also hold
        # what the backward passes before left in it
        held = [fp for _, g in groups for fp in g.fsdp_params if fp.sharded_param.grad is not None
                and bool(fp.sharded_param.grad.to_local().any())]
        if held:
            raise _refuse("an attach while the parameters hold gradients (a backward, or a step without "
                          "zero_grad, before it)", "the statistics count the reductions after attach, and the step "
                          "would apply the earlier ones too; call optimizer.zero_grad() (or model.zero_grad()) "
                          "before building the VRGD optimizer and attaching it")
    managed = {id(fp.sharded_param): fp for _, g in groups for fp in g.fsdp_params}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in managed:
                raise ValueError(f"{optimizer.name} updates a parameter of shape {tuple(p.shape)} that FSDP "
                                 "does not shard: build the optimizer on model.parameters() after fully_shard; a "
                                 "parameter left out with fully_shard(..., ignored_params=...) is reduced by no FSDP "
                                 "collective, so it has no statistics: give it an optimizer of its own")
    # the ranks the model's meshes cover together: a parameter outside tensor parallelism (a norm
    # without sequence parallelism) has the data-parallel mesh alone, its copies on the other
    # tensor-parallel ranks counted once below
    world_ranks = dist.get_world_size()
    covered = set().union(*(fp.sharded_param.device_mesh.mesh.flatten().tolist()
                            for _, g in groups for fp in g.fsdp_params))
    if len(covered) != world_ranks:
        raise _refuse(f"a model whose device meshes cover {len(covered)} of the {world_ranks} ranks (pipeline "
                      "parallelism: each stage on ranks of its own)", "the per-tensor sums run over every rank as "
                      "one model's; shard the whole model over every rank (FSDP, HSDP or FSDP + TP)")
    tensors = ModelTensors.of(model)
    device = groups[0][1].fsdp_params[0].sharded_param.device
    trained = [fp.sharded_param for _, g in groups for fp in g.fsdp_params if id(fp.sharded_param) in tensors.keys]
    pieces = [(tensors.keys[id(p)], *_piece(p)) for p in trained]
    copies = _copies([piece for piece in pieces if math.prod(piece[2])])
    drop = [False] * len(tensors.names)
    held = iter(copies)
    for key, _, shape in pieces:
        if math.prod(shape):
            drop[key] = next(held)
    # per-tensor sums over every rank (shards over data and tensor parallelism), each copy once
    layout = Layout(tensors.names, tensors.numel, group=dist.group.WORLD, device=device, shapes=tensors.shapes,
                         drop=drop)
    locals_ = []
    for p, (key, offset, shape) in zip(trained, pieces):
        local = p._local_tensor
        if merit and not _contiguous(p):  # MERIT's row and column maxima read contiguous runs of the tensor
            layout.add(local, [(start, length, key, at) for start, length, at in _runs(p, offset, shape)])
        else:
            layout.add(local, [(0, local.numel(), key, _flat_offset(p, offset))])
        locals_.append(local)
    if not any(g["gsnr"] for g in optimizer.param_groups):  # the base optimizers: per-tensor sums only
        optimizer.set_statistics_source(None, layout)
        logger.info("vrgd_ds.fsdp: %s without GSNR: per-tensor sums over the shards, FSDP's reduction untouched",
                    optimizer.name)
        return None
    stats = FSDPStats(select_for(optimizer), world, locals_, _SQUARES[squares_dtype])
    for gi, (module, group) in enumerate(groups):
        gi = stats.add_group(group, replicate)
        module.set_custom_reduce_scatter(ReduceScatterWithSquares(stats, gi))
        original = group.post_backward

        def post_backward(*unused: Any, gi: int = gi, original: Any = original,
                          ref: Any = weakref.ref(stats)) -> Any:
            alive = ref()  # held weakly, as by the reduce-scatter: nothing once the optimizer is gone
            if alive is not None:
                alive.about_to_reduce(gi)
            return original(*unused)

        group.post_backward = post_backward
    stats.alias_all()
    optimizer.set_statistics_source(stats, layout)
    logger.info("vrgd_ds.fsdp: statistics at FSDP's reduce-scatter of %d parameter groups (n = %d ranks x reductions; "
                "%s squares; %.0f bytes of statistics per rank)", len(groups), world, squares_dtype,
                stats.buffer_bytes())
    return stats


__all__ = ["FSDPStats", "UnsupportedFSDPConfiguration", "attach", "shard_degree"]
