"""The element-wise kernels of the family: a single-tensor reference in torch ops (any
device), the fused multi-tensor CPU kernels (``_fused/kernels.cpp``) and the Triton
multi-tensor kernels for CUDA (``_triton.py``).

Both take the same arguments: lists of flat tensors cut into segments by an int64
``seg`` table ``[S, 3]`` of (tensor index, start, length), per-segment float64 tables, and
return per-segment float64 reductions. The optimizers' family logic (bias corrections,
trust ratios, metrics) is written once on top of this interface; tests run every
optimizer through both and compare (the torch.optim foreach-vs-for-loop pattern).

The reference applies the operations in the kernels' order with the same roundings;
the kernels only sum in another order.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import Tensor

from vrgd_ds import gsnr as G
from vrgd_ds.optim.columns import (BOTH_MOMENTS, COL, FIRST_MOMENT, PLACEMENTS, UPDATE, BucketTable, DeviceTables,  # noqa: F401 (re-exported)
                                   KernelFailure, Kernels, Tensors)
from vrgd_ds.log import warn_once

logger = logging.getLogger(__name__)

def _piece(t: Tensor, start: int, length: int) -> Tensor:
    return t.view(-1).narrow(0, start, length)


def _sum(x: Tensor) -> float:
    return float(x.sum(dtype=torch.float64))


class _Gsnr:
    """Per-segment GSNR scale of the reference: p_hat, and r_t's clip indicators."""

    def __init__(self, sum_g: Tensors, sum_sq: Tensors, avg: Tensors, inv_n: float, eps: float, beta3: float):
        self.on = len(sum_g) > 0
        self.sum_g, self.sum_sq, self.avg = sum_g, sum_sq, avg
        self.inv_n, self.eps, self.beta3 = inv_n, eps, beta3

    def __call__(self, t: int, start: int, length: int, row: Tensor, write: bool) -> tuple[Tensor | float, float, float]:
        if not self.on:
            return 1.0, 0.0, 0.0
        inv_mean, lo, bc3 = float(row[COL.INV_MEAN]), float(row[COL.LO]), float(row[COL.BC3])
        sg = _piece(self.sum_g[t], start, length)
        sq = _piece(self.sum_sq[t], start, length)
        # gsnr() multiplies by 1/n: same rounding as the kernels' float(inv_n).
        raw = G.gsnr(sg, sq, round(1.0 / self.inv_n), self.eps)
        low, high = G.clip_counts(raw, inv_mean, lo)
        r = G.normalize(raw, inv_mean, lo)
        if not self.avg:
            return r, low, high
        a = _piece(self.avg[t], start, length)
        new = G.momentum(a, r, self.beta3)
        if write:
            a.copy_(new)
        return G.p_hat(new, bc3, lo), low, high

    def written(self, t: int, start: int, length: int, row: Tensor) -> Tensor | float:
        """p̂ once ``__call__(write=True)`` ran this step: the GSNR momentum is read back."""
        if not self.on:
            return 1.0
        if not self.avg:
            return self(t, start, length, row, write=False)[0]
        lo, bc3 = float(row[COL.LO]), float(row[COL.BC3])
        return G.p_hat(_piece(self.avg[t], start, length), bc3, lo)


def _scale_sum(sc: Tensor | float, length: int) -> float:
    return _sum(sc) if isinstance(sc, Tensor) else sc * length


