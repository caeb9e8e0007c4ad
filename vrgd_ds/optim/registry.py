"""The family as data: one entry per optimizer name (timm's ``OptimInfo``), read by everything
that lists the members — ``vrgd_ds.__all__``, the DeepSpeed names and their parameter checks,
the DDP hook's message, the README's table (checked by ``tests/unit/test_registry.py``), the
distributed test matrix and the unit tests that parametrise over ``REGISTRY``.

A variant is data too (``Variant``): ``Lamb`` is ``VRLamb`` with ``gsnr=False``, ``VRFusedLAMB``
is ``VRLamb`` with apex ``FusedLAMB``'s defaults. What a member needs is data as well: trust
ratios completed across shards, row and column maxima (MERIT). Adding a member (``docs/design.md`` §1.1): its update (a module under
``vrgd_ds/optim/`` with its class), one entry below, and — if it wants them fused — its
kernels in the three implementations (``columns.py`` lists them).
"""
from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vrgd_ds.optim.adam import VRAdam, vr_adam
from vrgd_ds.optim.base import BUILDING, FIXED, GSNROptimizer
from vrgd_ds.optim.lamb import VRLamb, vr_lamb
from vrgd_ds.optim.lars import VRLars, vr_lars
from vrgd_ds.optim.merit import VRMerit, vr_merit
from vrgd_ds.optim.sgd import VRSGD, VRMomentum, vr_momentum, vr_sgd

logger = logging.getLogger(__name__)


class Variant:
    """A member under another name with some arguments fixed or defaulted: data, not a subclass.
    ``Lamb`` is ``VRLamb`` with ``gsnr=False``; ``VRFusedLAMB`` is ``VRLamb`` with apex
    ``FusedLAMB``'s defaults and positional order. Calling it builds the member (its ``name`` is
    the variant's); ``isinstance(opt, variant)`` holds for optimizers built through it."""

    def __init__(self, name: str, of: type[GSNROptimizer], summary: str, fixed: dict[str, Any] | None = None,
                 defaults: dict[str, Any] | None = None, positional: tuple[str, ...] = ()) -> None:
        self.__name__ = self.__qualname__ = self.name = name
        self.of, self.fixed, self.defaults, self.positional = of, dict(fixed or {}), dict(defaults or {}), positional
        self.__doc__ = f"{name}: {summary} (:class:`{of.__name__}` with {self._settings()})."
        self.__module__ = __name__

    def _settings(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in {**self.fixed, **self.defaults}.items())

    def __repr__(self) -> str:
        return f"<optimizer variant {self.name}: {self.of.__name__} with {self._settings()}>"

    def __call__(self, params: Any, *args: Any, **kwargs: Any) -> GSNROptimizer:
        if len(args) > len(self.positional):
            raise TypeError(f"{self.name}() takes at most {len(self.positional) + 1} positional arguments")
        for key, value in zip(self.positional, args):
            if key in kwargs:
                raise TypeError(f"{self.name}() got multiple values for argument {key!r}")
            kwargs[key] = value
        for key, value in self.fixed.items():
            if key in kwargs and kwargs[key] != value:
                raise ValueError(f"{self.name} is {self.of.__name__} with {key}={value!r}; use {self.of.__name__} "
                                 f"for {key}={kwargs[key]!r}")
        token, fixed = BUILDING.set(self.name), FIXED.set(self.fixed)
        try:
            return self.of(params, **{**self.defaults, **kwargs, **self.fixed})
        finally:
            BUILDING.reset(token)
            FIXED.reset(fixed)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self.of) and getattr(obj, "name", None) == self.name

    def accepted_params(self) -> list[str]:
        """The constructor's keyword arguments: its member's, less those it fixes."""
        return [n for n in inspect.signature(self.of.__init__).parameters
                if n not in ("self", "params", "kwargs") and n not in self.fixed]


