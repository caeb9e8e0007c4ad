"""ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every parameter cut into equal pieces, one per
rank; the basic optimizer updates one flat fp32 partition per sub-group.

Everything this path reads or replaces in DeepSpeed 0.19.8 is here and checked at attach time:

* ``__avg_scatter_grads(params, communication_data_type)`` (name-mangled): replaced by one
  coalesced reduce-scatter of the gradients and their squares (per-micro-step scheme);
  ``reduce_scatter`` is set to True so every bucket goes through it;
* ``__reduce_and_partition_ipg_grads(communication_data_type)`` (name-mangled) and
  ``ipg_buckets[dtype]`` (``buffer``, ``params`` in the order they were copied in, ``elements``),
  ``contiguous_gradients``, ``reduce_bucket_size``: where a bucket holds one micro-step's local
  gradients just before DeepSpeed reduces them on ``reduce_and_partition_stream`` (the per-step
  scheme reads them there in one launch, on that stream);
* ``grad_position[param id] = (sub-group, offset, partition numel)``, ``get_param_id``,
  ``_get_param_partition_group``, ``fp16_groups``: which piece of each parameter this rank owns
  and where it lies in its flat partition; ``p.ds_numel``: the whole parameter's size;
* ``fp32_partitioned_groups_flat``: the tensors the basic optimizer updates;
  ``gradient_accumulation_dtype``: the dtype DeepSpeed accumulates reduced gradients in;
* ``unscale_and_clip_grads(sub_group_id, total_norm)``: where the reduced gradient is read for
  ``gbar="engine"``; ``loss_scale``; ``dp_process_group``;
* ``deepspeed.runtime.comm.coalesced_collectives.reduce_scatter_coalesced``: DeepSpeed's own
  partitioning of each tensor (padded to a multiple of the ranks, averaged over them);
* ``micro_step_id``: 0 at a step's first micro-step, where ``partition_grads`` copies rather than
  adds; ``step``: where every parameter's gradient partition is read (``refuse_late_gradients``).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from vrgd_ds.ds.internals import UnsupportedConfiguration, require
from vrgd_ds.stats.layout import Layout, ModelTensors
from vrgd_ds.stats.local import LocalStats, StatsBucket

AVG_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
REDUCE_IPG = "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"
_REQUIRED = (AVG_SCATTER, REDUCE_IPG, "fp32_partitioned_groups_flat", "fp16_groups", "grad_position", "get_param_id",
             "_get_param_partition_group", "gradient_accumulation_dtype", "loss_scale", "dp_process_group",
             "unscale_and_clip_grads", "ipg_buckets", "contiguous_gradients", "reduce_bucket_size",
             "reduce_and_partition_stream", "micro_step_id", "step")


def pieces(zopt: Any, i: int) -> list[tuple[Tensor, int, int]]:
    """(model parameter, start in this rank's flat partition, valid length) for sub-group i."""
    out = []
    for p in zopt.fp16_groups[i]:
        _, offset, part_numel = zopt.grad_position[zopt.get_param_id(p)]
        rank = dist.get_rank(group=zopt._get_param_partition_group(p))
        valid = max(0, min(p.ds_numel - rank * int(part_numel), int(part_numel)))
        out.append((p, int(offset), valid))
    return out


def tensor_offset(zopt: Any, p: Tensor) -> int:
    """Where this rank's partition of ``p`` starts inside the whole tensor (ZeRO-3 cuts each
    parameter into equal ``partition_numel`` pieces, rank r holding the r-th)."""
    _, _, part_numel = zopt.grad_position[zopt.get_param_id(p)]
    return min(dist.get_rank(group=zopt._get_param_partition_group(p)) * int(part_numel), int(p.ds_numel))


def _reduce_scatter_coalesced():
    from deepspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced

    return reduce_scatter_coalesced


class Zero3:
    """The ZeRO-3 engine path (``vrgd_ds/ds/paths.py``'s ``EnginePath``)."""

    per_micro_step = True  # every micro-step's bucket is reduce-scattered

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.zopt = engine.optimizer
        require(self.zopt, _REQUIRED, type(self.zopt).__name__)
        self.flats = list(self.zopt.fp32_partitioned_groups_flat)
        self.pieces = [pieces(self.zopt, i) for i in range(len(self.flats))]
        # parameter id -> (sub-group, offset in this rank's flat partition, valid length)
        self.where = {id(p): (i, off, valid) for i, ps in enumerate(self.pieces) for p, off, valid in ps}

    def targets(self) -> list[Tensor]:
        return self.flats

    def loss_scale(self) -> float:
        return self.zopt.loss_scale

    def layout(self, model: ModelTensors, device: torch.device) -> Layout:
        zopt = self.zopt
        layout = Layout(model.names, model.numel, group=zopt.dp_process_group, device=device, shapes=model.shapes,
                        comm=dist)
        for flat, ps in zip(self.flats, self.pieces):
            layout.add(flat, [(off, valid, model.keys[id(p)], tensor_offset(zopt, p)) for p, off, valid in ps])
        return layout

    def configure(self, opt: Any) -> None:
        if len(self.zopt.fp16_groups) > 1 and any(g.get("grad_pre_normalization") for g in opt.param_groups):
            raise UnsupportedConfiguration(
                "vrgd_ds: grad_pre_normalization under ZeRO-3 with more than one sub-group (param groups or "
                "zero_optimization.sub_group_size) is not supported: ZeRO-3 steps sub-groups one at a time")
        opt.merge_step_records = True  # one optimizer.step() per sub-group

    def refuse_late_gradients(self, model: ModelTensors) -> None:
        """DeepSpeed 0.19.8's ZeRO-3 keeps each parameter's reduced gradient in a partition it never
        zeroes between steps: ``partition_grads`` copies into it at a step's first micro-step
        (``micro_step_id == 0``) and adds at every later one, and ``step`` reads it for every
        parameter. So a parameter whose first gradient of a step comes after the first micro-step
        gets it added onto the previous step's, and one with no gradient in a step (after one in an
        earlier step) steps on the earlier step's. Its update is then wrong, and so are its
        statistics (the per-step scheme reads that sum as Σg). Refused where it happens, naming
        the tensors (every rank reduces the same buckets, so every rank raises)."""
        zopt = self.zopt
        reduce_ipg, step = getattr(zopt, REDUCE_IPG), zopt.step
        names = {pid: model.names[key] for pid, key in model.keys.items()}
        first: set[int] = set()  # the parameters with a gradient at this step's first micro-step
        used: set[int] = set()  # ... at any micro-step of this step
        earlier: set[int] = set()  # ... in an earlier step

        def named(ids: Any) -> str:
            listed = sorted(names.get(i, "a tensor without a name") for i in ids)
            return ", ".join(listed[:4]) + (", ..." if len(listed) > 4 else "")

        def refused(what: str, why: str) -> UnsupportedConfiguration:
            return UnsupportedConfiguration(
                f"vrgd_ds: under ZeRO-3, {what}: DeepSpeed 0.19.8 {why} (stage3.py: a gradient partition is not "
                "zeroed between steps), so its update and its GSNR would be wrong. Give it a gradient in every "
                "micro-batch (e.g. add 0 * its output to the loss), or use ZeRO-1/2")

        def reduce_and_partition_ipg_grads(communication_data_type):
            micro = zopt.micro_step_id
            ids = [id(p) for p in zopt.ipg_buckets[communication_data_type].params]
            if micro == 0:
                first.update(ids)
            elif any(i not in first for i in ids):
                raise refused(f"{named(i for i in ids if i not in first)} had no gradient in this step's first "
                              f"micro-batch but has one in micro-batch {micro}",
                              "adds it onto the previous step's gradient (partition_grads copies at micro_step_id 0 "
                              "only)")
            used.update(ids)
            return reduce_ipg(communication_data_type)

        def stepped(*args: Any, **kwargs: Any) -> Any:
            gone = earlier - used
            earlier.update(used)
            first.clear()
            used.clear()
            if gone:
                raise refused(f"{named(gone)} had a gradient in an earlier step and has none in this one",
                              "steps it on that earlier step's gradient")
            return step(*args, **kwargs)

        setattr(zopt, REDUCE_IPG, reduce_and_partition_ipg_grads)
        zopt.step = stepped

    # -- the per-micro-step scheme (vrgd_ds/ds/sources.py) ------------------------------------------

    def hook_reduction(self, stats: Any) -> None:
        """``__avg_scatter_grads`` becomes one coalesced reduce-scatter of the gradients and their
        fp32 squares (a second call for bf16 squares: a coalesced call flattens into one dtype)."""
        reduce_scatter_coalesced = _reduce_scatter_coalesced()
        zopt, flats, where = self.zopt, self.flats, self.where
        for flat, ps in zip(flats, self.pieces):
            for p, offset, valid in ps:
                if valid:
                    stats.piece(p, flat, offset, valid)
        zopt.reduce_scatter = True  # every bucket goes through __avg_scatter_grads

        def avg_scatter_grads(params, communication_data_type):
            group = zopt._get_param_partition_group(params[0])
            k = dist.get_world_size(group=group)
            stats.begin_round(params)
            c = stats.multiplier()
            grads, squares = self._packed(params, communication_data_type, stats, c)
            t = len(params)
            numel = sum(g.numel() for g in grads)
            if stats.squares_dtype == torch.float32:
                parts = reduce_scatter_coalesced(grads + squares, group)  # one collective, averaged over k
                g_parts, sq_parts = parts[:t], parts[t:]
                stats.counters.add(numel, 2 * 4 * numel)
            else:
                g_parts = reduce_scatter_coalesced(grads, group)
                sq_parts = [x.float() for x in
                            reduce_scatter_coalesced([x.to(stats.squares_dtype) for x in squares], group)]
                stats.counters.add(numel, 4 * numel + 2 * numel, calls=2)
            for p, gp, sp in zip(params, g_parts, sq_parts):
                i, offset, valid = where[id(p)]
                if valid:  # the coalesced reduce-scatter averaged over k: the squares' sum is k times it
                    sp.mul_(k)
                    stats.add(id(flats[i]), offset, gp.view(-1)[:valid], sp.view(-1)[:valid], k * c, stats.first(p))
            return [gp.to(zopt.gradient_accumulation_dtype) for gp in g_parts]

        setattr(zopt, AVG_SCATTER, avg_scatter_grads)

    def _packed(self, params: list[Tensor], communication_data_type: torch.dtype, stats: Any,
                c: float) -> tuple[list[Tensor], list[Tensor]]:
        """The bucket's gradients in fp32 and their squares ``(c·g)²``, one tensor each in the order
        of ``params``: one ``pack_squares`` launch over DeepSpeed's contiguous bucket, or one per
        gradient where the bucket holds the one gradient too large for its buffer."""
        got = self.bucket_source(communication_data_type)
        if got is None or len(got[1]) != len(params):
            grads = [p.grad.float() for p in params]
            squares = []
            for g in grads:  # one pass each: (c g)² in fp32
                sq = torch.empty(g.shape, dtype=torch.float32, device=g.device)
                stats.kernels.pack_squares(g, None, sq.view(-1), c)
                squares.append(sq)
            return grads, squares
        src = got[0]
        total = src.numel()
        both = torch.empty(2 * total, dtype=torch.float32, device=src.device)
        stats.kernels.pack_squares(src, both[:total], both[total:], c)  # [x | (c x)²], bucket order
        base, size = src.data_ptr(), src.element_size()
        grads, squares = [], []
        for p in params:  # DeepSpeed sorted the bucket's parameters: find each in the buffer
            off, n = (p.grad.data_ptr() - base) // size, p.grad.numel()
            grads.append(both.narrow(0, off, n))
            squares.append(both.narrow(0, total + off, n))
        return grads, squares

    # -- the per-step scheme (vrgd_ds/ds/local.py) --------------------------------------------------

    def local_buffers(self, stats: LocalStats) -> None:
        """One full-size statistics bucket over every parameter, reduce-scattered once per step
        with DeepSpeed's own coalesced reduce-scatter (its partitioning of each parameter)."""
        reduce_scatter_coalesced = _reduce_scatter_coalesced()
        zopt, targets, where, squares_dtype = self.zopt, self.flats, self.where, stats.squares_dtype
        params = [p for group in zopt.fp16_groups for p in group]
        sizes = [int(p.ds_numel) for p in params]
        group = zopt.dp_process_group
        k = dist.get_world_size(group=group)
        offsets, off = [], 0
        for n in sizes:
            offsets.append(off)
            off += n
        for t in targets:
            stats.alias(t, torch.zeros(t.numel(), dtype=torch.float32, device=t.device) if stats.gbar == "local"
                        else None, torch.zeros(t.numel(), dtype=torch.float32, device=t.device))
        # the helper pads every tensor to a multiple of k, as it does for DeepSpeed's own fp32 gradient
        # reduce-scatter: the padded size is what one fp32 gradient costs on this path, and what a call
        # of it allocates for the step (the calls one after another): its inputs copied, padded and
        # interleaved by rank (no copy for one tensor that k divides), and for low-precision squares
        # their copies before it
        sent = sum(-(-n // k) * k for n in sizes)
        copy = 0 if len(sizes) == 1 and sizes[0] % k == 0 else sent
        size = torch.finfo(squares_dtype).bits // 8
        squares_call = copy * 4 if size == 4 else (off + copy) * size
        stats.step_copy_bytes = max(squares_call, copy * 4 if stats.gbar == "local" else 0)

        def scatter(views: list[Tensor], dtype: torch.dtype, squares: bool) -> list[Tensor]:
            # views: one per parameter, of ``sizes``
            if dtype != torch.float32:
                low = [v.to(dtype) for v in views]
                stats.counters.add(sent if squares else 0, sent * low[0].element_size())
                return [x.float() for x in reduce_scatter_coalesced(low, group)]
            stats.counters.add(sent if squares else 0, sent * 4)
            return reduce_scatter_coalesced(views, group)

        def reduce_bucket(b: StatsBucket) -> list[Any]:
            g_local, sq_local = b.halves()
            parts = scatter([sq_local.narrow(0, o, n) for o, n in zip(offsets, sizes)], squares_dtype, True)
            gparts = None
            if g_local is not None:
                gparts = scatter([g_local.narrow(0, o, n) for o, n in zip(offsets, sizes)], torch.float32, False)
            for j, p in enumerate(params):
                sub, dst, valid = where[id(p)]
                if valid:
                    gb, sb = stats.moments_of(targets[sub])
                    sb.narrow(0, dst, valid).copy_(parts[j].view(-1)[:valid]).mul_(k)  # the helper averages over k
                    if gparts is not None:
                        gb.narrow(0, dst, valid).copy_(gparts[j].view(-1)[:valid]).mul_(k)
            return []

        bucket = stats.add_bucket(off, targets[0].device if targets else torch.device("cpu"), reduce_bucket)
        for p, o, n in zip(params, offsets, sizes):
            stats.place(p, bucket, o, n)
        self.record_micro_steps(stats)

    def node_buffers(self, stats: Any) -> None:
        """The hierarchical scheme (``vrgd_ds/stats/hierarchical.py``) on ZeRO-3's partitioning: a
        sub-group's partition is every tensor's piece of this rank, one after another
        (``grad_position``), so element ``e`` of a tensor cut into pieces of ``c`` lies in partition
        ``e // c``, at the tensor's offset in a partition plus ``e % c``. Each micro-step read from
        ZeRO-3's ipg buckets as ``local_buffers`` does."""
        zopt, targets = self.zopt, self.flats
        buckets = []
        for t in targets:
            b = stats.add_node_bucket(stats.world * t.numel(), t.device)
            stats.alias(t, *stats.halves(b))
            buckets.append(b)
        for group in zopt.fp16_groups:
            for p in group:
                sub, offset, part_numel = zopt.grad_position[zopt.get_param_id(p)]
                stats.place_flat(p, buckets[int(sub)], 0, int(p.ds_numel), period=int(part_numel), base=int(offset))
        self.record_micro_steps(stats)

    def bucket_source(self, communication_data_type: torch.dtype) -> tuple[Tensor, list[Tensor]] | None:
        """``(flat local gradients, their parameters in order)`` of the ipg bucket about to be
        reduced: DeepSpeed's contiguous buffer, or the one gradient too large for it, which it
        reduces alone; None when the bucket is empty."""
        zopt = self.zopt
        bucket = zopt.ipg_buckets[communication_data_type]
        params = list(bucket.params)
        if not params:
            return None
        if zopt.contiguous_gradients and bucket.elements <= zopt.reduce_bucket_size and bucket.buffer is not None:
            return bucket.buffer.narrow(0, 0, bucket.elements), params
        if len(params) != 1:
            raise RuntimeError("DeepSpeed's ZeRO-3 bucket holds several gradients outside its contiguous buffer: a "
                               "layout DeepSpeed 0.19.8 does not produce")
        return params[0].grad.reshape(-1), params

    def record_micro_steps(self, stats: LocalStats) -> None:
        """Each micro-step's gradients from DeepSpeed's ipg bucket, one ``pack_bucket`` launch per
        bucket just before DeepSpeed reduces it (ZeRO-3 reduces every micro-step); a tensor hook per
        parameter with ``"micro_steps": "hooks"``."""
        zopt = self.zopt
        if stats.hooks_only:
            for group in zopt.fp16_groups:
                for p in group:
                    stats.hook(p)
            return
        original = getattr(zopt, REDUCE_IPG)

        def members(params) -> list[tuple[int, int]]:
            out, off = [], 0
            for p in params:
                out.append((stats.index(p), off))
                off += p.grad.numel()
            return out

        accelerator = get_accelerator()

        def reduce_and_partition_ipg_grads(communication_data_type):
            got = self.bucket_source(communication_data_type)
            if got is not None:
                src, params = got
                # on the stream DeepSpeed copied the gradients into the bucket on, and reduces it on
                with accelerator.stream(zopt.reduce_and_partition_stream):
                    stats.record_bucket(tuple(map(id, params)), src, lambda: members(params))
            return original(communication_data_type)

        setattr(zopt, REDUCE_IPG, reduce_and_partition_ipg_grads)

    def capture_engine_gradient(self, stats: LocalStats) -> None:
        """``gbar="engine"``: each sub-group's reduced partition gradient, read just before
        DeepSpeed unscales and clips it."""
        zopt, targets = self.zopt, self.flats
        original = zopt.unscale_and_clip_grads

        def unscale_and_clip_grads(sub_group_id, total_norm):
            t = targets[sub_group_id]
            stats.capture(t, t.grad)
            return original(sub_group_id, total_norm)

        zopt.unscale_and_clip_grads = unscale_and_clip_grads