class Reference:
    """Single-tensor reference: one segment at a time, torch ops, any device."""

    name = "reference"
    sync_free = False  # the host decides a skip: ``found_inf`` is always None here

    def gsnr_moments(self, sum_g, sum_sq, seg, inv_n, eps):
        out = torch.zeros(seg.shape[0], 6, dtype=torch.float64)
        n = round(1.0 / inv_n)
        for i, (t, start, length) in enumerate(seg.tolist()):
            sg, sq = _piece(sum_g[t], start, length), _piece(sum_sq[t], start, length)
            r = G.gsnr(sg, sq, n, eps)
            gbar = sg * inv_n
            s = sq * inv_n
            out[i, 0] = _sum(r)
            out[i, 1] = float(r.min()) if length else float("inf")
            out[i, 2] = float(r.max()) if length else float("-inf")
            out[i, 3] = _sum(s)
            out[i, 4] = _sum(gbar * gbar)
        out[:, 5] = (~torch.isfinite(out[:, 3]) | ~torch.isfinite(out[:, 4])).double()
        return out

    def scaled_grad_norms(self, params, grads, sum_g, sum_sq, avg, seg, segf, inv_n, eps, beta3):
        scale = _Gsnr(sum_g, sum_sq, avg, inv_n, eps, beta3)
        out = torch.zeros(seg.shape[0], 3, dtype=torch.float64)
        for i, (t, start, length) in enumerate(seg.tolist()):
            p = _piece(params[t], start, length).float()
            g = _piece(grads[t], start, length).float()
            u = scale(t, start, length, segf[i], write=False)[0] * g
            out[i, 0] = _sum(p * p)
            out[i, 1] = _sum(u * u)
        out[:, 2] = (~torch.isfinite(out[:, 1])).double()
        return out

    def sgd_step(self, params, grads, bufs, sum_g, sum_sq, avg, seg, segf, inv_n, eps, beta3, lr, weight_decay,
                 momentum, dampening, nesterov, found_inf=None):
        scale = _Gsnr(sum_g, sum_sq, avg, inv_n, eps, beta3)
        out = torch.zeros(seg.shape[0], 3, dtype=torch.float64)
        for i, (t, start, length) in enumerate(seg.tolist()):
            p = _piece(params[t], start, length)
            pv = p.float()
            sc, out[i, 0], out[i, 1] = scale(t, start, length, segf[i], write=True)
            out[i, 2] = _scale_sum(sc, length)
            d = sc * _piece(grads[t], start, length).float()
            d = d + weight_decay * pv
            d = d * float(segf[i, COL.SGD_LR_MULT])
            if momentum != 0.0:
                b = _piece(bufs[t], start, length)
                if float(segf[i, COL.SGD_FIRST]) != 0.0:
                    b.copy_(d)
                else:
                    b.copy_(b * momentum + d * (1.0 - dampening))
                d = d + b * momentum if nesterov else b
            p.copy_(pv - lr * d)
        return out

    def adam_step(self, params, grads, exp_avg, exp_avg_sq, sum_g, sum_sq, avg, seg, segf, inv_n, eps_gsnr, beta3,
                  lr, beta1, beta2, eps, weight_decay, apply, placement, found_inf=None, apply_dtype=None):
        if placement not in range(len(PLACEMENTS)):
            raise ValueError(f"adam_step: unknown GSNR placement {placement}")
        scale = _Gsnr(sum_g, sum_sq, avg, inv_n, eps_gsnr, beta3)
        out = torch.zeros(seg.shape[0], 3 if apply else 5, dtype=torch.float64)
        for i, (t, start, length) in enumerate(seg.tolist()):
            row = segf[i]
            bc1, bc2s, mult = float(row[COL.ADAM_BC1]), float(row[COL.ADAM_BC2S]), float(row[COL.ADAM_GRAD_MULT])
            p = _piece(params[t], start, length)
            m, v = _piece(exp_avg[t], start, length), _piece(exp_avg_sq[t], start, length)
            sc, low, high = scale(t, start, length, row, write=True)
            graw = _piece(grads[t], start, length).float()
            gm = (graw if placement == UPDATE else sc * graw) * mult
            gv = gm if placement == BOTH_MOMENTS else graw * mult
            m.copy_(m * beta1 + gm * (1.0 - beta1))
            v.copy_(v * beta2 + (gv * gv) * (1.0 - beta2))
            denom = v.sqrt() / bc2s + eps
            on_update = sc if placement == UPDATE else 1.0
            if apply:
                pv = p.float() * (1.0 - lr * weight_decay)
                p.copy_(pv - (lr / bc1) * (on_update * (m / denom)))
                out[i] = torch.tensor([low, high, _scale_sum(sc, length)], dtype=torch.float64)
            else:
                pv = p.float()
                u = on_update * (m / (bc1 * denom)) + weight_decay * pv
                out[i] = torch.tensor([_sum(pv * pv), _sum(u * u), low, high, _scale_sum(sc, length)],
                                      dtype=torch.float64)
        return out

    def lamb_apply(self, params, exp_avg, exp_avg_sq, sum_g, sum_sq, avg, seg, segf, inv_n, eps_gsnr, beta3, lr,
                   eps, weight_decay, found_inf=None):
        scale = _Gsnr(sum_g, sum_sq, avg, inv_n, eps_gsnr, beta3)
        for i, (t, start, length) in enumerate(seg.tolist()):
            bc1, bc2s, trust = (float(segf[i, c]) for c in (COL.LAMB_BC1, COL.LAMB_BC2S, COL.LAMB_TRUST))
            p = _piece(params[t], start, length)
            m, v = _piece(exp_avg[t], start, length), _piece(exp_avg_sq[t], start, length)
            pv = p.float()
            denom = v.sqrt() / bc2s + eps
            u = scale.written(t, start, length, segf[i]) * (m / (bc1 * denom)) + weight_decay * pv
            p.copy_(pv - (lr * trust) * u)

    def pack_squares(self, src, g_out, sq_out, c, accumulate=False):
        x = src.reshape(-1).float()
        w = x * c
        if accumulate:
            if g_out is not None:
                g_out.add_(x)
            sq_out.add_(w * w)
            return
        if g_out is not None:
            g_out.copy_(x)
        torch.mul(w, w, out=sq_out)

    def pack_bucket(self, src, table, out, c, g_scale, main=None):
        table.check(src, out, g_scale is not None, main)
        flat = src.reshape(-1)
        for s, g, q, n, acc in table.rows.tolist():
            if main is not None:
                main.view(-1).narrow(0, s, n).add_(flat.narrow(0, s, n))
            x = flat.narrow(0, s, n).float()
            w = x * c
            sq = out.narrow(0, q, n)
            if acc:
                sq.add_(w * w)
            else:
                torch.mul(w, w, out=sq)
            if g_scale is not None:
                dg = out.narrow(0, g, n)
                if acc:
                    dg.add_(x * g_scale)
                else:
                    torch.mul(x, g_scale, out=dg)

    def unpack_bucket(self, src, table, out, src_sq, with_g):
        table.check(src, out, with_g)
        if src.dtype != torch.float32 or table.cache["ends"][1] + src_sq > src.numel():
            raise ValueError("unpack_bucket: an fp32 source that holds every row's squares")
        flat = src.reshape(-1)
        for s, g, q, n, acc in table.rows.tolist():
            pairs = [(q, s + src_sq)] + ([(g, s)] if with_g else [])
            for dst, start in pairs:
                d, x = out.narrow(0, dst, n), flat.narrow(0, start, n)
                if acc:
                    d.add_(x)
                else:
                    d.copy_(x)

    def nonfinite(self, tensors, seg):
        return torch.tensor([0.0 if bool(torch.isfinite(_piece(tensors[t], start, length)).all()) else 1.0
                             for t, start, length in seg.tolist()], dtype=torch.float64)

    def accumulate_moments(self, grad, sum_g, sum_sq, fresh, inv_n=0.0, eps=0.0):
        x = grad.reshape(sum_g.shape).float()
        if fresh:
            sum_g.copy_(x)
            torch.mul(x, x, out=sum_sq)
        else:
            sum_g.add_(x)
            sum_sq.add_(x * x)


