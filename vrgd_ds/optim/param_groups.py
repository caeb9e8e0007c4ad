"""The usual two param groups of LAMB/LARS/AdamW training: bias and normalisation
parameters get no weight decay and no trust-ratio adaptation (You et al. 2019 §3; NVIDIA's
BERT recipe excludes ``bias``, ``LayerNorm.weight`` and ``LayerNorm.bias``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm,
    nn.modules.batchnorm._NormBase,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def is_excluded(module: nn.Module, param_name: str, param: torch.Tensor) -> bool:
    """Bias vectors and parameters of normalisation layers (any 1-D parameter counts as one)."""
    return isinstance(module, NORM_TYPES) or param_name == "bias" or param.ndim <= 1


def param_groups(model: nn.Module, weight_decay: float, **decay_group_options: Any) -> list[dict[str, Any]]:
    """``[decayed, excluded]`` groups of ``model``'s trainable parameters, with names.

    The excluded group has ``weight_decay=0`` and ``trust_ratio=False``; extra keyword
    options go to the decayed group only. Groups carry ``param_names`` for per-tensor
    metrics. Shared parameters appear once. A model of several dtypes (bf16 weights, fp32
    norms) gets each group once per dtype: the fused kernels step one dtype per group.
    """
    decay: list[tuple[str, nn.Parameter]] = []
    skip: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            full = f"{mod_name}.{name}" if mod_name else name
            (skip if is_excluded(module, name, p) else decay).append((full, p))
    groups = []
    for members, options in ((decay, {"weight_decay": weight_decay, **decay_group_options}),
                             (skip, {"weight_decay": 0.0, "trust_ratio": False})):
        for dtype in dict.fromkeys(p.dtype for _, p in members):  # in order of first appearance
            of = [(n, p) for n, p in members if p.dtype == dtype]
            groups.append({"params": [p for _, p in of], "param_names": [n for n, _ in of], **options})
    return groups
