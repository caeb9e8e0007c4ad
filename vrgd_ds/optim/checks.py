"""The range checks of the options every member has, shared by the optimizers and their step
functions (``functional.options``)."""
from __future__ import annotations

from typing import Any


class InvalidArgument(ValueError):
    """A hyper-parameter out of range; ``name`` is the argument."""

    def __init__(self, owner: str, name: str, value: Any, want: str) -> None:
        super().__init__(f"{owner}: invalid {name}={value!r}: must be {want}")
        self.name = name


def check_arg(owner: str, name: str, ok: bool, value: Any, want: str) -> None:
    if not ok:
        raise InvalidArgument(owner, name, value, want)


def check_common(owner: str, options: dict[str, Any]) -> None:
    """The ranges of the options every member has: the constructor's defaults, and each param
    group's own (a group's ``beta3=1`` would make p̂ = 0/0)."""
    lr = options["lr"]
    check_arg(owner, "lr", isinstance(lr, (int, float)), lr, "a Python number (a tensor lr is not supported)")
    check_arg(owner, "lr", lr >= 0, lr, ">= 0")
    check_arg(owner, "gamma", 0.0 < options["gamma"] <= 1.0, options["gamma"], "in (0, 1]")
    check_arg(owner, "beta3", 0.0 <= options["beta3"] < 1.0, options["beta3"], "in [0, 1)")
    # 0 would make r = 0/0 where every group's gradient is 0 (an embedding row no sample used)
    check_arg(owner, "gsnr_eps", options["gsnr_eps"] > 0.0, options["gsnr_eps"],
              "> 0 (an element whose gradients are all equal, e.g. all zero, has variance 0)")
    check_arg(owner, "weight_decay", options["weight_decay"] >= 0.0, options["weight_decay"], ">= 0")