class Fused:
    """The fused multi-tensor CPU kernels, built on first use."""

    name = "fused"
    sync_free = False  # the host decides a skip: ``found_inf`` is always None here

    def __init__(self) -> None:
        from vrgd_ds.optim import _fused

        self._k = _fused.load()

    def __getattr__(self, item: str):
        return getattr(self._k, item)

    def sgd_step(self, *args, found_inf=None, **kwargs):
        return self._k.sgd_step(*args, **kwargs)

    def adam_step(self, *args, found_inf=None, apply_dtype=None, **kwargs):
        return self._k.adam_step(*args, **kwargs)

    def lamb_apply(self, *args, found_inf=None, **kwargs):
        return self._k.lamb_apply(*args, **kwargs)

    def pack_squares(self, src, g_out, sq_out, c, accumulate=False):
        self._k.pack_squares(src.contiguous().view(-1), g_out, sq_out, c, accumulate)

    def pack_bucket(self, src, table, out, c, g_scale, main=None):
        table.check(src, out, g_scale is not None, main)
        self._k.pack_bucket(src.reshape(-1), table.rows, out, c, g_scale, None if main is None else main.view(-1))

    def unpack_bucket(self, src, table, out, src_sq, with_g):
        table.check(src, out, with_g)
        if src.dtype != torch.float32 or table.cache["ends"][1] + src_sq > src.numel():
            raise ValueError("unpack_bucket: an fp32 source that holds every row's squares")
        self._k.unpack_bucket(src.reshape(-1), table.rows, out, src_sq, with_g)

    def accumulate_moments(self, grad, sum_g, sum_sq, fresh, inv_n=0.0, eps=0.0):
        return self._k.accumulate_moments(grad.contiguous().view(-1), sum_g.view(-1), sum_sq.view(-1), fresh,
                                          inv_n, eps)  # None (an undefined tensor) when inv_n == 0


