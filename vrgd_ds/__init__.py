"""vrgd_ds: variance-reduced gradient descent driven by the gradient signal-to-noise ratio
(GSNR; Jiang et al., arXiv 2309.13681) for PyTorch and DeepSpeed."""
from vrgd_ds import gsnr
from vrgd_ds.optim import GSNROptimizer, functional, param_groups
from vrgd_ds.optim.registry import CLASSES, REGISTRY

globals().update(CLASSES)  # every member and variant by name: vrgd_ds.VRLamb, vrgd_ds.Merit, ...

__version__ = "0.1.0"


def register() -> None:
    """Makes every name of ``REGISTRY`` (``Lamb``: on CPU, DeepSpeed's own on GPUs) a valid ``"optimizer": {"type": ...}`` names in DeepSpeed configs
    (idempotent; ``import vrgd_ds`` does it as soon as DeepSpeed is imported)."""
    from vrgd_ds.ds.integration import register as _register

    _register()


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with the VRGD names registered."""
    from vrgd_ds.ds import initialize as _initialize

    return _initialize(*args, **kwargs)


from vrgd_ds.ds.lazy import register_when_imported as _register_when_imported  # noqa: E402

_register_when_imported()

__all__ = ["gsnr", "GSNROptimizer", *CLASSES, "functional", "param_groups", "REGISTRY", "register", "initialize",
           "__version__"]
