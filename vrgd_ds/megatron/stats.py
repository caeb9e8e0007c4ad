"""Gradient statistics under megatron-core's ``DistributedDataParallel``, its reduction untouched
(docs/design.md §3; the scheme is DeepSpeed's per-step one, ``vrgd_ds/stats/local.py``).

* **Squares, locally.** A tensor hook on every parameter sees each micro-batch's local gradient
  ``x`` before Megatron's grad-accumulator hook adds it into ``main_grad``; ``x²`` is summed in
  fp32 into a local buffer laid out like each of Megatron's grad buffers (``param_index_map``
  offsets, padding included). No bucket of Megatron's holds one micro-batch (``main_grad``
  accumulates them), so the square is folded into Megatron's accumulation instead: the hook's
  one launch also does ``main_grad += x`` and sets ``grad_added_to_main_grad``, which Megatron's
  hook reads to skip its own ``add_`` (a parameter with ``zero_out_wgrad`` keeps Megatron's add).
* **One reduction per bucket per optimizer step**, on the buffer's own data-parallel group,
  when the optimizer's ``prepare_grads`` begins: a reduce-scatter into this rank's shard with the
  distributed optimizer (each parameter's piece lands at its ``gbuf_local`` range, as Megatron's
  gradient does), an all-reduce without. n = data-parallel ranks × micro-batches. Megatron divides
  each micro-batch's loss by the micro-batches M, and under fp16 its loss scaler multiplies it by
  S: the sums are of S·g/M (``group_unit`` = M/S), so the optimizer applies ``gsnr_eps · S²/M²``
  (the floor of one micro-batch's gradient, as on DeepSpeed, whatever the split into ranks and
  micro-batches and the loss scale) and the noise scale's figures are of one micro-batch's
  gradient. S, a device scalar, is read once per step, in ``begin_step``, where Megatron's
  ``prepare_grads`` is about to wait for the device anyway; never in a backward, where the read
  would stall the host's queue. The scale stays in the squares, as a ``GradScaler``'s does
  (docs/design.md, numerics rules): an fp16 ``x`` is at most 65504, its fp32 square finite.
* **The mean gradient** is Megatron's reduced ``main_grad`` read at the same moment, before
  Megatron unscales and clips it: ``Σg = main_grad / e``, in the squares' unit, with ``e`` the
  factor Megatron's reduction applied (``gradient_scaling_factor``, and ``1/DP`` with
  ``average_in_collective``).
  Extra bytes: one fp32 gradient per optimizer step, whatever the accumulation.
* **Per-tensor sums** (the GSNR mean, LAMB/LARS norms, metrics) are completed by
  :class:`MegatronLayout` over the ranks holding pieces of a tensor: the data-parallel shards of
  the distributed optimizer and the tensor-parallel shards (``tensor_model_parallel``
  parameters), a tensor every tensor-parallel rank holds whole counted once; global values
  (the pre-normalisation norm, the skip flag) span the pipeline stages.

Everything this module reads of megatron-core 0.16.1 is listed below and checked when the
optimizer is built (``vrgd_ds/megatron/internals.py``).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from vrgd_ds.megatron.internals import require
from vrgd_ds.stats.hierarchical import NodeStats, host_node_size, node_groups
from vrgd_ds.stats.layout import Layout
from vrgd_ds.stats.local import LocalStats, StatsBucket
from vrgd_ds.stats.scaling import Scaling

_CHUNK = ("buffers", "ddp_config")
_BUFFER = ("grad_data", "param_index_map", "buckets", "data_parallel_group", "gradient_scaling_factor")
_BUCKET = ("offset", "grad_data")
_DISTOPT = ("model_param_gbuf_map", "buffers", "_get_model_param_range_map", "model_float16_groups",
            "model_fp32_groups", "shard_fp32_groups", "shard_fp32_from_float16_groups")
_FLOAT16 = ("float16_groups", "fp32_from_float16_groups", "fp32_from_fp32_groups")
_OPTIMIZER = ("optimizer", "prepare_grads", "get_loss_scale")


def pairs(mopt: Any) -> list[tuple[Tensor, Tensor]]:
    """``(model parameter, tensor the inner optimizer updates)`` of a Megatron optimizer: the
    parameter itself (fp32), its fp32 main copy (bf16/fp16), or its shard (distributed)."""
    require(mopt, _OPTIMIZER, type(mopt).__name__)
    kind = type(mopt).__name__
    if kind == "DistributedOptimizer":
        require(mopt, _DISTOPT, kind)
        groups = [(mopt.model_float16_groups, mopt.shard_fp32_from_float16_groups),
                  (mopt.model_fp32_groups, mopt.shard_fp32_groups)]
    elif kind == "Float16OptimizerWithFloat16Params":
        require(mopt, _FLOAT16, kind)
        groups = [(mopt.float16_groups, mopt.fp32_from_float16_groups),
                  (mopt.fp32_from_fp32_groups, mopt.fp32_from_fp32_groups)]
    elif kind == "FP32Optimizer":
        groups = [([g["params"] for g in mopt.optimizer.param_groups],) * 2]
    else:
        raise RuntimeError(f"vrgd_ds.megatron: Megatron wrapped the optimizer in {kind}, which the statistics do "
                           "not cover (FP32Optimizer, Float16OptimizerWithFloat16Params, DistributedOptimizer)")
    return [(p, t) for models, targets in groups for mg, tg in zip(models, targets) for p, t in zip(mg, tg)]


class MegatronLayout(Layout):
    """Pieces of this pipeline stage's model tensors in what the inner optimizer updates, with
    per-key sums over ``group`` (tensor-parallel, and data-parallel with the distributed
    optimizer) and global values over ``stages``.

    ``duplicate[key]``: the tensor is whole and identical on every tensor-parallel rank (not
    ``tensor_model_parallel``): a sum takes it from tensor-parallel rank 0 only.
    """

    def __init__(self, names: list[str], numel: list[int], shapes: list[tuple[int, ...]], group: Any | None,
                 duplicate: list[bool], tp_rank: int, stages: Any | None, device: torch.device) -> None:
        super().__init__(names, numel, group, device=device, shapes=shapes,
                         drop=[d and tp_rank != 0 for d in duplicate])
        self.stages = stages


def model_tensors(chunks: list[Any], tp_size: int) -> tuple[list[str], dict[int, int], list[int],
                                                              list[tuple[int, ...]], list[bool]]:
    """The layout's keys: this stage's trainable parameters in model order (each once), their
    whole-tensor element counts (a tensor-parallel shard's times the tensor-parallel size) and
    whether every tensor-parallel rank holds them whole."""
    names, keys, numel, shapes, duplicate = [], {}, [], [], []
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if p.requires_grad and id(p) not in keys:
                split = bool(getattr(p, "tensor_model_parallel", False)) and tp_size > 1
                keys[id(p)] = len(names)
                names.append(name if len(chunks) == 1 else f"chunk{i}.{name}")
                numel.append(p.numel() * (tp_size if split else 1))
                shapes.append(tuple(p.shape))
                duplicate.append(not split and tp_size > 1)
    return names, keys, numel, shapes, duplicate


def attach(mopt: Any, chunks: list[Any], kernels: Any, fold: bool = True, squares: str = "per_step",
           node_size: int | None = None) -> LocalStats:
    """The statistics source of the inner optimizer of ``mopt`` (one Megatron optimizer over
    ``chunks``); its ``counters`` count the extra collectives and bytes, its ``begin_step`` runs
    where Megatron's step begins. ``fold``: each parameter's hook also adds the micro-batch's
    gradient into ``main_grad`` in its one launch and marks it added, so Megatron's own
    accumulation hook skips its ``main_grad.add_`` (one launch per tensor instead of two)."""
    for chunk in chunks:
        require(chunk, _CHUNK, "DistributedDataParallel")
    supersede(chunks)
    buffers = [b for chunk in chunks for b in chunk.buffers]
    for b in buffers:
        require(b, _BUFFER, "_ParamAndGradBuffer")
        for bucket in b.buckets:
            require(bucket, _BUCKET, "_ParamAndGradBucket")
    distributed = type(mopt).__name__ == "DistributedOptimizer"
    both = pairs(mopt)
    dp = buffers[0].data_parallel_group.size() if buffers else 1
    ddp_config = chunks[0].ddp_config

    # main_grad = e · Σ_ranks Σ_micro-batches x, with e fixed when Megatron built its buffers
    e = buffers[0].gradient_scaling_factor / (dp if ddp_config.average_in_collective else 1) if buffers else 1.0

    def scale() -> float:
        """S of this step's backward passes, read in ``begin_step`` only: 1 without a grad scaler
        (bf16, fp32: Megatron's scale is a constant 1, not read, since a device scalar read on the
        host waits for the device); under fp16 the scaler's."""
        if getattr(mopt, "grad_scaler", None) is None:
            return 1.0
        return float(mopt.get_loss_scale())

    if squares == "hierarchical":
        stats = _hierarchical(mopt, buffers, both, kernels, dp, 1.0 / e, node_size)
    else:
        stats = _per_step(mopt, buffers, both, kernels, dp, 1.0 / e, fold, distributed)

    def begin_step() -> None:
        """Before Megatron copies, unscales and clips the reduced gradients: launch the squares'
        reductions and read ``Σg`` from ``main_grad``."""
        if stats.superseded:
            raise RuntimeError("vrgd_ds.megatron: this optimizer's statistics were handed to an optimizer built "
                               "later on the same model chunks (get_megatron_optimizer); step that one")
        if stats.ended_unrecorded():  # Megatron's own loop never steps twice on one backward: a hand-written one may
            raise RuntimeError("vrgd_ds.megatron: an optimizer step with no backward pass since the last step; the "
                               "statistics (n, the squares) would be that step's. Run the micro-batches' forward and "
                               "backward (forward_backward_func) before each optimizer.step()")
        stats.start()
        # Megatron divides each micro-batch's loss by the step's micro-batches (its schedules'
        # forward_step) and fp16's scaler multiplies it by S: Σg and Σg² carry S/M and S²/M²,
        # which the optimizer's gsnr_eps · S²/M² (functional.step_plans) and the noise scale's
        # figures (StepRecord.unit) undo; M = the micro-batches each rank recorded
        stats.group_unit = stats.n / dp / scale()
        for t, p, where in stats.main_grads:
            stats.capture(t, p.main_grad.view(-1)[where])

    stats.begin_step = begin_step
    stats.superseded = False
    for chunk in chunks:
        chunk.vrgd_statistics = weakref.ref(stats)
        _discard_when_zeroed(chunk)
    return stats


def _discard_when_zeroed(chunk: Any) -> None:
    """``chunk.zero_grad_buffer()`` drops the statistics recorded since the last step with the
    gradients it zeroes (an accumulation a caller threw away: ``main_grad`` starts afresh, so must
    the squares and the micro-batch count). At the start of a usual iteration, after a step, there
    is nothing to drop. Installed once per chunk; it asks the chunk's current statistics."""
    if getattr(chunk, "vrgd_zero_wrapped", False):
        return
    zero, chunk_ref = type(chunk).zero_grad_buffer, weakref.ref(chunk)

    def zero_grad_buffer() -> None:
        owner = chunk_ref()
        ref = getattr(owner, "vrgd_statistics", None)
        stats = ref() if ref is not None else None
        if stats is not None and not stats.superseded:
            stats.discard()
        zero(owner)

    chunk.zero_grad_buffer = zero_grad_buffer
    chunk.vrgd_zero_wrapped = True


def supersede(chunks: list[Any]) -> None:
    """An optimizer built again on the same chunks (a second ``get_megatron_optimizer``) takes
    their statistics over: the earlier source's hooks go, else both would add every micro-batch's
    gradient into ``main_grad`` (each marks it added, so Megatron skips its own add), doubling it
    for as long as the earlier optimizer lives (its hooks hold no reference to it, but a cycle
    does until a full collection)."""
    for chunk in chunks:
        ref = getattr(chunk, "vrgd_statistics", None)
        old = ref() if ref is not None else None
        if old is not None and not old.superseded:
            old.unhook()
            old.superseded = True


def _main_grad_range(mopt: Any, p: Any, distributed: bool) -> slice:
    if distributed:
        inside = mopt._get_model_param_range_map(p)["param"]
        return slice(inside.start, inside.end)
    return slice(0, p.numel())


def _hierarchical(mopt: Any, buffers: list[Any], both: list, kernels: Any, dp: int, factor: float,
                  node_size: int | None) -> NodeStats:
    """The hierarchical scheme (``vrgd_ds/stats/hierarchical.py``) on the distributed optimizer:
    every Megatron bucket is cut into one shard per data-parallel rank, so each is a reduction of
    its own, reduced within the node every micro-step and across nodes once per step into this
    rank's shard. The micro-steps are read by the parameters' hooks (Megatron keeps its add)."""
    if type(mopt).__name__ != "DistributedOptimizer":
        raise ValueError("vrgd_ds.megatron: squares='hierarchical' needs the distributed optimizer "
                         "(use_distributed_optimizer=True): without it every rank reads every sum")
    group = buffers[0].data_parallel_group
    if group.size() != dist.get_world_size() or any(b.data_parallel_group.size() != dp for b in buffers):
        raise ValueError("vrgd_ds.megatron: squares='hierarchical' needs the data-parallel group to be every rank "
                         "(tensor-parallel size 1, pipeline-parallel size 1); use squares='per_step'")
    size = node_size if node_size is not None else host_node_size(group, dp)
    if dp % size:
        raise ValueError(f"vrgd_ds.megatron: node_size {size} does not divide the {dp} data-parallel ranks")
    nodes = node_groups(dist, dp, dist.get_rank(group=group), size)
    stats = NodeStats(dist, kernels, Scaling(dp, engine_factor=lambda: factor), [t for _, t in both],
                      "engine", nodes)
    stats.main_grads = []
    owned = dict(both)
    for b in buffers:  # every parameter: each rank packs the whole bucket, its own shard or not
        nbs = [stats.add_node_bucket(bucket.grad_data.numel(), b.grad_data.device) for bucket in b.buckets]
        for p, (start, end, i) in b.param_index_map.items():
            stats.place_flat(p, nbs[i], start - b.buckets[i].offset, end - start)
            stats.hook(p)
            t = owned.get(p)
            if t is not None:
                local = mopt._get_model_param_range_map(p)["gbuf_local"]
                stats.alias(t, None, stats.halves(nbs[i])[1][local.start:local.end])
                stats.main_grads.append((t, p, _main_grad_range(mopt, p, True)))
    return stats


def _per_step(mopt: Any, buffers: list[Any], both: list, kernels: Any, dp: int, factor: float, fold: bool,
              distributed: bool) -> LocalStats:
    """The per-step scheme on Megatron's buffers (the module docstring)."""
    stats = LocalStats(dist, kernels, Scaling(dp, engine_factor=lambda: factor), [t for _, t in both],
                       "engine", torch.float32)
    shards: dict[tuple[int, int], Tensor] = {}  # (buffer id, bucket index) -> this rank's reduced shard
    buckets: dict[int, StatsBucket] = {}
    for b in buffers:
        def reduce_buffer(sb: StatsBucket, b=b) -> list:
            works = []
            _, squares = sb.halves()
            for i, bucket in enumerate(b.buckets):
                local = squares.narrow(0, bucket.offset, bucket.grad_data.numel())
                out = shards.get((id(b), i), local)
                works += stats.launch(local, out, b.data_parallel_group, scatter=distributed, dtype=torch.float32,
                                      grad_elems=local.numel())
            return works

        buckets[id(b)] = stats.add_bucket(b.grad_data.numel(), b.grad_data.device, reduce_buffer)
        if distributed:
            for i, bucket in enumerate(b.buckets):
                shards[(id(b), i)] = torch.zeros(bucket.grad_data.numel() // dp, dtype=torch.float32,
                                                 device=b.grad_data.device)
        for p, (start, end, _) in b.param_index_map.items():
            if p.requires_grad:
                stats.place(p, buckets[id(b)], start, end - start)
                if fold and hasattr(p, "grad_added_to_main_grad") and not getattr(p, "zero_out_wgrad", False):
                    stats.hook(p, fold=lambda p=p: p.main_grad)
                else:
                    stats.hook(p)

    owner = {id(p): b for b in buffers for p in b.param_index_map}
    stats.main_grads = []  # (target, model parameter, range in its main_grad)
    for p, t in both:
        b = owner.get(id(p))
        if b is None:
            raise RuntimeError(f"vrgd_ds.megatron: a parameter of shape {tuple(p.shape)} the optimizer updates is in "
                               "no gradient buffer of the model chunks given (build the optimizer on the chunks the "
                               "Megatron DistributedDataParallel wraps)")
        if distributed:
            gbuf, _, bucket_index = mopt.model_param_gbuf_map[p]
            local = mopt._get_model_param_range_map(p)["gbuf_local"]
            if mopt.buffers[gbuf] is not b:
                raise RuntimeError("vrgd_ds.megatron: the distributed optimizer's buffers are not the model chunks' "
                                   "(build it on the same chunks)")
            sq = shards[(id(b), bucket_index)][local.start:local.end]
        else:
            start, end, _ = b.param_index_map[p]
            sq = buckets[id(b)].halves()[1][start:end]
        stats.main_grads.append((t, p, _main_grad_range(mopt, p, distributed)))
        stats.alias(t, None, sq)
    return stats
