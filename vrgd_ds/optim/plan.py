"""What one param group's step works on (``Plan``), and the tables derived from its tensors'
shapes and the layout alone (``PlanShape``), built once and reused by ``Planner`` while a group
holds the same tensors: a steady step's host work does not grow with rebuilding them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from vrgd_ds import gsnr as G
from vrgd_ds.optim.checks import check_dtypes

_NUMEL = torch.Tensor.numel
_DTYPE = operator.attrgetter("dtype")


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """A small host table on ``device`` without blocking the host (pinned memory)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class Plan:
    """What one param group's step works on: flat tensors cut into segments.

    The segment table is built on the host from shapes (``seg``, CPU int64 ``[S, 3]``: tensor
    index, start, length); every per-segment quantity derived from data (moments, scales,
    bias corrections, trust ratios, the non-finite flag) is a float64 tensor on ``tdev``, the
    device the kernels keep their tables on: the parameters' device for the sync-free
    (Triton) kernels, the CPU otherwise. So the step reads nothing back to the host.
    """

    index: int
    group: dict[str, Any]
    params: list[Tensor]
    grads: list[Tensor]
    states: list[dict[str, Any]]
    seg: Tensor  # int64 [S, 3] on the host: tensor index, start, length
    numel: Tensor  # float64 [S] on tdev: whole-tensor element count of each segment's piece
    keys: Tensor  # int64 [S] on tdev: the model tensor each segment belongs to
    tdev: torch.device = torch.device("cpu")
    key_base: int = 0  # one process: the key of the plan's first tensor (keys number tensors in order)
    tensor_of: Tensor | None = None  # int64 [S] on tdev: the tensor index of each segment
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)  # key -> the whole model tensor's shape
    rows: list[list[int]] = field(default_factory=list)  # per segment, host ints: tensor index, start, length,
    #                                                      key, numel (one process), offset in the model tensor
    step_t: Tensor | None = None  # float64 [S] on tdev: the step count after this step
    counters: list[Tensor] = field(default_factory=list)  # the tensors' step counters (state["step"])
    found: Tensor | None = None  # float64 0-dim on tdev: 1 when the step is skipped (sync-free kernels)
    sum_g: list[Tensor] = field(default_factory=list)
    sum_sq: list[Tensor] = field(default_factory=list)
    avg: list[Tensor] = field(default_factory=list)
    moments: Tensor | None = None  # float64 [S, 6] from pass 1
    whole_r: Tensor | None = None  # float64 [S, 1] on tdev: Σr of each segment's whole tensor
    grad_norms: Tensor | None = None  # float64 [S, 3] (groups without GSNR)
    scales: G.SegmentScales | None = None
    shape: PlanShape | None = None
    #: ``gsnr_eps`` for the statistics as the source reads them, set by ``functional.step_plans``
    #: at each step's start (None until then: a kernel given it fails, not a floor of 0)
    eps_gsnr: float | None = None

    @property
    def gsnr(self) -> bool:
        return self.group["gsnr"]

    @property
    def num_segments(self) -> int:
        return self.seg.shape[0]

    def ones(self) -> Tensor:
        return torch.ones(self.num_segments, dtype=torch.float64, device=self.tdev)

    def per_segment(self, per_param: list[float]) -> Tensor:
        """A value per parameter of the plan (host) -> per segment (ZeRO: several per flat tensor)."""
        return to_device(torch.tensor(per_param, dtype=torch.float64), self.tdev).index_select(0, self.tensor_of)

    def bias_correction(self, beta: float) -> Tensor:
        return G.gsnr_ema_bias_correction(beta, self.step_t)

    def gsnr_columns(self) -> dict[str, Tensor]:
        """The GSNR columns of every kernel table (``columns.GSNR``): inv_mean, lo and the
        GSNR momentum's bias correction bc3."""
        if not self.gsnr:
            return dict(inv_mean=self.ones(), lo=self.ones(), bc3=self.ones())
        beta3 = self.group["beta3"]
        bc3 = self.bias_correction(beta3) if beta3 > 0 else self.ones()
        return dict(inv_mean=self.scales.inv_mean, lo=self.scales.lo, bc3=bc3)

    def gsnr_args(self, n: int) -> dict[str, Any]:
        """The statistics arguments of every kernel (empty lists: GSNR off)."""
        g = self.group
        return dict(sum_g=self.sum_g, sum_sq=self.sum_sq, avg=self.avg, inv_n=1.0 / max(n, 1),
                    eps=self.eps_gsnr, beta3=g["beta3"] if self.gsnr else 0.0)

    def skip_args(self) -> dict[str, Any]:
        """``found_inf`` for the sync-free kernels (which skip on the device), else nothing."""
        return {} if self.found is None else {"found_inf": self.found}


