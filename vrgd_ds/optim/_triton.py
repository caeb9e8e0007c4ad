"""The VRGD family's step as Triton multi-tensor kernels: the implementation for CUDA
parameters (``fused=None``), and the same kernels on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how the tests compare them with the reference.

Shape (apex's ``multi_tensor_lamb``): one launch covers every tensor of a call. The work is
cut into *chunks* of at most ``CHUNK`` elements of one segment (a whole tensor in one process,
a piece of a ZeRO flat partition otherwise), listed in a device table; each program handles
one chunk and writes its partial sums to a ``[chunks, k]`` float64 buffer, which a second
kernel combines per segment **in chunk order** (one program per segment, a sequential loop):
results do not depend on scheduling. Tensors are reached through device tables of their
``data_ptr()``\\ s, cast to typed pointers inside the kernels.

Wide accesses. A chunk is walked as an aligned *body* of whole ``BLOCK``\\ s and a *rest* (the
few elements before the body and the tail after it). The body's pointers carry alignment
hints, so every fp32 stream moves 128 bits per access (64 for a bf16/fp16 parameter); the rest
is masked and scalar. The hints are true by construction: the host puts the body of a chunk
where every stream of its tensor is aligned to ``VEC`` elements (from the ``data_ptr()``\\ s, no
device read), and a tensor whose streams disagree (a view at an odd offset) gets no body —
never a wrong hint. ZeRO flat partitions cut at any element and tensors of any size go
through the same two loops.

No host synchronisation: the tables are built on the host from shapes and addresses only
(cached while the tensors are the same), copied to the device from pinned memory without
blocking; per-segment columns arrive as device float64 tables; the step's non-finite decision
arrives as a device flag ``found_inf`` that turns every store into a no-op (a skipped chunk
has zero length), as torch's fused AdamW takes ``found_inf``. Kernels return device tensors
and never read them back.

What can be launched is data: ``LAUNCHES`` lists, per kernel, every combination of
compile-time flags its launch site may pass and the launch options; ``Triton._launch`` refuses
anything else, and ``vrgd_ds.optim.triton_aot`` compiles exactly that list for A100 and H100
(no GPU needed) and reads registers, spills and access widths from the machine code.

Element-wise arithmetic follows the reference (``_impl.Reference``) op for op, in fp32, with
IEEE division and square root (``div_rn``, ``sqrt_rn``) and no FMA contraction on the GPU
(``enable_fp_fusion=False``), so only the order of summation differs. (Triton's interpreter
rounds fp32 -> bf16 by truncation; on the GPU the conversion rounds to nearest even.)
"""
import functools
import inspect
import itertools
import logging
import operator
import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from vrgd_ds.gsnr import R_MEAN_MIN
from vrgd_ds.optim import columns
from vrgd_ds.optim import metrics as metric_columns
from vrgd_ds.optim.columns import BOTH_MOMENTS, PLACEMENTS, UPDATE, BucketTable, KernelFailure

logger = logging.getLogger(__name__)

Tensors = Sequence[Tensor]

# Columns of the per-segment tables (columns.py); the Adam and LAMB tables get one more column
# computed on the device before the launch (lr / bc1, lr · trust). Module globals reach a
# compiled kernel only as tl.constexpr objects (an annotation is not enough).
_R_MEAN_MIN = tl.constexpr(R_MEAN_MIN)
_INV_MEAN = tl.constexpr(columns.index(columns.GSNR, "inv_mean"))
_LO = tl.constexpr(columns.index(columns.GSNR, "lo"))
_BC3 = tl.constexpr(columns.index(columns.GSNR, "bc3"))
_NORMS_W = tl.constexpr(len(columns.NORMS))
_SGD_LR_MULT = tl.constexpr(columns.index(columns.SGD, "lr_mult"))
_SGD_FIRST = tl.constexpr(columns.index(columns.SGD, "first"))
_SGD_W = tl.constexpr(len(columns.SGD))
_ADAM_BC1 = tl.constexpr(columns.index(columns.ADAM, "bc1"))
_ADAM_BC2S = tl.constexpr(columns.index(columns.ADAM, "bc2s"))
_ADAM_GRAD_MULT = tl.constexpr(columns.index(columns.ADAM, "grad_mult"))
_ADAM_STEP_SIZE = tl.constexpr(len(columns.ADAM))
_ADAM_W = tl.constexpr(len(columns.ADAM) + 1)
_LAMB_BC1 = tl.constexpr(columns.index(columns.LAMB_APPLY, "bc1"))
_LAMB_BC2S = tl.constexpr(columns.index(columns.LAMB_APPLY, "bc2s"))
_LAMB_TRUST = tl.constexpr(columns.index(columns.LAMB_APPLY, "trust"))
_LAMB_STEP = tl.constexpr(len(columns.LAMB_APPLY))
_LAMB_W = tl.constexpr(len(columns.LAMB_APPLY) + 1)
_SUMS_W = tl.constexpr(len(metric_columns.SUM_COLS))
_MAXS_W = tl.constexpr(len(metric_columns.MAX_COLS))
_TABLE_BLOCK = 128  # segments per iteration of the single-program table kernels

CHUNK = 1 << 16  # elements per program
BLOCK = 512  # elements per iteration inside a program: 4 per thread of 4 warps, one 128-bit access
HOOK_SPAN = 8 * BLOCK  # elements per program of the statistics hook (per tensor: enough programs to fill a GPU)
#: elements per program of ``pack_bucket``: an engine's bucket (DeepSpeed's default 5M elements) is
#: a launch of its own, so its programs must fill the GPU alone (1,221 of 4,096 elements, where
#: CHUNK would give 77 programs for 132 SMs)
PACK_CHUNK = 8 * BLOCK
VEC = 4  # elements per aligned access group: 128 bits of fp32
_VEC = tl.constexpr(VEC)
_ROW = tl.constexpr(6)  # chunk table row: tensor, start, length, segment, head, body blocks
_PACK_ROW = tl.constexpr(8)  # pack_bucket's chunk row: source, gradient, squares, length, accumulate, head, body,
#                              source aligned
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _kernel(fn):
    """``@triton.jit`` without value specialisation: Triton would otherwise compile another
    variant for an argument that happens to be 1, divisible by 16 or 16-byte aligned. Here the
    constexpr flags alone choose the code (``LAUNCHES``), and alignment is hinted where the
    host proved it."""
    params = inspect.signature(fn).parameters
    runtime = [n for n, p in params.items() if "constexpr" not in str(p.annotation)]
    return triton.jit(fn, do_not_specialize=runtime, do_not_specialize_on_alignment=runtime)


# ---- shared device helpers --------------------------------------------------------------------


@triton.jit
def _chunk(chunks, c, found):
    """(tensor, start, length, segment, head, body blocks) of chunk ``c``; all lengths 0 when
    ``found`` is set. The body is ``[start + head, start + head + blocks · BLOCK)``."""
    row = chunks + c * _ROW
    t = tl.load(row + 0)
    start = tl.load(row + 1)
    n = tl.load(row + 2)
    s = tl.load(row + 3)
    head = tl.load(row + 4)
    nblk = tl.load(row + 5)
    if found is not None:
        keep = 1 - (tl.load(found) != 0).to(tl.int64)
        n = n * keep
        head = head * keep
        nblk = nblk * keep
    return t, start, n, s, head, nblk


@triton.jit
def _body_idx(start, head, i, BLOCK: tl.constexpr):
    return start + head + i * BLOCK + tl.arange(0, BLOCK)


@triton.jit
def _rest_idx(start, n, head, nblk, off, BLOCK: tl.constexpr):
    """Indices and mask of the rest's ``off``-th block: the head, then the tail after the body."""
    rel = off + tl.arange(0, BLOCK)
    idx = start + rel + tl.where(rel < head, 0, nblk * BLOCK)
    return idx, rel < n - nblk * BLOCK


