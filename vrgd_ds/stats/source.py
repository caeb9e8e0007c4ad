"""The seam between the statistics and the optimizer, in one place: a source hands the step
(Σg, Σg², n) for the tensors it asks about, and forgets them at ``reset()``. The optimizer asks;
no source calls the optimizer. Every source of the package (one process's tensor hooks, the
engines' buckets under DeepSpeed, DDP, Megatron-core and FSDP2) has this shape, and
``tests/unit/test_imports.py`` checks each against it.
"""
from __future__ import annotations

from typing import Iterable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class StatisticsSource(Protocol):
    """Gradient statistics of one optimizer step.

    ``n``: the gradient groups since the last ``reset()`` (micro-batches, ranks, or both);
    ``moments(params)``: Σg and Σg² (fp32) for each tensor the optimizer updates, in its order,
    shaped like it (a flat ZeRO partition gets flat sums); ``reset()``: the step is done.
    A source may also offer ``taken_moments(params, n, eps)``: the step's pass 1 (per tensor
    ``[Σr, min r, max r, Σs, Σgbar², non-finite]``) when it took it while accumulating at ``n``
    groups and ``gsnr_eps=eps``, else None (``functional.step_plans`` then computes it).
    """

    @property
    def n(self) -> int: ...

    def moments(self, params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]: ...

    def reset(self) -> None: ...


class GivenStatistics:
    """Statistics the caller accumulated itself (``functional.functional_step``)."""

    def __init__(self, params: Sequence[Tensor], sum_g: Sequence[Tensor], sum_sq: Sequence[Tensor], n: int) -> None:
        if len(sum_g) != len(params) or len(sum_sq) != len(params):
            raise ValueError(f"statistics for {len(sum_g)}/{len(sum_sq)} tensors (sum_g/sum_sq) given for "
                             f"{len(params)} parameters; with gsnr=True pass Σg and Σg² for each")
        for name, given in (("sum_g", sum_g), ("sum_sq", sum_sq)):
            for i, (p, t) in enumerate(zip(params, given)):
                if t.dtype != torch.float32 or t.shape != p.shape or t.device != p.device or not t.is_contiguous():
                    raise ValueError(
                        f"{name}[{i}] is {'' if t.is_contiguous() else 'a non-contiguous '}{t.dtype} of shape "
                        f"{tuple(t.shape)} on {t.device}; the statistics are fp32, shaped like their parameter "
                        f"({tuple(p.shape)}), on its device ({p.device}) and contiguous")
        self._of = {id(p): (g, s) for p, g, s in zip(params, sum_g, sum_sq)}
        self._n = n

    @property
    def n(self) -> int:
        return self._n

    def moments(self, params: Iterable[Tensor]) -> tuple[list[Tensor], list[Tensor]]:
        got = [self._of[id(p)] for p in params]
        return [g for g, _ in got], [s for _, s in got]

    def reset(self) -> None:
        self._n = 0