#: how many ``betas`` columns a plan shape keeps (``PlanShape.powers_base``)
POWERS_KEPT = 4


@dataclass
class PlanShape:
    """What a plan derives from its tensors' shapes and the layout alone, built once and reused
    while the group holds the same tensors with gradients (``Planner``): the segment
    table, its device columns and the metrics' per-tensor names. ``ready`` is the optimizer's
    state epoch at which every state tensor of the plan was last found complete."""

    seg: Tensor
    numel: Tensor
    keys: Tensor
    tensor_of: Tensor
    length: Tensor  # float64 [S] on tdev: each segment's length
    shapes: dict[int, tuple[int, ...]]
    rows: list[list[int]]
    names: list[str]
    ready: int = -1
    states: list[dict[str, Any]] | None = None  # the tensors' state dicts, valid for the epoch ``ready``
    # where ``states`` were found: the optimizer's state mapping and its values then, in order
    # (``Planner.plan``: a state cleared, replaced or deleted is looked up again)
    found_in: Any = None
    found: list[Any] | None = None
    length_share: Tensor | None = None  # float64 [S] on tdev: each segment's share of its whole tensor
    key_set: frozenset = frozenset()  # the model tensors the segments belong to
    _constants: dict[Any, Any] = field(default_factory=dict)

    @property
    def unique_keys(self) -> bool:
        """Whether no two segments belong to one model tensor (a kernel may write a row per key)."""
        return len(self.key_set) == self.seg.shape[0]

    def ones_table(self, width: int) -> Tensor:
        """A float64 ``[S, width]`` table of ones on the table device (the GSNR columns of a group
        without GSNR; made once)."""
        got = self._constants.get(("ones", width))
        if got is None:
            got = self._constants[("ones", width)] = torch.ones(self.length.numel(), width, dtype=torch.float64,
                                                                device=self.length.device)
        return got

    def powers_base(self, betas: tuple[float, ...]) -> Tensor:
        """``betas`` as a float64 ``[k, 1]`` column on the table device, made once per values, of
        which the last ``POWERS_KEPT`` are kept (a scheduler that cycles beta1, as ``OneCycleLR``
        does, gives every step new ones)."""
        kept = self._constants.setdefault("powers", {})
        got = kept.pop(betas, None)
        if got is None:
            got = to_device(torch.tensor(betas, dtype=torch.float64)[:, None], self.length.device)
            while len(kept) >= POWERS_KEPT:
                kept.pop(next(iter(kept)))
        kept[betas] = got  # the newest last
        return got

    def constants(self, gsnr: bool) -> dict[str, Tensor]:
        """The metric tables' constant columns for this plan (made once)."""
        got = self._constants.get(gsnr)
        if got is None:
            got = self._constants[gsnr] = constant_columns(self.length.numel(), self.length.device, gsnr)
        return got


def constant_columns(segments: int, device: torch.device, gsnr: bool) -> dict[str, Tensor]:
    """Constant columns of the metric tables: absent extremes and trust (-inf), and the gsnr and
    present flags."""
    absent = torch.full((segments, 2), -torch.inf, dtype=torch.float64, device=device)
    flags = torch.tensor([[float(gsnr), 1.0]], dtype=torch.float64).expand(segments, 2).contiguous()
    return {"extremes": absent, "untrusted": absent, "flags": flags.to(device)}


