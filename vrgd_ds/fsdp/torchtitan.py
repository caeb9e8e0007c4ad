"""torchtitan 0.3.0: any member of the VRGD family selected by name, without a fork of torchtitan.

torchtitan's trainer takes its configuration from a function named by ``--config`` in the module
named by ``--module`` (a fully qualified import path works), and builds its optimizer container
from ``config.optimizer`` after parallelising the model. This module gives both::

    torchrun --nproc_per_node 8 -m torchtitan.train --module vrgd_ds.fsdp.torchtitan \\
        --config llama3_debugmodel_vr_lamb

or, in a config registry of one's own::

    from vrgd_ds.fsdp.torchtitan import with_vrgd
    config = with_vrgd(config, "VRLamb", lr=2e-3, gamma=0.1, beta3=0.9, weight_decay=0.1)

(``with_vrgd`` also refuses context and expert parallelism once the run's parallelism is known.)

``VRGDOptimizersContainer`` resolves the family's names (``vrgd_ds.optim.registry``) beside
torchtitan's own (AdamW, ...) and attaches each VRGD optimizer to the FSDP model it updates
(``vrgd_ds.fsdp.attach``; a base member on a model with neither FSDP modules nor DTensor
parameters needs nothing attached). Its ``implementation`` defaults to ``"for-loop"``: torchtitan's
default ``"fused"`` injects ``fused=True`` into every param group, which the VRGD optimizers
refuse (they choose their kernels themselves); ``"fused_opt_states_bf16"`` is refused here
(bf16 optimizer states are not supported). torchtitan hands a param group's ``optimizer_kwargs``
to the optimizer inside the group, not to its constructor: each VRGD group's options are made
here as the constructor makes them (``group_options``: what it derives, such as VRLamb's
pre-normalisation from ``max_grad_norm``, and what it refuses, such as ``amsgrad``), and a key the
constructor does not take is an error naming it. Checkpoints are torchtitan's own (DCP, state keyed
by parameter name): the zero-gradient, lr = 0 step it runs before a load creates the VRGD state
without advancing it (``vrgd_ds.optim.state.is_state_init``).

torchtitan 0.3.0 calls ``torch.distributed.set_timeout``, which torch 2.13 (the release
``vrgd_ds.fsdp`` supports) does not have: importing this module aliases it to torch's
``distributed_c10d._set_pg_timeout`` where it is missing, and says so in the log.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

import vrgd_ds.fsdp
from vrgd_ds.fsdp.internals import UnsupportedFSDPConfiguration
from vrgd_ds.optim.base import GSNROptimizer, built_for_engine
from vrgd_ds.optim.metrics import Recorder
from vrgd_ds.optim.registry import REGISTRY, did_you_mean, probe_group

logger = logging.getLogger(__name__)

#: the torchtitan release this module was written against
SUPPORTED_TORCHTITAN = ("0.3.0",)

if not hasattr(torch.distributed, "set_timeout"):
    from torch.distributed.distributed_c10d import _set_pg_timeout

    torch.distributed.set_timeout = _set_pg_timeout
    logger.info("vrgd_ds.fsdp.torchtitan: torch %s has no torch.distributed.set_timeout, which torchtitan 0.3.0 "
                "calls after the first step; aliased to distributed_c10d._set_pg_timeout", torch.__version__)


def _check_version() -> None:
    from importlib.metadata import version

    found = version("torchtitan")
    if found not in SUPPORTED_TORCHTITAN:
        raise RuntimeError(f"vrgd_ds.fsdp.torchtitan supports torchtitan {', '.join(SUPPORTED_TORCHTITAN)}, found "
                           f"{found}: it subclasses torchtitan's OptimizersContainer. Install: pip install "
                           f"torchtitan=={SUPPORTED_TORCHTITAN[-1]}")


# what torchtitan's _build_param_groups puts into every param group beside the config's optimizer_kwargs
_TORCHTITAN_GROUP_KEYS = ("params", "param_names", "fused", "foreach")


# the optimizer's own settings, not a param group's
_OPTIMIZER_KEYS = ("fused", "set_grad_none")

# options a param group takes and the constructor does not, where the member has them (a LAMB or
# LARS group left unadapted: vrgd_ds.param_groups sets it for biases and norms)
_GROUP_ONLY_KEYS = ("trust_ratio",)


def _takes(name: str) -> list[str]:
    """Family member ``name``'s keyword arguments (``OptimInfo.accepted_params``), a variant's fixed
    ones too: the variant's own refusal names them."""
    info = REGISTRY[name]
    return info.accepted_params() + list(getattr(info.cls, "fixed", {}))


