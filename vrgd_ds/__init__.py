"""vrgd_ds: variance-reduced gradient descent driven by the gradient signal-to-noise ratio
(GSNR; Jiang et al., arXiv 2309.13681) for PyTorch and DeepSpeed."""
from vrgd_ds import gsnr
from vrgd_ds.optim import (REGISTRY, VRSGD, GSNROptimizer, Lamb, Lars, VRAdam, VRLamb, VRLars, VRMomentum,
                           param_groups)

__version__ = "0.1.0"

__all__ = ["gsnr", "GSNROptimizer", "VRSGD", "VRMomentum", "VRAdam", "VRLamb", "VRLars", "Lamb", "Lars",
           "param_groups", "REGISTRY", "__version__"]
