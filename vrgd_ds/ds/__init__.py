"""DeepSpeed integration: config names, statistics hooks per engine path, checkpoints."""
from vrgd_ds.ds.integration import SUPPORTED_DEEPSPEED, UnsupportedConfiguration, register

__all__ = ["register", "initialize", "UnsupportedConfiguration", "SUPPORTED_DEEPSPEED"]


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the VRGD names registered (a thin convenience)."""
    import deepspeed

    register()
    return deepspeed.initialize(*args, **kwargs)
