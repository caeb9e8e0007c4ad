"""Sources of per-group gradient statistics (Σg, Σg², n) for the optimizers."""
from vrgd_ds.stats.hooks import TensorHookStats

__all__ = ["TensorHookStats"]
