"""The training engines the job spine (``vrgd_ds/train/loop.py``) drives: ``job.engine`` names
one. Each module holds everything that knows its engine; nothing else in ``vrgd_ds.train``
imports DeepSpeed or Megatron (``tests/unit/test_engines.py``)."""
from __future__ import annotations

import importlib

from vrgd_ds.train.engines.base import Engine

#: ``job.engine`` -> the module that holds its ``ENGINE`` class (imported when chosen)
MODULES = {"deepspeed": "vrgd_ds.train.engines.deepspeed", "megatron": "vrgd_ds.train.engines.megatron"}


def engine_class(name: str) -> type[Engine]:
    """The engine class ``job.engine`` names (``parse_job`` has checked the name)."""
    return importlib.import_module(MODULES[name]).ENGINE


__all__ = ["Engine", "MODULES", "engine_class"]