@dataclass(frozen=True)
class OptimInfo:
    """One member.

    name: the class name and DeepSpeed ``"type"``; cls: the class, or the ``Variant`` that builds
    it (a base variant); base: the name with GSNR off; summary: the README table's line;
    kernels: the ``Kernels`` operations its update calls; fused: whether the whole update runs
    in them (False: part of it in torch ops, logged once); trust_ratio: a per-tensor (or
    element-wise) ratio completed across ZeRO partitions; row_col_maxima: per-row and per-column
    maxima of each whole matrix (MERIT's element-wise ratios: a tensor-parallel shard cuts them, so
    Megatron refuses TP > 1 for it); function: its step as a function (None: a variant, whose
    member's function takes ``gsnr=False``); torch_equivalent: the torch.optim class
    the base equals (None: ours is the base); test_kwargs: arguments that exercise every option.
    """

    name: str
    cls: type[GSNROptimizer]
    base: str
    summary: str
    kernels: tuple[str, ...]
    fused: bool = True
    trust_ratio: bool = False
    row_col_maxima: bool = False
    function: Callable[..., dict[str, float]] | None = None
    torch_equivalent: type[torch.optim.Optimizer] | None = None
    test_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def vr(self) -> bool:
        """Whether the name has GSNR on (a base variant fixes it off; our own classes default to on)."""
        return self.variant_of is None

    @property
    def variant_of(self) -> type[GSNROptimizer] | None:
        """The class a base variant fixes ``gsnr=False`` on (None: a class of its own)."""
        return self.cls.of if isinstance(self.cls, Variant) else None

    def accepted_params(self) -> list[str]:
        """The constructor's keyword arguments (a base variant's are its class's, less ``gsnr``)."""
        if isinstance(self.cls, Variant):
            return self.cls.accepted_params()
        return [n for n in inspect.signature(self.cls.__init__).parameters if n not in ("self", "params", "kwargs")]


_OFF = {"gsnr": False}
Lamb = Variant("Lamb", VRLamb, "LAMB, the same code with the GSNR off", fixed=_OFF)
Lars = Variant("Lars", VRLars, "LARS, the same code with the GSNR off", fixed=_OFF)
Merit = Variant("Merit", VRMerit, "MERIT, the same code with the GSNR off", fixed=_OFF)
#: apex ``FusedLAMB``'s constructor (apex/optimizers/fused_lamb.py): its defaults and positional
#: order; not a DeepSpeed name (DeepSpeed's ``Lamb``/``VRLamb`` take DeepSpeed's arguments)
VRFusedLAMB = Variant("VRFusedLAMB", VRLamb, "apex FusedLAMB's defaults: clipping at 1.0, unclamped trust ratio, "
                      "no adaptation of groups without weight decay",
                      defaults=dict(lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01,
                                    amsgrad=False, adam_w_mode=True, grad_averaging=True, set_grad_none=True,
                                    max_grad_norm=1.0, use_nvlamb=False, min_coeff=0.0, max_coeff=float("inf")),
                      positional=("lr", "bias_correction", "betas", "eps", "weight_decay", "amsgrad", "adam_w_mode",
                                  "grad_averaging", "set_grad_none", "max_grad_norm", "use_nvlamb"))
#: every variant by name
VARIANTS: dict[str, Variant] = {v.name: v for v in (Lamb, Lars, Merit, VRFusedLAMB)}

_SGD, _ADAM = ("nonfinite", "sgd_step"), ("nonfinite", "adam_step")
_LAMB = ("scaled_grad_norms", "adam_step", "lamb_apply")

