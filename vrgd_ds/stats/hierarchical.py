"""The hierarchical scheme of the per-step statistics (``"vrgd": {"squares": "hierarchical"}``):
reduced within the node at every micro-step, across nodes once per step, so that no rank holds a
full-size buffer (docs/design.md §3).

Ranks are grouped into nodes of ``L`` consecutive ranks (those that share a host; ``k = N·L``
ranks in all). A ZeRO-1/2 param group's flat gradient is cut into ``k`` partitions (ZeRO-3 cuts
each tensor into ``k`` pieces instead: ``NodeStats.place_flat``'s ``period``), rank
``r = j·L + l`` (node ``j``, local rank ``l``) owning partition ``P_r``. Local rank ``l`` of every
node keeps the node's sums for the partitions its cross-node peers own, ``S_l = P_l ∪ P_{L+l} ∪
… ∪ P_{(N-1)·L+l}``: ``1/L`` of the flat group, laid out as ``N`` blocks (``[Σg | Σg²]`` per
block with ``gbar`` local, so one collective carries both).

* **Every micro-step, per engine bucket**: one ``pack_bucket`` launch writes the bucket's scaled
  gradients and squares into a transient buffer cut into ``L`` equal chunks, chunk ``l`` holding
  the bucket's elements of ``S_l``; one reduce-scatter over the node's ranks (NVLink on a real
  node) hands local rank ``l`` the node's sum of chunk ``l``; one ``unpack_bucket`` launch adds it
  into the node buffer. Two launches and one intra-node collective per bucket, whatever the
  number of tensors in it (the bucket's tables are built once per bucket layout).
* **Once per step**: one reduce-scatter of each node buffer over the ranks with the same local
  rank (one per node: the InfiniBand part) leaves each rank the sums over all ranks of its own
  partition, ``[Σg | Σg²]``, shaped like the flat partition its optimizer updates.

``n`` = ranks × micro-steps, as with ``per_step``. Memory per rank: the node buffers (``1/L`` of
``per_step``'s full-size buffer), the transient bucket buffer (``L`` chunks, each as long as the
largest local rank's share of the bucket, twice with ``gbar`` local: one bucket where its elements
spread evenly over the local ranks, up to ``L`` buckets where one local rank owns nearly all of
them, as where a partition is longer than a bucket; kept between micro-steps), and the reduced
partition. Bytes into collectives per rank: per micro-step that buffer within the node (about one
bucket's fp32 statistics where evenly spread), per step ``1/L`` of the flat group's across nodes;
what leaves a node per step equals ``per_step``'s (``(N − 1)/N`` of the flat group's statistics per
node, the bandwidth-optimal volume of both).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np
import torch
from torch import Tensor

from vrgd_ds.optim.columns import BucketTable
from vrgd_ds.stats.comm import all_gather, all_reduce, reduce_scatter
from vrgd_ds.stats.local import PAD, BucketPlan, LocalStats
from vrgd_ds.stats.scaling import Scaling


def _pad(n: int) -> int:
    return -(-n // PAD) * PAD


@dataclass(frozen=True)
class Nodes:
    """This rank's place among the nodes and the two kinds of groups the scheme reduces over."""

    size: int  # ranks per node, L
    count: int  # nodes, N
    node: int  # this rank's node, j
    local: int  # this rank's index in its node, l
    intra: Any  # the group of this node's ranks
    cross: Any  # the group of the ranks with this local index, one per node


