"""The DeepSpeed release the hooks are written against, and how a missing internal fails: a
leaf module (no other import of ``vrgd_ds``), imported by every module that reaches DeepSpeed
internals. Each module lists the attributes it uses next to the code that uses them
(``require(obj, (...), where)`` at attach time), so a renamed attribute fails loudly there,
naming it and the supported release."""
from __future__ import annotations

from typing import Any

#: DeepSpeed versions whose internals the hooks were written against (pinned in pyproject).
SUPPORTED_DEEPSPEED = ("0.19.8",)


class UnsupportedConfiguration(ValueError):
    """A DeepSpeed configuration the VRGD hooks do not cover (the message says which key)."""


def require(obj: Any, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        import deepspeed

        raise RuntimeError(
            f"vrgd_ds: DeepSpeed {deepspeed.__version__} lacks {where}.{', '.join(missing)}, which the VRGD hooks "
            f"use; supported DeepSpeed versions: {', '.join(SUPPORTED_DEEPSPEED)} (pip install deepspeed=="
            f"{SUPPORTED_DEEPSPEED[-1]})"
        )


def model_groups(engine: Any, opt: Any) -> list[list[Any]]:
    """The model parameters of each of ``opt``'s param groups: DeepSpeed's wrappers replace the
    groups' tensors with flat partitions (ZeRO-1/2) or fp32 copies (fp16, bf16) and keep the
    model's in a list per group of their own."""
    wrapper = engine.optimizer
    for name in ("bit16_groups", "bf16_groups", "fp16_groups"):
        groups = getattr(wrapper, name, None)
        if groups is not None and wrapper is not opt:
            return [list(g) for g in groups]
    return [list(g["params"]) for g in opt.param_groups]


def check_version() -> None:
    import deepspeed

    if deepspeed.__version__ not in SUPPORTED_DEEPSPEED:
        raise RuntimeError(
            f"vrgd_ds supports DeepSpeed {', '.join(SUPPORTED_DEEPSPEED)}, found {deepspeed.__version__}: its hooks "
            f"use DeepSpeed internals that change between releases. Install: pip install deepspeed=="
            f"{SUPPORTED_DEEPSPEED[-1]}"
        )
