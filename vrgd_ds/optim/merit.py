"""VR-MERIT and MERIT (Luo et al., ICML 2025, "MERIT: Maximum-normalized Element-wise Ratio for
Language Model Large-batch Training", arXiv 2508.20577, Algorithm 1; the authors' code
``NUS-HPC-AI-Lab/MERIT``, ``optim/merit.py``; Jiang et al., arXiv 2309.13681 for the GSNR part).

Algorithm 1, by line, with ‖·‖_m the max-norm (largest absolute value)::

    m = beta1 · m + (1 - beta1) · p̂ ⊙ g        v = beta2 · v + (1 - beta2) · g²      (lines 4-5)
    u = m / (sqrt(v) + eps) + wd · θ                                                   (line 6)
    b      = ‖θ‖_m / ‖u‖_m                       whole tensor                          (line 7)
    r_i    = ‖θ_i,:‖_m / ‖u_i,:‖_m               row i                                 (line 8)
    c_j    = ‖θ_:,j‖_m / ‖u_:,j‖_m               column j                              (line 9)
    s_ij   = max(max(r_i, c_j), b)                                                     (lines 10-11)
    θ     -= lr · clip(s ⊙ u, -1, 1)             element-wise                          (line 12)

Where the paper and the code differ, this follows the code, and says so:

* neither has a bias correction (``bias_correction=False`` by default; True divides m and v as Adam);
* the code sets s = 1 for an element whose row or column maximum of |θ| or |u| is 0, after the
  lower bound b (the paper has no guard);
* the paper writes Algorithm 1 for matrices; the code treats a tensor of two or more dimensions by
  its dims 0 and 1 (rows: maxima over dim 1, columns: over dim 0, further dims kept apart), and a
  1-D tensor (biases, LayerNorm) by the whole-tensor ratio b alone (1 if either maximum is 0);
* defaults are the code's: ``lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0`` (its
  docstring says eps 1e-8; the constructor uses 1e-6). The clip threshold is 1 in both.

What p̂ does here (``tests/unit/test_damping.py``): noise elements that share rows and columns
with signal elements are damped as in VR-LAMB (a [16, 64] matrix with scattered noise: 0.073 of
the signal's step against MERIT's 0.600); a row or column that is noise throughout is rescaled by
its own ratio to its weights' max-norm, which cancels p̂ there (0.661 against 0.685) — the
element-wise analogue of LAMB's trust ratio, which does the same to a tensor that is all noise.

A group with ``trust_ratio=False`` keeps s = 1 (``param_groups`` puts biases and norms there), the
clip still applies. p̂ enters as ``gsnr_placement`` says, where VR-LAMB puts it (``adam.py``).

Exact under ZeRO: a tensor cut across partitions completes its row and column maxima with one
small MAX all-reduce per ``step()`` call (``Layout.all_reduce``) of a table holding, per model
tensor, [max|θ|, max|u|, row and column maxima of |θ| and of |u|] — (2 + 2·(rows + columns)) fp32
values, about 1 % of a BERT weight matrix's elements — so every rank scales its elements exactly
as the unsharded computation. The moments run in the fused ``adam_step`` kernels; the ratios
are torch ops (no fused kernel: a one-time log line says so).
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
from torch import Tensor

from vrgd_ds.optim import _impl, columns
from vrgd_ds.optim.adam import (GSNR_PLACEMENTS, UPDATE_PLACEMENT, adam_columns, check_adam_group,
                                placement_index)
from vrgd_ds.optim.base import GSNROptimizer, constructor_args
from vrgd_ds.optim.checks import as_pair
from vrgd_ds.optim.functional import StepContext, member_step
from vrgd_ds.optim.plan import Plan

logger = logging.getLogger(__name__)


class MaxTable:
    """Where each model tensor's maxima live in one flat fp32 table:
    ``[max|θ|, max|u|, |θ| rows, |θ| columns, |u| rows, |u| columns]`` per key."""

    def __init__(self, shapes: dict[int, tuple[int, ...]]) -> None:
        self.base: dict[int, int] = {}
        self.dims: dict[int, tuple[int, int, int]] = {}  # key -> (rows a, columns b, kept R) for >= 2-D
        size = 0
        for key in sorted(shapes):
            shape = shapes[key]
            self.base[key] = size
            if len(shape) >= 2 and math.prod(shape):  # an empty tensor has no rows to take maxima of
                a, b, r = shape[0], shape[1], math.prod(shape[2:])
                self.dims[key] = (a, b, r)
                size += 2 + 2 * (a + b) * r
            else:
                size += 2
        self.size = size

    def split(self, key: int, offset: int, length: int) -> tuple[list[tuple[int, int]], tuple[int, int, int, int] | None]:
        """A piece of a >= 2-D tensor as its partial rows (at most a head and a tail, element
        ranges within the piece, read through ``indices``) and its whole rows ``(start, end,
        first row, end row)``, reduced and scaled as a ``[rows, b, R]`` view (no index tensors)."""
        a, b, r = self.dims[key]
        rs = b * r
        first, end = -(-offset // rs), (offset + length) // rs
        if end <= first:
            return [(0, length)], None
        s0, s1 = first * rs - offset, end * rs - offset
        return [(0, s0), (s1, length)], (s0, s1, first, end)

    def views(self, maxima: Tensor, key: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``[a, R]`` and ``[b, R]`` views of the |θ| and |u| row and column maxima of ``key``."""
        a, b, r = self.dims[key]
        w_rows = self.base[key] + 2
        sizes = (a * r, b * r, a * r, b * r)
        flat = maxima.narrow(0, w_rows, sum(sizes)).split(sizes)
        return flat[0].view(a, r), flat[1].view(b, r), flat[2].view(a, r), flat[3].view(b, r)

    def indices(self, key: int, offset: int, length: int, device: torch.device) -> tuple[Tensor, ...] | None:
        """Table positions of the |θ|-row, |θ|-column, |u|-row, |u|-column maxima of elements
        ``offset .. offset+length`` of tensor ``key`` (None for a tensor under 2-D)."""
        if key not in self.dims:
            return None
        a, b, r = self.dims[key]
        e = torch.arange(offset, offset + length, device=device)
        row = (e // (b * r)) * r + e % r
        col = ((e // r) % b) * r + e % r
        w_rows = self.base[key] + 2
        w_cols, u_rows = w_rows + a * r, w_rows + (a + b) * r
        u_cols = u_rows + a * r
        return w_rows + row, w_cols + col, u_rows + row, u_cols + col


@functools.lru_cache(maxsize=64)
def _table(shapes: tuple[tuple[int, tuple[int, ...]], ...]) -> MaxTable:
    """The table of these tensors, built once (the step asks for it every time)."""
    return MaxTable(dict(shapes))


def element_ratio(w_row: Tensor, w_col: Tensor, u_row: Tensor, u_col: Tensor, b: Tensor) -> Tensor:
    """``s = max(max(r, c), b)`` from the maxima of each element's row and column (lines 8-11),
    1 where any of them is 0 (the code's guard). Whole rows compute r and c per row and column
    first and broadcast (``_update``): the same operations on the same values, so the same bits."""
    zero = (w_row == 0) | (u_row == 0) | (w_col == 0) | (u_col == 0)
    s = torch.maximum(w_row / u_row, w_col / u_col).clamp_min(b)
    return torch.where(zero, 1.0, s)


def merit_update(plan: Plan, ctx: StepContext) -> dict[str, Tensor]:
    """VR-MERIT's update of one plan: the moments in the kernels, then the max-norm and the
    element-wise row/column ratios over each whole model tensor (maxima completed across ranks)
    in torch ops, and the clipped apply."""
    g, kernels, n, layout = plan.group, ctx.kernels, ctx.n, ctx.layout
    ctx.warn_once("merit-torch", "%s: the max-norm and element-wise ratios run in torch ops (no fused kernel); "
                  "the moments in the %s kernels", ctx.owner, kernels.name, scope="job")
    m = [st["exp_avg"] for st in plan.states]
    v = [st["exp_avg_sq"] for st in plan.states]
    cols = adam_columns(plan)
    gsnr_args = {k: val for k, val in plan.gsnr_args(n).items() if k != "eps"}
    placement = placement_index(plan)
    segf = columns.build(columns.ADAM, **cols)
    out = kernels.adam_step(plan.params, plan.grads, m, v, seg=plan.seg, segf=segf, lr=g["lr"],
                            beta1=g["betas"][0], beta2=g["betas"][1], eps=g["eps"],
                            weight_decay=g["weight_decay"], apply=False, placement=placement,
                            eps_gsnr=plan.eps_gsnr, **gsnr_args, **plan.skip_args())
    on_update = None
    if plan.gsnr and placement == UPDATE_PLACEMENT:  # p̂ on u, read back as the kernels left it (syncs)
        on_update = _impl._Gsnr(plan.sum_g, plan.sum_sq, plan.avg, gsnr_args["inv_n"], plan.eps_gsnr,
                                gsnr_args["beta3"])
        segf_host = segf.cpu()
    # host ints from the plan, per-segment values as device scalars: nothing is read back
    segs = [(t, start, length, key, offset) for t, start, length, key, _, offset in plan.rows]
    bc1, bc2s = cols["bc1"], cols["bc2s"]

    def update(i: int) -> tuple[Tensor, Tensor]:
        t, start, length = segs[i][:3]
        pv = plan.params[t].view(-1).narrow(0, start, length).float()
        mi, vi = (x[t].view(-1).narrow(0, start, length) for x in (m, v))
        if g["bias_correction"] or not g.get("grad_averaging", True):
            u = mi / (bc1[i].float() * (vi.sqrt() / bc2s[i].float() + g["eps"]))
        else:  # both corrections are 1 (MERIT's default): the same values, two passes fewer
            u = mi / (vi.sqrt() + g["eps"])
        if on_update is not None:
            u = on_update.written(t, start, length, segf_host[i]) * u
        return pv, (u + g["weight_decay"] * pv) if g["weight_decay"] else u

    device = plan.params[0].device if plan.params else plan.tdev
    # every rank builds the same table (all model tensors under ZeRO) for the collective
    table = _table(tuple(sorted(plan.shapes.items() if layout is None else enumerate(layout.shapes))))
    maxima = torch.zeros(table.size, dtype=torch.float32, device=device)
    for i, (_, _, length, key, offset) in enumerate(segs):
        pv, u = update(i)
        w_abs, u_abs = pv.abs(), u.abs()
        base = table.base[key]
        if length:
            maxima[base] = torch.maximum(maxima[base], w_abs.max())
            maxima[base + 1] = torch.maximum(maxima[base + 1], u_abs.max())
        if key not in table.dims:
            continue
        parts, rows = table.split(key, offset, length)
        for s0, s1 in parts:  # partial rows: through index tensors
            if s1 > s0:
                idx = table.indices(key, offset + s0, s1 - s0, device)
                for where, x in zip(idx, (w_abs[s0:s1], w_abs[s0:s1], u_abs[s0:s1], u_abs[s0:s1])):
                    maxima.scatter_reduce_(0, where, x, "amax")
        if rows is not None:  # whole rows: reductions over a [rows, b, R] view
            s0, s1, r0, r1 = rows
            w_row, w_col, u_row, u_col = table.views(maxima, key)
            for x, row, col in ((w_abs, w_row, w_col), (u_abs, u_row, u_col)):
                block = x[s0:s1].view(r1 - r0, *table.dims[key][1:])
                row[r0:r1] = torch.maximum(row[r0:r1], block.amax(1))
                col.copy_(torch.maximum(col, block.amax(0)))
    if layout is not None:
        layout.all_reduce(maxima, "max")

    adapt = bool(g["trust_ratio"])
    ratio = torch.ones(len(segs), dtype=torch.float64, device=device)
    adapted = torch.zeros(len(segs), dtype=torch.bool, device=device)
    for i, (t, start, length, key, offset) in enumerate(segs):
        pv, u = update(i)
        base = table.base[key]
        w_max, u_max = maxima[base], maxima[base + 1]
        whole = (w_max > 0) & (u_max > 0)
        b = torch.where(whole, w_max / torch.where(whole, u_max, 1.0), 1.0)
        ratio[i], adapted[i] = b.double(), whole & adapt
        if not adapt:
            s: Tensor | float = 1.0
        elif key not in table.dims:  # under 2-D: the whole-tensor ratio (1 if either maximum is 0)
            s = b
        else:
            s = torch.empty_like(u)
            parts, rows = table.split(key, offset, length)
            for s0, s1 in parts:
                if s1 > s0:
                    idx = table.indices(key, offset + s0, s1 - s0, device)
                    s[s0:s1] = element_ratio(*(maxima.index_select(0, j) for j in idx), b)
            if rows is not None:  # the ratios of the rows and columns first, then one broadcast
                s0, s1, r0, r1 = rows
                w_row, w_col, u_row, u_col = table.views(maxima, key)
                r, r_zero = w_row[r0:r1] / u_row[r0:r1], (w_row[r0:r1] == 0) | (u_row[r0:r1] == 0)
                c, c_zero = w_col / u_col, (w_col == 0) | (u_col == 0)
                full = torch.maximum(r[:, None], c[None]).clamp_min_(b)
                s[s0:s1] = torch.where(r_zero[:, None] | c_zero[None], 1.0, full).reshape(-1)
        new = pv - g["lr"] * (u * s).clamp(-1.0, 1.0)
        if plan.found is not None:  # the sync-free kernels skip on the device
            new = torch.where(plan.found > 0, pv, new)
        plan.params[t].view(-1).narrow(0, start, length).copy_(new)
    return {"gsnr_counts": out[:, 2:5], "trust": ratio.to(plan.tdev), "adapted": adapted.to(plan.tdev)}


class VRMerit(GSNROptimizer):
    r"""VR-MERIT; see the module docstring.

    Args:
        params: parameters or param groups; a group with ``trust_ratio=False`` keeps s = 1.
        lr: learning rate.
        betas: (beta1, beta2) of the moments.
        eps: added to sqrt(v).
        weight_decay: λ, inside u (so inside the ratios and the clip), as Algorithm 1.
        bias_correction: Adam's bias correction of m and v (the paper and its code have none).
        gamma, beta3, gsnr_eps, gsnr_placement, gsnr, fused: as :class:`vrgd_ds.VRAdam`.
    """

    state_keys = ("exp_avg", "exp_avg_sq")
    zero_eps_keys = ("gsnr_eps", "eps")  # Adam's eps, accepted at 0 by earlier releases too

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, bias_correction: bool = False, gamma: float = 0.1, beta3: float = 0.9,
                 gsnr_eps: float = 1e-12, gsnr_placement: str = GSNR_PLACEMENTS[0], gsnr: bool = True,
                 fused: bool | str | None = None) -> None:
        super().__init__(params, self._group(constructor_args(locals())), fused=fused)

    @classmethod
    def _group(cls, args: dict[str, Any]) -> dict[str, Any]:
        gsnr_keys = ("gamma", "beta3", "gsnr_eps", "gsnr_placement", "gsnr")
        return dict({k: v for k, v in args.items() if k not in gsnr_keys}, betas=as_pair(args["betas"]),
                    trust_ratio=True, **{k: args[k] for k in gsnr_keys})

    _check_options = staticmethod(check_adam_group)
    _update = staticmethod(merit_update)


vr_merit = member_step("vr_merit", VRMerit, "VR-MERIT")
