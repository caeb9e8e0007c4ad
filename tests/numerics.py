"""Comparisons of low-precision optimizer steps, shared by the kernel tests."""
from __future__ import annotations

import torch


def within_one_ulp(before, want, got):
    """Low-precision parameters ``got`` against ``want``, both one step on from ``before``: every
    element one ulp apart at most (two fp32 updates a rounding apart round to neighbours), and the
    step itself over a quarter of the elements more than an ulp, so that a step left unwritten
    (``got == before``) fails. Returns the share of the elements the step moved so."""
    spacing = torch.finfo(want.dtype).eps * torch.maximum(want.float().abs(), before.float().abs())
    off = (got.float() - want.float()).abs()
    assert bool((off <= spacing).all()), f"{int((off > spacing).sum())} elements over an ulp apart, max {off.max():g}"
    return float(((want.float() - before.float()).abs() > spacing).float().mean())


def sync_from(model, opt, other_model, other_opt):
    """``other_model``'s parameters and ``other_opt``'s state set to ``model``'s and ``opt``'s, so
    that the next step of each starts from the same place."""
    with torch.no_grad():
        for p1, p2 in zip(model.parameters(), other_model.parameters()):
            p2.copy_(p1)
            for k, v in opt.state[p1].items():
                other_opt.state[p2][k].copy_(v)
