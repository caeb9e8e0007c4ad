"""The VRGD optimizer names in DeepSpeed configs: which class a ``"type"`` means and the checks
of its ``"params"``, from the registry (``vrgd_ds/optim/registry.py``)."""
from __future__ import annotations

import difflib
from typing import Any

import torch

from vrgd_ds.ds.internals import UnsupportedConfiguration
from vrgd_ds.optim.base import GSNROptimizer, InvalidArgument
from vrgd_ds.optim.registry import REGISTRY

#: our optimizer names accepted in ``"optimizer": {"type": ...}``
NAMES = {name: info.cls for name, info in REGISTRY.items()}


def resolve(name: str | None) -> type[GSNROptimizer] | None:
    """Our class for a config ``"type"`` (DeepSpeed lower-cases its own names, e.g. ``lamb``).

    ``Lamb`` is also DeepSpeed's (FusedLamb, CUDA only): ours serves it on the CPU accelerator,
    DeepSpeed's on GPUs. Use ``VRLamb`` with ``gamma: 1`` for our exact-under-ZeRO LAMB anywhere.
    """
    if name is None:
        return None
    if name in NAMES:
        return NAMES[name]
    if name == "lamb":
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cpu":
            return NAMES["Lamb"]
    return None


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if c.lower() == word.lower()]
    return f"; did you mean {close[0]!r}?" if close else ""


def accepted_params(cls: type[GSNROptimizer]) -> list[str]:
    """The ``optimizer.params`` keys of a config ``"type"`` (a base variant fixes ``gsnr``)."""
    return next(info for info in REGISTRY.values() if info.cls is cls).accepted_params()


def check_params(cls: type[GSNROptimizer], type_name: str, params: dict[str, Any]) -> None:
    """Rejects ``optimizer.params`` keys the class does not take, naming the key."""
    if "max_grad_norm" in params and "max_grad_norm" not in accepted_params(cls):
        raise UnsupportedConfiguration(
            "optimizer.params.max_grad_norm: use DeepSpeed's top-level 'gradient_clipping' instead")
    accepted = accepted_params(cls)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise UnsupportedConfiguration(
            f"optimizer.params.{unknown[0]}: not a parameter of {cls.__name__} (type {type_name!r})"
            f"{_did_you_mean(unknown[0], accepted)}; accepted: {', '.join(accepted)}")


def check_optimizer_block(raw_config: dict[str, Any]) -> type[GSNROptimizer]:
    """Validates the ``"optimizer"`` block of a DeepSpeed config dict before any work: the type
    is a VRGD optimizer, every parameter is one it takes, and every value passes its checks
    (the class is built on a one-element dummy parameter). Errors name the key."""
    block = raw_config.get("optimizer")
    if not isinstance(block, dict) or "type" not in block:
        raise UnsupportedConfiguration('optimizer: the config needs an "optimizer" block with a "type", e.g. '
                                       '{"type": "VRLamb", "params": {"lr": 6e-3}}')
    name = block["type"]
    cls = resolve(name) if isinstance(name, str) else None
    if cls is None:
        raise UnsupportedConfiguration(
            f"optimizer.type: {name!r} is not a VRGD optimizer{_did_you_mean(str(name), list(NAMES))}; "
            f"registered: {', '.join(NAMES)}")
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise UnsupportedConfiguration(f"optimizer.params: must be an object of {cls.__name__}'s arguments, "
                                       f"got {type(params).__name__}")
    check_params(cls, name, params)
    try:
        cls([torch.zeros(1, requires_grad=True)], **params)
    except InvalidArgument as e:
        raise UnsupportedConfiguration(f"optimizer.params.{e.name.split('[')[0]}: {e}") from None
    except (ValueError, TypeError) as e:
        raise UnsupportedConfiguration(f"optimizer.params: {e}") from None
    return cls
