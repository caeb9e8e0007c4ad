"""The torch release whose FSDP2 internals ``vrgd_ds.fsdp`` reads, and how a missing one fails
(the DeepSpeed counterpart is ``vrgd_ds/ds/internals.py``). The module that reads an attribute
lists it next to the code and checks it with ``require`` at attach, so a renamed attribute fails
there, naming it and the supported release."""
from __future__ import annotations

from typing import Any

import torch

#: torch releases (major.minor) whose ``torch.distributed.fsdp._fully_shard`` internals were read
SUPPORTED_TORCH = ("2.13",)


class UnsupportedFSDPConfiguration(ValueError):
    """An FSDP2 set-up the VRGD statistics do not cover (the message names the option)."""


def release() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def check_version() -> None:
    if release() not in SUPPORTED_TORCH:
        raise RuntimeError(
            f"vrgd_ds.fsdp supports torch {', '.join(SUPPORTED_TORCH)}.x, found {torch.__version__}: it reads FSDP2's "
            "parameter groups and reduce-scatter, which change between releases. Install: pip install "
            f"torch=={SUPPORTED_TORCH[-1]}.0")


def require(obj: Any, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        raise RuntimeError(
            f"vrgd_ds.fsdp: torch {torch.__version__} lacks {where}.{', '.join(missing)}, which the VRGD statistics "
            f"use; supported torch releases: {', '.join(SUPPORTED_TORCH)}.x")