@functools.lru_cache(maxsize=None)
def _group_only(name: str) -> tuple[str, ...]:
    """``_GROUP_ONLY_KEYS`` that member ``name``'s param groups have (built once per member)."""
    return tuple(k for k in _GROUP_ONLY_KEYS if k in probe_group(REGISTRY[name].cls, {}))


def group_options(name: str, given: dict[str, Any], where: str) -> dict[str, Any]:
    """The param-group options of family member ``name`` that the keyword arguments ``given``
    make, as its constructor makes them: derived where it derives them, refused where it refuses
    them (it builds them, on a throwaway parameter). A key it does not take, or one that sets the
    optimizer and not a group (``fused``, ``set_grad_none``), is an error naming ``where``."""
    takes = _takes(name)
    takes += _group_only(name)
    unknown = [k for k in given if k not in takes]
    if unknown:
        groups_take = [k for k in takes if k not in _OPTIMIZER_KEYS]
        raise ValueError(f"{where}: {name} takes no {unknown[0]!r}{did_you_mean(unknown[0], groups_take)}; its "
                         f"param groups take {', '.join(groups_take)}")
    for key in _OPTIMIZER_KEYS:
        if key in given:
            raise ValueError(f"{where}: {key} is the {name} optimizer's setting, not a param group's: pass it as "
                             f"optimizer_factory_kwargs_by_name={{{name!r}: {{{key!r}: {given[key]!r}}}}}")
    try:
        return probe_group(REGISTRY[name].cls, {k: v for k, v in given.items() if k not in _GROUP_ONLY_KEYS},
                           {k: v for k, v in given.items() if k in _GROUP_ONLY_KEYS})
    except (TypeError, ValueError) as e:  # the constructor's refusal (amsgrad=True, Lamb with gsnr=True, ...)
        raise ValueError(f"{where}: {e}") from e


def _vrgd_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
    """Family member ``name`` built from torchtitan's param groups: each group's options through
    ``group_options``, so that they are what the constructor would make of them."""
    cls = REGISTRY[name].cls

    def build(param_groups: list[dict[str, Any]], **factory_kwargs: Any) -> torch.optim.Optimizer:
        groups = []
        for i, group in enumerate(param_groups):
            given = {k: v for k, v in group.items() if k not in _TORCHTITAN_GROUP_KEYS}
            options = group_options(name, given, f"vrgd_ds.fsdp.torchtitan: optimizer param group {i} ({name}) "
                                                 "optimizer_kwargs")
            groups.append({**options, **{k: group[k] for k in ("params", "param_names") if k in group}})
        return cls(groups, **factory_kwargs)

    build.__name__ = build.__qualname__ = name
    return build


