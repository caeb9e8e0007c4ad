"""The collectives that carry gradient statistics, and what they cost: one place for every
engine (DeepSpeed's paths in ``vrgd_ds/ds/``, torch DDP in ``vrgd_ds/ddp.py``).

* ``fused_all_reduce``: the per-micro-step scheme's ``[x | (c·x)²]`` all-reduce of one bucket
  (DeepSpeed stage 0 and ZeRO-1/2, the DDP communication hook).
* ``launch``: the per-step scheme's one collective per local buffer (all-reduce or
  reduce-scatter), asynchronous, waited for when the optimizer asks for the moments.
* ``CommCounters``: what a source sent, against the fp32 gradient its calls stand for.

The ``comm`` argument is ``deepspeed.comm`` or ``torch.distributed`` (the signatures used here
are common to both); nothing here imports either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class CommCounters:
    """What a statistics source sent (per rank), to check its cost: collectives, the bytes of
    their buffers, and the bytes the fp32 gradient they stand for takes."""

    collectives: int = 0
    bytes_sent: int = 0
    grad_bytes_fp32: int = 0

    def add(self, numel_grad: int, nbytes: int, calls: int = 1) -> None:
        self.collectives += calls
        self.bytes_sent += nbytes
        self.grad_bytes_fp32 += 4 * numel_grad


class Scratch:
    """Reusable fused buffers, one per dtype: a fresh multi-GB allocation per bucket would pay
    its page faults (CPU) or allocator traffic every time. For synchronous calls only (a buffer
    is reused by the next call)."""

    def __init__(self) -> None:
        self._bufs: dict[torch.dtype, Tensor] = {}

    def get(self, numel: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < numel or buf.device != device:
            buf = self._bufs[dtype] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel]


SCRATCH = Scratch()


def fused_all_reduce(comm: Any, flat: Tensor, c: float, group: Any, counters: CommCounters, kernels: Any,
                     squares_dtype: torch.dtype = torch.float32,
                     scratch: Scratch | None = SCRATCH) -> tuple[Tensor, Tensor, list[Any]]:
    """``(Σ_r x_r, Σ_r (c·x_r)², works)`` for this rank's flat local values ``x``.

    fp32 squares: one all-reduce of ``[x | (c·x)²]``, formed in one pass (``Kernels.pack_squares``:
    cast, scale and square together). bf16 squares: a collective cannot mix dtypes, so the fp32
    ``x`` and the bf16 squares go as two all-reduces issued together (on NCCL they queue back to
    back on one stream) — half the extra bytes, one more call. Squares are formed in fp32 and
    rounded once to bf16 (8-bit mantissa: relative error <= 2^-9 per element before the sum).

    ``scratch``: shared buffers (the results are views of them: use them before the next call),
    or ``None`` for fresh ones (calls in flight together, as DDP's buckets are). The collectives
    are launched asynchronously: the sums are complete once every one of ``works`` has finished,
    and the squares are in ``squares_dtype`` (``.float()`` after waiting for bf16)."""
    n = flat.numel()

    def buf(numel: int, dtype: torch.dtype = torch.float32) -> Tensor:
        if scratch is None:
            return torch.empty(numel, dtype=dtype, device=flat.device)
        return scratch.get(numel, flat.device, dtype)

    if squares_dtype == torch.float32:
        both = buf(2 * n)
        kernels.pack_squares(flat.view(-1), both[:n], both[n:], c)  # one pass: [x | (c x)²]
        counters.add(n, both.numel() * both.element_size())
        return both[:n], both[n:], [comm.all_reduce(both, group=group, async_op=True)]
    g = buf(n)
    sq32 = buf(n, torch.float64).view(torch.float32)[:n]  # fp32 squares before rounding
    kernels.pack_squares(flat.view(-1), g, sq32, c)
    sq = buf(n, squares_dtype)
    sq.copy_(sq32)  # one rounding to bf16
    counters.add(n, g.numel() * g.element_size() + sq.numel() * sq.element_size(), calls=2)
    return g, sq, [comm.all_reduce(g, group=group, async_op=True), comm.all_reduce(sq, group=group, async_op=True)]


def fused_all_reduce_sync(comm: Any, flat: Tensor, c: float, group: Any, counters: CommCounters, kernels: Any,
                          squares_dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """``fused_all_reduce`` waited for: both sums in fp32, views of the shared scratch buffers."""
    g, sq, works = fused_all_reduce(comm, flat, c, group, counters, kernels, squares_dtype)
    for w in works:
        w.wait()
    return g, sq if sq.dtype == torch.float32 else sq.float()


def reduce_scatter(comm: Any, out: Tensor, inp: Tensor, group: Any, async_op: bool = True) -> Any:
    """``out`` = this rank's part of the sum of ``inp`` over ``group``. torch 2.13 names it
    ``reduce_scatter_single`` and deprecates ``reduce_scatter_tensor`` (a FutureWarning per call
    site, which deepspeed.comm 0.19.8 still calls): the current name wherever torch has it."""
    fn = getattr(comm, "reduce_scatter_single", None) or getattr(torch.distributed, "reduce_scatter_single", None)
    if fn is None:
        fn = comm.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def all_gather(comm: Any, out: Tensor, inp: Tensor, group: Any, async_op: bool = False) -> Any:
    """``out`` = ``inp`` of every rank of ``group``, in rank order (``all_gather_single`` where
    torch has it, as ``reduce_scatter`` above)."""
    fn = getattr(comm, "all_gather_single", None) or getattr(torch.distributed, "all_gather_single", None)
    if fn is None:
        fn = comm.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def all_reduce(comm: Any, t: Tensor, group: Any, async_op: bool = True) -> Any:
    return comm.all_reduce(t, group=group, async_op=async_op)


def launch(comm: Any, counters: CommCounters, local: Tensor, out: Tensor, group: Any, scatter: bool,
           dtype: torch.dtype, grad_elems: int) -> list[Any]:
    """Launches the sum of ``local`` over the group into ``out``: this rank's part of it when
    ``scatter`` (a reduce-scatter), else all of it (an all-reduce; ``out`` may be ``local``),
    travelling in ``dtype``. Returns what the caller waits on or runs, in order. The counters
    measure bytes against the fp32 gradient, ``grad_elems`` elements of which the call stands for."""
    wire = local if dtype == local.dtype else local.to(dtype)
    if scatter:
        dest = out if wire.dtype == out.dtype else torch.empty(out.numel(), dtype=wire.dtype, device=out.device)
        work = reduce_scatter(comm, dest, wire, group)
    else:
        dest = wire
        work = all_reduce(comm, wire, group)
    counters.add(grad_elems, wire.numel() * wire.element_size())
    return [work] if dest is out else [work, lambda: out.copy_(dest)]


__all__ = ["CommCounters", "Scratch", "SCRATCH", "all_reduce", "fused_all_reduce", "fused_all_reduce_sync", "launch",
           "reduce_scatter"]