_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: accepted values of the optimizers' ``fused`` argument
FUSED_CHOICES = (None, True, False, "triton")


class StepRetry(Exception):
    """A step's kernels failed before anything was written: the step is to be run again (on the
    reference, which the kernels now are)."""


class WithFallback:
    """The Triton kernels for ``fused=None``: when one fails to compile or launch at run time,
    the compiler's message is logged once and the reference takes over for good. A hook's call
    is redone on the reference at once (it only writes its outputs); a step's failure before any
    parameter or state was written raises ``StepRetry`` (the optimizer runs the step again), and
    after that a ``RuntimeError`` naming the fix (nothing is silently half-applied)."""

    _HOOKS = frozenset(("pack_squares", "pack_bucket", "unpack_bucket", "accumulate_moments"))

    def __init__(self, kernels: Kernels, owner: str) -> None:
        self.primary, self.reference, self.owner = kernels, Reference(), owner
        self.failure: KernelFailure | None = None
        self._step_writes = 0

    @property
    def active(self) -> Kernels:
        return self.reference if self.failure is not None else self.primary

    @property
    def name(self) -> str:
        return self.active.name

    @property
    def sync_free(self) -> bool:
        return self.active.sync_free

    def _writes(self) -> int:
        """Launches so far that wrote parameters or optimizer state."""
        return getattr(self.primary, "counts", {}).get("mutating_launches", 0)

    def new_step(self) -> None:
        """A step begins: nothing of it is written yet."""
        self._step_writes = self._writes()

    def _call(self, method: str, *args, **kwargs):
        if self.failure is None:
            try:
                return getattr(self.primary, method)(*args, **kwargs)
            except KernelFailure as exc:
                self.failure = exc
                logger.warning("%s: the %s kernels failed; using the reference implementation from now on "
                               "(fused=True raises instead): %s", self.owner, self.primary.name, exc)
                if method not in self._HOOKS:
                    if self._writes() > self._step_writes:
                        raise RuntimeError(f"{self.owner}: a {self.primary.name} kernel failed after this step "
                                           "had written parameters or state, so it cannot be redone; restart "
                                           "from the last checkpoint with fused=False") from exc
                    raise StepRetry() from exc
        kwargs.pop("found_inf", None)
        return getattr(self.reference, method)(*args, **kwargs)


def _fallback_method(method: str, protocol: type = Kernels):
    def call(self: WithFallback, *args, **kwargs):
        return self._call(method, *args, **kwargs)

    call.__name__ = call.__qualname__ = method
    call.__doc__ = getattr(protocol, method).__doc__
    return call


