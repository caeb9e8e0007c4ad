"""The VRGD optimizer family: stateful shells over fused functional updates. The members are
listed once, in ``registry.py``; this package exports each by name."""
from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.optim.lamb import VRFusedLAMB
from vrgd_ds.optim.param_groups import param_groups
from vrgd_ds.optim.registry import CLASSES, REGISTRY, OptimInfo

globals().update(CLASSES)

__all__ = ["GSNROptimizer", *CLASSES, "VRFusedLAMB", "param_groups", "REGISTRY", "OptimInfo"]
