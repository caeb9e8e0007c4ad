"""Gradient statistics with the engine's own gradient reduction untouched (DeepSpeed, torch DDP,
megatron-core): each rank sums its micro-steps' gradients and squares locally, and one
collective per statistics bucket per optimizer step brings the sums into the partition this
rank's optimizer owns (docs/design.md §3; DeepSpeed: ``"vrgd": {"squares": "per_step"}``, each
engine path's set-up in ``vrgd_ds/ds/stage0.py``, ``zero12.py`` and ``zero3.py``; DDP:
``vrgd_ds.ddp.attach``; Megatron: ``vrgd_ds/megatron/stats.py``).

Why it is exact: Σ over ranks and micro-steps of g² equals the sum over ranks of each rank's
local Σ over its micro-steps (associativity), so ``n = ranks × micro-steps`` on every path.

* **Where a micro-step's gradient is read.** Where the engine holds one micro-step's local
  gradient in a flat bucket (DeepSpeed ZeRO-2's ipg buckets, ZeRO-1 and stage 0 without
  accumulation, DDP's comm-hook buckets, ZeRO-3's ipg buckets), the engine path calls
  ``record_bucket`` there: **one** ``Kernels.pack_bucket`` launch per bucket per micro-step, its
  segment table (bucket offsets -> statistics offsets) built once per bucket layout and cached
  by the bucket's parameters. Where no bucket holds one micro-step (ZeRO-1 and stage 0 with
  accumulation, DDP under ``no_sync()``), a tensor hook per parameter records each backward's
  gradient with the same kernel and table machinery (``hook``): the two paths write the same
  numbers, bit for bit.
* **Scaling, once.** A local micro-batch gradient is ``x = S·g/A`` under DeepSpeed (the engine
  divides the loss by the accumulation A, the loss scaler multiplies by S): the kernel takes
  ``w = c·x`` with ``c = A/S`` in fp32 and adds ``w²`` and, with ``gbar="local"``, ``w`` itself.
  The collective sums; nothing else rescales (DDP and Megatron pass their own ``c``).
* **Statistics buckets** (``StatsBucket``, after Megatron's ``_ParamAndGradBucket``): one flat
  fp32 local buffer per reduction with its layout, its collective started and finished in
  pairs (``start``/``finish``), and its counters. A ZeRO-1/2 param group's buffer is laid out
  per rank as ``[Σg_r | Σg²_r]``, so **one** reduce-scatter hands each rank both halves of its
  partition (bf16 squares travel in their own collective: one call cannot mix dtypes). All
  buckets of a source are views of one allocation, so one launch covers an engine bucket that
  spans param groups.

Extra traffic per optimizer step, whatever the accumulation: the fp32 gradient's bytes
(``gbar="engine"``), half of them with bf16 squares, twice with ``gbar="local"``.
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np
import torch
from torch import Tensor

from vrgd_ds.optim.columns import BucketTable
from vrgd_ds.stats.backward import BackwardGroups, remove_hooks
from vrgd_ds.stats.comm import CommCounters, launch
from vrgd_ds.stats.scaling import Scaling

logger = logging.getLogger(__name__)


def moment_views(bufs: dict[int, tuple[Tensor, Tensor]], params) -> tuple[list[Tensor], list[Tensor]]:
    """``moments()``'s answer: each tensor's buffers viewed in its shape; a tensor without
    statistics is an error naming its shape (it was added after the engine was built)."""
    sum_g, sum_sq = [], []
    for p in params:
        pair = bufs.get(id(p))
        if pair is None:
            raise RuntimeError(f"no VRGD statistics for a tensor of shape {tuple(p.shape)}: it was not in the "
                               "optimizer when its statistics were attached (the engine built its partitions, or "
                               "vrgd_ds.ddp.attach ran); add every param group before either")
        sum_g.append(pair[0].view(p.shape))
        sum_sq.append(pair[1].view(p.shape))
    return sum_g, sum_sq


def moment_buffers(targets: list[Tensor]) -> dict[int, tuple[Tensor, Tensor]]:
    """The ``(Σg, Σg²)`` fp32 buffers of each flat tensor the basic optimizer updates, by id."""
    return {id(t): (torch.zeros(t.numel(), dtype=torch.float32, device=t.device),
                    torch.zeros(t.numel(), dtype=torch.float32, device=t.device)) for t in targets}


@dataclass
class StatCounters:
    """What a statistics source did on the backward path, to check its cost on any machine:
    ``pack_bucket`` launches, tensor hooks installed, segment tables built (host table work), and
    the launches that did the engine's own accumulation too."""

    launches: int = 0
    hooks: int = 0
    tables_built: int = 0
    folded: int = 0  # launches that also did the engine's accumulation (Megatron's main_grad)