for _method in ("gsnr_moments", "scaled_grad_norms", "sgd_step", "adam_step", "lamb_apply", "nonfinite",
                "pack_squares", "pack_bucket", "unpack_bucket", "accumulate_moments"):  # the Kernels protocol
    setattr(WithFallback, _method, _fallback_method(_method))
for _method in ("checked_moments", "adam_tables", "finish", "sgd_tables", "lars_trust"):  # sync-free only: called while Triton is active
    setattr(WithFallback, _method, _fallback_method(_method, DeviceTables))


#: Triton releases [from, to) whose compiler the kernels passed ``vrgd_ds.optim.triton_aot`` with
#: (every specialization for sm_80 and sm_90: compiles, no spills, <= 128 registers, 128-bit bodies)
TESTED_TRITON = ((3, 8), (3, 10))


def _triton() -> tuple[Kernels | None, str | None]:
    """The Triton kernels, or why they cannot run here."""
    try:
        import triton

        from vrgd_ds.optim import _triton
    except ImportError as exc:  # triton ships with the CUDA torch wheels; pip install triton otherwise
        return None, f"triton is not importable ({exc})"
    version = tuple(int(x) for x in triton.__version__.split(".")[:2] if x.isdigit())
    if not TESTED_TRITON[0] <= version < TESTED_TRITON[1]:
        lo, hi = (".".join(map(str, v)) for v in TESTED_TRITON)
        warn_once(logger, "triton-version", "Triton %s: the kernels were compiled and checked with Triton >= %s, < %s; "
                  "check this one with `python -m vrgd_ds.optim.triton_aot` (a kernel that fails at run time "
                  "hands over to the reference implementation with fused=None)", triton.__version__, lo, hi,
                  scope="node")
    why = _triton.available()
    return (_triton.Triton(), None) if why is None else (None, why)


def select_for(optimizer: Any) -> Kernels:
    """``select`` for an optimizer's tensors and kernel choice (its ``fused``): what an engine's
    statistics source takes. The source gets an object of its own (a kernel failure there hands
    over to the reference for the source only); it never borrows the optimizer's."""
    return select(optimizer.fused, [p for g in optimizer.param_groups for p in g["params"]], optimizer.name)


def select(fused: bool | str | None, params: Sequence[Tensor], owner: str) -> Kernels:
    """The implementation for ``params``: on the CPU the fused C++ kernels, on CUDA the Triton
    kernels. ``fused=True`` demands the fused kernels of the parameters' device, ``False``
    takes the reference, ``"triton"`` the Triton kernels (on CPU tensors under
    ``TRITON_INTERPRET=1``, as the tests run them), ``None`` the fused kernels where they apply
    and the reference, with a warning naming the reason, where they do not."""
    if fused is False:
        return Reference()
    why_not = None
    if any(p.dtype not in _FUSED_DTYPES for p in params):
        why_not = "parameters are not fp32/bf16/fp16"
    elif len({p.device for p in params}) > 1:
        why_not = "parameters are on more than one device"
    on_cpu = all(p.device.type == "cpu" for p in params)
    if fused == "triton" or (why_not is None and not on_cpu):
        kernels, why = _triton()
        if why_not is None and kernels is not None:
            return kernels if fused else WithFallback(kernels, owner)
        why_not = why_not or why
        if fused:
            raise ValueError(f"{owner}(fused={fused!r}): {why_not}; pass fused=None or False")
        warn_once(logger, "triton-unavailable", "%s: using the reference implementation: %s", owner, why_not,
                  scope="node")
        return Reference()
    if why_not is not None:
        if fused:
            raise ValueError(f"{owner}(fused=True): {why_not}; pass fused=None or False")
        warn_once(logger, f"reference-{why_not}", "%s: using the reference implementation: %s", owner, why_not,
                  scope="node")
        return Reference()
    from vrgd_ds.optim import _fused

    try:
        return Fused()
    except _fused.FusedKernelsUnavailable as exc:
        if fused:
            raise
        warn_once(logger, "fused-unavailable", "%s: using the reference implementation: %s", owner, exc, scope="node")
        return Reference()