REGISTRY: dict[str, OptimInfo] = {
    info.name: info
    for info in (
        OptimInfo("VRSGD", VRSGD, "VRSGD", "SGD with the GSNR scale on the gradient", _SGD, function=vr_sgd,
                  torch_equivalent=torch.optim.SGD, test_kwargs=dict(lr=0.05, weight_decay=0.01)),
        OptimInfo("VRMomentum", VRMomentum, "VRMomentum", "SGD momentum (Nesterov optional), GSNR momentum", _SGD,
                  function=vr_momentum, torch_equivalent=torch.optim.SGD,
                  test_kwargs=dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, beta3=0.5)),
        OptimInfo("VRAdam", VRAdam, "VRAdam", "AdamW with p̂ on the first moment (or both, or the update)", _ADAM,
                  function=vr_adam, torch_equivalent=torch.optim.AdamW, test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("VRLamb", VRLamb, "Lamb", "LAMB (NVLAMB pre-normalisation, apex FusedLAMB's arguments)", _LAMB,
                  trust_ratio=True, function=vr_lamb,
                  test_kwargs=dict(lr=1e-2, weight_decay=0.1, max_coeff=0.3, grad_pre_normalization=True)),
        OptimInfo("VRLars", VRLars, "Lars", "LARS / LARC clipping", ("scaled_grad_norms", "sgd_step"),
                  trust_ratio=True, function=vr_lars,
                  test_kwargs=dict(lr=0.5, weight_decay=1e-3, trust_coefficient=0.01, clip=True)),
        OptimInfo("VRMerit", VRMerit, "Merit", "MERIT: max-norm, element-wise row/column ratios, clip at 1",
                  _ADAM, fused=False, trust_ratio=True, row_col_maxima=True, function=vr_merit,
                  test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("Lamb", Lamb, "Lamb", "LAMB without GSNR (DeepSpeed's name: ours serves it on CPU)", _LAMB,
                  trust_ratio=True, test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
        OptimInfo("Lars", Lars, "Lars", "LARS without GSNR", ("scaled_grad_norms", "sgd_step"), trust_ratio=True,
                  test_kwargs=dict(lr=0.5, weight_decay=1e-3, trust_coefficient=0.01)),
        OptimInfo("Merit", Merit, "Merit", "MERIT without GSNR, exact under ZeRO 1/2/3", _ADAM, fused=False,
                  trust_ratio=True, row_col_maxima=True, test_kwargs=dict(lr=1e-2, weight_decay=0.1)),
    )
}

#: each member's step as a function, by the function's name (``vr_lamb``)
FUNCTIONS: dict[str, Callable[..., dict[str, float]]] = {
    info.function.__name__: info.function for info in REGISTRY.values() if info.function is not None}
#: every member's class (or variant) by name, and VRFusedLAMB: what ``vrgd_ds`` and ``vrgd_ds.optim`` export
CLASSES: dict[str, Any] = {**{name: info.cls for name, info in REGISTRY.items()}, "VRFusedLAMB": VRFusedLAMB}


def table() -> str:
    """The README's table of members, from the registry (a test checks the README holds it)."""
    rows = ["| name | GSNR | base | what | fused |", "|---|---|---|---|---|"]
    for info in REGISTRY.values():
        fused = "yes" if info.fused else "moments (ratios in torch ops)"
        rows.append(f"| `{info.name}` | {'on' if info.vr else 'off'} | `{info.base}` | {info.summary} | {fused} |")
    return "\n".join(rows)


def info_of(optimizer: GSNROptimizer) -> OptimInfo:
    """The registry entry an optimizer was built as: by its name, else by its class (a user's
    subclass of a member)."""
    info = REGISTRY.get(getattr(optimizer, "name", ""))
    if info is not None:
        return info
    for cls in type(optimizer).__mro__:
        for info in REGISTRY.values():
            if info.cls is cls:
                return info
    raise TypeError(f"{type(optimizer).__name__} is not a member of the VRGD family ({', '.join(REGISTRY)})")


#: the keys of an ``"optimizer"`` block (DeepSpeed's ``runtime/constants.py``: TYPE,
#: OPTIMIZER_PARAMS, LEGACY_FUSION)
BLOCK_KEYS = ("type", "params", "legacy_fusion")


def vrgd_optimizer(optimizer: Any, caller: str) -> GSNROptimizer:
    """``optimizer``, or the VRGD optimizer a wrapper holds as ``.optimizer``: Accelerate's
    ``AcceleratedOptimizer``, which HF Trainer's ``trainer.optimizer`` is after ``prepare`` (its
    ``step()`` and ``zero_grad()`` call the one inside, and the param groups are the same)."""
    inner = optimizer
    for _ in range(3):  # a wrapper of a wrapper at most
        if isinstance(inner, GSNROptimizer):
            return inner
        inner = getattr(inner, "optimizer", None)
    raise TypeError(f"{caller} needs a VRGD optimizer ({', '.join(REGISTRY)}), or a wrapper holding one as "
                    f"its .optimizer (Accelerate's AcceleratedOptimizer), got {type(optimizer).__name__}")


def json_name(value: Any) -> str:
    """``value``'s kind as a JSON config writes it (null, a list, a string, ...)."""
    kinds = {type(None): "null", bool: "a boolean", list: "a list", tuple: "a list", str: "a string", int: "a number",
             float: "a number"}
    return f"{kinds.get(type(value), type(value).__name__)} ({value!r})"


class OptimizerBlockError(ValueError):
    """An ``"optimizer"`` block of a job or engine config that names no member, a parameter the
    member does not take, or a value it refuses; the message names the key (and a close match)."""


def did_you_mean(word: str, choices: list[str]) -> str:
    """``"; did you mean 'gamma'?"`` for the closest choice, or ``""``."""
    import difflib

    # the same name in other case first ("vrlamb" is VRLamb, which difflib ranks below Lamb)
    close = [c for c in choices if c.lower() == word.lower()] or difflib.get_close_matches(word, choices, n=1,
                                                                                          cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def member_of(cls: Any) -> OptimInfo:
    """The member a class or variant builds (a variant under a member's name with other defaults,
    such as DeepSpeed's ``lamb`` on CPU, is that member)."""
    return next(i for i in REGISTRY.values() if i.cls is cls or isinstance(cls, Variant) and i.name == cls.name)


#: the options only the GSNR reads: given with it off, they change nothing
GSNR_OPTIONS = ("gamma", "beta3", "gsnr_eps", "gsnr_placement")


def check_params(cls: Any, type_name: str, params: dict[str, Any], clipping: str) -> None:
    """Rejects ``optimizer.params`` keys the member does not take, naming the key; ``clipping``
    names the engine's own gradient clipping (what ``max_grad_norm`` should be instead). A key a
    variant fixes (``Lamb``'s ``gsnr``) is taken at that value and refused at another, naming the
    member to use; the GSNR's own options with the GSNR off are said to change nothing (kept, so
    that turning it on is one word)."""
    info = member_of(cls)
    accepted = info.accepted_params()
    if "max_grad_norm" in params and "max_grad_norm" not in accepted:
        raise OptimizerBlockError(f"optimizer.params.max_grad_norm: use {clipping} instead")
    fixed = cls.fixed if isinstance(cls, Variant) else {}
    for key, value in fixed.items():
        if key in params and not isinstance(params[key], type(value)):
            raise OptimizerBlockError(f"optimizer.params.{key}: {params[key]!r} is not a {type(value).__name__} "
                                      f"({info.name} fixes {key}={value!r}: leave it out)")
        if key in params and params[key] != value:
            raise OptimizerBlockError(
                f"optimizer.params.{key}: {info.name} (type {type_name!r}) is {cls.of.__name__} with "
                f"{key}={value!r}; for {key}={params[key]!r} use type {cls.of.__name__!r}")
    unknown = sorted(set(params) - set(accepted) - set(fixed))
    if unknown:
        raise OptimizerBlockError(
            f"optimizer.params.{unknown[0]}: not a parameter of {info.name} (type {type_name!r})"
            f"{did_you_mean(unknown[0], accepted)}; accepted: {', '.join(accepted)}")
    auto = sorted(k for k, v in params.items() if v == "auto" or isinstance(v, (list, tuple)) and "auto" in v)
    if auto:
        raise OptimizerBlockError(
            f"optimizer.params.{auto[0]}: \"auto\" is left for HF Trainer or Accelerate to fill in, and nothing did "
            "here; give its value (or leave the key out for the default)")
    idle = [k for k in GSNR_OPTIONS if k in params]
    if idle and (fixed.get("gsnr") is False or params.get("gsnr") is False):
        from vrgd_ds.log import warn_once

        warn_once(logger, f"gsnr-off-{type_name}-{idle}", "optimizer.params: %s with the GSNR off (%s) change(s) "
                  "nothing: only the GSNR reads them", ", ".join(idle),
                  f"type {type_name!r}" if fixed.get("gsnr") is False else "gsnr: false", scope="job")


def probe_group(cls: Any, params: dict[str, Any], group_only: dict[str, Any] | None = None) -> dict[str, Any]:
    """The param-group options member ``cls`` (a class or variant) makes of the keyword arguments
    ``params``, as its constructor makes them: derived where it derives them (``gsnr``'s default),
    refused where it refuses them; ``group_only``: options a param group takes and the constructor
    does not (``trust_ratio``), checked as a group's. It is built on a throwaway one-element
    parameter, with no tensor hooks (``built_for_engine``)."""
    from vrgd_ds.optim.base import built_for_engine

    with built_for_engine():
        group = cls([{"params": [torch.nn.Parameter(torch.zeros(1))], **(group_only or {})}],
                    **params).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def check_optimizer(block: Any, clipping: str, resolve: Callable[[str], Any] | None = None,
                    written: str | None = None) -> Any:
    """Validates an ``"optimizer": {"type": ..., "params": {...}}`` block before any work: the type
    is a member (``resolve`` maps an engine's own spelling, else the registry's names), every
    parameter is one it takes, and every value passes its checks. Returns the member's class (or
    variant). ``written``: the type as the config wrote it, where the engine reads another
    spelling (messages name what the user wrote)."""
    return checked_group(block, clipping, resolve, written)[0]


def checked_group(block: Any, clipping: str, resolve: Callable[[str], Any] | None = None,
                  written: str | None = None) -> tuple[Any, dict[str, Any]]:
    """``check_optimizer``, returning the member's class (or variant) and the options of the
    param group it builds of the block's ``params`` (``probe_group``)."""
    from vrgd_ds.optim.base import InvalidArgument

    if not isinstance(block, dict) or "type" not in block:
        raise OptimizerBlockError('optimizer: the config needs an "optimizer" block with a "type", e.g. '
                                  '{"type": "VRLamb", "params": {"lr": 6e-3}}')
    stray = sorted(set(block) - set(BLOCK_KEYS))
    if stray:  # DeepSpeed reads "type", "params" and "legacy_fusion" alone: an option here would be dropped
        raise OptimizerBlockError(
            f"optimizer.{stray[0]}: not a key of the optimizer block{did_you_mean(stray[0], list(BLOCK_KEYS))}; its "
            'keys are "type", "params" and "legacy_fusion", and the optimizer\'s arguments go in "params"')
    name = block["type"]
    cls = None
    if isinstance(name, str):
        cls = resolve(name) if resolve is not None else REGISTRY[name].cls if name in REGISTRY else None
    if cls is None:
        raise OptimizerBlockError(f"optimizer.type: {name!r} is not a VRGD optimizer{did_you_mean(str(name), list(REGISTRY))}; "
                                  f"registered: {', '.join(REGISTRY)}")
    params = block.get("params", {})
    if not isinstance(params, dict):  # null or [] too: the engine reads it as its arguments
        raise OptimizerBlockError(f"optimizer.params: must be an object of {name}'s arguments (or left out), got "
                                  f"{json_name(params)}")
    check_params(cls, name if written is None else written, params, clipping)
    try:
        group = probe_group(cls, params)
    except InvalidArgument as e:
        raise OptimizerBlockError(f"optimizer.params.{e.name.split('[')[0]}: {e}") from None
    except (ValueError, TypeError) as e:
        raise OptimizerBlockError(f"optimizer.params: {e}") from None
    return cls, group
