"""The family as registry data: one entry per optimizer name (timm's ``OptimInfo``).

Tests parametrise over ``REGISTRY``; the DeepSpeed integration registers every name.
Adding an optimizer: its functional update, a thin class, one entry here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vrgd_ds.optim.adam import VRAdam
from vrgd_ds.optim.base import GSNROptimizer
from vrgd_ds.optim.lamb import Lamb, VRLamb
from vrgd_ds.optim.lars import Lars, VRLars
from vrgd_ds.optim.sgd import VRSGD, VRMomentum


@dataclass(frozen=True)
class OptimInfo:
    """name: the class name (and DeepSpeed config type); base: the name with GSNR off;
    torch_equivalent: the torch.optim class the base equals (None: ours is the base);
    test_kwargs: arguments that exercise every option in tests."""

    name: str
    cls: type[GSNROptimizer]
    vr: bool
    base: str
    torch_equivalent: type[torch.optim.Optimizer] | None = None
    test_kwargs: dict[str, Any] = field(default_factory=dict)


REGISTRY: dict[str, OptimInfo] = {
    info.name: info
    for info in (
        OptimInfo("VRSGD", VRSGD, True, "VRSGD", torch.optim.SGD, dict(lr=0.05, weight_decay=0.01)),
        OptimInfo("VRMomentum", VRMomentum, True, "VRMomentum", torch.optim.SGD,
                  dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, beta3=0.5)),
        OptimInfo("VRAdam", VRAdam, True, "VRAdam", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("VRLamb", VRLamb, True, "Lamb", None, dict(lr=1e-2, weight_decay=0.1, max_coeff=0.3,
                                                             grad_pre_normalization=True)),
        OptimInfo("VRLars", VRLars, True, "Lars", None, dict(lr=0.5, weight_decay=1e-3, trust_coefficient=0.01,
                                                             clip=True)),
        OptimInfo("Lamb", Lamb, False, "Lamb", None, dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("Lars", Lars, False, "Lars", None, dict(lr=0.5, weight_decay=1e-3, trust_coefficient=0.01)),
    )
}
