"""The family as data: one entry per optimizer name (timm's ``OptimInfo``), read by everything
that lists the members — ``vrgd_ds.__all__``, the DeepSpeed names and their parameter checks,
the DDP hook's message, the README's table (checked by ``tests/unit/test_registry.py``), the
distributed test matrix and the unit tests that parametrise over ``REGISTRY``.

A base variant is data too: ``Lamb`` is ``VRLamb`` with ``gsnr=False``, built here by
:func:`without_gsnr`. Adding a member (``docs/design.md`` §1.1): its update (a module under
``vrgd_ds/optim/`` with its class), one entry below, and — if it wants them fused — its
kernels in the three implementations (``columns.py`` lists them).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from vrgd_ds.optim.adam import VRAdam
from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.optim.lamb import VRLamb
from vrgd_ds.optim.lars import VRLars
from vrgd_ds.optim.merit import VRMerit
from vrgd_ds.optim.sgd import VRSGD, VRMomentum


def without_gsnr(cls: type[GSNROptimizer], name: str) -> type[GSNROptimizer]:
    """``cls`` with ``gsnr=False`` fixed, under ``name`` (the same code, nothing else differs)."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        if kwargs.pop("gsnr", False):
            raise ValueError(f"{name} is {cls.__name__} without GSNR; use {cls.__name__} for gsnr=True")
        cls.__init__(self, params, gsnr=False, **kwargs)

    doc = f"{name}: :class:`{cls.__name__}` with ``gsnr=False`` (same code, nothing else differs)."
    return type(name, (cls,), {"__init__": __init__, "__doc__": doc, "__module__": __name__, "__qualname__": name})


@dataclass(frozen=True)
class OptimInfo:
    """One member.

    name: the class name and DeepSpeed ``"type"``; cls: the class (a base variant's is built by
    :func:`without_gsnr`); base: the name with GSNR off; summary: the README table's line;
    kernels: the ``Kernels`` operations its update calls; fused: whether the whole update runs
    in them (False: part of it in torch ops, logged once); trust_ratio: a per-tensor (or
    element-wise) ratio completed across ZeRO partitions; torch_equivalent: the torch.optim class
    the base equals (None: ours is the base); test_kwargs: arguments that exercise every option.
    """

    name: str
    cls: type[GSNROptimizer]
    base: str
    summary: str
    kernels: tuple[str, ...]
    fused: bool = True
    trust_ratio: bool = False
    torch_equivalent: type[torch.optim.Optimizer] | None = None
    test_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def vr(self) -> bool:
        """Whether the name has GSNR on (a base variant fixes it off; our own classes default to on)."""
        return self.variant_of is None

    @property
    def variant_of(self) -> type[GSNROptimizer] | None:
        """The class a base variant fixes ``gsnr=False`` on (None: a class of its own)."""
        return self.cls.__mro__[1] if self.cls.__module__ == __name__ else None

    def accepted_params(self) -> list[str]:
        """The constructor's keyword arguments (a base variant's are its class's, less ``gsnr``)."""
        own = self.variant_of or self.cls
        return [n for n in inspect.signature(own.__init__).parameters
                if n not in ("self", "params", "kwargs") and not (n == "gsnr" and self.variant_of)]


Lamb = without_gsnr(VRLamb, "Lamb")
Lars = without_gsnr(VRLars, "Lars")
Merit = without_gsnr(VRMerit, "Merit")

_SGD, _ADAM = ("nonfinite", "sgd_step"), ("nonfinite", "adam_step")
_LAMB = ("scaled_grad_norms", "adam_step", "lamb_apply")

REGISTRY: dict[str, OptimInfo] = {
    info.name: info
    for info in (
        OptimInfo("VRSGD", VRSGD, "VRSGD", "SGD with the GSNR scale on the gradient", _SGD,
                  torch_equivalent=torch.optim.SGD, test_kwargs=dict(lr=0.05, weight_decay=0.01)),
        OptimInfo("VRMomentum", VRMomentum, "VRMomentum", "SGD momentum (Nesterov optional), GSNR momentum", _SGD,
                  torch_equivalent=torch.optim.SGD,
                  test_kwargs=dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, beta3=0.5)),
        OptimInfo("VRAdam", VRAdam, "VRAdam", "AdamW with p̂ on the first moment (or both, or the update)", _ADAM,
                  torch_equivalent=torch.optim.AdamW, test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("VRLamb", VRLamb, "Lamb", "LAMB (NVLAMB pre-normalisation, apex FusedLAMB's arguments)", _LAMB,
                  trust_ratio=True,
                  test_kwargs=dict(lr=1e-2, weight_decay=0.1, max_coeff=0.3, grad_pre_normalization=True)),
        OptimInfo("VRLars", VRLars, "Lars", "LARS / LARC clipping", ("scaled_grad_norms", "sgd_step"),
                  trust_ratio=True, test_kwargs=dict(lr=0.5, weight_decay=1e-3, trust_coefficient=0.01, clip=True)),
        OptimInfo("VRMerit", VRMerit, "Merit", "MERIT: max-norm, element-wise row/column ratios, clip at 1",
                  _ADAM, fused=False, trust_ratio=True, test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("Lamb", Lamb, "Lamb", "LAMB without GSNR (DeepSpeed's name: ours serves it on CPU)", _LAMB,
                  trust_ratio=True, test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("Lars", Lars, "Lars", "LARS without GSNR", ("scaled_grad_norms", "sgd_step"), trust_ratio=True,
                  test_kwargs=dict(lr=0.5, weight_decay=1e-3, trust_coefficient=0.01)),
        OptimInfo("Merit", Merit, "Merit", "MERIT without GSNR, exact under ZeRO 1/2/3", _ADAM, fused=False,
                  trust_ratio=True, test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
    )
}

#: every member's class by name (what ``vrgd_ds`` and ``vrgd_ds.optim`` export)
CLASSES: dict[str, type[GSNROptimizer]] = {name: info.cls for name, info in REGISTRY.items()}


def table() -> str:
    """The README's table of members, from the registry (a test checks the README holds it)."""
    rows = ["| name | GSNR | base | what | fused |", "|---|---|---|---|---|"]
    for info in REGISTRY.values():
        fused = "yes" if info.fused else "moments (ratios in torch ops)"
        rows.append(f"| `{info.name}` | {'on' if info.vr else 'off'} | `{info.base}` | {info.summary} | {fused} |")
    return "\n".join(rows)