#: the launchers' ranks-per-host variables: torchrun, DeepSpeed's launcher, Open MPI's mpirun
LOCAL_SIZE_ENV = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def host_node_size(group: Any, world: int) -> int:
    """The ranks per node of ``group`` (``world`` ranks): those that share a host, which must be
    consecutive and as many on every host, checked against the launcher's local world size where
    it sets one (``LOCAL_SIZE_ENV``). One gather of every rank's host and launcher value: each
    rank judges from the same view, so a refusal is every rank's."""
    import os
    import socket
    from collections import Counter

    import torch.distributed

    # as set: read after the gather, on every rank alike (one rank failing to parse it alone would
    # leave the others in the next collective)
    local = next(((name, os.environ[name]) for name in LOCAL_SIZE_ENV if name in os.environ), None)
    seen: list[Any] = [None] * world
    torch.distributed.all_gather_object(seen, (socket.gethostname(), local), group=group)
    hosts = [host for host, _ in seen]
    counts = Counter(hosts)
    if len(set(counts.values())) > 1:
        raise ValueError("the hosts hold unequally many ranks ("
                         + ", ".join(f"{host}: {n}" for host, n in counts.items()) + ")")
    size = counts[hosts[0]]
    if any(hosts[r] != hosts[(r // size) * size] for r in range(world)):
        raise ValueError(f"the ranks of each host are not consecutive ({', '.join(hosts)})")
    for host, value in seen:
        if value is not None and (not value[1].strip().isdigit() or int(value[1]) != size):
            raise ValueError(f"the launcher's {value[0]}={value[1]} disagrees with the {size} rank(s) found on "
                             f"each host (on {host})")
    return size


#: (world, rank, node size) -> the groups ``node_groups`` made for it, reused by every later attach
#: in the process while they live (a backend's group holds threads and, on NCCL, communicators)
_NODES: dict[tuple[int, int, int], Nodes] = {}


def _alive(nodes: Nodes, world: int, size: int) -> bool:
    """Whether ``nodes``' two groups are still registered with their ranks (neither the group nor
    the default one destroyed since: ``destroy_process_group`` unregisters them)."""
    import torch.distributed

    try:
        intra = torch.distributed.get_process_group_ranks(nodes.intra)
        cross = torch.distributed.get_process_group_ranks(nodes.cross)
    except (KeyError, ValueError, RuntimeError):
        return False
    return (intra == list(range(nodes.node * size, (nodes.node + 1) * size))
            and cross == list(range(nodes.local, world, size)))


def node_groups(comm: Any, world: int, rank: int, size: int) -> Nodes:
    """The groups of a world of ``world`` ranks in nodes of ``size`` consecutive ranks. Every rank
    creates every group (``new_group`` is collective), in the same order; a later attach with the
    same world and node size reuses them while they live (``_NODES``), on every rank alike."""
    if size < 1 or world % size:
        raise ValueError(f"a node size of {size} does not divide the {world} ranks")
    key = (world, rank, size)
    cached = _NODES.get(key)
    if cached is not None and _alive(cached, world, size):
        return cached
    count = world // size
    intra = cross = None
    for j in range(count):
        g = comm.new_group(list(range(j * size, (j + 1) * size)))
        if j == rank // size:
            intra = g
    for local in range(size):
        g = comm.new_group(list(range(local, world, size)))
        if local == rank % size:
            cross = g
    _NODES[key] = Nodes(size, count, rank // size, rank % size, intra, cross)
    return _NODES[key]


@dataclass
class NodeBucket:
    """One reduction of the hierarchical scheme (a ZeRO-1/2 param group, a ZeRO-3 sub-group, a
    Megatron bucket): the node buffer of this rank's local index, in ``N`` blocks of ``[Σg | Σg²]``
    (or ``Σg²``), and the reduced partition."""

    base: int  # offset of the node buffer in the source's allocation
    numel: int  # the flat group, k partitions
    part: int  # one partition, P
    padded: int  # P rounded up to PAD
    with_g: bool
    group: Any = None  # the cross-node group
    out: Tensor | None = None  # [Σg | Σg²] (or Σg²) of this rank's partition
    members: list[int] = field(default_factory=list)
    blocks: int = 1  # N blocks in the node buffer; 1 when replicated
    replicated: bool = False  # stage 0: every rank reads every sum (below)
    intra: Any = None  # replicated: the node's group, which gathers the node buffers

    @property
    def width(self) -> int:
        return (2 if self.with_g else 1) * self.padded

    @property
    def shift(self) -> int:
        return self.padded if self.with_g else 0


class NodeStats(LocalStats):
    """The statistics of the hierarchical scheme (a ``StatisticsSource``): ``LocalStats``' counts,
    ``n``, ``gbar`` capture and step protocol, with the node buffers and the two-level reduction
    of the module docstring in place of full-size buffers. fp32 squares only (the
    intra-node reduce-scatter carries ``[Σg | Σg²]`` chunks in one dtype)."""

    def __init__(self, comm: Any, kernels: Any, scaling: Scaling, targets: list[Tensor], gbar: str,
                 nodes: Nodes) -> None:
        super().__init__(comm, kernels, scaling, targets, gbar, torch.float32)
        self.nodes = nodes
        self.node_buckets: list[NodeBucket] = []
        # per parameter: its bucket, and where its elements lie: element e is at x = start + e, in
        # partition x // period at offset base + x % period of that partition
        self._where: list[tuple[NodeBucket, int, int, int, int]] = []
        self._unpacked = np.zeros(0, dtype=np.int64)  # per parameter: reductions unpacked this step
        self._scratch: Tensor | None = None
        self._recv: Tensor | None = None
        self.intra_bytes = 0  # input bytes of the collectives within the node, and their number
        self.intra_calls = 0
        self.inter_bytes = 0

    # -- set-up ------------------------------------------------------------------------------------

    def add_node_bucket(self, numel: int, device: torch.device, replicated: bool = False) -> NodeBucket:
        """The reduction of one flat group of ``numel`` elements (k partitions); returns it with
        ``out`` allocated, whose halves the optimizer's statistics alias. ``replicated`` (stage 0,
        where every rank steps every parameter): the group is cut into ``L`` partitions, one per
        local rank, each kept whole by that local rank of every node (one block); at the step an
        all-reduce across nodes, then an all-gather within the node (NVLink) of each half, so
        ``out`` is the whole group's ``[Σg | Σg²]`` on every rank. ``numel`` a multiple of
        ``L · PAD`` then, so the gathered halves have no gaps."""
        if self._arena is not None:
            raise RuntimeError("statistics buckets are added before the first micro-step")
        L = self.nodes.size
        k = L if replicated else self.world
        if numel % k or (replicated and (numel // k) % PAD):
            raise ValueError(f"a flat group of {numel} elements is not {k} equal partitions"
                             + (f" of a multiple of {PAD}" if replicated else ""))
        self._device = device
        part = numel // k
        b = NodeBucket(self._size, numel, part, _pad(part), self.gbar == "local", group=self.nodes.cross,
                       blocks=1 if replicated else self.nodes.count, replicated=replicated, intra=self.nodes.intra)
        self._size += b.blocks * b.width
        b.out = torch.zeros((2 if b.with_g else 1) * numel if replicated else b.width, dtype=torch.float32,
                            device=device)
        self.node_buckets.append(b)
        return b

    def halves(self, b: NodeBucket) -> tuple[Tensor | None, Tensor]:
        """``(Σg, Σg²)`` of this rank's partition (replicated: of the whole group), once the
        step's reduction is done."""
        if b.replicated:  # out: [Σg | Σg²] over the group (padded == part there)
            n, shift = b.numel, b.numel if b.with_g else 0
        else:
            n, shift = b.part, b.shift
        g = b.out.narrow(0, 0, n) if b.with_g else None
        return g, b.out.narrow(0, shift, n)

    def place_flat(self, p: Tensor, b: NodeBucket, offset: int, numel: int, period: int | None = None,
                   base: int = 0) -> int:
        """``p`` is the flat elements ``[offset, offset + numel)`` of ``b``'s group (ZeRO-1/2: the
        group is cut into equal partitions). ``period`` (ZeRO-3, which cuts every tensor itself):
        element ``e`` of ``p`` lies in partition ``(offset + e) // period``, at ``base + (offset + e) %
        period`` inside it."""
        if id(p) in self._index:
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is placed twice in the statistics")
        idx = len(self._where)
        self._index[id(p)] = idx
        self._where.append((b, offset, numel, period or b.part, base))
        self._dests.append([])  # LocalStats' per-parameter rows: unused here
        self._counts = np.append(self._counts, 0)
        self._unpacked = np.append(self._unpacked, 0)
        b.members.append(idx)
        return idx

    def _pieces(self, idx: int):
        """``(start in the parameter, partition, offset in the partition, length)`` of each piece of
        parameter ``idx``, cut where a partition ends."""
        b, offset, numel, period, base = self._where[idx]
        x, end = offset, offset + numel
        while x < end:
            r, q = divmod(x, period)
            n = min(end, (r + 1) * period) - x
            yield x - offset, r, base + q, n
            x += n

    # -- every micro-step ---------------------------------------------------------------------------

    def record_bucket(self, key: Hashable, src: Tensor, members: Callable[[], list[tuple[int, int]]],
                      main: Tensor | None = None) -> None:
        if main is not None:
            raise ValueError("the hierarchical scheme does not fold into an engine's accumulation")
        plan = self._plan_for(key, members, self._node_plan)
        L, chunk = self.nodes.size, plan.chunk
        need = L * chunk
        if self._scratch is None or self._scratch.numel() < need or self._scratch.device != src.device:
            self._scratch = torch.empty(need, dtype=torch.float32, device=src.device)
            self._recv = torch.empty(need // L, dtype=torch.float32, device=src.device)
        if not src.is_contiguous():
            src = src.contiguous()
        scratch, recv = self._scratch.narrow(0, 0, need), self._recv.narrow(0, 0, chunk)
        with_g = self.gbar == "local"
        self.kernels.pack_bucket(src.reshape(-1), plan.pack, scratch, self._c, self._c if with_g else None)
        reduce_scatter(self.comm, recv, scratch, self.nodes.intra, async_op=False)
        self.intra_bytes += need * 4
        self.intra_calls += 1
        if plan.rows.shape[0]:
            table = self._table(plan, self._unpacked)
            self.kernels.unpack_bucket(recv, table, self.arena, plan.half if with_g else 0, with_g)
        self._counts[plan.params] += 1
        self._unpacked[plan.params] += 1
        self.stat_counters.launches += 2

    def _new_step(self) -> None:
        super()._new_step()
        self._unpacked[:] = 0

    def _node_plan(self, members: list[tuple[int, int]]) -> "_NodePlan":
        """A bucket's chunks: its elements cut by partition, each partition's elements to the chunk
        of the local index that owns it; this rank's chunk's elements to its node buffer."""
        L, me = self.nodes.size, self.nodes.local
        pieces, fill = [], [0] * L  # (source start, local index, position in its chunk, length, param, bucket, node, q)
        for idx, start in members:
            b = self._where[idx][0]
            for rel, r, q, n in self._pieces(idx):
                node, local = divmod(r, L)
                pieces.append((start + rel, local, fill[local], n, idx, b, node, q))
                fill[local] += n
        with_g = self.gbar == "local"
        half = _pad(max(fill, default=0))
        chunk = (2 if with_g else 1) * half
        pack = [(s, local * chunk + pos, local * chunk + (half if with_g else 0) + pos, n, 0)
                for s, local, pos, n, *_ in pieces]
        rows, seg_param = [], []
        for s, local, pos, n, idx, b, node, q in pieces:
            if local == me:
                g = b.base + node * b.width + q
                rows.append((pos, g, g + b.shift, n))
                seg_param.append(idx)
        params = np.unique(np.asarray([i for i, _ in members], dtype=np.int64))
        pack_table = BucketTable(torch.tensor(pack, dtype=torch.long).reshape(-1, 5))
        self.stat_counters.tables_built += 1
        return _NodePlan(np.asarray(rows, dtype=np.int64).reshape(-1, 4), np.asarray(seg_param, dtype=np.int64),
                         params, pack=pack_table, chunk=chunk, half=half)

    # -- once per step ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started or self._stale:
            return
        self._n_local = int(self._counts.max()) if len(self._counts) else 0
        arena, me = self.arena, self.nodes.local
        for idx in np.flatnonzero(self._unpacked == 0).tolist():  # nothing reduced this step: old sums must not count
            b = self._where[idx][0]
            for _, r, q, n in self._pieces(idx):
                node, local = divmod(r, self.nodes.size)
                if local == me:
                    g = b.base + node * b.width + q
                    arena.narrow(0, g + b.shift, n).zero_()
                    if b.with_g:
                        arena.narrow(0, g, n).zero_()
        self._works = []
        for b in self.node_buckets:
            local = arena.narrow(0, b.base, b.blocks * b.width)
            if b.replicated:
                self._works.append(all_reduce(self.comm, local, b.group))
            else:
                self._works.append(reduce_scatter(self.comm, b.out, local, b.group))
            self.inter_bytes += local.numel() * 4
            self.counters.add(b.numel, local.numel() * 4)
        self._started = True

    def _gather(self) -> None:
        """Replicated buckets: each half of this rank's reduced node buffer gathered over the node
        into ``out`` (two collectives with ``Σg``: ``out`` is ``[Σg | Σg²]`` over the group)."""
        for b in self.node_buckets:
            if not b.replicated:
                continue
            local = self.arena.narrow(0, b.base, b.width)
            for h in range(2 if b.with_g else 1):
                all_gather(self.comm, b.out.narrow(0, h * b.numel, b.numel), local.narrow(0, h * b.part, b.part),
                           b.intra)
                self.intra_bytes += b.part * 4
                self.intra_calls += 1

    def moments(self, params) -> tuple[list[Tensor], list[Tensor]]:
        self.start()
        if not self._finished:
            self.wait()
            self._gather()
            self._finished = True
        return super().moments(params)

    def wait(self) -> None:
        for w in self._works:
            if w is not None:
                w.wait()
        self._works = []

    def memory(self) -> dict[str, int]:
        """``local``: the node buffers (``1/node_size`` of the per-step scheme's full-size ones);
        ``partition``: the reduced partitions (and ``Σg`` captured from the engine); ``transient``:
        the bucket buffers (the largest bucket's chunks)."""
        part = sum(b.out.numel() * 4 for b in self.node_buckets)
        if self.gbar == "engine":
            part += sum(g.numel() * 4 for g, _ in self._bufs.values() if g is not None)
        transient = sum(0 if t is None else t.numel() * 4 for t in (self._scratch, self._recv))
        return {"local": self._size * 4, "partition": part, "transient": transient}

    def describe(self) -> str:
        n = self.nodes
        return (f"hierarchical over {n.count} node(s) of {n.size} rank(s): " + super().describe())


@dataclass
class _NodePlan(BucketPlan):
    """A bucket layout of the hierarchical scheme: ``BucketPlan``'s rows are this rank's unpack rows;
    ``pack`` writes the whole bucket into ``L`` chunks of ``chunk`` elements (``half`` apart
    between ``Σg`` and ``Σg²``)."""

    pack: BucketTable | None = None
    chunk: int = 0
    half: int = 0


__all__ = ["NodeBucket", "NodeStats", "Nodes", "host_node_size", "node_groups"]
