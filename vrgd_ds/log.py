"""Logging helpers of the package: the one place for warn-once and rank filtering."""
from __future__ import annotations

import itertools
import logging
import os
import weakref

_warned: set[str] = set()
_serials = itertools.count()
_names: weakref.WeakKeyDictionary[object, int] = weakref.WeakKeyDictionary()

# who says a warning that every rank would say alike (``warn_once``'s ``scope``)
SCOPES = ("rank", "node", "job")


def _first_of(scope: str) -> bool:
    """Whether this process speaks for ``scope``: "rank" every process; "node" the node's first
    (``LOCAL_RANK`` 0, as torchrun, DeepSpeed's launchers and the job's set it; every process where
    it is unset); "job" the job's first (the process group's rank 0, else ``RANK`` 0)."""
    if scope == "rank":
        return True
    if scope == "node":
        return os.environ.get("LOCAL_RANK", "0") == "0"
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


def warn_once(logger: logging.Logger, key: str, msg: str, *args: object, scope: str = "rank") -> None:
    """Logs ``msg`` at WARNING the first time ``key`` is seen in this process, on the processes
    ``scope`` names: "rank" (default) for what one rank sees of its own (its gradients, its
    hooks), "node" for what the node's software gives every rank alike (Triton, the kernels), "job"
    for what the configuration gives every rank alike (said once, not once per rank)."""
    if scope not in SCOPES:
        raise ValueError(f"warn_once(scope={scope!r}): one of {SCOPES}")
    if key in _warned:
        return
    _warned.add(key)
    if _first_of(scope):
        logger.warning(msg, *args)


def name_of(obj: object) -> int:
    """A number naming ``obj`` in warn-once keys for as long as it lives: an ``id()`` is reused by
    a later object, whose warning its key would then take for already said."""
    if obj not in _names:
        _names[obj] = next(_serials)
    return _names[obj]