#: each rank's part of a statistics bucket is padded to this many elements (16 bytes), so that a
#: segment's gradient and squares agree modulo the kernels' vector width (128-bit accesses)
PAD = 4


class StatsBucket:
    """One flat fp32 buffer of local statistics and its collective (one per optimizer step).

    Element ``e`` of the flat layout it mirrors (``numel = ranks · part``; rank ``r`` owns
    ``[r·part, (r+1)·part)``, ``j = e - r·part``; ``P`` is ``part`` rounded up to ``PAD``) keeps
    its local ``Σ w`` and ``Σ w²`` at

    * ``[Σg_r | Σg²_r]`` blocks (fp32 squares with ``Σg``): ``Σg`` at ``r·2P + j``, ``Σg²`` ``P``
      further: a reduce-scatter of the whole buffer gives each rank both halves of its part;
    * ``[Σg | Σg²]`` halves (bf16 squares with ``Σg``): ``Σg`` at ``r·P + j``, ``Σg²``
      ``ranks·P`` further: each half has its own collective and dtype;
    * squares only (``gbar="engine"``): ``Σg²`` at ``r·P + j``.

    ``reduce`` launches the collective(s) and returns what ``finish`` waits on or runs, in order.
    """

    def __init__(self, owner: "LocalStats", base: int, numel: int, ranks: int, device: torch.device,
                 reduce: Callable[["StatsBucket"], list[Any]] | None) -> None:
        if numel % ranks:
            raise ValueError(f"a statistics bucket of {numel} elements cannot be split over {ranks} ranks")
        # weakly: the source holds its buckets, and a cycle would keep it (and the hooks that feed it,
        # which hold it weakly) alive past its optimizer until a garbage collection, which the ranks
        # run at different times
        self._owner = weakref.proxy(owner)
        self.base, self.numel, self.ranks, self.part = base, numel, ranks, numel // ranks
        self.padded = -(-self.part // PAD) * PAD
        self.device = device
        self.with_g = owner.gbar == "local"
        self.fused = self.with_g and owner.squares_dtype == torch.float32
        self.width = (2 if self.fused else 1) * self.padded  # one rank's block
        self.shift = self.padded if self.fused else ranks * self.padded if self.with_g else 0  # Σg -> Σg²
        self.size = (2 if self.with_g else 1) * ranks * self.padded
        self.reduce = reduce
        self.members: list[int] = []  # parameter indices placed here
        self._works: list[Any] = []
        self._out: tuple[Tensor | None, Tensor | None, Tensor] | None = None

    # -- layout -----------------------------------------------------------------------------------

    @property
    def local(self) -> Tensor:
        """The bucket's local buffer (a view of its source's one allocation)."""
        return self._owner.arena.narrow(0, self.base, self.size)

    def dests(self, offset: int, length: int) -> list[tuple[int, int, int, int]]:
        """``(start in the piece, Σg start, Σg² start, length)`` in the source's allocation of the
        flat elements ``[offset, offset + length)``, cut where a rank's part ends."""
        out, e, end = [], offset, offset + length
        while e < end:
            r, j = divmod(e, self.part)
            n = min(end, (r + 1) * self.part) - e
            g = self.base + r * self.width + j
            out.append((e - offset, g, g + self.shift, n))
            e += n
        return out

    def halves(self, rank: int | None = None) -> tuple[Tensor | None, Tensor]:
        """``(Σg, Σg²)`` local views of rank ``rank``'s part (all of it when ``None``, one rank)."""
        if rank is None:
            if self.ranks != 1:
                raise ValueError("halves(): name the rank of a bucket split over ranks")
            rank = 0
        local, start = self.local, rank * self.width
        sq = local.narrow(0, start + self.shift, self.part)
        return (local.narrow(0, start, self.part) if self.with_g else None), sq

    @property
    def _grad_elems(self) -> int:
        """The fp32 gradient one collective of the squares stands for: the buffer it reduces (the
        mirrored flat layout, each rank's part padded to ``PAD``)."""
        return self.ranks * self.padded

    # -- the collective ---------------------------------------------------------------------------

    def start(self) -> None:
        if self.reduce is not None:
            self._works = self.reduce(self)

    def finish(self) -> None:
        for w in self._works:
            if callable(w):
                w()  # a completion step (e.g. bf16 squares back to fp32)
            elif w is not None:
                w.wait()
        self._works = []

    def all_reduce_in_place(self, group: Any) -> list[Any]:
        """Stage 0, DDP: the sums over ``group`` land in the local buffer itself (one rank's
        layout): one collective for fp32 squares, two with bf16 squares beside the fp32 ``Σg``."""
        owner, local, P = self._owner, self.local, self.padded
        if self.fused or not self.with_g:
            return owner.launch(local, local, group, scatter=False, dtype=owner.squares_dtype if not self.with_g
                                else torch.float32, grad_elems=self._grad_elems)
        g, sq = local.narrow(0, 0, P), local.narrow(0, P, P)
        works = owner.launch(sq, sq, group, scatter=False, dtype=owner.squares_dtype, grad_elems=self._grad_elems)
        return works + owner.launch(g, g, group, scatter=False, dtype=torch.float32, grad_elems=0)

    def scatter_outputs(self) -> tuple[Tensor | None, Tensor]:
        """``(Σg, Σg²)`` of this rank's part, which ``reduce_scatter`` fills (allocated here once;
        for fused buckets two halves of one tensor, so one collective fills both)."""
        if self._out is None:
            P, n = self.padded, self.part
            if self.fused:
                both = torch.zeros(2 * P, dtype=torch.float32, device=self.device)
                self._out = (both, both[:n], both[P:P + n])
            else:
                g = torch.zeros(P, dtype=torch.float32, device=self.device) if self.with_g else None
                self._out = (g, None, torch.zeros(P, dtype=torch.float32, device=self.device))
        if self.fused:
            return self._out[1], self._out[2]
        g, sq = self._out[0], self._out[2]
        return (None if g is None else g[:self.part]), sq[:self.part]

    def reduce_scatter(self, group: Any) -> list[Any]:
        """ZeRO-1/2: this rank's part of the sums over ``group`` into ``scatter_outputs()``: one
        collective, two with bf16 squares beside the fp32 ``Σg``."""
        owner, local = self._owner, self.local
        self.scatter_outputs()
        first, _, out_sq = self._out
        if self.fused:
            return owner.launch(local, first, group, scatter=True, dtype=torch.float32, grad_elems=self._grad_elems)
        if self.with_g:
            half = self.ranks * self.padded
            g, sq = local.narrow(0, 0, half), local.narrow(0, half, half)
            works = owner.launch(sq, out_sq, group, scatter=True, dtype=owner.squares_dtype,
                                 grad_elems=self._grad_elems)
            return works + owner.launch(g, first, group, scatter=True, dtype=torch.float32, grad_elems=0)
        return owner.launch(local, out_sq, group, scatter=True, dtype=owner.squares_dtype, grad_elems=self._grad_elems)


@dataclass(frozen=True)
class CountSlot:
    """An element of ``bucket``'s halves that the step's collective sums over ``ranks`` ranks:
    each writes its count ``c`` of the step's gradient groups in the ``Σg`` half and ``c²`` in the
    ``Σg²`` half, and every rank must have counted alike (``LocalStats._verify_count``: the sums
    are ``ranks · c`` and ``ranks · c²`` on every rank only where every count is ``c``).
    ``counted``: what the count is, for the refusal; ``fix``: the refusal's reason and fix."""

    bucket: StatsBucket
    slot: int
    ranks: int
    counted: str
    fix: str


@dataclass
class BucketPlan:
    """A cached bucket layout: every segment's rows and parameter, the parameters it covers,
    and its tables by accumulate flags (at most two in steady training: first micro-step, later)."""

    rows: np.ndarray  # int64 [S, 4]: source start, Σg start, Σg² start, length
    seg_param: np.ndarray  # int64 [S]: the parameter index of each segment
    params: np.ndarray  # int64 [P]: the parameters (unique)
    tables: dict[bytes, BucketTable] = field(default_factory=dict)


class LocalStats:
    """``Σg`` and ``Σg²`` per flat tensor the optimizer updates, from per-rank local sums reduced
    once per step (a ``StatisticsSource``).

    ``targets``: the optimizer's tensors; the engine path aliases their statistics to views of
    the reduced buckets (``alias``), or ``gbar="engine"`` captures ``Σg`` from the engine's
    reduced gradient (``capture``). The path-specific parts (the buckets, where the engine's
    gradient is read) are set up by each engine path.
    """

    def __init__(self, comm: Any, kernels: Any, scaling: Scaling, targets: list[Tensor], gbar: str,
                 squares_dtype: torch.dtype) -> None:
        self.comm = comm  # deepspeed.comm or torch.distributed
        #: the engine's world size, loss scale, averaging and Σg factor (``gbar="engine"``)
        self.scaling = scaling
        self.kernels = kernels
        self.world = scaling.world
        self.gbar = gbar
        self.squares_dtype = squares_dtype
        self._targets = {id(t): t for t in targets}
        self._bufs: dict[int, tuple[Tensor, Tensor]] = {}
        self.stat_buckets: list[StatsBucket] = []
        self._size = 0
        #: bytes an engine's collective allocates for the step's reduction and frees after it (ZeRO-3:
        #: DeepSpeed's coalesced reduce-scatter copies its inputs, padded and interleaved), set by the path
        self.step_copy_bytes = 0
        self._arena: Tensor | None = None
        self._device: torch.device | None = None
        # parameters, by index: their placement (rows in the allocation) and micro-step counts
        self._index: dict[int, int] = {}  # id(param) -> index
        self._dests: list[list[tuple[int, int, int, int]]] = []
        self._counts = np.zeros(0, dtype=np.int64)
        self._plans: dict[Hashable, BucketPlan] = {}
        self._stale = False
        self._started = False
        self._finished = False
        self._captured: set[int] = set()
        self._c = 1.0
        self._scale = 1.0
        self._n_local = 0
        #: (Σ counts and Σ counts² on the host, event, this rank's)
        self._count_check: tuple[Tensor, Any, int] | None = None
        self._count_host: Tensor | None = None
        self._handles: dict[int, Any] = {}
        weakref.finalize(self, remove_hooks, self._handles)  # statistics gone with their optimizer leave no hooks
        self._passes = BackwardGroups()  # the hook path: which backward() a hook runs in
        self._steps_ended = 0
        self.counters = CommCounters()
        self.stat_counters = StatCounters()

    # -- set-up ----------------------------------------------------------------------------------

    def add_bucket(self, numel: int, device: torch.device, reduce: Callable[[StatsBucket], list[Any]] | None,
                   ranks: int = 1) -> StatsBucket:
        """A statistics bucket mirroring ``numel`` flat elements split over ``ranks`` (the layout of
        ``StatsBucket``); ``reduce`` is its collective. Buckets are added before training."""
        if self._arena is not None:
            raise RuntimeError("statistics buckets are added before the first micro-step")
        if self._device is not None and device != self._device:
            raise ValueError(f"statistics buckets on {self._device} and {device}: one device per rank")
        self._device = device
        bucket = StatsBucket(self, self._size, numel, ranks, device, reduce)
        self._size += -(-bucket.size // PAD) * PAD
        self.stat_buckets.append(bucket)
        return bucket

    @property
    def arena(self) -> Tensor:
        """The one fp32 allocation every bucket is a view of (made at first use)."""
        if self._arena is None:
            self._arena = torch.zeros(self._size, dtype=torch.float32, device=self._device or "cpu")
        return self._arena

    def place(self, p: Tensor, bucket: StatsBucket, offset: int, numel: int) -> int:
        """Where parameter ``p``'s statistics live: the flat elements ``[offset, offset + numel)``
        of ``bucket``'s layout. Returns its index."""
        if id(p) in self._index:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is placed twice in the statistics")
        idx = len(self._dests)
        self._index[id(p)] = idx
        self._dests.append(bucket.dests(offset, numel))
        self._counts = np.append(self._counts, 0)
        bucket.members.append(idx)
        return idx

    def hook(self, p: Tensor, fold: Callable[[], Tensor | None] | None = None) -> None:
        """The hook path: a tensor hook records each backward's gradient of ``p`` (placed).
        ``fold``: the engine's accumulation buffer of ``p`` (Megatron's ``main_grad``), which the
        same launch adds the gradient into; the engine is told so (``grad_added_to_main_grad``)."""
        idx = self._index[id(p)]
        if idx in self._handles:
            return
        me, p_ref = weakref.ref(self), weakref.ref(p)

        def hook(grad: Tensor, me=me, idx=idx) -> None:
            stats = me()
            if stats is None:
                return
            stats._passes.record(idx, p_ref(), "VRGD statistics")
            main = fold() if fold is not None else None
            stats.record_bucket(("param", idx), grad.detach(), lambda: [(idx, 0)], main=main)
            if main is not None:
                p_ref().grad_added_to_main_grad = True

        self._handles[idx] = p.register_hook(hook)
        self.stat_counters.hooks = len(self._handles)

    def unhook(self, p: Tensor | None = None) -> None:
        """Removes the tensor hook of ``p`` (every hook when ``None``): a bucket records it now."""
        keys = list(self._handles) if p is None else [self._index[id(p)]]
        for k in keys:
            h = self._handles.pop(k, None)
            if h is not None:
                h.remove()
        self.stat_counters.hooks = len(self._handles)

    def index(self, p: Tensor) -> int:
        return self._index[id(p)]

    def holds(self, p: Tensor) -> bool:
        """Whether ``p`` has statistics here (a parameter of a ``gsnr=False`` group has none)."""
        return id(p) in self._index

    # -- recording -------------------------------------------------------------------------------

    def record_bucket(self, key: Hashable, src: Tensor, members: Callable[[], list[tuple[int, int]]],
                      main: Tensor | None = None) -> None:
        """One micro-step's local gradients of a bucket: ``src`` flat, holding the parameters that
        ``members()`` lists as ``(index, start in src)`` (called once per ``key``: the bucket's
        layout, e.g. its parameters). One launch, whatever the number of parameters; ``main``
        (laid out like ``src``) accumulates ``src`` in the same launch."""
        plan = self._plan_for(key, members, self._plan)
        if not len(plan.params):  # a bucket of parameters without statistics
            return
        table = self._table(plan, self._counts)
        if not src.is_contiguous():
            src = src.contiguous()
        self.kernels.pack_bucket(src.reshape(-1), table, self.arena, self._c, self._c if self.gbar == "local" else None,
                                 main=main)
        self._counts[plan.params] += 1
        self.stat_counters.launches += 1
        self.stat_counters.folded += main is not None

    def _new_step(self) -> None:
        """The first record after a step: nothing recorded yet."""
        self._counts[:] = 0
        self._stale = False
        self._started = self._finished = False
        self._captured.clear()

    def _plan_for(self, key: Hashable, members: Callable[[], list[tuple[int, int]]],
                  build: Callable[[list[tuple[int, int]]], BucketPlan]) -> BucketPlan:
        """The plan of bucket layout ``key`` (built once); at the step's first micro-step the loss
        scale, fixed until the step, and ``c``."""
        if self._stale:
            self._new_step()
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build(members())
        if not self._counts.any():
            self._scale = float(self.scaling.loss_scale())
            self._c = self.scaling.group_multiplier(self._scale)
        return plan

    def _table(self, plan: BucketPlan, counts: np.ndarray) -> BucketTable:
        """``plan``'s rows with each segment's accumulate flag: whether ``counts`` says its parameter
        was recorded this step (one table per pattern of flags, built once)."""
        seen = counts[plan.seg_param] > 0
        flags = b"\x01" if seen.all() else b"\x00" if not seen.any() else seen.tobytes()
        table = plan.tables.get(flags)
        if table is None:
            acc = np.broadcast_to(seen, (len(plan.rows),)).astype(np.int64)
            table = plan.tables[flags] = BucketTable(torch.from_numpy(np.column_stack([plan.rows, acc])))
            self.stat_counters.tables_built += 1
        return table

    def _plan(self, members: list[tuple[int, int]]) -> BucketPlan:
        rows, seg_param = [], []
        for idx, start in members:
            for rel, g, q, n in self._dests[idx]:
                rows.append((start + rel, g, q, n))
                seg_param.append(idx)
        params = np.unique(np.asarray([i for i, _ in members], dtype=np.int64))
        if len(params) != len(members):
            raise RuntimeError("a bucket lists a parameter twice")
        return BucketPlan(np.asarray(rows, dtype=np.int64).reshape(-1, 4), np.asarray(seg_param, dtype=np.int64), params)

    # -- engine side -----------------------------------------------------------------------------

    @property
    def n(self) -> int:
        """The step's gradient groups. Where the optimizer's ``step``/``zero_grad`` end the step
        (``reset_ends_step``: DDP), 0 once it has ended until the next micro-step is recorded, as
        the hook source's count after ``reset``, so that a second ``step()`` with no backward is
        refused; where the engine ends it (DeepSpeed, Megatron), the ended step's count until then."""
        if self._stale and self.reset_ends_step:
            return 0
        local = self._n_local if self._started else (int(self._counts.max()) if len(self._counts) else 0)
        return self.world * local

    def start(self) -> None:
        """The engine's step begins: every micro-step is in; launch the step's collective(s)."""
        if self._started or self._stale:
            return
        self._n_local = int(self._counts.max()) if len(self._counts) else 0
        arena = self.arena
        if self.count_slot is not None:
            self._verify_count()  # the last step's, read back by now
            g, sq = self.count_slot.bucket.halves()
            slot = self.count_slot.slot
            # summed over the ranks by the step's collective
            g.narrow(0, slot, 1).fill_(float(self._n_local))
            sq.narrow(0, slot, 1).fill_(float(self._n_local) ** 2)
        for idx in np.flatnonzero(self._counts == 0).tolist():  # no gradient this step: old sums must not count
            for _, g, q, n in self._dests[idx]:
                arena.narrow(0, q, n).zero_()
                if self.gbar == "local":
                    arena.narrow(0, g, n).zero_()
        for bucket in self.stat_buckets:
            bucket.start()
        self._started = True

    def launch(self, local: Tensor, out: Tensor, group: Any, scatter: bool, dtype: torch.dtype,
               grad_elems: int) -> list[Any]:
        """A bucket's collective through this source's communication module and counters."""
        return launch(self.comm, self.counters, local, out, group, scatter, dtype, grad_elems)

    def capture(self, target: Tensor, grad: Tensor) -> None:
        """``gbar="engine"``: the gradient the engine reduced for ``target``, still loss-scaled and
        unclipped (read just before the engine unscales and clips it), as ``Σg`` (``Scaling.sum_g_factor``:
        ``world · accumulation · g / S`` on DeepSpeed, which is ``n · g / S`` when every micro-step of
        the accumulation ran)."""
        if self.gbar != "engine" or id(target) not in self._targets:
            return
        factor = self.scaling.sum_g_factor(self._scale)
        g, sq = self._bufs.get(id(target), (None, None))
        if g is None or g.numel() != target.numel() or g is sq:
            g = torch.empty(target.numel(), dtype=torch.float32, device=target.device)
            self._bufs[id(target)] = (g, sq)
        torch.mul(grad.reshape(-1), factor, out=g)
        self._captured.add(id(target))

    def wait(self) -> None:
        """Waits for the step's collectives (and runs their completion steps)."""
        for bucket in self.stat_buckets:
            bucket.finish()
        if self.count_slot is not None and self._started:
            g, sq = self.count_slot.bucket.halves()
            slot = self.count_slot.slot
            total, squares = g.narrow(0, slot, 1), sq.narrow(0, slot, 1)
            if total.device.type == "cpu":
                self._count_check = (torch.cat([total, squares]), None, self._n_local)
                self._verify_count()
            else:  # read at the next step's start: copies behind the step's work, no wait for them now
                if self._count_host is None:  # one pinned buffer: a step's copy is read before the next one's
                    self._count_host = torch.empty(2, dtype=torch.float32, pin_memory=True)
                host = self._count_host
                host.narrow(0, 0, 1).copy_(total, non_blocking=True)
                host.narrow(0, 1, 1).copy_(squares, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._count_check = (host, event, self._n_local)

    def _verify_count(self) -> None:
        """``count_slot``: every rank counted as many gradient groups in the step as this one (``n``
        is the world size times this rank's count), else an error naming the fix. The sum of the
        counts alone passes a rank whose count is their mean (counts 1, 2, 3); with the sum of
        their squares, ``Σ(c - mine)² = Σc² - ranks·mine²`` once ``Σc = ranks·mine``, which is 0
        only where every count is this rank's, so every rank refuses (fp32 sums of counts and
        squares: exact up to 2^24)."""
        if self._count_check is None:
            return
        total, event, mine = self._count_check
        self._count_check = None
        if event is not None:
            event.synchronize()
        slot = self.count_slot
        (total, squares), expected = total.tolist(), slot.ranks * mine
        summed = abs(total - expected) <= max(0.5, expected * 2.0**-23)
        spread = squares - slot.ranks * mine * mine  # Σ(c - mine)² where the sum agrees
        if not summed or abs(spread) > max(0.5, squares * 2.0**-23):
            raise RuntimeError(f"vrgd_ds: this rank ran {mine} {slot.counted} in an optimizer step, the {slot.ranks} "
                               f"ranks {total:.0f} together{'' if not summed else ', not ' + str(mine) + ' each'}: "
                               f"{slot.fix}")

    def agree_on_count(self) -> None:
        """A step about to be refused for too few gradient groups: where the step's collective
        carries the ranks' counts (``count_slot``), it runs first and the counts are read back now,
        so that ranks whose counts differ (one whose micro-steps reached no parameter of a GSNR
        group, counting none) refuse together, naming the counts, where this rank would have
        refused alone and the others waited in the collective."""
        if self.count_slot is None:
            return
        if self._stale:  # nothing recorded since the last step: this step's count is 0
            self._new_step()
        self._reduced()
        self._verify_count()

    def _reduced(self) -> None:
        """The step's collectives launched (where the engine has not: a caller that steps the
        optimizer directly) and waited for, once."""
        self.start()
        if not self._finished:
            self.wait()
            self._finished = True

    def moments(self, params) -> tuple[list[Tensor], list[Tensor]]:
        self._reduced()
        params = list(params)
        for p in params:
            if id(p) in self._targets and id(p) not in self._bufs:  # no bucket covers it: nothing was recorded
                self._bufs[id(p)] = (torch.zeros(p.numel(), dtype=torch.float32, device=p.device),
                                     torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
            if self.gbar == "engine" and id(p) not in self._captured:
                # the engine did not unscale or clip (loss scale 1, no clipping): as reduced
                self.capture(p, p.grad)
        return moment_views(self._bufs, params)

    #: True where no engine wraps the step (DDP): the optimizer's reset ends the step
    reset_ends_step = False
    #: where each rank's count of the step's gradient groups is summed over the ranks by the step's
    #: collective (DDP, whose ranks may run any number of backward passes; HSDP's replicas)
    count_slot: CountSlot | None = None
    #: a tensor hook per parameter even where an engine bucket holds each micro-step (the
    #: engine paths read it when they choose)
    hooks_only = False

    def describe(self) -> str:
        """Where the micro-steps are read now, for the attach log line."""
        hooked = self.stat_counters.hooks
        if hooked == 0:
            return "micro-steps from the engine's buckets (no parameter hooks)"
        if hooked == len(self._dests):
            return f"micro-steps from {hooked} parameter hooks"
        return f"micro-steps from the engine's buckets and {hooked} parameter hooks"

    def reset(self) -> None:
        """The optimizer's end of step (and ``zero_grad``). Under DeepSpeed nothing (ZeRO calls it
        once per group or sub-group; the engine's step wrapper calls ``end_step``). Where it ends
        the step, only once something was recorded: a ``zero_grad`` between a step's first forward
        and its backward (``loss = model(x); opt.zero_grad(); loss.backward()``) keeps the step."""
        if self.reset_ends_step and self._recorded():
            self.end_step()

    def discard(self) -> None:
        """The gradients were zeroed without a step (Megatron's ``zero_grad_buffer``: an
        accumulation dropped): what was recorded since the last step is dropped with them."""
        if self._recorded():
            self.end_step()

    def ended_unrecorded(self) -> bool:
        """A step has ended and none of this rank's tensors recorded a micro-step since: statistics
        read now would be the ended step's (where the engine ends the step, ``n`` keeps its count)."""
        return self._stale and bool(self._dests)

    def _recorded(self) -> bool:
        """Whether this step has recorded a micro-step or launched its reduction."""
        return self._started or (not self._stale and bool(self._counts.any()))

    def end_step(self) -> None:
        """The engine's step is over (taken or skipped): the next micro-step starts afresh. A step
        the engine skipped (overflow, non-finite gradients) launched its collectives (``start``)
        but never read them: they are waited for here, since an in-place all-reduce still in flight
        (NCCL on its own stream) would land on the buffers the next micro-steps write."""
        if self._started and not self._finished:
            self.wait()
        self._stale = True
        self._started = self._finished = False
        self._passes.close()
        self._steps_ended += 1

    def fresh_step(self) -> int:
        """How many steps have ended: a value that changes when a new step begins."""
        return self._steps_ended

    def alias(self, target: Tensor, sum_g: Tensor | None, sum_sq: Tensor) -> None:
        """The statistics of ``target`` are these views (of a reduced bucket); ``sum_g=None``:
        captured from the engine (``gbar="engine"``)."""
        if sum_g is None:
            sum_g = torch.zeros(target.numel(), dtype=torch.float32, device=sum_sq.device)
        self._bufs[id(target)] = (sum_g, sum_sq)

    def moments_of(self, target: Tensor) -> tuple[Tensor, Tensor]:
        """``(Σg, Σg²)`` of ``target`` (flat), as ``alias`` set them."""
        return self._bufs[id(target)]

    def memory(self) -> dict[str, int]:
        """Bytes the statistics hold on this rank, by kind: ``local`` the buffers that mirror the
        model's gradients (full size), ``partition`` the sums the optimizer reads (shaped like its
        partition), ``transient`` what the step's reduction allocates for a while (``step_copy_bytes``)."""
        storages = {}  # the allocations behind the views the optimizer reads, each once
        for g, sq in self._bufs.values():
            for t in (g, sq):
                if t is not None and t.numel():
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        if self._arena is not None:
            storages.pop(self._arena.untyped_storage().data_ptr(), None)  # counted as local
        return {"local": self._size * 4, "partition": sum(storages.values()), "transient": self.step_copy_bytes}

    def buffer_bytes(self) -> int:
        """Bytes of every buffer the statistics hold on this rank (``memory()``'s sum)."""
        return sum(self.memory().values())

    def remove(self) -> None:
        self.unhook()


__all__ = ["CountSlot", "LocalStats", "PAD", "StatsBucket", "StatCounters", "moment_buffers", "moment_views"]