class VRGDOptimizersContainer(OptimizersContainer):
    """torchtitan's optimizer container with the VRGD names, each VRGD optimizer attached to the
    FSDP model part it updates."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        implementation: str = "for-loop"
        """torchtitan's kernel choice for its own optimizers; the VRGD ones choose theirs (no
        ``fused``/``foreach`` in their param groups)."""

        force_sum_reduction_for_comms: bool = False
        """Set FSDP's ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (needed on
        gloo, which has no ``PREMUL_SUM`` for torchtitan's gradient divide factor)."""

        squares_dtype: str = "fp32"
        """The dtype the statistics' squares travel in ("fp32" or "bf16")."""

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., torch.optim.Optimizer]:
        if name in REGISTRY:
            return _vrgd_factory(name)
        return OptimizersContainer._resolve_optimizer_factory(name)

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        _check_version()
        uses_vrgd = any(pg.optimizer_name in REGISTRY for pg in config.param_groups)
        if uses_vrgd and config.implementation != "for-loop":
            why = ("its state is fp32" if config.implementation == "fused_opt_states_bf16" else
                   "torchtitan puts fused=/foreach= into every param group, and the VRGD optimizers pick their own "
                   "kernels")
            raise UnsupportedFSDPConfiguration(
                f"vrgd_ds.fsdp.torchtitan: optimizer.implementation={config.implementation!r} is not supported with a "
                f"VRGD optimizer: {why}; use 'for-loop' (--optimizer.implementation for-loop)")
        for i, pg in enumerate(config.param_groups):  # what torchtitan would overwrite in the group, or drop
            if pg.optimizer_name in REGISTRY and {"fused", "foreach"} & set(pg.optimizer_kwargs):
                raise UnsupportedFSDPConfiguration(
                    f"vrgd_ds.fsdp.torchtitan: param group {i} ({pg.optimizer_name}): fused/foreach in "
                    "optimizer_kwargs: the VRGD optimizers pick their own kernels; their fused= goes in "
                    f"optimizer_factory_kwargs_by_name={{{pg.optimizer_name!r}: {{'fused': ...}}}}")
        for name, kwargs in config.optimizer_factory_kwargs_by_name.items():  # the groups' options are all given
            if name in REGISTRY and (options := [k for k in kwargs if k not in _OPTIMIZER_KEYS]):
                raise UnsupportedFSDPConfiguration(
                    f"vrgd_ds.fsdp.torchtitan: optimizer_factory_kwargs_by_name[{name!r}] sets {options[0]!r}, a "
                    f"param group's option: every {name} group is built with all of its options (its optimizer_kwargs, "
                    "the constructor's defaults for the rest), so it would have no effect; put it in the param "
                    f"groups' optimizer_kwargs (only {', '.join(_OPTIMIZER_KEYS)} go here)")
        if uses_vrgd and len(model_parts) != 1:
            raise UnsupportedFSDPConfiguration(
                f"vrgd_ds.fsdp.torchtitan: pipeline parallelism ({len(model_parts)} model parts on this rank) is not "
                "supported: the statistics' per-tensor sums run over every rank of one model; set "
                "parallelism.pipeline_parallel_degree to 1")
        if config.force_sum_reduction_for_comms:
            for part in model_parts:
                for module in part.modules():
                    if isinstance(module, FSDPModule):
                        module.set_force_sum_reduction_for_comms(True)
        #: why the VRGD optimizers were built without statistics (torchtitan's seed checkpoint), or None
        self.not_attached: str | None = None
        # a base member (Lamb, or gsnr=False) takes no statistics, so a shard of one rank is no
        # refusal (attach takes it), and a model with no FSDP module and no DTensor parameter (its
        # tensors whole where it steps) needs nothing attached
        with_gsnr = any(pg.optimizer_name in REGISTRY and REGISTRY[pg.optimizer_name].vr
                        and pg.optimizer_kwargs.get("gsnr", True) for pg in config.param_groups)
        with _in_torchtitan_terms():
            if with_gsnr:
                self.not_attached = _unsharded(model_parts[0])
            with built_for_engine():  # each VRGD optimizer is fed by vrgd_ds.fsdp.attach below
                super().__init__(config, model_parts=model_parts)
            self.statistics: list[Any] = []
            if self.not_attached is not None:
                logger.info("vrgd_ds.fsdp.torchtitan: %s", self.not_attached)
                return
            if not with_gsnr and vrgd_ds.fsdp.shard_degree(model_parts[0]) is None and not any(
                    isinstance(p, DTensor) for p in model_parts[0].parameters()):
                return
            for optimizer in self.optimizers:
                if isinstance(optimizer, GSNROptimizer):
                    self.statistics.append(vrgd_ds.fsdp.attach(model_parts[0], optimizer,
                                                               squares_dtype=config.squares_dtype))

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self.not_attached is not None:
            raise UnsupportedFSDPConfiguration(f"vrgd_ds.fsdp.torchtitan: a training step, but {self.not_attached}")
        super().step(*args, **kwargs)

    def gsnr_metrics(self, per_tensor: bool = False, samples_per_group: int | None = None) -> dict[str, float]:
        """The VRGD optimizers' metrics of the last step (``GSNROptimizer.gsnr_metrics``), as of
        one optimizer over all their tensors (``Recorder.combined``)."""
        recorders = [o.records for o in self.optimizers if isinstance(o, GSNROptimizer)]
        return Recorder.combined(recorders).summary(per_tensor, samples_per_group) if recorders else {}


