"""The VRGD family under megatron-core (tensor, pipeline and data parallelism, its
``DistributedDataParallel`` with or without the distributed optimizer)::

    from vrgd_ds.megatron import get_megatron_optimizer
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=..., use_distributed_optimizer=True, ...),
                                       model_chunks, optimizer="VRLamb", optimizer_kwargs={"gamma": 0.1})

Shaped like Megatron's ``megatron.core.optimizer.get_megatron_optimizer``: its param groups,
process groups, grad scaler and wrappers, with a family member inside. The statistics:
``vrgd_ds/megatron/stats.py``; what is refused and why: ``vrgd_ds/megatron/optimizer.py``,
docs/megatron.md. Needs the ``megatron`` extra (``megatron-core``, the release in
``SUPPORTED_MEGATRON_CORE``; another release fails when the optimizer is built, naming it).
"""
from __future__ import annotations

from vrgd_ds.megatron.internals import SUPPORTED_MEGATRON_CORE, UnsupportedMegatronConfiguration
from vrgd_ds.megatron.optimizer import get_megatron_optimizer

__all__ = ["get_megatron_optimizer", "SUPPORTED_MEGATRON_CORE", "UnsupportedMegatronConfiguration"]
