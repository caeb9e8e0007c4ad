"""How an engine's gradient values relate to the sums the statistics need, in one place. Every
engine path builds one ``Scaling`` and every statistics source reads it:

* ``world``: the ranks whose local sums the statistics' collective adds (n = world × the
  gradient groups each rank took);
* ``loss_scale()``: the dynamic loss scale S of the values read (1 without fp16), fixed from a
  step's first micro-step to its end;
* ``accumulation()``: the engine's averaging over micro-steps: DeepSpeed divides each
  micro-step's loss by its gradient accumulation steps, so one group's gradient is the value
  read times ``accumulation() / S`` (``group_multiplier``);
* ``engine_factor()``: where Σg is read from the engine's reduced gradient, the multiplier that
  makes it Σg where that is not DeepSpeed's (Megatron: 1 / e, e the factor its buffers were
  built with; under fp16 the sums keep the loss scale, which the step's unit takes out).
  DeepSpeed's is ``world · accumulation() / S``: its gradient is the sum over the groups
  divided by the ranks and the accumulation steps, also on a step that ends before
  the accumulation is full (``set_gradient_accumulation_boundary``, which accelerate calls at
  every micro-step), where it is not the mean over the n groups. Where the loss is scaled by
  another count instead (HF ``Trainer`` turns DeepSpeed's division off and scales every
  micro-step's loss alike), every group's gradient and Σg carry the same factor, which the
  GSNR and ``B_simple`` do not see; not so a loss over ``num_items_in_batch``, which weights
  each group by its token count (docs/deepspeed.md).

What remains elsewhere is the engines' own arithmetic where our reduction stands in for theirs
(DeepSpeed's post-scale average in ``ds/stage0.py``/``ds/zero12.py``, DDP's mean in ``ddp.py``,
the coalesced reduce-scatter's average undone in ``ds/zero3.py``): the model's gradient, not the
statistics.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _one() -> float:
    return 1.0


def _single() -> int:
    return 1


@dataclass(frozen=True)
class Scaling:
    world: int
    loss_scale: Callable[[], float] = _one
    accumulation: Callable[[], int] = _single
    engine_factor: Callable[[], float] | None = None

    def group_multiplier(self, scale: float) -> float:
        """``c``: a value read (loss-scaled by ``scale``, averaged by the engine) -> one group's gradient."""
        return float(self.accumulation()) / scale

    def sum_g_factor(self, scale: float) -> float:
        """The engine's reduced gradient -> Σg over the step's groups."""
        return self.engine_factor() if self.engine_factor is not None else self.world * self.accumulation() / scale