#: what in a torchtitan run makes an FSDP set-up ``vrgd_ds.fsdp.attach`` refuses: the words of its
#: refusal, and the torchtitan option to change
_TORCHTITAN_CAUSES = (
    ("several FSDP parameter groups", "torchtitan shards a MoE block's experts on a mesh of their own under "
     "expert parallelism: set parallelism.expert_parallel_degree to 1"),
    ("CPUOffloadPolicy", "torchtitan: set training.enable_cpu_offload to false"),
    # (the refusals name every FSDP option that replaces the reduce-scatter, and the class that did it)
    ("by SymmMemReduceScatter", "torchtitan: set parallelism.enable_fsdp_symm_mem to false"),
)


@contextlib.contextmanager
def _in_torchtitan_terms() -> Iterator[None]:
    """An FSDP refusal raised while the container is built, with the torchtitan option that makes
    the refused set-up (its message names FSDP's API, which a torchtitan user does not call)."""
    try:
        yield
    except UnsupportedFSDPConfiguration as e:
        for words, option in _TORCHTITAN_CAUSES:
            if words in str(e):
                raise UnsupportedFSDPConfiguration(f"{e} ({option})") from e
        raise


def _unsharded(model: torch.nn.Module) -> str | None:
    """Why a VRGD optimizer with the GSNR on, of ``model``, is built without statistics: on one rank, a model with no
    FSDP module is torchtitan's seed checkpoint (``--checkpoint.create_seed_checkpoint``, which skips
    ``parallelize_fn``), which saves the initial state and takes no step. A model sharded over fewer
    than 2 ranks otherwise is refused, naming torchtitan's option; None where it is sharded."""
    degree = vrgd_ds.fsdp.shard_degree(model)
    if degree is not None and degree >= 2:
        return None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if degree is None and world == 1:
        return ("the model has no FSDP module on this single rank (torchtitan's seed checkpoint, "
                "--checkpoint.create_seed_checkpoint), so the VRGD optimizers are not attached and take no step; "
                "train with parallelism.data_parallel_shard_degree >= 2 (or -1) on >= 2 ranks")
    where = ("the model has no FSDP module (torchtitan's parallelize_fn applied no fully_shard)" if degree is None else
             f"the model is sharded over {degree} rank (parallelism.data_parallel_shard_degree=1)")
    raise UnsupportedFSDPConfiguration(
        f"vrgd_ds.fsdp.torchtitan: {where}: the statistics are taken at FSDP's reduce-scatter, which a shard of one "
        "rank does not run; set parallelism.data_parallel_shard_degree to -1 (every data-parallel rank) or >= 2, "
        "with any replicas in parallelism.data_parallel_replicate_degree (HSDP)")


