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

No host synchronisation: the tables are built on the host from shapes only (cached), copied
to the device from pinned memory without blocking; per-segment columns arrive as device
float64 tables; the step's non-finite decision arrives as a device flag ``found_inf`` that
turns every store into a no-op (a skipped chunk has zero length), as torch's fused AdamW
takes ``found_inf``. Kernels return device tensors and never read them back.

Element-wise arithmetic follows the reference (``_impl.Reference``) op for op, in fp32, with
IEEE division and square root (``div_rn``, ``sqrt_rn``) and no FMA contraction on the GPU
(``enable_fp_fusion=False``), so only the order of summation differs. (Triton's interpreter
rounds fp32 -> bf16 by truncation; on the GPU the conversion rounds to nearest even.)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from vrgd_ds.optim import columns
from vrgd_ds.optim._impl import BOTH_MOMENTS, PLACEMENTS

Tensors = Sequence[Tensor]

# Columns of the per-segment tables (columns.py); the Adam and LAMB tables get one more column
# computed on the device before the launch (lr / bc1, lr · trust).
_INV_MEAN: tl.constexpr = columns.index(columns.GSNR, "inv_mean")
_LO: tl.constexpr = columns.index(columns.GSNR, "lo")
_BC3: tl.constexpr = columns.index(columns.GSNR, "bc3")
_NORMS_W: tl.constexpr = len(columns.NORMS)
_SGD_LR_MULT: tl.constexpr = columns.index(columns.SGD, "lr_mult")
_SGD_FIRST: tl.constexpr = columns.index(columns.SGD, "first")
_SGD_W: tl.constexpr = len(columns.SGD)
_ADAM_BC1: tl.constexpr = columns.index(columns.ADAM, "bc1")
_ADAM_BC2S: tl.constexpr = columns.index(columns.ADAM, "bc2s")
_ADAM_GRAD_MULT: tl.constexpr = columns.index(columns.ADAM, "grad_mult")
_ADAM_STEP_SIZE: tl.constexpr = len(columns.ADAM)
_ADAM_W: tl.constexpr = len(columns.ADAM) + 1
_LAMB_BC1: tl.constexpr = columns.index(columns.LAMB_APPLY, "bc1")
_LAMB_BC2S: tl.constexpr = columns.index(columns.LAMB_APPLY, "bc2s")
_LAMB_TRUST: tl.constexpr = columns.index(columns.LAMB_APPLY, "trust")
_LAMB_STEP: tl.constexpr = len(columns.LAMB_APPLY)
_LAMB_W: tl.constexpr = len(columns.LAMB_APPLY) + 1

CHUNK = 1 << 16  # elements per program
BLOCK = 1024  # elements per iteration inside a program
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---- shared device helpers --------------------------------------------------------------------


@triton.jit
def _chunk(chunks, c, found):
    """(tensor index, start, length, segment) of chunk ``c``; length 0 when ``found`` is set."""
    t = tl.load(chunks + c * 4 + 0)
    start = tl.load(chunks + c * 4 + 1)
    n = tl.load(chunks + c * 4 + 2)
    s = tl.load(chunks + c * 4 + 3)
    if found is not None:
        n = n * (1 - (tl.load(found) != 0).to(tl.int64))
    return t, start, n, s


@triton.jit
def _gsnr_raw(sg, sq, inv_n, eps):
    gbar = sg * inv_n
    s = sq * inv_n
    g2 = gbar * gbar
    var = tl.maximum(s - g2, 0.0)
    return tl.div_rn(g2, var + eps)


@triton.jit
def _p_hat(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, b3, omb3, ON: tl.constexpr, EMA: tl.constexpr,
           WRITE: tl.constexpr):
    """The GSNR scale p̂ of elements ``idx`` (the reference's ``_Gsnr.__call__``) and the
    indicators of r_t raised to lo / cut to 1. ``SG``/``SQ``/``AVG``: typed base pointers."""
    if ON:
        sg = tl.load(SG + idx, mask=m, other=0.0)
        sq = tl.load(SQ + idx, mask=m, other=0.0)
        x = _gsnr_raw(sg, sq, inv_n, eps) * inv_mean
        low = tl.where(m & (x < lo), 1.0, 0.0)
        high = tl.where(m & (x > 1.0), 1.0, 0.0)
        r = tl.minimum(tl.maximum(x, lo), 1.0)
        if EMA:
            a = tl.load(AVG + idx, mask=m, other=0.0) * b3 + r * omb3
            if WRITE:
                tl.store(AVG + idx, a, mask=m)
            r = tl.minimum(tl.maximum(tl.div_rn(a, bc3), lo), 1.0)
    else:
        r = tl.full(idx.shape, 1.0, tl.float32)
        low = tl.zeros(idx.shape, tl.float32)
        high = tl.zeros(idx.shape, tl.float32)
    return r, low, high