class Planner:
    """The plans of an optimizer's groups. A plan's shape is cached under the group's tensor ids
    and sizes (cheap to key, nothing rebuilt on a steady step); ``epoch`` (the optimizer's state
    epoch) says when the state dicts must be looked up again."""

    def __init__(self, owner: str, fused: bool | str | None = False) -> None:
        self.owner = owner
        self.fused = fused  # the optimizer's kernel choice, for the dtype rule (``checks.check_dtypes``)
        self._shapes: dict[tuple, PlanShape] = {}

    def clear(self) -> None:
        self._shapes = {}

    def plan(self, index: int, group: dict[str, Any], params: list[Tensor], grads: list[Tensor], key_base: int,
             tdev: torch.device, layout: Any | None, epoch: int, state_of: Callable[[Tensor], dict[str, Any]],
             state: dict | None = None) -> Plan:
        """``state_of(p)``: the state dict the kernels read for ``p``. With ``state`` (the
        optimizer's state mapping, which ``state_of`` reads), each step checks that it holds the
        same dicts as when they were looked up, in one pass over its values in C (no tensor is
        hashed: ``Tensor.__hash__`` is Python): a state cleared (``opt.state.clear()``), replaced
        (``opt.state = ...``) or deleted for a tensor (``del opt.state[p]``, a layer
        re-initialised) is looked up again and starts anew, as torch's optimizers start it."""
        key = (index, key_base, tdev, id(layout), tuple(map(id, params)), tuple(map(_NUMEL, params)),
               tuple(map(_DTYPE, params)))
        shape = self._shapes.get(key)
        if shape is None:
            # dtypes as add_param_group checks them, again: a model cast after the optimizer was built
            # (``model.double()``) changes its tensors in place
            check_dtypes(f"{self.owner} param group {index}", params, self.fused)
            shape = self._shape(index, group, params, key_base, tdev, layout)
            if len(self._shapes) > max(64, 4 * (index + 1)):  # a few shapes per group, however many groups
                self._shapes.clear()
            self._shapes[key] = shape
        stale = state is not None and (shape.found_in is not state or len(state) != len(shape.found)
                                       or not all(map(operator.is_, state.values(), shape.found)))
        if shape.states is None or shape.ready != epoch or stale:  # looked up once per epoch, and when replaced
            shape.ready = -1  # the state found is checked again (``init_state``)
            shape.states = [state_of(p) for p in params]
            if state is not None:
                shape.found_in, shape.found = state, list(state.values())
        plan = Plan(index, group, params, grads, shape.states, shape.seg, shape.numel, shape.keys, tdev, key_base)
        plan.tensor_of, plan.shapes, plan.rows, plan.shape = shape.tensor_of, shape.shapes, shape.rows, shape
        return plan

    def _shape(self, index: int, group: dict[str, Any], params: list[Tensor], key_base: int, tdev: torch.device,
               layout: Any | None) -> PlanShape:
        """The segment table of a group's tensors (built when they change, not every step)."""
        for p in params:
            if not p.is_contiguous():
                raise RuntimeError(f"{self.owner} needs contiguous parameters and gradients (a parameter of shape "
                                   f"{tuple(p.shape)} is not: a model in channels_last memory format? keep its "
                                   "parameters in torch.contiguous_format; channels_last inputs are fine)")
        if layout is None:  # every tensor is a whole model tensor
            rows = [[i, 0, p.numel(), key_base + i, p.numel(), 0] for i, p in enumerate(params)]
            shapes = {key_base + i: tuple(p.shape) for i, p in enumerate(params)}
            given = group.get("param_names")
            # a tensor's name, or its place in the group (``params`` holds those with a gradient only)
            name_of = ({id(q): nm for q, nm in zip(group["params"], given)} if given else
                       {id(q): f"group{index}.param{j}" for j, q in enumerate(group["params"])})
            names = [name_of.get(id(p), f"group{index}.param?") for p in params]
        else:
            rows = [[i, start, length, key, 0, offset] for i, p in enumerate(params)
                    for (start, length, key), offset in zip(layout.segments(p), layout.offsets(p))]
            shapes = {row[3]: layout.shapes[row[3]] for row in rows}
            names = []
        t = torch.tensor(rows, dtype=torch.long).reshape(-1, 6)
        seg, keys = t[:, :3].contiguous(), t[:, 3].contiguous()
        numel = t[:, 4].double() if layout is None else layout.numel.index_select(0, keys)
        length = seg[:, 2].double()
        return PlanShape(seg, to_device(numel, tdev), to_device(keys, tdev), to_device(seg[:, 0].contiguous(), tdev),
                         to_device(length, tdev), shapes, rows, names,
                         length_share=to_device(length / numel.clamp_min(1), tdev),
                         key_set=frozenset(row[3] for row in rows))