@triton.jit
def _at(PTR, idx, WIDE: tl.constexpr):
    """The element pointers; in the body, hinted aligned to VEC elements (true by construction)."""
    ptrs = PTR + idx
    if WIDE:
        ptrs = tl.multiple_of(ptrs, _VEC * (PTR.dtype.element_ty.primitive_bitwidth // 8))
    return ptrs


@triton.jit
def _ld(PTR, idx, m, WIDE: tl.constexpr):
    if WIDE:
        x = tl.load(_at(PTR, idx, True))
    else:
        x = tl.load(PTR + idx, mask=m, other=0.0)
    return x


@triton.jit
def _st(PTR, idx, x, m, WIDE: tl.constexpr):
    if WIDE:
        tl.store(_at(PTR, idx, True), x)
    else:
        tl.store(PTR + idx, x, mask=m)


@triton.jit
def _keep(x, m, WIDE: tl.constexpr):
    """``x`` where the element exists, else 0 (for the partial sums of the masked rest)."""
    if not WIDE:
        x = tl.where(m, x, 0.0)
    return x


@triton.jit
def _gsnr(sg, sq, inv_n, eps):
    """The GSNR of elements, the one place Triton computes it (docs/design.md §1): ``(s, ḡ², r)``
    with ḡ = Σg/n, s = Σg²/n, r = min(ḡ² / (max(s − ḡ², 0) + eps), 2^64) (``gsnr.R_MAX``); pass 1
    also sums s and ḡ²."""
    gbar = sg * inv_n
    s = sq * inv_n
    g2 = gbar * gbar
    var = tl.maximum(s - g2, 0.0)
    return s, g2, tl.minimum(tl.div_rn(g2, var + eps), 18446744073709551616.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _gsnr_raw(sg, sq, inv_n, eps):
    return _gsnr(sg, sq, inv_n, eps)[2]


@triton.jit
def _clamp_unit(x, lo):
    """Every GSNR scale is clamped to [lo, 1]; a NaN stays NaN, as in the reference and the C++
    kernels (Triton's default maximum/minimum return the other operand)."""
    return tl.minimum(tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), 1.0,
                      propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _p_hat(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, b3, omb3, ON: tl.constexpr, EMA: tl.constexpr,
           WRITE: tl.constexpr, WIDE: tl.constexpr):
    """The GSNR scale p̂ of elements ``idx`` (the reference's ``_Gsnr.__call__``) and the
    indicators of r_t raised to lo / cut to 1. ``SG``/``SQ``/``AVG``: typed base pointers."""
    if ON:
        x = _gsnr_raw(_ld(SG, idx, m, WIDE), _ld(SQ, idx, m, WIDE), inv_n, eps) * inv_mean
        low = _keep(tl.where(x < lo, 1.0, 0.0), m, WIDE)
        high = _keep(tl.where(x > 1.0, 1.0, 0.0), m, WIDE)
        r = _clamp_unit(x, lo)
        if EMA:
            a = _ld(AVG, idx, m, WIDE) * b3 + r * omb3
            if WRITE:
                _st(AVG, idx, a, m, WIDE)
            r = _clamp_unit(tl.div_rn(a, bc3), lo)
    else:
        r = tl.full(idx.shape, 1.0, tl.float32)
        low = tl.zeros(idx.shape, tl.float32)
        high = tl.zeros(idx.shape, tl.float32)
    return r, low, high


@triton.jit
def _p_hat_written(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, ON: tl.constexpr, EMA: tl.constexpr,
                   WIDE: tl.constexpr):
    """p̂ once ``_p_hat(WRITE=True)`` ran this step: the GSNR momentum is read back."""
    if ON:
        if EMA:
            r = _clamp_unit(tl.div_rn(_ld(AVG, idx, m, WIDE), bc3), lo)
        else:
            r = _clamp_unit(_gsnr_raw(_ld(SG, idx, m, WIDE), _ld(SQ, idx, m, WIDE), inv_n, eps) * inv_mean, lo)
    else:
        r = tl.full(idx.shape, 1.0, tl.float32)
    return r


@triton.jit
def _ptr(table, t, DT: tl.constexpr):
    return tl.load(table + t).to(tl.pointer_type(DT))


@triton.jit
def _seg_f(segf, s, j, K: tl.constexpr):
    return tl.load(segf + s * K + j).to(tl.float32)


@_kernel
def _combine(part: "*fp64", bounds: "*i64", out: "*fp64", K: tl.constexpr, NSUM: tl.constexpr, MINMAX: tl.constexpr,
             FORM: tl.constexpr):
    """Per segment ``s``: the partial rows of its chunks ``bounds[s]..bounds[s+1]`` combined in
    chunk order, in float64. Columns ``0..NSUM-1`` are summed; with ``MINMAX`` the next two are
    a minimum and a maximum. ``FORM`` writes the row as its caller reads it: 0 as combined;
    1 (pass 1's five columns, or six with the gradient's non-finite count) as ``gsnr_moments``' six,
    ``[Σr, min r, max r, Σs, Σḡ², non-finite]``;
    2 (one summed count) as a flag, 1.0 where it is positive; 3 (``scaled_grad_norms``' two sums)
    with a third column, 1.0 where the second is not finite."""
    s = tl.program_id(0)
    c0 = tl.load(bounds + s)
    c1 = tl.load(bounds + s + 1)
    if FORM == 1:
        sr = tl.zeros((), tl.float64)
        ss = tl.zeros((), tl.float64)
        sg = tl.zeros((), tl.float64)
        lo = tl.full((), float("inf"), tl.float64)
        hi = tl.full((), float("-inf"), tl.float64)
        nb = tl.zeros((), tl.float64)
        for c in range(c0, c1):
            row = part + c * K
            sr += tl.load(row + 0)
            ss += tl.load(row + 1)
            sg += tl.load(row + 2)
            lo = tl.minimum(lo, tl.load(row + 3))
            hi = tl.maximum(hi, tl.load(row + 4))
            if K == 6:
                nb += tl.load(row + 5)
        bad = (ss != ss) | (tl.abs(ss) == float("inf")) | (sg != sg) | (tl.abs(sg) == float("inf")) | (nb > 0)
        o = out + s * 6
        tl.store(o + 0, sr)
        tl.store(o + 1, lo)
        tl.store(o + 2, hi)
        tl.store(o + 3, ss)
        tl.store(o + 4, sg)
        tl.store(o + 5, tl.where(bad, 1.0, 0.0).to(tl.float64))
    elif FORM == 2:
        acc = tl.zeros((), tl.float64)
        for c in range(c0, c1):
            acc += tl.load(part + c * K)
        tl.store(out + s, tl.where(acc > 0, 1.0, 0.0).to(tl.float64))
    elif FORM == 3:
        a0 = tl.zeros((), tl.float64)
        a1 = tl.zeros((), tl.float64)
        for c in range(c0, c1):
            a0 += tl.load(part + c * K)
            a1 += tl.load(part + c * K + 1)
        tl.store(out + s * 3, a0)
        tl.store(out + s * 3 + 1, a1)
        tl.store(out + s * 3 + 2, tl.where((a1 != a1) | (tl.abs(a1) == float("inf")), 1.0, 0.0).to(tl.float64))
    else:
        for j in tl.static_range(NSUM):
            acc = tl.zeros((), tl.float64)
            for c in range(c0, c1):
                acc += tl.load(part + c * K + j)
            tl.store(out + s * K + j, acc)
        if MINMAX:
            lo = tl.full((), float("inf"), tl.float64)
            hi = tl.full((), float("-inf"), tl.float64)
            for c in range(c0, c1):
                lo = tl.minimum(lo, tl.load(part + c * K + NSUM))
                hi = tl.maximum(hi, tl.load(part + c * K + NSUM + 1))
            tl.store(out + s * K + NSUM, lo)
            tl.store(out + s * K + NSUM + 1, hi)


# ---- the step's per-segment tables: one program each, float64, the torch ops of the reference's ---
# tables (``functional.DeviceTables``) in the same order and roundings, so that a steady step's
# decision, counters, scales, bias corrections, trust ratios and metric rows cost two launches,
# not fifty small torch operations


@triton.jit
def _seg_idx(b, nseg, BLOCK: tl.constexpr):
    i = b + tl.arange(0, BLOCK)
    return i, i < nseg


@triton.jit
def _decide(flags, nflags, fstride, found, skipped, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """The step's skip decision, the largest of the flags (``torch.cat(flags).amax()``), stored in
    ``found`` and added to ``skipped`` (``COUNT``); returns what a counter advances by,
    ``(1.0 - found).float()``."""
    f = tl.zeros([BLOCK], tl.float64)
    for b in range(0, nflags, BLOCK):
        i, m = _seg_idx(b, nflags, BLOCK)
        f = tl.maximum(f, tl.load(flags + i * fstride, mask=m, other=0.0))
    fo = tl.max(f, axis=0)
    tl.store(found, fo)
    if COUNT:
        tl.store(skipped, tl.load(skipped) + fo)  # Recorder: skipped_device + found
    return (1.0 - fo).to(tl.float32)


@triton.jit
def _scales(sum_r, rstride, numel, bc3_powers, i, t, m, gamma, ON: tl.constexpr, EMA: tl.constexpr,
            BLOCK: tl.constexpr):
    """The GSNR columns of segments ``i`` (``gsnr.segment_scales`` and 1 - beta3 ** step from
    ``bc3_powers``, indexed by tensor ``t``): (inv_mean, lo, bc3), ones without GSNR."""
    one = tl.full([BLOCK], 1.0, tl.float64)
    if ON:
        mean = tl.load(sum_r + i * rstride, mask=m, other=1.0) / tl.load(numel + i, mask=m, other=1.0)
        informative = mean >= _R_MEAN_MIN
        inv_mean = tl.where(informative, 1.0 / mean, 0.0)  # mean.reciprocal()
        lo = tl.where(informative, gamma, 1.0)
        if EMA:
            bc3 = 1.0 - tl.load(bc3_powers + t, mask=m, other=0.0)
        else:
            bc3 = one
    else:
        inv_mean = one
        lo = one
        bc3 = one
    return inv_mean, lo, bc3


@triton.jit
def _store_gsnr(row, inv_mean, lo, bc3, m):
    """The three GSNR columns every kernel table starts with (``columns.GSNR``)."""
    tl.store(row + _INV_MEAN, inv_mean, mask=m)
    tl.store(row + _LO, lo, mask=m)
    tl.store(row + _BC3, bc3, mask=m)


@_kernel
def _adam_tables_kernel(flags: "*fp64", nflags: tl.int64, fstride: tl.int64, found: "*fp64", skipped: "*fp64",
                        counters: "*i64", ntensors: tl.int64, powers: "*fp64", pstride: tl.int64, tensor_of: "*i64",
                        sum_r: "*fp64", rstride: tl.int64, numel: "*fp64", mult: "*fp64", out: "*fp64",
                        nseg: tl.int64, gamma: tl.float64, lr: tl.float64, bc1_mult: tl.float64, ON: tl.constexpr,
                        EMA: tl.constexpr, BIAS: tl.constexpr, MULT: tl.constexpr, COUNT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """``Triton.adam_tables``; the torch expressions it follows are quoted beside each line."""
    added = _decide(flags, nflags, fstride, found, skipped, COUNT, BLOCK)
    for b in range(0, ntensors, BLOCK):
        i, m = _seg_idx(b, ntensors, BLOCK)
        cp = tl.load(counters + i, mask=m, other=0).to(tl.pointer_type(tl.float32))
        tl.store(cp, tl.load(cp, mask=m) + added, mask=m)  # torch._foreach_add_(counters, added)
    for b in range(0, nseg, BLOCK):
        i, m = _seg_idx(b, nseg, BLOCK)
        t = tl.load(tensor_of + i, mask=m, other=0)
        one = tl.full([BLOCK], 1.0, tl.float64)
        if BIAS:
            bc1 = 1.0 - tl.load(powers + t, mask=m, other=0.0)  # 1 - beta1 ** step
            bc2s = tl.sqrt(1.0 - tl.load(powers + pstride + t, mask=m, other=0.0))  # (1 - beta2 ** step).sqrt()
        else:
            bc1 = one
            bc2s = one
        bc1 = bc1 * bc1_mult  # grad_averaging=False: bc1 * (1 - beta1), else 1.0 (exact)
        inv_mean, lo, bc3 = _scales(sum_r, rstride, numel, powers + 2 * pstride, i, t, m, gamma, ON, EMA, BLOCK)
        if MULT:
            gm = one * tl.load(mult)  # ones() * mult
        else:
            gm = one
        row = out + i * _ADAM_W
        _store_gsnr(row, inv_mean, lo, bc3, m)
        tl.store(row + _ADAM_BC1, bc1, mask=m)
        tl.store(row + _ADAM_BC2S, bc2s, mask=m)
        tl.store(row + _ADAM_GRAD_MULT, gm, mask=m)
        tl.store(row + _ADAM_STEP_SIZE, lr * (1.0 / bc1), mask=m)  # lr / bc1 is reciprocal, then mul


@_kernel
def _finish_kernel(res: "*fp64", norms: "*fp64", nstride: tl.int64, table: "*fp64", sum_r: "*fp64",
                        rstride: tl.int64, numel: "*fp64", moments: "*fp64", keys: "*i64", length: "*fp64",
                        share: "*fp64", lamb: "*fp64", sums: "*fp64", maxs: "*fp64", nseg: tl.int64,
                        lr: tl.float64, min_coeff: tl.float64, max_coeff: tl.float64, K: tl.constexpr,
                        ON: tl.constexpr, TRUST: tl.constexpr, ADAPT: tl.constexpr, BLOCK: tl.constexpr):
    """``Triton.finish``: ``metrics.step_tables``' rows of the plan; ``TRUST`` 1: first LAMB's trust
    ratios (``lamb.trust_ratios``) and the ``lamb_apply`` table; 2: the trust ratios given as
    ``[trust, adapted]`` rows in ``norms`` (LARS, ``lars_trust``); 0: none."""
    C: tl.constexpr = K - 3  # the clip counts and Σ p̂ are the last three columns of adam_step's rows
    neg_inf = float("-inf")
    for b in range(0, nseg, BLOCK):
        i, m = _seg_idx(b, nseg, BLOCK)
        row = table + i * _ADAM_W
        if TRUST == 2:
            trust_col = tl.load(norms + i * nstride, mask=m, other=1.0)
            adapted_col = tl.load(norms + i * nstride + 1, mask=m, other=0.0)
        elif TRUST == 1:
            n0 = tl.sqrt(tl.load(norms + i * nstride, mask=m, other=1.0))  # sq_norms[:, :2].sqrt()
            n1 = tl.sqrt(tl.load(norms + i * nstride + 1, mask=m, other=1.0))
            if ADAPT:
                adapted = (n0 > 0) & (n1 > 0)
            else:
                adapted = (n0 > 0) & (n0 < 0)  # all False, a NaN norm too
            ratio = n0 / n1
            ratio = tl.where(ratio < min_coeff, min_coeff, ratio)  # .clamp(min_coeff, max_coeff): NaN stays NaN
            ratio = tl.where(ratio > max_coeff, max_coeff, ratio)
            trust = tl.where(adapted, ratio, 1.0)
            out = lamb + i * _LAMB_W
            _store_gsnr(out, tl.load(row + _INV_MEAN, mask=m), tl.load(row + _LO, mask=m), tl.load(row + _BC3, mask=m),
                        m)
            tl.store(out + _LAMB_BC1, tl.load(row + _ADAM_BC1, mask=m), mask=m)
            tl.store(out + _LAMB_BC2S, tl.load(row + _ADAM_BC2S, mask=m), mask=m)
            tl.store(out + _LAMB_TRUST, trust, mask=m)
            tl.store(out + _LAMB_STEP, lr * trust, mask=m)
            trust_col = trust
            adapted_col = adapted.to(tl.float64)
        else:
            trust_col = tl.full([BLOCK], neg_inf, tl.float64)
            adapted_col = trust_col
        k = tl.load(keys + i, mask=m, other=0)
        srow = sums + k * _SUMS_W
        mrow = maxs + k * _MAXS_W
        mom = moments + i * 6
        zero = tl.zeros([BLOCK], tl.float64)
        if ON:
            mean = tl.load(sum_r + i * rstride, mask=m, other=1.0) / tl.load(numel + i, mask=m, other=1.0)
            zero_info = tl.where(mean >= _R_MEAN_MIN, 0.0, tl.load(share + i, mask=m, other=0.0))
            sums_cols = (tl.load(mom + 0, mask=m), tl.load(length + i, mask=m), tl.load(mom + 3, mask=m),
                         tl.load(mom + 4, mask=m), tl.load(res + i * K + C, mask=m),
                         tl.load(res + i * K + C + 1, mask=m), zero_info, tl.load(res + i * K + C + 2, mask=m))
            neg_min = -tl.load(mom + 1, mask=m)
            max_r = tl.load(mom + 2, mask=m)
            flag = tl.full([BLOCK], 1.0, tl.float64)
        else:
            sums_cols = (zero, zero, zero, zero, zero, zero, zero, zero)
            neg_min = tl.full([BLOCK], neg_inf, tl.float64)
            max_r = neg_min
            flag = zero
        for j in tl.static_range(8):
            tl.store(srow + j, sums_cols[j], mask=m)
        tl.store(mrow + 0, neg_min, mask=m)
        tl.store(mrow + 1, max_r, mask=m)
        tl.store(mrow + 2, trust_col, mask=m)
        tl.store(mrow + 3, adapted_col, mask=m)
        tl.store(mrow + 4, flag, mask=m)
        tl.store(mrow + 5, zero + 1.0, mask=m)


@_kernel
def _sgd_tables_kernel(flags: "*fp64", nflags: tl.int64, fstride: tl.int64, found: "*fp64", skipped: "*fp64",
                       counters: "*i64", ntensors: tl.int64, powers: "*fp64", tensor_of: "*i64", sum_r: "*fp64",
                       rstride: tl.int64, numel: "*fp64", created: "*fp64", out: "*fp64", norms_out: "*fp64",
                       nseg: tl.int64, gamma: tl.float64, ON: tl.constexpr, EMA: tl.constexpr, MOM: tl.constexpr,
                       CREATED: tl.constexpr, NORMS: tl.constexpr, COUNT: tl.constexpr, BLOCK: tl.constexpr):
    """``Triton.sgd_tables``: as ``adam_tables`` for the SGD members (``sgd_step``'s table, with
    ``lr_mult`` 1 and the momentum buffer's ``first`` flag; ``NORMS``: the GSNR columns again as
    the ``scaled_grad_norms`` table LARS reads). ``first`` reads the counters before they are
    advanced, so the advance waits behind a barrier."""
    added = _decide(flags, nflags, fstride, found, skipped, COUNT, BLOCK)
    for b in range(0, nseg, BLOCK):
        i, m = _seg_idx(b, nseg, BLOCK)
        t = tl.load(tensor_of + i, mask=m, other=0)
        one = tl.full([BLOCK], 1.0, tl.float64)
        inv_mean, lo, bc3 = _scales(sum_r, rstride, numel, powers, i, t, m, gamma, ON, EMA, BLOCK)
        if MOM:  # (step_t <= 1).double(), step_t the advanced counter clamped to 1
            cp = tl.load(counters + t, mask=m, other=0).to(tl.pointer_type(tl.float32))
            step = tl.maximum((tl.load(cp, mask=m, other=0.0) + added).to(tl.float64), 1.0)
            first = tl.where(step <= 1.0, 1.0, 0.0)
            if CREATED:
                first = tl.maximum(tl.load(created + i, mask=m, other=0.0), first)
        else:
            first = one * 0.0
        row = out + i * _SGD_W
        _store_gsnr(row, inv_mean, lo, bc3, m)
        tl.store(row + _SGD_LR_MULT, one, mask=m)
        tl.store(row + _SGD_FIRST, first, mask=m)
        if NORMS:
            _store_gsnr(norms_out + i * _NORMS_W, inv_mean, lo, bc3, m)
    tl.debug_barrier()  # every counter read above before any is advanced
    for b in range(0, ntensors, BLOCK):
        i, m = _seg_idx(b, ntensors, BLOCK)
        cp = tl.load(counters + i, mask=m, other=0).to(tl.pointer_type(tl.float32))
        tl.store(cp, tl.load(cp, mask=m) + added, mask=m)


@_kernel
def _lars_trust_kernel(norms: "*fp64", nstride: tl.int64, table: "*fp64", trust: "*fp64", nseg: tl.int64,
                       weight_decay: tl.float64, eps: tl.float64, coefficient: tl.float64, lr: tl.float64,
                       ADAPT: tl.constexpr, CLIP: tl.constexpr, BLOCK: tl.constexpr):
    """``Triton.lars_trust``: LARS's local lr from whole-tensor ``[‖θ‖², ‖d‖²]`` rows into the
    ``sgd_step`` table's ``lr_mult`` column and ``[trust, adapted]`` rows for the metrics, as
    ``lars.lars_update`` computes them with torch operations (``local / lr`` a true division, as
    torch's on the CPU; torch on CUDA multiplies by the reciprocal of a Python scalar divisor)."""
    for b in range(0, nseg, BLOCK):
        i, m = _seg_idx(b, nseg, BLOCK)
        w = tl.sqrt(tl.load(norms + i * nstride, mask=m, other=1.0))
        u = tl.sqrt(tl.load(norms + i * nstride + 1, mask=m, other=1.0))
        adapted = (w > 0) & (u > 0) & ADAPT
        denom = tl.where(adapted, u + weight_decay * w + eps, 1.0)
        local = tl.where(adapted, coefficient * w / denom, 1.0)
        if CLIP:
            capped = local / lr
            local = tl.where(adapted, tl.where(capped > 1.0, 1.0, capped), local)  # .clamp(max=1.0)
        tl.store(table + i * _SGD_W + _SGD_LR_MULT, local, mask=m)
        tl.store(trust + i * 2, local, mask=m)
        tl.store(trust + i * 2 + 1, adapted.to(tl.float64), mask=m)


# ---- kernels: per element (one block of indices), then the chunk loops -----------------------------


@triton.jit
def _bad(X, idx, m, WIDE: tl.constexpr):
    x = _ld(X, idx, m, WIDE).to(tl.float32)
    return _keep(tl.where(x == x, tl.where(tl.abs(x) < float("inf"), 0.0, 1.0), 1.0), m, WIDE)


@triton.jit
def _moments_add(sg, sq, m, inv_n, eps, sr, ss, sgb, mn, mx, WIDE: tl.constexpr):
    """Pass 1's per-lane sums (Σr, Σs, Σḡ², min r, max r) with one block of statistics added."""
    s, g2, r = _gsnr(sg, sq, inv_n, eps)
    sr += _keep(r, m, WIDE)
    ss += s
    sgb += g2
    if WIDE:
        mn = tl.minimum(mn, r)
        mx = tl.maximum(mx, r)
    else:
        mn = tl.minimum(mn, tl.where(m, r, float("inf")))
        mx = tl.maximum(mx, tl.where(m, r, float("-inf")))
    return sr, ss, sgb, mn, mx


@triton.jit
def _moments_zero(BLOCK: tl.constexpr):
    """Pass 1's per-lane sums before the first block: Σr, Σs, Σḡ², min r, max r."""
    zero = tl.zeros([BLOCK], tl.float32)
    return zero, zero, zero, zero + float("inf"), zero - float("inf")


@triton.jit
def _moments_row(part, c, sr, ss, sgb, mn, mx, K: tl.constexpr = 5):
    row = part + c * K
    tl.store(row + 0, tl.sum(sr, axis=0).to(tl.float64))
    tl.store(row + 1, tl.sum(ss, axis=0).to(tl.float64))
    tl.store(row + 2, tl.sum(sgb, axis=0).to(tl.float64))
    tl.store(row + 3, tl.min(mn, axis=0).to(tl.float64))
    tl.store(row + 4, tl.max(mx, axis=0).to(tl.float64))


@_kernel
def _moments_kernel(SG_T: "*i64", SQ_T: "*i64", G_T: "*i64", chunks: "*i64", part: "*fp64", inv_n: tl.float32,
                    eps: tl.float32, GDT: tl.constexpr, CHECK: tl.constexpr, BLOCK: tl.constexpr):
    """Pass 1 over one chunk; with ``CHECK`` the same pass counts the gradient's non-finite
    elements too (a sixth column): one launch answers pass 1 and the step's non-finite check."""
    c = tl.program_id(0)
    t, start, n, s, head, nblk = _chunk(chunks, c, None)
    SG = _ptr(SG_T, t, tl.float32)
    SQ = _ptr(SQ_T, t, tl.float32)
    G = _ptr(G_T, t, GDT) if CHECK else SG
    sr, ss, sgb, mn, mx = _moments_zero(BLOCK)
    bad = tl.zeros([BLOCK], tl.float32)
    for i in range(nblk):
        idx = _body_idx(start, head, i, BLOCK)
        sr, ss, sgb, mn, mx = _moments_add(_ld(SG, idx, None, True), _ld(SQ, idx, None, True), None, inv_n, eps,
                                           sr, ss, sgb, mn, mx, True)
        if CHECK:
            bad += _bad(G, idx, None, True)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        idx, m = _rest_idx(start, n, head, nblk, off, BLOCK)
        sr, ss, sgb, mn, mx = _moments_add(_ld(SG, idx, m, False), _ld(SQ, idx, m, False), m, inv_n, eps,
                                           sr, ss, sgb, mn, mx, False)
        if CHECK:
            bad += _bad(G, idx, m, False)
    _moments_row(part, c, sr, ss, sgb, mn, mx, 6 if CHECK else 5)
    if CHECK:
        tl.store(part + c * 6 + 5, tl.sum(bad, axis=0).to(tl.float64))


@triton.jit
def _grad_norms_elems(P, G, SG, SQ, AVG, idx, m, inv_n, eps, b3, omb3, inv_mean, lo, bc3, pp, uu, ON: tl.constexpr,
                      EMA: tl.constexpr, WIDE: tl.constexpr):
    r, low, high = _p_hat(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, b3, omb3, ON, EMA, False, WIDE)
    p = _ld(P, idx, m, WIDE).to(tl.float32)
    g = _ld(G, idx, m, WIDE).to(tl.float32)
    u = r * g
    return pp + p * p, uu + u * u


@_kernel
def _grad_norms_kernel(P_T: "*i64", G_T: "*i64", SG_T: "*i64", SQ_T: "*i64", AVG_T: "*i64", chunks: "*i64",
                       segf: "*fp64", part: "*fp64", inv_n: tl.float32, eps: tl.float32, b3: tl.float32,
                       omb3: tl.float32, PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s, head, nblk = _chunk(chunks, c, None)
    P = _ptr(P_T, t, PDT)
    G = _ptr(G_T, t, PDT)
    SG = _ptr(SG_T, t, tl.float32) if ON else P
    SQ = _ptr(SQ_T, t, tl.float32) if ON else P
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else P
    inv_mean = _seg_f(segf, s, _INV_MEAN, _NORMS_W)
    lo = _seg_f(segf, s, _LO, _NORMS_W)
    bc3 = _seg_f(segf, s, _BC3, _NORMS_W)
    pp = tl.zeros([BLOCK], tl.float32)
    uu = tl.zeros([BLOCK], tl.float32)
    for i in range(nblk):
        idx = _body_idx(start, head, i, BLOCK)
        pp, uu = _grad_norms_elems(P, G, SG, SQ, AVG, idx, None, inv_n, eps, b3, omb3, inv_mean, lo, bc3, pp, uu,
                                   ON, EMA, True)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        idx, m = _rest_idx(start, n, head, nblk, off, BLOCK)
        pp, uu = _grad_norms_elems(P, G, SG, SQ, AVG, idx, m, inv_n, eps, b3, omb3, inv_mean, lo, bc3, pp, uu,
                                   ON, EMA, False)
    tl.store(part + c * 2 + 0, tl.sum(pp, axis=0).to(tl.float64))
    tl.store(part + c * 2 + 1, tl.sum(uu, axis=0).to(tl.float64))


@triton.jit
def _sgd_elems(P, G, B, SG, SQ, AVG, idx, m, inv_n, eps, b3, omb3, inv_mean, lo, bc3, mult, first, lr, wd, mu, omd,
               nlo, nhi, nsc, PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr, BUF: tl.constexpr,
               NESTEROV: tl.constexpr, WIDE: tl.constexpr):
    # p̂ first: its IEEE divisions call a subroutine, and values live across the calls would spill
    r, low, high = _p_hat(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, b3, omb3, ON, EMA, True, WIDE)
    pv = _ld(P, idx, m, WIDE).to(tl.float32)
    g = _ld(G, idx, m, WIDE).to(tl.float32)
    d = r * g
    d = d + wd * pv
    d = d * mult
    if BUF:
        bv = _ld(B, idx, m, WIDE)
        bv = tl.where(first, d, bv * mu + d * omd)
        _st(B, idx, bv, m, WIDE)
        if NESTEROV:
            d = d + bv * mu
        else:
            d = bv
    _st(P, idx, (pv - lr * d).to(PDT, fp_downcast_rounding="rtne"), m, WIDE)
    return nlo + low, nhi + high, nsc + _keep(r, m, WIDE)


@_kernel
def _sgd_kernel(P_T: "*i64", G_T: "*i64", B_T: "*i64", SG_T: "*i64", SQ_T: "*i64", AVG_T: "*i64", chunks: "*i64",
                segf: "*fp64", part: "*fp64", found: "*fp64", inv_n: tl.float32, eps: tl.float32, b3: tl.float32,
                omb3: tl.float32, lr: tl.float32, wd: tl.float32, mu: tl.float32, omd: tl.float32, PDT: tl.constexpr,
                ON: tl.constexpr, EMA: tl.constexpr, BUF: tl.constexpr, NESTEROV: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s, head, nblk = _chunk(chunks, c, found)
    P = _ptr(P_T, t, PDT)
    G = _ptr(G_T, t, PDT)
    B = _ptr(B_T, t, tl.float32) if BUF else P
    SG = _ptr(SG_T, t, tl.float32) if ON else P
    SQ = _ptr(SQ_T, t, tl.float32) if ON else P
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else P
    inv_mean = _seg_f(segf, s, _INV_MEAN, _SGD_W)
    lo = _seg_f(segf, s, _LO, _SGD_W)
    bc3 = _seg_f(segf, s, _BC3, _SGD_W)
    mult = _seg_f(segf, s, _SGD_LR_MULT, _SGD_W)
    first = _seg_f(segf, s, _SGD_FIRST, _SGD_W) != 0.0
    nlo = tl.zeros([BLOCK], tl.float32)
    nhi = tl.zeros([BLOCK], tl.float32)
    nsc = tl.zeros([BLOCK], tl.float32)
    for i in range(nblk):
        idx = _body_idx(start, head, i, BLOCK)
        nlo, nhi, nsc = _sgd_elems(P, G, B, SG, SQ, AVG, idx, None, inv_n, eps, b3, omb3, inv_mean, lo, bc3, mult,
                                   first, lr, wd, mu, omd, nlo, nhi, nsc, PDT, ON, EMA, BUF, NESTEROV, True)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        idx, m = _rest_idx(start, n, head, nblk, off, BLOCK)
        nlo, nhi, nsc = _sgd_elems(P, G, B, SG, SQ, AVG, idx, m, inv_n, eps, b3, omb3, inv_mean, lo, bc3, mult,
                                   first, lr, wd, mu, omd, nlo, nhi, nsc, PDT, ON, EMA, BUF, NESTEROV, False)
    tl.store(part + c * 3 + 0, tl.sum(nlo, axis=0).to(tl.float64))
    tl.store(part + c * 3 + 1, tl.sum(nhi, axis=0).to(tl.float64))
    tl.store(part + c * 3 + 2, tl.sum(nsc, axis=0).to(tl.float64))


@triton.jit
def _adam_elems(P, G, M, V, SG, SQ, AVG, idx, m, inv_n, eps_gsnr, b3, omb3, b1, omb1, b2, omb2, eps, wd, decay,
                inv_mean, lo, bc3, bc1, bc2s, mult, step_size, pp, uu, nlo, nhi, nsc, PDT: tl.constexpr,
                ON: tl.constexpr, EMA: tl.constexpr, APPLY: tl.constexpr, PLACE: tl.constexpr, WIDE: tl.constexpr):
    r, low, high = _p_hat(SG, SQ, AVG, idx, m, inv_n, eps_gsnr, inv_mean, lo, bc3, b3, omb3, ON, EMA, True,
                          WIDE)  # first: see _sgd_elems
    graw = _ld(G, idx, m, WIDE).to(tl.float32)
    if PLACE == 2:  # update
        gm = graw * mult
    else:
        gm = (r * graw) * mult
    if PLACE == 1:  # both moments
        gv = gm
    else:
        gv = graw * mult
    mv = _ld(M, idx, m, WIDE) * b1 + gm * omb1
    vv = _ld(V, idx, m, WIDE) * b2 + (gv * gv) * omb2
    _st(M, idx, mv, m, WIDE)
    _st(V, idx, vv, m, WIDE)
    denom = tl.div_rn(tl.sqrt_rn(vv), bc2s) + eps
    if APPLY:
        step = tl.div_rn(mv, denom)
        if PLACE == 2:
            step = r * step
        pv = _ld(P, idx, m, WIDE).to(tl.float32)  # after the divisions, as in _sgd_elems
        _st(P, idx, (pv * decay - step_size * step).to(PDT, fp_downcast_rounding="rtne"), m, WIDE)
    else:
        step = tl.div_rn(mv, bc1 * denom)
        if PLACE == 2:
            step = r * step
        pv = _ld(P, idx, m, WIDE).to(tl.float32)
        u = _keep(step + wd * pv, m, WIDE)
        pp += pv * pv
        uu += u * u
    return pp, uu, nlo + low, nhi + high, nsc + _keep(r, m, WIDE)


@_kernel
def _adam_kernel(P_T: "*i64", G_T: "*i64", M_T: "*i64", V_T: "*i64", SG_T: "*i64", SQ_T: "*i64", AVG_T: "*i64",
                 chunks: "*i64", segf: "*fp64", part: "*fp64", found: "*fp64", inv_n: tl.float32,
                 eps_gsnr: tl.float32, b3: tl.float32, omb3: tl.float32, b1: tl.float32, omb1: tl.float32,
                 b2: tl.float32, omb2: tl.float32, eps: tl.float32, wd: tl.float32, decay: tl.float32,
                 PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr, APPLY: tl.constexpr, PLACE: tl.constexpr,
                 BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s, head, nblk = _chunk(chunks, c, found)
    P = _ptr(P_T, t, PDT)
    G = _ptr(G_T, t, PDT)
    M = _ptr(M_T, t, tl.float32)
    V = _ptr(V_T, t, tl.float32)
    SG = _ptr(SG_T, t, tl.float32) if ON else M
    SQ = _ptr(SQ_T, t, tl.float32) if ON else M
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else M
    inv_mean = _seg_f(segf, s, _INV_MEAN, _ADAM_W)
    lo = _seg_f(segf, s, _LO, _ADAM_W)
    bc3 = _seg_f(segf, s, _BC3, _ADAM_W)
    bc1 = _seg_f(segf, s, _ADAM_BC1, _ADAM_W)
    bc2s = _seg_f(segf, s, _ADAM_BC2S, _ADAM_W)
    mult = _seg_f(segf, s, _ADAM_GRAD_MULT, _ADAM_W)
    step_size = _seg_f(segf, s, _ADAM_STEP_SIZE, _ADAM_W)  # lr / bc1 rounded once from float64
    pp = tl.zeros([BLOCK], tl.float32)
    uu = tl.zeros([BLOCK], tl.float32)
    nlo = tl.zeros([BLOCK], tl.float32)
    nhi = tl.zeros([BLOCK], tl.float32)
    nsc = tl.zeros([BLOCK], tl.float32)
    for i in range(nblk):
        idx = _body_idx(start, head, i, BLOCK)
        pp, uu, nlo, nhi, nsc = _adam_elems(
            P, G, M, V, SG, SQ, AVG, idx, None, inv_n, eps_gsnr, b3, omb3, b1, omb1, b2, omb2, eps, wd, decay, inv_mean,
            lo, bc3, bc1, bc2s, mult, step_size, pp, uu, nlo, nhi, nsc, PDT, ON, EMA, APPLY, PLACE, True)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        idx, m = _rest_idx(start, n, head, nblk, off, BLOCK)
        pp, uu, nlo, nhi, nsc = _adam_elems(
            P, G, M, V, SG, SQ, AVG, idx, m, inv_n, eps_gsnr, b3, omb3, b1, omb1, b2, omb2, eps, wd, decay, inv_mean,
            lo, bc3, bc1, bc2s, mult, step_size, pp, uu, nlo, nhi, nsc, PDT, ON, EMA, APPLY, PLACE, False)
    if APPLY:
        row = part + c * 3
        tl.store(row + 0, tl.sum(nlo, axis=0).to(tl.float64))
        tl.store(row + 1, tl.sum(nhi, axis=0).to(tl.float64))
        tl.store(row + 2, tl.sum(nsc, axis=0).to(tl.float64))
    else:
        row = part + c * 5
        tl.store(row + 0, tl.sum(pp, axis=0).to(tl.float64))
        tl.store(row + 1, tl.sum(uu, axis=0).to(tl.float64))
        tl.store(row + 2, tl.sum(nlo, axis=0).to(tl.float64))
        tl.store(row + 3, tl.sum(nhi, axis=0).to(tl.float64))
        tl.store(row + 4, tl.sum(nsc, axis=0).to(tl.float64))


@triton.jit
def _lamb_apply_elems(P, M, V, SG, SQ, AVG, idx, m, inv_n, eps_gsnr, eps, wd, inv_mean, lo, bc3, bc1, bc2s, step,
                      PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr, WIDE: tl.constexpr):
    pv = _ld(P, idx, m, WIDE).to(tl.float32)
    denom = tl.div_rn(tl.sqrt_rn(_ld(V, idx, m, WIDE)), bc2s) + eps
    adam = tl.div_rn(_ld(M, idx, m, WIDE), bc1 * denom)
    if ON:
        adam = _p_hat_written(SG, SQ, AVG, idx, m, inv_n, eps_gsnr, inv_mean, lo, bc3, ON, EMA, WIDE) * adam
    u = adam + wd * pv
    _st(P, idx, (pv - step * u).to(PDT, fp_downcast_rounding="rtne"), m, WIDE)


@_kernel
def _lamb_apply_kernel(P_T: "*i64", M_T: "*i64", V_T: "*i64", SG_T: "*i64", SQ_T: "*i64", AVG_T: "*i64",
                       chunks: "*i64", segf: "*fp64", found: "*fp64", inv_n: tl.float32, eps_gsnr: tl.float32,
                       eps: tl.float32, wd: tl.float32, PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr,
                       BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s, head, nblk = _chunk(chunks, c, found)
    P = _ptr(P_T, t, PDT)
    M = _ptr(M_T, t, tl.float32)
    V = _ptr(V_T, t, tl.float32)
    SG = _ptr(SG_T, t, tl.float32) if ON else M
    SQ = _ptr(SQ_T, t, tl.float32) if ON else M
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else M
    inv_mean = _seg_f(segf, s, _INV_MEAN, _LAMB_W)
    lo = _seg_f(segf, s, _LO, _LAMB_W)
    bc3 = _seg_f(segf, s, _BC3, _LAMB_W)
    bc1 = _seg_f(segf, s, _LAMB_BC1, _LAMB_W)
    bc2s = _seg_f(segf, s, _LAMB_BC2S, _LAMB_W)
    step = _seg_f(segf, s, _LAMB_STEP, _LAMB_W)  # lr * trust rounded once from float64
    for i in range(nblk):
        idx = _body_idx(start, head, i, BLOCK)
        _lamb_apply_elems(P, M, V, SG, SQ, AVG, idx, None, inv_n, eps_gsnr, eps, wd, inv_mean, lo, bc3, bc1, bc2s,
                          step, PDT, ON, EMA, True)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        idx, m = _rest_idx(start, n, head, nblk, off, BLOCK)
        _lamb_apply_elems(P, M, V, SG, SQ, AVG, idx, m, inv_n, eps_gsnr, eps, wd, inv_mean, lo, bc3, bc1, bc2s,
                          step, PDT, ON, EMA, False)


@_kernel
def _nonfinite_kernel(X_T: "*i64", chunks: "*i64", part: "*fp64", XDT: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s, head, nblk = _chunk(chunks, c, None)
    X = _ptr(X_T, t, XDT)
    bad = tl.zeros([BLOCK], tl.float32)
    for i in range(nblk):
        bad += _bad(X, _body_idx(start, head, i, BLOCK), None, True)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        idx, m = _rest_idx(start, n, head, nblk, off, BLOCK)
        bad += _bad(X, idx, m, False)
    tl.store(part + c, tl.sum(bad, axis=0).to(tl.float64))


# ---- hook kernels: one tensor, one block per program; the last (partial) block masked ----------------


@triton.jit
def _pack_elems(X, G, SQ, idx, m, c, WITH_G: tl.constexpr, ACCUMULATE: tl.constexpr, WIDE: tl.constexpr):
    x = _ld(X, idx, m, WIDE).to(tl.float32)
    w = x * c
    if ACCUMULATE:
        if WITH_G:
            _st(G, idx, _ld(G, idx, m, WIDE) + x, m, WIDE)
        _st(SQ, idx, _ld(SQ, idx, m, WIDE) + w * w, m, WIDE)
    else:
        if WITH_G:
            _st(G, idx, x, m, WIDE)
        _st(SQ, idx, w * w, m, WIDE)


@_kernel
def _pack_squares_kernel(x: tl.int64, G: "*fp32", SQ: "*fp32", numel: tl.int64, c: tl.float32, XDT: tl.constexpr,
                         WITH_G: tl.constexpr, ACCUMULATE: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    X = x.to(tl.pointer_type(XDT))
    b = tl.program_id(0).to(tl.int64)
    idx = b * BLOCK + tl.arange(0, BLOCK)
    if ALIGNED:
        if (b + 1) * BLOCK <= numel:
            _pack_elems(X, G, SQ, idx, None, c, WITH_G, ACCUMULATE, True)
        else:
            _pack_elems(X, G, SQ, idx, idx < numel, c, WITH_G, ACCUMULATE, False)
    else:
        _pack_elems(X, G, SQ, idx, idx < numel, c, WITH_G, ACCUMULATE, False)


@triton.jit
def _pack_bucket_elems(X, MN, G, Q, sidx, didx, m, c, gs, acc, WITH_G: tl.constexpr, MAIN: tl.constexpr,
                       WIDE: tl.constexpr, SRC_WIDE: tl.constexpr):
    """``SRC_WIDE``: the source is aligned like the destinations (hinted); else, in the body, read
    unhinted and unmasked (an engine's bucket packs tensors in another order than the flat layout
    the statistics mirror, so a segment's source and destinations rarely agree modulo VEC).
    ``MAIN``: ``MN`` (laid out like the source) accumulates the source as ``Tensor.add_`` does."""
    if WIDE and not SRC_WIDE:
        xr = tl.load(X + sidx)
    else:
        xr = _ld(X, sidx, m, WIDE)
    x = xr.to(tl.float32)
    if MAIN:
        if WIDE and not SRC_WIDE:
            mv = tl.load(MN + sidx).to(tl.float32) + x
            tl.store(MN + sidx, mv.to(MN.dtype.element_ty, fp_downcast_rounding="rtne"))
        else:
            mv = _ld(MN, sidx, m, WIDE).to(tl.float32) + x
            _st(MN, sidx, mv.to(MN.dtype.element_ty, fp_downcast_rounding="rtne"), m, WIDE)
    w = x * c
    if acc:
        _st(Q, didx, _ld(Q, didx, m, WIDE) + w * w, m, WIDE)
        if WITH_G:
            _st(G, didx, _ld(G, didx, m, WIDE) + x * gs, m, WIDE)
    else:
        _st(Q, didx, w * w, m, WIDE)
        if WITH_G:
            _st(G, didx, x * gs, m, WIDE)


@triton.jit
def _chunk_row(chunks, ALIGNED: tl.constexpr):
    """This program's chunk row of ``pack_bucket``/``unpack_bucket``: (source, gradient, squares,
    length, accumulate, head, body blocks, source aligned); no aligned body unless ``ALIGNED``."""
    row = chunks + tl.program_id(0) * _PACK_ROW
    n = tl.load(row + 3)
    head = tl.load(row + 5)
    nblk = tl.load(row + 6)
    if not ALIGNED:
        head = n
        nblk = n * 0
    return (tl.load(row + 0), tl.load(row + 1), tl.load(row + 2), n, tl.load(row + 4) != 0, head, nblk,
            tl.load(row + 7) != 0)


@_kernel
def _pack_bucket_kernel(x: tl.int64, mn: tl.int64, OUT: "*fp32", chunks: "*i64", c: tl.float32, gs: tl.float32,
                        XDT: tl.constexpr, MDT: tl.constexpr, WITH_G: tl.constexpr, MAIN: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of one segment of a bucket (``Kernels.pack_bucket``): chunk rows (source start,
    gradient start, squares start, length, accumulate, head, body blocks, source aligned); the
    body is aligned in both destinations when ``ALIGNED`` (the bases are; the host put it there),
    and in the source (and ``main``) too where the row says so."""
    X = x.to(tl.pointer_type(XDT))
    M = mn.to(tl.pointer_type(MDT))
    s, g, q, n, acc, head, nblk, src_wide = _chunk_row(chunks, ALIGNED)
    G = OUT + g
    Q = OUT + q
    XS = X + s
    MS = M + s
    if src_wide:
        for i in range(nblk):
            off = head + i * BLOCK + tl.arange(0, BLOCK)
            _pack_bucket_elems(XS, MS, G, Q, off, off, None, c, gs, acc, WITH_G, MAIN, True, True)
    else:
        for i in range(nblk):
            off = head + i * BLOCK + tl.arange(0, BLOCK)
            _pack_bucket_elems(XS, MS, G, Q, off, off, None, c, gs, acc, WITH_G, MAIN, True, False)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        rel = rel + tl.where(rel < head, 0, nblk * BLOCK)
        _pack_bucket_elems(XS, MS, G, Q, rel, rel, rel < n, c, gs, acc, WITH_G, MAIN, False, False)


@triton.jit
def _add_into(X, D, idx, m, acc, WIDE: tl.constexpr, SRC_WIDE: tl.constexpr):
    """``D[idx] = X[idx]``, plus ``D[idx]`` when ``acc``; the source read wide only where aligned."""
    if WIDE and not SRC_WIDE:
        x = tl.load(X + idx)
    else:
        x = _ld(X, idx, m, WIDE)
    if acc:
        x = x + _ld(D, idx, m, WIDE)
    _st(D, idx, x, m, WIDE)


@triton.jit
def _unpack_elems(XG, XQ, G, Q, idx, m, acc, WITH_G: tl.constexpr, WIDE: tl.constexpr, SRC_WIDE: tl.constexpr):
    _add_into(XQ, Q, idx, m, acc, WIDE, SRC_WIDE)
    if WITH_G:
        _add_into(XG, G, idx, m, acc, WIDE, SRC_WIDE)


@_kernel
def _unpack_bucket_kernel(SRC: "*fp32", OUT: "*fp32", chunks: "*i64", src_sq: tl.int64, WITH_G: tl.constexpr,
                          ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """One chunk of one row of ``Kernels.unpack_bucket``: the chunk rows of ``pack_bucket``
    (source, gradient, squares, length, accumulate, head, body blocks, source aligned)."""
    s, g, q, n, acc, head, nblk, src_wide = _chunk_row(chunks, ALIGNED)
    XG = SRC + s
    XQ = SRC + s + src_sq
    G = OUT + g
    Q = OUT + q
    if src_wide:
        for i in range(nblk):
            off = head + i * BLOCK + tl.arange(0, BLOCK)
            _unpack_elems(XG, XQ, G, Q, off, None, acc, WITH_G, True, True)
    else:
        for i in range(nblk):
            off = head + i * BLOCK + tl.arange(0, BLOCK)
            _unpack_elems(XG, XQ, G, Q, off, None, acc, WITH_G, True, False)
    for off in range(0, n - nblk * BLOCK, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        rel = rel + tl.where(rel < head, 0, nblk * BLOCK)
        _unpack_elems(XG, XQ, G, Q, rel, rel < n, acc, WITH_G, False, False)


@triton.jit
def _accumulate_elems(G, SG, SQ, idx, m, FRESH: tl.constexpr, WIDE: tl.constexpr):
    x = _ld(G, idx, m, WIDE).to(tl.float32)
    if FRESH:
        sg = x
        sq = x * x
    else:
        sg = _ld(SG, idx, m, WIDE) + x
        sq = _ld(SQ, idx, m, WIDE) + x * x
    _st(SG, idx, sg, m, WIDE)
    _st(SQ, idx, sq, m, WIDE)
    return sg, sq


@_kernel
def _accumulate_kernel(g: tl.int64, SG: "*fp32", SQ: "*fp32", part: "*fp64", numel: tl.int64, inv_n: tl.float32,
                       eps: tl.float32, GDT: tl.constexpr, FRESH: tl.constexpr, MOMENTS: tl.constexpr,
                       ALIGNED: tl.constexpr, BLOCK: tl.constexpr, SPAN: tl.constexpr):
    """One backward's gradient into the statistics, ``SPAN`` elements per program; with
    ``MOMENTS`` (the backward expected to be the step's last) also pass 1's partial sums of the
    completed statistics, taken while they are in registers (the step then skips its pass 1)."""
    G = g.to(tl.pointer_type(GDT))
    c = tl.program_id(0)
    start = c.to(tl.int64) * SPAN
    n = tl.minimum(numel - start, SPAN)
    nblk = n // BLOCK if ALIGNED else n * 0  # SPAN and BLOCK are multiples of VEC: aligned blocks
    sr, ss, sgb, mn, mx = _moments_zero(BLOCK)
    for i in range(nblk):
        idx = start + i * BLOCK + tl.arange(0, BLOCK)
        sg, sq = _accumulate_elems(G, SG, SQ, idx, None, FRESH, True)
        if MOMENTS:
            sr, ss, sgb, mn, mx = _moments_add(sg, sq, None, inv_n, eps, sr, ss, sgb, mn, mx, True)
    for off in range(nblk * BLOCK, n, BLOCK):
        idx = start + off + tl.arange(0, BLOCK)
        m = idx < start + n
        sg, sq = _accumulate_elems(G, SG, SQ, idx, m, FRESH, False)
        if MOMENTS:
            sr, ss, sgb, mn, mx = _moments_add(sg, sq, m, inv_n, eps, sr, ss, sgb, mn, mx, False)
    if MOMENTS:
        _moments_row(part, c, sr, ss, sgb, mn, mx)


# ---- what can be launched -----------------------------------------------------------------------------

_PDTS = (tl.float32, tl.bfloat16, tl.float16)
_BOOL = (False, True)


@dataclass(frozen=True)
class Launch:
    """A kernel and every combination of compile-time flags its launch site may pass."""

    kernel: Any
    cases: tuple[dict[str, Any], ...]  # constexpr name -> value, BLOCK included
    num_warps: int = 4
    mutates: bool = False  # writes parameters or optimizer state (a step failing after it cannot be redone)

    def admits(self, flags: dict[str, Any]) -> bool:
        return _flag_key(flags) in self._keys

    @functools.cached_property
    def _keys(self) -> frozenset:
        return frozenset(_flag_key(c) for c in self.cases)


def _flag_key(flags: dict[str, Any]) -> tuple:
    """A hashable form of a flag combination, in any order (Triton dtypes by name)."""
    return tuple(sorted((k, str(v)) for k, v in flags.items()))


def _cases(where=lambda c: True, **axes: Sequence[Any]) -> tuple[dict[str, Any], ...]:
    names = list(axes)
    every = (dict(zip(names, values)) for values in itertools.product(*axes.values()))
    return tuple(c for c in every if where(c))


def _stats_ok(c: dict[str, Any]) -> bool:
    """The GSNR momentum only with statistics."""
    return c["ON"] or not c["EMA"]


#: every kernel the implementation launches, with every flag combination its call site can
#: produce; ``Triton._launch`` refuses others, ``triton_aot`` compiles exactly these.
#: The element-wise kernels run 4 warps over blocks of 512: 4 elements per thread and stream
#: (one 128-bit access each), which keeps every variant under 128 registers without spilling
#: around the IEEE division's subroutine calls.
LAUNCHES: dict[str, Launch] = {
    "moments": Launch(_moments_kernel, _cases(lambda c: c["CHECK"] or c["GDT"] == tl.float32, GDT=_PDTS, CHECK=_BOOL,
                                              BLOCK=(BLOCK,)), num_warps=4),
    "grad_norms": Launch(_grad_norms_kernel, _cases(_stats_ok, PDT=_PDTS, ON=_BOOL, EMA=_BOOL, BLOCK=(BLOCK,)),
                         num_warps=4),
    "sgd": Launch(_sgd_kernel, _cases(lambda c: _stats_ok(c) and (c["BUF"] or not c["NESTEROV"]), PDT=_PDTS,
                                      ON=_BOOL, EMA=_BOOL, BUF=_BOOL, NESTEROV=_BOOL, BLOCK=(BLOCK,)),
                  num_warps=4, mutates=True),
    "adam": Launch(_adam_kernel, _cases(lambda c: _stats_ok(c) and (c["ON"] or c["PLACE"] == BOTH_MOMENTS),
                                        PDT=_PDTS, ON=_BOOL, EMA=_BOOL, APPLY=_BOOL,
                                        PLACE=tuple(range(len(PLACEMENTS))), BLOCK=(BLOCK,)),
                   num_warps=4, mutates=True),
    "lamb_apply": Launch(_lamb_apply_kernel, _cases(_stats_ok, PDT=_PDTS, ON=_BOOL, EMA=_BOOL, BLOCK=(BLOCK,)),
                         num_warps=4, mutates=True),
    "adam_tables": Launch(_adam_tables_kernel, _cases(lambda c: c["ON"] or not c["EMA"], ON=_BOOL, EMA=_BOOL,
                                                      BIAS=_BOOL, MULT=_BOOL, COUNT=_BOOL, BLOCK=(_TABLE_BLOCK,)),
                          num_warps=4),
    # K: the step's row width, 5 for LAMB's first pass (trust ratios computed, adapted or not), 3 for
    # Adam (no trust ratios) and the SGD members (LARS: trust ratios given)
    "finish": Launch(_finish_kernel, _cases(lambda c: (c["TRUST"] == 1) == (c["K"] == 5) and (
        c["TRUST"] == 1 or not c["ADAPT"]), K=(3, 5), ON=_BOOL, TRUST=(0, 1, 2), ADAPT=_BOOL,
                                            BLOCK=(_TABLE_BLOCK,)), num_warps=4),
    "sgd_tables": Launch(_sgd_tables_kernel, _cases(lambda c: (c["ON"] or not c["EMA"]) and (
        c["MOM"] or not c["CREATED"]), ON=_BOOL, EMA=_BOOL, MOM=_BOOL, CREATED=_BOOL, NORMS=_BOOL, COUNT=_BOOL,
                                                    BLOCK=(_TABLE_BLOCK,)), num_warps=4),
    "lars_trust": Launch(_lars_trust_kernel, _cases(ADAPT=_BOOL, CLIP=_BOOL, BLOCK=(_TABLE_BLOCK,)), num_warps=4),
    "nonfinite": Launch(_nonfinite_kernel, _cases(XDT=_PDTS, BLOCK=(BLOCK,)), num_warps=4),
    # the reductions' (columns, summed, min/max) of the call sites above
    "combine": Launch(_combine, tuple(dict(K=k, NSUM=s, MINMAX=mm, FORM=f) for k, s, mm, f in
                                      ((5, 3, True, 1), (6, 3, True, 1), (2, 2, False, 3), (3, 3, False, 0),
                                       (5, 5, False, 0), (1, 1, False, 2))),
                      num_warps=1),
    "pack_squares": Launch(_pack_squares_kernel, _cases(XDT=_PDTS, WITH_G=_BOOL, ACCUMULATE=_BOOL, ALIGNED=_BOOL,
                                                        BLOCK=(BLOCK,)), num_warps=4),
    "pack_bucket": Launch(_pack_bucket_kernel, _cases(lambda c: c["MAIN"] or c["MDT"] == c["XDT"], XDT=_PDTS,
                                                      MDT=_PDTS, WITH_G=_BOOL, MAIN=_BOOL, ALIGNED=_BOOL,
                                                      BLOCK=(BLOCK,)), num_warps=4),
    "unpack_bucket": Launch(_unpack_bucket_kernel, _cases(WITH_G=_BOOL, ALIGNED=_BOOL, BLOCK=(BLOCK,)), num_warps=4),
    "accumulate": Launch(_accumulate_kernel, _cases(GDT=_PDTS, FRESH=_BOOL, MOMENTS=_BOOL, ALIGNED=_BOOL,
                                                    BLOCK=(BLOCK,), SPAN=(HOOK_SPAN,)), num_warps=4),
}


# ---- host side --------------------------------------------------------------------------------------


@dataclass
class _Chunks:
    table: Tensor  # int64 [C, 6] on the device: tensor, start, length, segment, head, body blocks
    bounds: Tensor  # int64 [S + 1] on the device: each segment's first chunk
    count: int
    segments: int


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


_DATA_PTR = torch.Tensor.data_ptr
_DTYPE_OF = operator.attrgetter("dtype")
_FP32 = {torch.float32}


def _addresses(tensors: Tensors) -> tuple[tuple[int, ...], int]:
    """(the tensors' addresses, their element size): all a launch's tables are built from (host
    metadata). One list holds one dtype (``_dtype``/``_fp32`` check it); ``map`` reads the
    addresses in C, so the host cost per tensor is a pointer read, not a Python call."""
    if not tensors:
        return (), 0
    return tuple(map(_DATA_PTR, tensors)), tensors[0].element_size()


def _phases(streams: Sequence[tuple[tuple[int, ...], int]], count: int) -> bytes:
    """Per tensor index (int8): the element offset (mod ``VEC``) at which every one of its streams
    is aligned to ``VEC`` elements, or -1 when they disagree (that tensor gets no wide body)."""
    want = None
    for ptrs, es in streams:
        a = np.asarray(ptrs, dtype=np.int64)
        q = np.where(a % es == 0, (-(a // es)) % VEC, -1)
        want = q if want is None else np.where(want == q, want, -1)
    if want is None:
        want = np.full(count, -1, dtype=np.int64)
    return want.astype(np.int8).tobytes()


#: an argument of each annotated parameter type, for ``Triton._compile``: the compiler reads types, not values
_PLACEHOLDERS: dict[str, Callable[[torch.device], Any]] = {
    "*fp32": lambda device: torch.empty(1, dtype=torch.float32, device=device),
    "*fp64": lambda device: torch.empty(1, dtype=torch.float64, device=device),
    "*i64": lambda device: torch.empty(1, dtype=torch.int64, device=device),
    "fp32": lambda device: 0.0,
    "fp64": lambda device: 0.0,
    "i64": lambda device: 0,
}


class Triton:
    """The kernels of ``_impl.Kernels`` as Triton launches; every result stays on the device.

    ``sync_free``: the step orchestration (``GSNROptimizer``) keeps its tables on the device,
    decides a non-finite skip on the device and hands it over as ``found_inf``.

    Tables are cached while the tensors are the same (the same shapes and addresses): a steady
    step copies nothing to the device. ``counts`` tallies launches and table copies (the static
    cost report reads it)."""

    name = "triton"
    sync_free = True

    def __init__(self) -> None:
        self._chunks: dict[tuple, _Chunks] = {}
        self._ptrs: dict[tuple, Tensor] = {}
        self._compiled: set[tuple] = set()  # specializations compiled ahead of their launch (_compile)
        self._options = {} if INTERPRETED else {"enable_fp_fusion": False}
        self.counts = {"launches": 0, "mutating_launches": 0, "table_copies": 0}

    # -- launching
    def _launch(self, name: str, grid: tuple[int, ...], *args: Any, then: Sequence[tuple[str, dict]] = (),
                **flags: Any) -> None:
        """Launches ``LAUNCHES[name]`` with ``flags``. A kernel that writes parameters or state first
        has the launches that complete its call (``then``) compiled, so that a compile failure
        surfaces before anything is written (``_impl.WithFallback`` can then redo the step)."""
        spec = LAUNCHES[name]
        if not spec.admits(flags):
            raise ValueError(f"Triton kernel {name}: flags {flags} are not in LAUNCHES (add them there, where the "
                             "compile check finds them)")
        for later, later_flags in then:
            self._compile(later, args[0].device, later_flags)
        try:
            spec.kernel[grid](*args, **flags, num_warps=spec.num_warps, **self._options)
        except Exception as exc:  # a compile or launch error, from Triton or the driver
            raise KernelFailure(spec.kernel.__name__, flags, exc) from exc
        self.counts["launches"] += 1
        self.counts["mutating_launches"] += spec.mutates

    def _compile(self, name: str, device: torch.device, flags: dict[str, Any]) -> None:
        """Compiles a specialization without launching it (on the GPU; the interpreter compiles
        nothing). Arguments are placeholders of the annotated types: only types reach the compiler."""
        key = (name, device, _flag_key(flags))
        if INTERPRETED or key in self._compiled:
            return
        spec = LAUNCHES[name]
        args = [_PLACEHOLDERS[p.annotation_type](device) for p in spec.kernel.params if not p.is_constexpr]
        try:
            spec.kernel.warmup(*args, grid=(1,), **flags, num_warps=spec.num_warps, **self._options)
        except Exception as exc:
            raise KernelFailure(spec.kernel.__name__, flags, exc) from exc
        self._compiled.add(key)

    # -- tables
    def tables(self, seg: Tensor, device: torch.device, *streams: Tensors) -> tuple[_Chunks, list[Tensor]]:
        """A launch's chunk table and the address table of each of its tensor lists (``streams``,
        by tensor index), from one read of the tensors' addresses; both cached."""
        addrs = [_addresses(s) for s in streams]
        return self._chunk_table(seg, device, addrs), [self._ptr_table(a, device) for a in addrs]

    def chunks(self, seg: Tensor, device: torch.device, streams: Sequence[Tensors] = ()) -> _Chunks:
        return self._chunk_table(seg, device, [_addresses(s) for s in streams])

    def ptrs(self, tensors: Tensors, device: torch.device) -> Tensor:
        return self._ptr_table(_addresses(tensors), device)

    def _chunk_table(self, seg: Tensor, device: torch.device, streams: Sequence[tuple]) -> _Chunks:
        """The chunk table of a host segment table ``[S, 3]``, with each chunk's aligned body for
        the streams' addresses (cached by the table's bytes and the streams' alignment)."""
        if seg.device.type != "cpu":
            raise ValueError("the segment table must be a host (CPU) tensor: it is built from shapes")
        host = seg.numpy()  # host memory: reading it never waits for a device
        phases_key = _phases([a for a in streams if a[0]], int(host[:, 0].max()) + 1 if host.shape[0] else 0)
        key = (device, CHUNK, host.shape, host.tobytes(), phases_key)
        got = self._chunks.get(key)
        if got is None:
            phases = np.frombuffer(phases_key, dtype=np.int8).tolist()
            rows, bounds = [], [0]
            for s, (t, start, length) in enumerate(host.tolist()):
                for off in range(0, length, CHUNK):
                    st, n = start + off, min(CHUNK, length - off)
                    head = n if phases[t] < 0 else min((phases[t] - st) % VEC, n)
                    rows.append((t, st, n, s, head, (n - head) // BLOCK))
                bounds.append(len(rows))
            table = torch.tensor(rows or [(0, 0, 0, 0, 0, 0)], dtype=torch.long).reshape(-1, 6)
            got = _Chunks(self._copy(table, device), self._copy(torch.tensor(bounds, dtype=torch.long), device),
                          len(rows), seg.shape[0])
            if len(self._chunks) > 64:
                self._chunks.clear()
            self._chunks[key] = got
        return got

    def _ptr_table(self, addrs: tuple[tuple[int, ...], int], device: torch.device) -> Tensor:
        """The device table of the addresses (cached by them)."""
        key = (device, addrs[0])
        got = self._ptrs.get(key)
        if got is None:
            got = self._copy(torch.tensor(addrs[0] or [0], dtype=torch.long), device)
            if len(self._ptrs) > 256:
                self._ptrs.clear()
            self._ptrs[key] = got
        return got

    def _copy(self, host: Tensor, device: torch.device) -> Tensor:
        self.counts["table_copies"] += 1
        return _to_device(host, device)

    def _combined(self, ch: _Chunks, part: Tensor, k: int, nsum: int, minmax: bool, form: int = 0) -> Tensor:
        width = {0: k, 1: 6, 2: 1, 3: 3}[form]
        out = torch.empty(ch.segments, width, dtype=torch.float64, device=part.device)
        if ch.segments:
            self._launch("combine", (ch.segments,), part, ch.bounds, out, K=k, NSUM=nsum, MINMAX=minmax, FORM=form)
        return out

    @staticmethod
    def _device(tensors: Tensors) -> torch.device:
        """The tensors' device; for none (a rank holding no piece of a param group, whose empty
        tables still join the group's reductions) this process's CUDA device (the CPU under the
        interpreter, without one)."""
        if len(tensors):
            return tensors[0].device
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    @staticmethod
    def _dtype(tensors: Tensors) -> tl.dtype:
        dt = tensors[0].dtype
        if len(set(map(_DTYPE_OF, tensors))) != 1 or dt not in _DTYPES:
            raise TypeError(f"Triton VRGD kernels take fp32/bf16/fp16 tensors of one dtype per call, got "
                            f"{sorted({str(t.dtype) for t in tensors})}")
        return _DTYPES[dt]

    @staticmethod
    def _fp32(*lists: Tensors) -> None:
        for tensors in lists:
            if tensors and set(map(_DTYPE_OF, tensors)) != _FP32:
                raise TypeError("Triton VRGD kernels keep optimizer state and statistics in fp32")

    @staticmethod
    def _no_skip(dev: torch.device) -> Tensor:
        """``found_inf`` for a caller that decided on the host (the step is taken)."""
        return torch.zeros((), dtype=torch.float64, device=dev)

    # -- kernels
    def gsnr_moments(self, sum_g, sum_sq, seg, inv_n, eps):
        return self.checked_moments(sum_g, sum_sq, None, seg, inv_n, eps)

    # -- the step's own operations (sync-free only): ``columns.DeviceTables``

    def checked_moments(self, sum_g, sum_sq, grads, seg, inv_n, eps):
        """``gsnr_moments`` whose non-finite column also answers ``nonfinite(grads, seg)``, in the
        same launch (``grads`` None: the statistics alone)."""
        dev = self._device(sum_g)
        self._fp32(sum_g, sum_sq)
        streams = (sum_g, sum_sq) if grads is None else (sum_g, sum_sq, grads)
        ch, ptrs = self.tables(seg, dev, *streams)
        k = 5 if grads is None else 6
        part = torch.empty(max(ch.count, 1), k, dtype=torch.float64, device=dev)
        if ch.count:
            self._launch("moments", (ch.count,), ptrs[0], ptrs[1], ptrs[-1], ch.table, part, float(inv_n), float(eps),
                         GDT=tl.float32 if grads is None else self._dtype(grads), CHECK=grads is not None,
                         BLOCK=BLOCK)
        return self._combined(ch, part, k, 3, True, form=1)

    def adam_tables(self, flags, found, skipped, counters, powers, tensor_of, sum_r, numel, mult, out, gamma, lr,
                    bc1_mult, gsnr, ema, bias):
        """The step's decision and the Adam family's kernel table in one single-program launch:
        ``found`` = the largest of ``flags`` (a float64 vector, any stride); each step counter
        (fp32 0-dim tensors) += 1 - found; ``skipped`` (float64 0-dim, or None) += found; and
        ``out`` [S, len(ADAM) + 1], the ``adam_step`` table with its ``lr / bc1`` column, from
        ``powers`` [3, T] (beta1, beta2, beta3 to the power of each tensor's step after a taken
        step), whole-tensor ``sum_r`` (any row stride), ``numel`` and ``mult`` (a 0-dim
        gradient multiplier, or None for 1)."""
        dev = out.device
        ptrs = self._ptr_table(_addresses(counters), dev)
        self._launch("adam_tables", (1,), flags, flags.numel(), flags.stride(0) if flags.dim() else 1, found,
                     found if skipped is None else skipped, ptrs, len(counters), powers, powers.stride(0), tensor_of,
                     sum_r, sum_r.stride(0), numel, found if mult is None else mult, out, out.shape[0], float(gamma),
                     float(lr), float(bc1_mult), ON=bool(gsnr), EMA=bool(ema), BIAS=bool(bias),
                     MULT=mult is not None, COUNT=skipped is not None, BLOCK=_TABLE_BLOCK)

    def finish(self, res, norms, table, sum_r, numel, moments, keys, length, share, lamb, sums, maxs, lr,
               min_coeff, max_coeff, gsnr, trust, adapt):
        """After the step's combine (``res``: its rows), in one single-program launch: the step's
        metric rows written into ``sums``/``maxs`` at each segment's key (keys unique); before
        them, ``trust`` 1 (LAMB): the trust ratios from whole-tensor ``norms`` [‖θ‖², ‖u‖²] (any
        row stride) and ``lamb``, the ``lamb_apply`` table with its ``lr · trust`` column, from the
        ``adam_step`` table; ``trust`` 2: ``norms`` holds ``[trust, adapted]`` rows (LARS); 0: none."""
        self._launch("finish", (1,), res, norms, norms.stride(0), table, sum_r, sum_r.stride(0), numel, moments,
                     keys, length, share, table if lamb is None else lamb, sums, maxs, table.shape[0], float(lr),
                     float(min_coeff), float(max_coeff), K=res.shape[1], ON=bool(gsnr), TRUST=int(trust),
                     ADAPT=bool(adapt), BLOCK=_TABLE_BLOCK)

    def sgd_tables(self, flags, found, skipped, counters, powers, tensor_of, sum_r, numel, created, out, norms_out,
                   gamma, gsnr, ema, momentum):
        """``adam_tables`` for the SGD members: ``out`` the ``sgd_step`` table (``lr_mult`` 1, ``first``
        from the advanced counters and ``created``, a per-segment float64 vector of new momentum
        buffers or None), ``norms_out`` (or None) the ``scaled_grad_norms`` table; ``powers`` [1, T]:
        beta3 to the power of each tensor's step after a taken step."""
        ptrs = self._ptr_table(_addresses(counters), out.device)
        self._launch("sgd_tables", (1,), flags, flags.numel(), flags.stride(0) if flags.dim() else 1, found,
                     found if skipped is None else skipped, ptrs, len(counters), powers, tensor_of, sum_r,
                     sum_r.stride(0), numel, found if created is None else created, out,
                     out if norms_out is None else norms_out, out.shape[0], float(gamma), ON=bool(gsnr),
                     EMA=bool(ema), MOM=bool(momentum), CREATED=created is not None, NORMS=norms_out is not None,
                     COUNT=skipped is not None, BLOCK=_TABLE_BLOCK)

    def lars_trust(self, norms, table, trust, weight_decay, eps, coefficient, lr, adapt, clip):
        """LARS's local lr from whole-tensor ``norms`` [‖θ‖², ‖d‖²] (any row stride) into ``table``'s
        ``lr_mult`` column (the ``sgd_step`` table) and ``trust`` [S, 2] (local lr, adapted)."""
        self._launch("lars_trust", (1,), norms, norms.stride(0), table, trust, table.shape[0], float(weight_decay),
                     float(eps), float(coefficient), float(lr), ADAPT=bool(adapt), CLIP=bool(clip),
                     BLOCK=_TABLE_BLOCK)

    def scaled_grad_norms(self, params, grads, sum_g, sum_sq, avg, seg, segf, inv_n, eps, beta3):
        dev = self._device(params)
        self._fp32(sum_g, sum_sq, avg)
        ch, ptrs = self.tables(seg, dev, params, grads, sum_g, sum_sq, avg)
        part = torch.empty(max(ch.count, 1), 2, dtype=torch.float64, device=dev)
        if ch.count:
            self._launch("grad_norms", (ch.count,), *ptrs, ch.table,
                         segf.contiguous(), part, float(inv_n), float(eps), float(beta3), float(1.0 - beta3),
                         PDT=self._dtype(params), ON=bool(sum_g), EMA=bool(avg), BLOCK=BLOCK)
        return self._combined(ch, part, 2, 2, False, form=3)

    def sgd_step(self, params, grads, bufs, sum_g, sum_sq, avg, seg, segf, inv_n, eps, beta3, lr, weight_decay,
                 momentum, dampening, nesterov, found_inf=None):
        dev = self._device(params)
        found_inf = self._no_skip(dev) if found_inf is None else found_inf
        self._fp32(bufs, sum_g, sum_sq, avg)
        ch, ptrs = self.tables(seg, dev, params, grads, bufs, sum_g, sum_sq, avg)
        part = torch.empty(max(ch.count, 1), 3, dtype=torch.float64, device=dev)
        if ch.count:
            buf = momentum != 0.0
            self._launch("sgd", (ch.count,), *ptrs, ch.table,
                         segf.contiguous(), part, found_inf, float(inv_n), float(eps), float(beta3),
                         float(1.0 - beta3), float(lr),
                         float(weight_decay), float(momentum), float(1.0 - dampening), PDT=self._dtype(params),
                         ON=bool(sum_g), EMA=bool(avg), BUF=buf, NESTEROV=bool(nesterov) and buf, BLOCK=BLOCK,
                         # the metric rows after it: SGD's (TRUST 0) or LARS's (2), not known here
                         then=[_combine_flags(3, 3, False)] + [
                             ("finish", dict(K=3, ON=bool(sum_g), TRUST=trust, ADAPT=False, BLOCK=_TABLE_BLOCK))
                             for trust in (0, 2)])
        return self._combined(ch, part, 3, 3, False)

    def adam_step(self, params, grads, exp_avg, exp_avg_sq, sum_g, sum_sq, avg, seg, segf, inv_n, eps_gsnr, beta3,
                  lr, beta1, beta2, eps, weight_decay, apply, placement, found_inf=None, apply_dtype=None):
        if placement not in range(len(PLACEMENTS)):
            raise ValueError(f"adam_step: unknown GSNR placement {placement}")
        dev = self._device(params)
        found_inf = self._no_skip(dev) if found_inf is None else found_inf
        self._fp32(exp_avg, exp_avg_sq, sum_g, sum_sq, avg)
        ch, ptrs = self.tables(seg, dev, params, grads, exp_avg, exp_avg_sq, sum_g, sum_sq, avg)
        k = 3 if apply else 5
        part = torch.empty(max(ch.count, 1), k, dtype=torch.float64, device=dev)
        if ch.count:
            on = bool(sum_g)
            self._launch("adam", (ch.count,), *ptrs, ch.table,
                         _with_column(segf, _ADAM_W.value, lambda t: lr / t[:, _ADAM_BC1.value]),
                         part, found_inf,
                         float(inv_n), float(eps_gsnr), float(beta3), float(1.0 - beta3), float(beta1),
                         float(1.0 - beta1), float(beta2),
                         float(1.0 - beta2), float(eps), float(weight_decay), float(1.0 - lr * weight_decay),
                         PDT=self._dtype(params), ON=on, EMA=bool(avg), APPLY=bool(apply),
                         PLACE=placement if on else BOTH_MOMENTS, BLOCK=BLOCK,
                         then=[_combine_flags(k, k, False)] + ([] if apply else [_lamb_apply_flags(
                             _DTYPES[apply_dtype] if apply_dtype is not None else self._dtype(params),
                             on and placement == UPDATE, bool(avg) and placement == UPDATE)])
                         + (_finish_flags(k, on) if segf.shape[1] == _ADAM_W.value else []))
        return self._combined(ch, part, k, k, False)

    def lamb_apply(self, params, exp_avg, exp_avg_sq, sum_g, sum_sq, avg, seg, segf, inv_n, eps_gsnr, beta3, lr,
                   eps, weight_decay, found_inf=None):
        dev = self._device(params)
        found_inf = self._no_skip(dev) if found_inf is None else found_inf
        self._fp32(exp_avg, exp_avg_sq, sum_g, sum_sq, avg)
        ch, ptrs = self.tables(seg, dev, params, exp_avg, exp_avg_sq, sum_g, sum_sq, avg)
        if ch.count:
            self._launch("lamb_apply", (ch.count,), *ptrs, ch.table,
                         _with_column(segf, _LAMB_W.value, lambda t: lr * t[:, _LAMB_TRUST.value]), found_inf,
                         float(inv_n), float(eps_gsnr), float(eps), float(weight_decay), PDT=self._dtype(params),
                         ON=bool(sum_g), EMA=bool(avg), BLOCK=BLOCK)

    def nonfinite(self, tensors, seg):
        dev = self._device(tensors)
        ch, ptrs = self.tables(seg, dev, tensors)
        part = torch.empty(max(ch.count, 1), 1, dtype=torch.float64, device=dev)
        if ch.count:
            self._launch("nonfinite", (ch.count,), *ptrs, ch.table, part,
                         XDT=self._dtype(tensors), BLOCK=BLOCK)
        return self._combined(ch, part, 1, 1, False, form=2)[:, 0]

    def pack_squares(self, src, g_out, sq_out, c, accumulate=False):
        x = src.reshape(-1).contiguous()  # a strided 1-D view stays strided in reshape: the kernel reads flat memory
        numel = x.numel()
        if numel:
            self._fp32([sq_out] if g_out is None else [sq_out, g_out])
            g = sq_out if g_out is None else g_out
            self._launch("pack_squares", (triton.cdiv(numel, BLOCK),), x.data_ptr(), g, sq_out, numel, float(c),
                         XDT=self._dtype([x]), WITH_G=g_out is not None, ACCUMULATE=bool(accumulate),
                         ALIGNED=_aligned(x, g, sq_out), BLOCK=BLOCK)

    def pack_bucket(self, src, table, out, c, g_scale, main=None):
        table.check(src, out, g_scale is not None, main)
        x = src.reshape(-1)
        ch = self._bucket_chunks(table, x.device)
        if ch.count:
            self._fp32([out])
            xdt = self._dtype([x])
            m = x if main is None else main.view(-1)  # without main: a placeholder the kernel never reads
            aligned = _aligned(x, out) and (main is None or _aligned(m))
            self._launch("pack_bucket", (ch.count,), x.data_ptr(), m.data_ptr(), out, ch.table, float(c),
                         float(0.0 if g_scale is None else g_scale), XDT=xdt, MDT=self._dtype([m]),
                         WITH_G=g_scale is not None, MAIN=main is not None, ALIGNED=aligned, BLOCK=BLOCK)

    def unpack_bucket(self, src, table, out, src_sq, with_g):
        table.check(src, out, with_g)
        if src.dtype != torch.float32 or table.cache["ends"][1] + src_sq > src.numel():
            raise ValueError("unpack_bucket: an fp32 source that holds every row's squares")
        # the chunk rows say whether a row's source agrees with its destinations modulo VEC; the
        # squares, src_sq further, agree too only when src_sq does
        ch = self._bucket_chunks(table, src.device, src_shift=src_sq)
        if ch.count:
            self._fp32([out])
            self._launch("unpack_bucket", (ch.count,), src, out, ch.table, int(src_sq), WITH_G=bool(with_g),
                         ALIGNED=_aligned(src, out), BLOCK=BLOCK)

    def _bucket_chunks(self, table: BucketTable, device: torch.device, src_shift: int | None = None) -> _Chunks:
        """The chunk table of a bucket table (cached in it): segments cut into ``PACK_CHUNK`` elements,
        each with a body aligned in both destinations where they agree modulo ``VEC`` (the
        statistics buffers are laid out so that they do), and read aligned from the source where
        it agrees too (the bases' alignment is checked at each launch). ``src_shift``
        (``unpack_bucket``): the squares are read that far past the row's source, which must
        agree as well."""
        key = ("triton", device, PACK_CHUNK, src_shift)
        got = table.cache.get(key)
        if got is None:
            rows = []
            for s, g, q, n, acc in table.rows.tolist():
                for off in range(0, n, PACK_CHUNK):
                    st, gt, qt, k = s + off, g + off, q + off, min(PACK_CHUNK, n - off)
                    wide = (gt - qt) % VEC == 0
                    head = min((-qt) % VEC, k) if wide else k
                    src_wide = (st - qt) % VEC == 0 if src_shift is None else (
                        (st - gt) % VEC == 0 and (st + src_shift - qt) % VEC == 0)
                    rows.append((st, gt, qt, k, acc, head, (k - head) // BLOCK, int(src_wide)))
            host = torch.tensor(rows or [(0,) * 8], dtype=torch.long).reshape(-1, 8)
            got = table.cache[key] = _Chunks(self._copy(host, device), host, len(rows), table.segments)
        return got

    def accumulate_moments(self, grad, sum_g, sum_sq, fresh, inv_n=0.0, eps=0.0):
        g = grad.reshape(-1)
        if not g.is_contiguous():
            g = g.contiguous()
        numel = g.numel()
        if not numel:
            return None
        if sum_g.numel() != numel or sum_sq.numel() != numel:  # the kernel writes numel words into each
            raise RuntimeError(f"statistics size mismatch: a gradient of {numel} elements, buffers of "
                               f"{sum_g.numel()} and {sum_sq.numel()}")
        self._fp32([sum_g, sum_sq])
        sg, sq = sum_g.view(-1), sum_sq.view(-1)
        programs = triton.cdiv(numel, HOOK_SPAN)
        moments = inv_n > 0
        part = torch.empty(programs if moments else 1, 5, dtype=torch.float64, device=g.device)
        self._launch("accumulate", (programs,), g.data_ptr(), sg, sq, part, numel, float(inv_n), float(eps),
                     GDT=self._dtype([g]), FRESH=bool(fresh), MOMENTS=moments, ALIGNED=_aligned(g, sg, sq),
                     BLOCK=BLOCK, SPAN=HOOK_SPAN)
        if not moments:
            return None
        return self._combined(self._one_segment(programs, g.device), part, 5, 3, True, form=1)[0]

    def _one_segment(self, chunks: int, device: torch.device) -> _Chunks:
        """The combine table of one segment made of ``chunks`` partial rows (cached)."""
        key = ("one", device, chunks)
        got = self._chunks.get(key)
        if got is None:
            bounds = self._copy(torch.tensor([0, chunks], dtype=torch.long), device)
            got = self._chunks[key] = _Chunks(bounds, bounds, chunks, 1)
        return got


def _aligned(*tensors: Tensor) -> bool:
    """Every tensor starts on a ``VEC``-element boundary (the hook kernels' wide blocks)."""
    return all(t.data_ptr() % (VEC * t.element_size()) == 0 for t in tensors)


def _combine_flags(k: int, nsum: int, minmax: bool, form: int = 0) -> tuple[str, dict[str, Any]]:
    return "combine", dict(K=k, NSUM=nsum, MINMAX=minmax, FORM=form)


def _finish_flags(k: int, on: bool) -> list[tuple[str, dict[str, Any]]]:
    """``finish`` after an ``adam_step`` whose table ``adam_tables`` built (``k`` its row
    width: 5 is LAMB's first pass, with trust ratios adapted or not)."""
    return [("finish", dict(K=k, ON=on, TRUST=int(k == 5), ADAPT=adapt, BLOCK=_TABLE_BLOCK))
            for adapt in ((False, True) if k == 5 else (False,))]


def _lamb_apply_flags(pdt: tl.dtype, on: bool, ema: bool) -> tuple[str, dict[str, Any]]:
    """LAMB's second pass after ``adam_step(apply=False)``: it reads p̂ again only for the
    ``update`` placement (``VRLamb._update``)."""
    return "lamb_apply", dict(PDT=pdt, ON=on, EMA=ema, BLOCK=BLOCK)


def _with_column(segf: Tensor, width: int, col: Callable[[Tensor], Tensor]) -> Tensor:
    """The table with one more float64 column computed on the device (a Python float would
    reach the kernel as fp32; the C++ kernels round ``lr / bc1`` from float64 once); a table
    ``width`` wide has it already (``adam_tables``/``finish`` wrote it)."""
    if segf.shape[1] == width:
        return segf
    return torch.cat([segf, col(segf).unsqueeze(1)], dim=1).contiguous()


def available() -> str | None:
    """None when the kernels can run here, else why not."""
    if INTERPRETED:
        return None
    if not torch.cuda.is_available():
        return "no CUDA device (on CPU the kernels run only under TRITON_INTERPRET=1)"
    return None
