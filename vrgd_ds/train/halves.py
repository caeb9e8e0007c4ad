"""SimiGrad's direct measurement: the cosine similarity of the two half-batch gradients of one
optimizer step, to compare with the similarity the noise scale implies
(``vrgd_ds.adaptive_batch``: ``1 / (1 + 2 B_simple / B)``).

The halves are the first and the second half of the step's micro-steps (on every rank), or,
with an odd number of micro-steps, the first and the second half of the ranks. Tensor hooks on
the model's parameters add each backward's gradient into one of two full-size fp32 buffers;
at the end of the step one all-reduce of ``[h₁ | h₂]`` completes them. Cost: 8 B/param of
memory per rank, one all-reduce of twice the fp32 gradient per measured step, two adds per
gradient element and micro-step; nothing on the steps that are not measured.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vrgd_ds.train.config import ConfigError


class HalfBatchCosine:
    def __init__(self, engine: Any, dist: Any) -> None:
        if engine.zero_optimization_stage() == 3:
            raise ConfigError("job.phases[*].adaptive_batch.measure_cosine_every: not available under ZeRO-3 "
                              "(parameters are partitioned, their hooks see pieces); use stage 0-2 or set it to 0")
        if dist.get_world_size() % 2:  # found at set-up, not at the first step of odd micro-steps
            raise ConfigError(f"job.phases[*].adaptive_batch.measure_cosine_every: the half batches need an even "
                              f"number of micro-steps or of ranks, and the controller also picks odd numbers of "
                              f"micro-steps; this job has {dist.get_world_size()} rank(s). Use an even number of "
                              "ranks, or set it to 0")
        self.dist = dist
        self.params = [p for p in engine.module.parameters() if p.requires_grad]
        device = self.params[0].device
        self.numel = sum(p.numel() for p in self.params)
        self.buf = torch.zeros(2, self.numel, dtype=torch.float32, device=device)
        self.half: int | None = None  # the half this rank's next backward belongs to; None: not measuring
        self.by_rank = False
        self._handles = []
        off = 0
        for p in self.params:
            self._handles.append(p.register_hook(self._hook(off, p.numel())))
            off += p.numel()

    def _hook(self, off: int, n: int):
        def add(grad: Tensor) -> None:
            if self.half is not None:
                self.buf[self.half, off:off + n].add_(grad.detach().reshape(-1).float())

        return add

    def start(self, accumulation: int) -> None:
        """A measured step of ``accumulation`` micro-steps begins."""
        world, rank = self.dist.get_world_size(), self.dist.get_rank()
        if accumulation % 2 and world % 2:
            raise ConfigError(f"adaptive_batch.measure_cosine_every: halves need an even number of micro-steps or "
                              f"ranks; this step has {accumulation} micro-steps on {world} ranks")
        self.by_rank = accumulation % 2 == 1
        self.accumulation = accumulation
        self.buf.zero_()
        self.half = int(rank >= world // 2) if self.by_rank else 0

    def micro_step(self, j: int) -> None:
        """Micro-step ``j`` of the measured step is about to run its backward."""
        if not self.by_rank:
            self.half = int(j >= self.accumulation // 2)

    def finish(self) -> float:
        """Completes the halves across ranks; their cosine similarity."""
        self.half = None
        self.dist.all_reduce(self.buf)
        h1, h2 = self.buf[0].double(), self.buf[1].double()
        denom = float(h1.norm() * h2.norm())
        return float(h1 @ h2) / denom if denom > 0 else float("nan")

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