def vrgd_optimizer(name: str = "VRLamb", pattern: str = r".*", **optimizer_kwargs: Any) -> VRGDOptimizersContainer.Config:
    """A torchtitan optimizer configuration with one catch-all param group of family member
    ``name`` (``optimizer_kwargs`` include ``lr``; ``fused`` and ``set_grad_none``, the
    optimizer's own, go to its ``optimizer_factory_kwargs_by_name``), checked here as its
    constructor checks them (``group_options``). ``with_vrgd`` also checks the parallelism."""
    if name not in REGISTRY:
        raise ValueError(f"vrgd_optimizer: {name!r} is not a VRGD optimizer; registered: {', '.join(REGISTRY)}")
    takes = _takes(name)
    own = {k: optimizer_kwargs.pop(k) for k in _OPTIMIZER_KEYS if k in optimizer_kwargs and k in takes}
    group_options(name, optimizer_kwargs, f"vrgd_optimizer({name!r})")
    return VRGDOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=pattern, optimizer_name=name, optimizer_kwargs=optimizer_kwargs)],
        optimizer_factory_kwargs_by_name={name: own} if own else {})


def check_parallelism(parallel_dims: Any) -> None:
    """Refuses the parallelisms whose reductions the statistics do not see as micro-batch groups
    (torchtitan's ``ParallelDims``, once the run's command line is applied): pipeline parallelism
    (the per-tensor sums run over every rank as one model's), context parallelism
    (a reduction then sums the sequence chunks of one sample) and expert parallelism (experts on
    a mesh of their own)."""
    for degree, option, why in (
            ("pp", "parallelism.pipeline_parallel_degree", "each stage's tensors would be summed over every rank as "
             "one model's, and a stage's GSNR and trust ratios taken from another stage's tensors"),
            ("cp", "parallelism.context_parallel_degree", "each FSDP reduction would also sum a sample's sequence "
             "chunks, so the gradient groups would be chunks, not micro-batches"),
            ("ep", "parallelism.expert_parallel_degree", "the experts are sharded and reduced on a mesh of their "
             "own, over which the statistics count no groups")):
        if getattr(parallel_dims, degree, 1) > 1:
            raise UnsupportedFSDPConfiguration(f"vrgd_ds.fsdp.torchtitan: {option}={getattr(parallel_dims, degree)} is "
                                               f"not supported with a VRGD optimizer: {why}; set it to 1")


def with_vrgd(config: Any, name: str = "VRLamb", **optimizer_kwargs: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) trained with family member ``name``: its
    optimizer replaced by ``vrgd_optimizer``, CUDA graphs off (``training.disable_cuda_graphs``:
    a replay would skip the statistics' Python), and the run's parallelism checked right after the
    optimizer is built (``check_parallelism``, through the model spec's post-optimizer hook, which
    runs first what the model had there)."""
    spec = config.model_spec
    if spec is None:  # the check would have nowhere to go, and the run would go unchecked
        raise ValueError("with_vrgd: config.model_spec is None; set the model spec first (torchtitan's Trainer needs "
                         "it anyway), then call with_vrgd, which checks the parallelism in its post-optimizer hook")
    config.optimizer = vrgd_optimizer(name, **optimizer_kwargs)
    # the statistics' bookkeeping runs in Python at each FSDP reduction, which a CUDA graph's replay
    # skips (torchtitan captures forward and backward on NVIDIA GPUs unless told not to)
    config.training.disable_cuda_graphs = True
    before = spec.post_optimizer_build_fn

    def post_optimizer_build(optimizers: Any, model_parts: Any, parallel_dims: Any) -> None:
        check_parallelism(parallel_dims)
        if before is not None:
            before(optimizers, model_parts, parallel_dims)

    config.model_spec = dataclasses.replace(spec, post_optimizer_build_fn=post_optimizer_build)
    return config


def llama3_debugmodel_vr_lamb() -> Any:
    """torchtitan's llama3 debug model trained with VRLamb (its AdamW's learning rate and decay)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return with_vrgd(llama3_debugmodel(), "VRLamb", lr=8e-4, weight_decay=0.1, gamma=0.1, beta3=0.9)


__all__ = ["VRGDOptimizersContainer", "check_parallelism", "llama3_debugmodel_vr_lamb", "vrgd_optimizer", "with_vrgd"]
