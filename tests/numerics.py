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
