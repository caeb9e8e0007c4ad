"""The parameters a step works on: plain tensors, or the local shards of DTensor parameters
(FSDP2, ``vrgd_ds/fsdp``), whose state is kept as DTensors sharded like them (``LocalState``).
"""
from __future__ import annotations

import itertools
import operator
from collections.abc import MutableMapping
from typing import Any, Iterator

import torch
from torch import Tensor


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support
        return None
    return DTensor


_DTENSOR = _dtensor_type()


class LocalState(MutableMapping):
    """The state of a DTensor parameter (FSDP2, ``vrgd_ds/fsdp``) as the kernels see it: each
    state tensor read as its local shard (a view: the kernels update the DTensor in place), and
    a local tensor shaped like the parameter's shard stored as a DTensor with the parameter's
    mesh and placements, so a checkpoint (DCP) holds sharded state. Scalars (``step``) stay
    plain tensors, as torch's optimizers keep them."""

    def __init__(self, state: dict[str, Any], param: Tensor) -> None:
        self._state, self._param = state, param
        self._local_shape = param._local_tensor.shape

    def __getitem__(self, key: str) -> Any:
        v = self._state[key]
        return v._local_tensor if isinstance(v, _DTENSOR) else v

    def __setitem__(self, key: str, value: Any) -> None:
        if isinstance(value, Tensor) and not isinstance(value, _DTENSOR) and value.dim() > 0:
            if value.shape != self._local_shape:
                raise ValueError(f"state {key!r} of shape {tuple(value.shape)} for a parameter whose shard is "
                                 f"{tuple(self._local_shape)}")
            p = self._param
            value = _DTENSOR.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                        stride=p.stride())
        self._state[key] = value

    def __delitem__(self, key: str) -> None:
        del self._state[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


def local_tensor(p: Tensor) -> Tensor:
    """``p`` itself, or its local shard when it is a DTensor (a view of the same storage)."""
    return p._local_tensor if _DTENSOR is not None and isinstance(p, _DTENSOR) else p


_IS_SPARSE = operator.attrgetter("is_sparse")
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def gather(group: dict[str, Any], attached: bool, sharded: dict[int, Tensor],
           owner: str) -> tuple[list[Tensor], list[Tensor]]:
    """The group's parameters with a gradient, and their gradients, as the kernels see them (a
    DTensor's local shard, remembered in ``sharded``: id(shard) -> its DTensor parameter). ``map``
    does the per-tensor checks in C: the host cost of a steady step hardly grows with the number
    of tensors. ``attached``: an engine laid the tensors out (needed for DTensors)."""
    params = [p for p in group["params"] if p.grad is not None]
    grads = [p.grad for p in params]
    if params and _DTENSOR is not None and any(map(isinstance, params, itertools.repeat(_DTENSOR))):
        if not attached:
            raise RuntimeError(f"{owner} steps DTensor (sharded) parameters: call "
                               "vrgd_ds.fsdp.attach(model, optimizer) first (its per-tensor sums and statistics "
                               "span the shards)")
        for p in params:
            sharded[id(p._local_tensor)] = p
        params, grads = list(map(local_tensor, params)), list(map(local_tensor, grads))
    if grads and (any(map(_IS_SPARSE, grads)) or not all(map(_IS_CONTIGUOUS, grads))):
        for p, gr in zip(params, grads):
            if gr.is_sparse:
                raise RuntimeError(f"{owner} does not support sparse gradients; "
                                   "use a dense layer (e.g. nn.Embedding(sparse=False))")
            if not gr.is_contiguous():
                raise RuntimeError(f"{owner} needs contiguous parameters and gradients (the gradient of a parameter "
                                   f"of shape {tuple(p.shape)} is not: a model in channels_last memory format? keep "
                                   "its parameters in torch.contiguous_format; channels_last inputs are fine)")
    return params, grads


def state_of(state: dict[Tensor, dict[str, Any]], sharded: dict[int, Tensor], p: Tensor) -> dict[str, Any]:
    """The state dict of ``p``; of its DTensor parameter when ``p`` is a local shard."""
    owner = sharded.get(id(p))
    if owner is None:
        return state[p]
    return LocalState(state[owner], owner)