@triton.jit
def _p_hat_written(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, ON: tl.constexpr, EMA: tl.constexpr):
    """p̂ once ``_p_hat(WRITE=True)`` ran this step: the GSNR momentum is read back."""
    if ON:
        if EMA:
            r = tl.minimum(tl.maximum(tl.div_rn(tl.load(AVG + idx, mask=m, other=0.0), bc3), lo), 1.0)
        else:
            sg = tl.load(SG + idx, mask=m, other=0.0)
            sq = tl.load(SQ + idx, mask=m, other=0.0)
            r = tl.minimum(tl.maximum(_gsnr_raw(sg, sq, inv_n, eps) * inv_mean, lo), 1.0)
    else:
        r = tl.full(idx.shape, 1.0, tl.float32)
    return r


@triton.jit
def _ptr(table, t, DT: tl.constexpr):
    return tl.load(table + t).to(tl.pointer_type(DT))


@triton.jit
def _seg_f(segf, s, j, K: tl.constexpr):
    return tl.load(segf + s * K + j)


@triton.jit
def _combine(part, bounds, out, K: tl.constexpr, NSUM: tl.constexpr, MINMAX: tl.constexpr):
    """Per segment ``s``: the partial rows of its chunks ``bounds[s]..bounds[s+1]`` combined in
    chunk order, in float64. Columns ``0..NSUM-1`` are summed; with ``MINMAX`` the next two are
    a minimum and a maximum."""
    s = tl.program_id(0)
    c0 = tl.load(bounds + s)
    c1 = tl.load(bounds + s + 1)
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


