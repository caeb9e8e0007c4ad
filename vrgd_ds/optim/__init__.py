"""The VRGD optimizer family: stateful shells over fused functional updates."""
from vrgd_ds.optim.adam import VRAdam
from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.optim.lamb import Lamb, VRFusedLAMB, VRLamb
from vrgd_ds.optim.lars import Lars, VRLars
from vrgd_ds.optim.param_groups import param_groups
from vrgd_ds.optim.registry import REGISTRY, OptimInfo
from vrgd_ds.optim.sgd import VRSGD, VRMomentum

__all__ = ["GSNROptimizer", "VRSGD", "VRMomentum", "VRAdam", "VRLamb", "VRLars", "Lamb", "Lars", "VRFusedLAMB",
           "param_groups", "REGISTRY", "OptimInfo"]
