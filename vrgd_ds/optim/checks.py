"""The kind checks (finite real numbers, bools) and range checks of the options every member has,
shared by the optimizers and their step functions (``functional.options``)."""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

FP32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, the least normal fp32


class InvalidArgument(ValueError):
    """A hyper-parameter out of range; ``name`` is the argument."""

    def __init__(self, owner: str, name: str, value: Any, want: str) -> None:
        super().__init__(f"{owner}: invalid {name}={value!r}: must be {want}")
        self.name = name


def check_arg(owner: str, name: str, ok: bool, value: Any, want: str) -> None:
    if not ok:
        raise InvalidArgument(owner, name, value, want)


def check_dtypes(where: str, params: Any, fused: bool | str | None) -> None:
    """The dtypes of one param group (or one functional step's tensors): fp32/bf16/fp16, and one
    of them unless ``fused`` is False."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
    other = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if other:
        raise ValueError(f"{where}: {' and '.join(other)} parameters: the family steps fp32/bf16/fp16 parameters "
                         "in fp32 arithmetic (a float64 update would be rounded to fp32, a complex one would lose "
                         "its imaginary part); give them an optimizer of torch.optim, or cast them")
    if len(dtypes) > 1 and fused is not False:
        raise ValueError(f"{where}: the group mixes {' and '.join(dtypes)} tensors, and the fused kernels step "
                         "one dtype per group: give each dtype its group (vrgd_ds.param_groups does), or "
                         "fused=False")


def check_given_tensors(where: str, params: Any, grads: Any, states: Any) -> None:
    """A functional step's gradients and states against its parameters, as an optimizer's
    ``.grad`` is (one per parameter, of its dtype, shape and device), and contiguous: the kernels
    read each tensor's memory in order for the parameter's length."""
    if len(grads) != len(params) or len(states) != len(params):
        raise ValueError(f"{where}: {len(grads)} gradients and {len(states)} states given for {len(params)} "
                         "parameters; pass one of each per parameter")
    for i, (p, g) in enumerate(zip(params, grads)):
        if g.dtype != p.dtype or g.shape != p.shape or g.device != p.device or not g.is_contiguous():
            raise ValueError(f"{where}: grads[{i}] is {'' if g.is_contiguous() else 'a non-contiguous '}"
                             f"{str(g.dtype).removeprefix('torch.')} of shape {tuple(g.shape)} on {g.device}; a "
                             f"gradient is its parameter's dtype ({str(p.dtype).removeprefix('torch.')}), shape "
                             f"({tuple(p.shape)}) and device ({p.device}), and contiguous (.contiguous())")


#: the members' switches, wherever an options dict has them: a string such as "false" (a config
#: from YAML or a template) is true to Python, and would turn on what it meant to turn off
FLAGS = ("gsnr", "bias_correction", "grad_pre_normalization", "use_nvlamb", "grad_averaging", "adam_w_mode",
         "nesterov", "clip", "set_grad_none")


def check_flags(owner: str, options: dict[str, Any]) -> None:
    for name in FLAGS:
        if name in options:
            value = options[name]
            check_arg(owner, name, isinstance(value, (bool, np.bool_)), value,
                      "true or false (a bool, not a string or number)")


#: the members' numeric options, wherever an options dict has them: each a finite real number
#: (``max_coeff`` may be +inf: apex's unclamped trust ratio; ``max_grad_norm`` may be None)
NUMBERS = ("lr", "gamma", "beta3", "gsnr_eps", "weight_decay", "eps", "momentum", "dampening", "trust_coefficient",
           "min_coeff", "max_coeff", "max_grad_norm")


def is_number(value: Any) -> bool:
    """A real number, not a bool (True is an int to Python, and 1.0 to ``float``) nor a string."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def check_numbers(owner: str, options: dict[str, Any]) -> None:
    """Each numeric option of ``options`` (``NUMBERS``, and both ``betas``) is a finite real number:
    a string ("1e-8", from a template) would fail a comparison without the key's name, a bool
    would be read as 0 or 1, and an infinite or NaN one passes no range check it should."""
    for name in NUMBERS:
        if name not in options or name == "max_grad_norm" and options[name] is None:
            continue
        value = options[name]
        ok = is_number(value) and (math.isfinite(value) or name == "max_coeff" and value == math.inf)
        check_arg(owner, name, ok, value, "a finite number (not a string or a bool)" if name != "max_coeff" else
                  "a number, finite or +inf (not a string or a bool)")
    if "betas" in options:
        betas = options["betas"]
        check_arg(owner, "betas", isinstance(betas, (tuple, list)) and len(betas) == 2, betas, "a pair (beta1, beta2)")
        for i, beta in enumerate(betas):
            check_arg(owner, f"betas[{i}]", is_number(beta) and math.isfinite(beta), beta,
                      "a finite number (not a string or a bool)")


def as_pair(betas: Any) -> Any:
    """``betas`` as the tuple a group holds (a JSON config gives a list); anything else as given,
    for ``check_numbers`` to refuse naming it."""
    return tuple(betas) if isinstance(betas, (list, tuple)) else betas


def check_common(owner: str, options: dict[str, Any]) -> None:
    """The ranges of the options every member has: the constructor's defaults, and each param
    group's own (a group's ``beta3=1`` would make p̂ = 0/0); the switches are bools, the numbers
    finite numbers (``check_numbers``)."""
    check_flags(owner, options)
    lr = options["lr"]
    check_arg(owner, "lr", isinstance(lr, (int, float)) and not isinstance(lr, bool), lr,
              "a Python number (a tensor lr is not supported)")
    check_numbers(owner, options)
    check_arg(owner, "lr", lr >= 0, lr, ">= 0")
    check_arg(owner, "gamma", 0.0 < options["gamma"] <= 1.0, options["gamma"], "in (0, 1]")
    check_arg(owner, "beta3", 0.0 <= options["beta3"] < 1.0, options["beta3"], "in [0, 1)")
    # 0 would make r = 0/0 where every group's gradient is 0 (an embedding row no sample used)
    check_arg(owner, "gsnr_eps", options["gsnr_eps"] >= FP32_TINY, options["gsnr_eps"],
              f">= {FP32_TINY:.4g}, the least normal fp32 (the statistics' precision: a smaller one rounds or "
              "flushes to 0, and an element whose gradients are all equal, e.g. all zero, has variance 0)")
    check_arg(owner, "weight_decay", options["weight_decay"] >= 0.0, options["weight_decay"], ">= 0")