# ---- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _moments_kernel(SG_T, SQ_T, chunks, part, inv_n, eps, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s = _chunk(chunks, c, None)
    SG = _ptr(SG_T, t, tl.float32)
    SQ = _ptr(SQ_T, t, tl.float32)
    sr = tl.zeros([BLOCK], tl.float32)
    ss = tl.zeros([BLOCK], tl.float32)
    sgb = tl.zeros([BLOCK], tl.float32)
    mn = tl.full([BLOCK], float("inf"), tl.float32)
    mx = tl.full([BLOCK], float("-inf"), tl.float32)
    for off in range(0, n, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        m = rel < n
        idx = start + rel
        sg = tl.load(SG + idx, mask=m, other=0.0)
        sq = tl.load(SQ + idx, mask=m, other=0.0)
        gbar = sg * inv_n
        r = _gsnr_raw(sg, sq, inv_n, eps)
        sr += tl.where(m, r, 0.0)
        ss += sq * inv_n
        sgb += gbar * gbar
        mn = tl.minimum(mn, tl.where(m, r, float("inf")))
        mx = tl.maximum(mx, tl.where(m, r, float("-inf")))
    row = part + c * 5
    tl.store(row + 0, tl.sum(sr, axis=0).to(tl.float64))
    tl.store(row + 1, tl.sum(ss, axis=0).to(tl.float64))
    tl.store(row + 2, tl.sum(sgb, axis=0).to(tl.float64))
    tl.store(row + 3, tl.min(mn, axis=0).to(tl.float64))
    tl.store(row + 4, tl.max(mx, axis=0).to(tl.float64))


@triton.jit
def _grad_norms_kernel(P_T, G_T, SG_T, SQ_T, AVG_T, chunks, segf, part, inv_n, eps, b3,
                       PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s = _chunk(chunks, c, None)
    P = _ptr(P_T, t, PDT)
    G = _ptr(G_T, t, PDT)
    SG = _ptr(SG_T, t, tl.float32) if ON else P
    SQ = _ptr(SQ_T, t, tl.float32) if ON else P
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else P
    inv_mean = _seg_f(segf, s, _INV_MEAN, _NORMS_W).to(tl.float32)
    lo = _seg_f(segf, s, _LO, _NORMS_W).to(tl.float32)
    bc3 = _seg_f(segf, s, _BC3, _NORMS_W).to(tl.float32)
    pp = tl.zeros([BLOCK], tl.float32)
    uu = tl.zeros([BLOCK], tl.float32)
    for off in range(0, n, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        m = rel < n
        idx = start + rel
        p = tl.load(P + idx, mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + idx, mask=m, other=0.0).to(tl.float32)
        r, low, high = _p_hat(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, b3, 1.0 - b3, ON, EMA, False)
        u = r * g
        pp += p * p
        uu += u * u
    tl.store(part + c * 2 + 0, tl.sum(pp, axis=0).to(tl.float64))
    tl.store(part + c * 2 + 1, tl.sum(uu, axis=0).to(tl.float64))


@triton.jit
def _sgd_kernel(P_T, G_T, B_T, SG_T, SQ_T, AVG_T, chunks, segf, part, found, inv_n, eps, b3, lr, wd, mu, omd,
                PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr, BUF: tl.constexpr, NESTEROV: tl.constexpr,
                BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s = _chunk(chunks, c, found)
    P = _ptr(P_T, t, PDT)
    G = _ptr(G_T, t, PDT)
    B = _ptr(B_T, t, tl.float32) if BUF else P
    SG = _ptr(SG_T, t, tl.float32) if ON else P
    SQ = _ptr(SQ_T, t, tl.float32) if ON else P
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else P
    inv_mean = _seg_f(segf, s, _INV_MEAN, _SGD_W).to(tl.float32)
    lo = _seg_f(segf, s, _LO, _SGD_W).to(tl.float32)
    bc3 = _seg_f(segf, s, _BC3, _SGD_W).to(tl.float32)
    mult = _seg_f(segf, s, _SGD_LR_MULT, _SGD_W).to(tl.float32)
    first = _seg_f(segf, s, _SGD_FIRST, _SGD_W) != 0.0
    nlo = tl.zeros([BLOCK], tl.float32)
    nhi = tl.zeros([BLOCK], tl.float32)
    nsc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, n, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        m = rel < n
        idx = start + rel
        pv = tl.load(P + idx, mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + idx, mask=m, other=0.0).to(tl.float32)
        r, low, high = _p_hat(SG, SQ, AVG, idx, m, inv_n, eps, inv_mean, lo, bc3, b3, 1.0 - b3, ON, EMA, True)
        d = r * g
        d = d + wd * pv
        d = d * mult
        if BUF:
            bv = tl.load(B + idx, mask=m, other=0.0)
            bv = tl.where(first, d, bv * mu + d * omd)
            tl.store(B + idx, bv, mask=m)
            if NESTEROV:
                d = d + bv * mu
            else:
                d = bv
        tl.store(P + idx, (pv - lr * d).to(PDT, fp_downcast_rounding="rtne"), mask=m)
        nlo += low
        nhi += high
        nsc += tl.where(m, r, 0.0)
    tl.store(part + c * 3 + 0, tl.sum(nlo, axis=0).to(tl.float64))
    tl.store(part + c * 3 + 1, tl.sum(nhi, axis=0).to(tl.float64))
    tl.store(part + c * 3 + 2, tl.sum(nsc, axis=0).to(tl.float64))


@triton.jit
def _adam_kernel(P_T, G_T, M_T, V_T, SG_T, SQ_T, AVG_T, chunks, segf, part, found, inv_n, eps_gsnr, b3, b1, omb1,
                 b2, omb2, eps, wd, decay, PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr,
                 APPLY: tl.constexpr, PLACE: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s = _chunk(chunks, c, found)
    P = _ptr(P_T, t, PDT)
    G = _ptr(G_T, t, PDT)
    M = _ptr(M_T, t, tl.float32)
    V = _ptr(V_T, t, tl.float32)
    SG = _ptr(SG_T, t, tl.float32) if ON else M
    SQ = _ptr(SQ_T, t, tl.float32) if ON else M
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else M
    inv_mean = _seg_f(segf, s, _INV_MEAN, _ADAM_W).to(tl.float32)
    lo = _seg_f(segf, s, _LO, _ADAM_W).to(tl.float32)
    bc3 = _seg_f(segf, s, _BC3, _ADAM_W).to(tl.float32)
    bc1 = _seg_f(segf, s, _ADAM_BC1, _ADAM_W).to(tl.float32)
    bc2s = _seg_f(segf, s, _ADAM_BC2S, _ADAM_W).to(tl.float32)
    mult = _seg_f(segf, s, _ADAM_GRAD_MULT, _ADAM_W).to(tl.float32)
    step_size = _seg_f(segf, s, _ADAM_STEP_SIZE, _ADAM_W).to(tl.float32)  # lr / bc1 rounded once from float64
    pp = tl.zeros([BLOCK], tl.float32)
    uu = tl.zeros([BLOCK], tl.float32)
    nlo = tl.zeros([BLOCK], tl.float32)
    nhi = tl.zeros([BLOCK], tl.float32)
    nsc = tl.zeros([BLOCK], tl.float32)
    for off in range(0, n, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        m = rel < n
        idx = start + rel
        graw = tl.load(G + idx, mask=m, other=0.0).to(tl.float32)
        r, low, high = _p_hat(SG, SQ, AVG, idx, m, inv_n, eps_gsnr, inv_mean, lo, bc3, b3, 1.0 - b3, ON, EMA, True)
        if PLACE == 2:  # update
            gm = graw * mult
        else:
            gm = (r * graw) * mult
        if PLACE == 1:  # both moments
            gv = gm
        else:
            gv = graw * mult
        mv = tl.load(M + idx, mask=m, other=0.0) * b1 + gm * omb1
        vv = tl.load(V + idx, mask=m, other=0.0) * b2 + (gv * gv) * omb2
        tl.store(M + idx, mv, mask=m)
        tl.store(V + idx, vv, mask=m)
        denom = tl.div_rn(tl.sqrt_rn(vv), bc2s) + eps
        pv = tl.load(P + idx, mask=m, other=0.0).to(tl.float32)
        if APPLY:
            step = tl.div_rn(mv, denom)
            if PLACE == 2:
                step = r * step
            tl.store(P + idx, (pv * decay - step_size * step).to(PDT, fp_downcast_rounding="rtne"), mask=m)
        else:
            step = tl.div_rn(mv, bc1 * denom)
            if PLACE == 2:
                step = r * step
            u = tl.where(m, step + wd * pv, 0.0)
            pp += pv * pv
            uu += u * u
        nlo += low
        nhi += high
        nsc += tl.where(m, r, 0.0)
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
def _lamb_apply_kernel(P_T, M_T, V_T, SG_T, SQ_T, AVG_T, chunks, segf, found, inv_n, eps_gsnr, eps, wd,
                       PDT: tl.constexpr, ON: tl.constexpr, EMA: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s = _chunk(chunks, c, found)
    P = _ptr(P_T, t, PDT)
    M = _ptr(M_T, t, tl.float32)
    V = _ptr(V_T, t, tl.float32)
    SG = _ptr(SG_T, t, tl.float32) if ON else M
    SQ = _ptr(SQ_T, t, tl.float32) if ON else M
    AVG = _ptr(AVG_T, t, tl.float32) if EMA else M
    inv_mean = _seg_f(segf, s, _INV_MEAN, _LAMB_W).to(tl.float32)
    lo = _seg_f(segf, s, _LO, _LAMB_W).to(tl.float32)
    bc3 = _seg_f(segf, s, _BC3, _LAMB_W).to(tl.float32)
    bc1 = _seg_f(segf, s, _LAMB_BC1, _LAMB_W).to(tl.float32)
    bc2s = _seg_f(segf, s, _LAMB_BC2S, _LAMB_W).to(tl.float32)
    step = _seg_f(segf, s, _LAMB_STEP, _LAMB_W).to(tl.float32)  # lr * trust rounded once from float64
    for off in range(0, n, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        m = rel < n
        idx = start + rel
        pv = tl.load(P + idx, mask=m, other=0.0).to(tl.float32)
        denom = tl.div_rn(tl.sqrt_rn(tl.load(V + idx, mask=m, other=0.0)), bc2s) + eps
        adam = tl.div_rn(tl.load(M + idx, mask=m, other=0.0), bc1 * denom)
        if ON:
            adam = _p_hat_written(SG, SQ, AVG, idx, m, inv_n, eps_gsnr, inv_mean, lo, bc3, ON, EMA) * adam
        u = adam + wd * pv
        tl.store(P + idx, (pv - step * u).to(PDT, fp_downcast_rounding="rtne"), mask=m)


@triton.jit
def _nonfinite_kernel(X_T, chunks, part, XDT: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0)
    t, start, n, s = _chunk(chunks, c, None)
    X = _ptr(X_T, t, XDT)
    bad = tl.zeros([BLOCK], tl.float32)
    for off in range(0, n, BLOCK):
        rel = off + tl.arange(0, BLOCK)
        m = rel < n
        x = tl.load(X + start + rel, mask=m, other=0.0).to(tl.float32)
        bad += tl.where(x == x, tl.where(tl.abs(x) < float("inf"), 0.0, 1.0), 1.0)
    tl.store(part + c, tl.sum(bad, axis=0).to(tl.float64))


@triton.jit
def _pack_squares_kernel(X, G, SQ, numel, c, WITH_G: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < numel
    x = tl.load(X + idx, mask=m, other=0.0).to(tl.float32)
    w = x * c
    if ACCUMULATE:
        if WITH_G:
            tl.store(G + idx, tl.load(G + idx, mask=m, other=0.0) + x, mask=m)
        tl.store(SQ + idx, tl.load(SQ + idx, mask=m, other=0.0) + w * w, mask=m)
    else:
        if WITH_G:
            tl.store(G + idx, x, mask=m)
        tl.store(SQ + idx, w * w, mask=m)


@triton.jit
def _accumulate_kernel(G, SG, SQ, numel, FRESH: tl.constexpr, BLOCK: tl.constexpr):
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = idx < numel
    x = tl.load(G + idx, mask=m, other=0.0).to(tl.float32)
    if FRESH:
        tl.store(SG + idx, x, mask=m)
        tl.store(SQ + idx, x * x, mask=m)
    else:
        tl.store(SG + idx, tl.load(SG + idx, mask=m, other=0.0) + x, mask=m)
        tl.store(SQ + idx, tl.load(SQ + idx, mask=m, other=0.0) + x * x, mask=m)


# ---- host side --------------------------------------------------------------------------------------


@dataclass
class _Chunks:
    table: Tensor  # int64 [C, 4] on the device: tensor, start, length, segment
    bounds: Tensor  # int64 [S + 1] on the device: each segment's first chunk
    count: int
    segments: int


def _to_device(host: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


class Triton:
    """The kernels of ``_impl.Kernels`` as Triton launches; every result stays on the device.

    ``sync_free``: the step orchestration (``GSNROptimizer``) keeps its tables on the device,
    decides a non-finite skip on the device and hands it over as ``found_inf``."""

    name = "triton"
    sync_free = True

    def __init__(self) -> None:
        self._chunks: dict[tuple, _Chunks] = {}
        self._launch = {} if INTERPRETED else {"enable_fp_fusion": False}

    # -- tables
    def chunks(self, seg: Tensor, device: torch.device) -> _Chunks:
        """The chunk table of a host segment table ``[S, 3]`` (cached by its content)."""
        if seg.device.type != "cpu":
            raise ValueError("the segment table must be a host (CPU) tensor: it is built from shapes")
        host = seg.numpy()  # host memory: reading it never waits for a device
        key = (device, host.shape, host.tobytes())
        got = self._chunks.get(key)
        if got is None:
            rows, bounds = [], [0]
            for s, (t, start, length) in enumerate(host.tolist()):
                for off in range(0, length, CHUNK):
                    rows.append((t, start + off, min(CHUNK, length - off), s))
                bounds.append(len(rows))
            table = torch.tensor(rows or [(0, 0, 0, 0)], dtype=torch.long).reshape(-1, 4)
            got = _Chunks(_to_device(table, device), _to_device(torch.tensor(bounds, dtype=torch.long), device),
                          len(rows), seg.shape[0])
            if len(self._chunks) > 64:
                self._chunks.clear()
            self._chunks[key] = got
        return got

    @staticmethod
    def ptrs(tensors: Tensors, device: torch.device) -> Tensor:
        if not tensors:
            return torch.zeros(1, dtype=torch.long, device=device)
        return _to_device(torch.tensor([t.data_ptr() for t in tensors], dtype=torch.long), device)

    def _combined(self, ch: _Chunks, part: Tensor, k: int, nsum: int, minmax: bool) -> Tensor:
        out = torch.empty(ch.segments, k, dtype=torch.float64, device=part.device)
        if ch.segments:
            _combine[(ch.segments,)](part, ch.bounds, out, K=k, NSUM=nsum, MINMAX=minmax)
        return out

    @staticmethod
    def _device(tensors: Tensors) -> torch.device:
        return tensors[0].device

    @staticmethod
    def _dtype(tensors: Tensors) -> tl.dtype:
        dt = tensors[0].dtype
        if any(t.dtype != dt for t in tensors) or dt not in _DTYPES:
            raise TypeError(f"Triton VRGD kernels take fp32/bf16/fp16 tensors of one dtype per call, got "
                            f"{sorted({str(t.dtype) for t in tensors})}")
        return _DTYPES[dt]

    # -- kernels
    def gsnr_moments(self, sum_g, sum_sq, seg, inv_n, eps):
        dev = self._device(sum_g)
        ch = self.chunks(seg, dev)
        part = torch.empty(max(ch.count, 1), 5, dtype=torch.float64, device=dev)
        if ch.count:
            _moments_kernel[(ch.count,)](self.ptrs(sum_g, dev), self.ptrs(sum_sq, dev), ch.table, part, float(inv_n),
                                         float(eps), BLOCK=BLOCK, **self._launch)
        c = self._combined(ch, part, 5, 3, True)
        flag = (~torch.isfinite(c[:, 1]) | ~torch.isfinite(c[:, 2])).double()
        return torch.stack([c[:, 0], c[:, 3], c[:, 4], c[:, 1], c[:, 2], flag], dim=1)

    def scaled_grad_norms(self, params, grads, sum_g, sum_sq, avg, seg, segf, inv_n, eps, beta3):
        dev = self._device(params)
        ch = self.chunks(seg, dev)
        part = torch.empty(max(ch.count, 1), 2, dtype=torch.float64, device=dev)
        if ch.count:
            _grad_norms_kernel[(ch.count,)](
                self.ptrs(params, dev), self.ptrs(grads, dev), self.ptrs(sum_g, dev), self.ptrs(sum_sq, dev),
                self.ptrs(avg, dev), ch.table, segf.contiguous(), part, float(inv_n), float(eps), float(beta3),
                PDT=self._dtype(params), ON=bool(sum_g), EMA=bool(avg), BLOCK=BLOCK, **self._launch)
        c = self._combined(ch, part, 2, 2, False)
        return torch.cat([c, (~torch.isfinite(c[:, 1:2])).double()], dim=1)

    def sgd_step(self, params, grads, bufs, sum_g, sum_sq, avg, seg, segf, inv_n, eps, beta3, lr, weight_decay,
                 momentum, dampening, nesterov, found_inf):
        dev = self._device(params)
        ch = self.chunks(seg, dev)
        part = torch.empty(max(ch.count, 1), 3, dtype=torch.float64, device=dev)
        if ch.count:
            buf = momentum != 0.0
            _sgd_kernel[(ch.count,)](
                self.ptrs(params, dev), self.ptrs(grads, dev), self.ptrs(bufs, dev), self.ptrs(sum_g, dev),
                self.ptrs(sum_sq, dev), self.ptrs(avg, dev), ch.table, segf.contiguous(), part, found_inf,
                float(inv_n), float(eps), float(beta3), float(lr), float(weight_decay), float(momentum),
                float(1.0 - dampening), PDT=self._dtype(params), ON=bool(sum_g), EMA=bool(avg), BUF=buf,
                NESTEROV=bool(nesterov) and buf, BLOCK=BLOCK, **self._launch)
        return self._combined(ch, part, 3, 3, False)

    def adam_step(self, params, grads, exp_avg, exp_avg_sq, sum_g, sum_sq, avg, seg, segf, inv_n, eps_gsnr, beta3,
                  lr, beta1, beta2, eps, weight_decay, apply, placement, found_inf):
        if placement not in range(len(PLACEMENTS)):
            raise ValueError(f"adam_step: unknown GSNR placement {placement}")
        dev = self._device(params)
        ch = self.chunks(seg, dev)
        k = 3 if apply else 5
        part = torch.empty(max(ch.count, 1), k, dtype=torch.float64, device=dev)
        if ch.count:
            on = bool(sum_g)
            _adam_kernel[(ch.count,)](
                self.ptrs(params, dev), self.ptrs(grads, dev), self.ptrs(exp_avg, dev), self.ptrs(exp_avg_sq, dev),
                self.ptrs(sum_g, dev), self.ptrs(sum_sq, dev), self.ptrs(avg, dev), ch.table,
                _with_column(segf, lr / segf[:, _ADAM_BC1]), part, found_inf, float(inv_n), float(eps_gsnr), float(beta3), float(beta1), float(1.0 - beta1),
                float(beta2), float(1.0 - beta2), float(eps), float(weight_decay), float(1.0 - lr * weight_decay),
                PDT=self._dtype(params), ON=on,
                EMA=bool(avg), APPLY=bool(apply), PLACE=placement if on else BOTH_MOMENTS, BLOCK=BLOCK,
                **self._launch)
        return self._combined(ch, part, k, k, False)

    def lamb_apply(self, params, exp_avg, exp_avg_sq, sum_g, sum_sq, avg, seg, segf, inv_n, eps_gsnr, beta3, lr,
                   eps, weight_decay, found_inf):
        dev = self._device(params)
        ch = self.chunks(seg, dev)
        if ch.count:
            _lamb_apply_kernel[(ch.count,)](
                self.ptrs(params, dev), self.ptrs(exp_avg, dev), self.ptrs(exp_avg_sq, dev), self.ptrs(sum_g, dev),
                self.ptrs(sum_sq, dev), self.ptrs(avg, dev), ch.table, _with_column(segf, lr * segf[:, _LAMB_TRUST]), found_inf,
                float(inv_n), float(eps_gsnr), float(eps), float(weight_decay), PDT=self._dtype(params),
                ON=bool(sum_g), EMA=bool(avg), BLOCK=BLOCK, **self._launch)

    def nonfinite(self, tensors, seg):
        dev = self._device(tensors)
        ch = self.chunks(seg, dev)
        part = torch.empty(max(ch.count, 1), 1, dtype=torch.float64, device=dev)
        if ch.count:
            _nonfinite_kernel[(ch.count,)](self.ptrs(tensors, dev), ch.table, part, XDT=self._dtype(tensors),
                                           BLOCK=BLOCK, **self._launch)
        return (self._combined(ch, part, 1, 1, False)[:, 0] > 0).double()

    def pack_squares(self, src, g_out, sq_out, c, accumulate=False):
        x = src.reshape(-1)
        numel = x.numel()
        if numel:
            _pack_squares_kernel[(triton.cdiv(numel, BLOCK),)](x, sq_out if g_out is None else g_out, sq_out, numel,
                                                               float(c), WITH_G=g_out is not None,
                                                               ACCUMULATE=bool(accumulate), BLOCK=BLOCK, **self._launch)

    def accumulate_moments(self, grad, sum_g, sum_sq, fresh, inv_n=0.0, eps=0.0):
        g = grad.reshape(-1)
        if not g.is_contiguous():
            g = g.contiguous()
        numel = g.numel()
        if numel:
            _accumulate_kernel[(triton.cdiv(numel, BLOCK),)](g, sum_g.view(-1), sum_sq.view(-1), numel,
                                                             FRESH=bool(fresh), BLOCK=BLOCK, **self._launch)
        return None  # pass 1 is the step's own stage 1 here


def _with_column(segf: Tensor, col: Tensor) -> Tensor:
    """The table with one more float64 column computed on the device (a Python float would
    reach the kernel as fp32; the C++ kernels round ``lr / bc1`` from float64 once)."""
    return torch.cat([segf, col.unsqueeze(1)], dim=1).contiguous()


def available() -> str | None:
    """None when the kernels can run here, else why not."""
    if INTERPRETED:
        return None
    if not torch.cuda.is_available():
        return "no CUDA device (on CPU the kernels run only under TRITON_INTERPRET=1)"
    return None
