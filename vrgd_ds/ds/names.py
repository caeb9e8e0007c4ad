"""The VRGD optimizer names in DeepSpeed configs: which class a ``"type"`` means and the checks
of its ``"params"``, from the registry (``vrgd_ds/optim/registry.py``)."""
from __future__ import annotations

from typing import Any

from vrgd_ds.ds.internals import UnsupportedConfiguration
from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.optim import registry
from vrgd_ds.optim.registry import REGISTRY

#: our optimizer names accepted in ``"optimizer": {"type": ...}``
NAMES = {name: info.cls for name, info in REGISTRY.items()}

#: DeepSpeed's ``lamb`` where ours serves it (the CPU accelerator): ``Lamb`` with the defaults of
#: DeepSpeed's FusedLamb (``deepspeed/ops/lamb/fused_lamb.py``: eps 1e-8, weight_decay 0), so that
#: a config leaving them out trains alike on CPU and GPU (ours: 1e-6 and 0.01)
FUSED_LAMB_DEFAULTS = {"eps": 1e-8, "weight_decay": 0.0}
DEEPSPEED_LAMB = registry.Variant("Lamb", REGISTRY["Lamb"].cls.of, "DeepSpeed FusedLamb's defaults",
                                  fixed=REGISTRY["Lamb"].cls.fixed, defaults=FUSED_LAMB_DEFAULTS)


#: our names in DeepSpeed configs, where DeepSpeed has the base optimizer: the member with the
#: defaults of DeepSpeed's (``FusedLamb``: eps 1e-8, weight_decay 0; ``FusedAdam``: weight_decay 0)
#: for what a config leaves out, so that ``"Lamb"`` -> ``"VRLamb"`` or ``"Adam"`` -> ``"VRAdam"``
#: changes nothing but the GSNR. In Python the classes keep apex's defaults (eps 1e-6, 0.01).
DEEPSPEED_DEFAULTS = {
    "VRLamb": registry.Variant("VRLamb", REGISTRY["VRLamb"].cls, "DeepSpeed FusedLamb's defaults",
                               defaults=FUSED_LAMB_DEFAULTS),
    "VRAdam": registry.Variant("VRAdam", REGISTRY["VRAdam"].cls, "DeepSpeed FusedAdam's defaults",
                               defaults={"weight_decay": 0.0}),
}


def resolve(name: str | None) -> type[GSNROptimizer] | None:
    """Our class for a config ``"type"`` (DeepSpeed lower-cases its own names, e.g. ``lamb``).

    ``Lamb`` is also DeepSpeed's (FusedLamb, CUDA only): ours serves it on the CPU accelerator,
    with FusedLamb's defaults (``DEEPSPEED_LAMB``), DeepSpeed's on GPUs. Use ``VRLamb`` with ``gsnr: false`` for our exact-under-ZeRO LAMB anywhere
    (``gamma: 1`` gives the same step but still gathers the statistics).
    """
    if name is None:
        return None
    if name in DEEPSPEED_DEFAULTS:
        return DEEPSPEED_DEFAULTS[name]
    if name in NAMES:
        return NAMES[name]
    if name == "lamb":
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cpu":
            return DEEPSPEED_LAMB
    return None


CLIPPING = "DeepSpeed's top-level 'gradient_clipping'"


def accepted_params(cls: type[GSNROptimizer]) -> list[str]:
    """The ``optimizer.params`` keys of a config ``"type"`` (a base variant fixes ``gsnr``)."""
    return registry.member_of(cls).accepted_params()


def check_params(cls: type[GSNROptimizer], type_name: str, params: dict[str, Any]) -> None:
    """Rejects ``optimizer.params`` keys the class does not take, naming the key
    (``registry.check_params``)."""
    try:
        registry.check_params(cls, type_name, params, CLIPPING)
    except registry.OptimizerBlockError as e:
        raise UnsupportedConfiguration(str(e)) from None


def deepspeed_own(name: Any) -> bool:
    """Whether a config ``"type"`` is one of DeepSpeed's own names, in any case."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return isinstance(name, str) and name.lower() in DEEPSPEED_OPTIMIZERS


def engine_spelling(name: Any) -> Any:
    """A config ``"type"`` as DeepSpeed's engine reads it: one of DeepSpeed's own names in any case
    is lower-cased (``"LAMB"``, ``"Lamb"``: ``lamb``; ``deepspeed/runtime/config.py``), any other
    name is kept."""
    return name.lower() if deepspeed_own(name) else name


def check_optimizer_block(raw_config: dict[str, Any]) -> type[GSNROptimizer]:
    """Validates the ``"optimizer"`` block of a DeepSpeed config dict before any work
    (``registry.check_optimizer``), reading its type as the engine will (``engine_spelling``,
    ``resolve``): ``"LAMB"`` is our Lamb on the CPU accelerator, and ``"Lamb"`` on a GPU is
    DeepSpeed's FusedLamb, which the job does not train with. Errors name the key."""
    block, given = raw_config.get("optimizer"), None
    written = block.get("type") if isinstance(block, dict) else None
    # DeepSpeed's own name in any case, lower case included ("lamb"): where ours does not serve it,
    # said so (a did-you-mean of ours would suggest "Lamb", which is the same name to DeepSpeed)
    if deepspeed_own(written):
        given = block["type"]
        block = dict(block, type=engine_spelling(given))
        if resolve(block["type"]) is None:
            raise UnsupportedConfiguration(
                f"optimizer.type: {given!r} is DeepSpeed's own {block['type']!r} on this accelerator, not a VRGD "
                "optimizer" + ("; for LAMB exact under ZeRO use \"VRLamb\" with \"params\": {\"gsnr\": false}"
                               if block["type"] == "lamb" else f"; registered: {', '.join(NAMES)}"))
    try:
        return registry.check_optimizer(block, CLIPPING, resolve, given)
    except registry.OptimizerBlockError as e:
        raise UnsupportedConfiguration(str(e)) from None
