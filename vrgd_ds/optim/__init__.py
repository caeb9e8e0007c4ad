"""The VRGD optimizer family: stateful shells (``base.py``) over the step as functions
(``functional.py``; each member's public function, ``vr_lamb`` and so on, in its module). The
members and their variants are listed once, in ``registry.py``; this package exports each by name."""
from vrgd_ds.optim import functional
from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.optim.param_groups import param_groups
from vrgd_ds.optim.registry import CLASSES, FUNCTIONS, REGISTRY, OptimInfo, Variant

globals().update(CLASSES)
globals().update(FUNCTIONS)

__all__ = ["GSNROptimizer", *CLASSES, *FUNCTIONS, "param_groups", "REGISTRY", "OptimInfo", "Variant", "functional"]
