"""VRGD inside DeepSpeed: optimizer names in the JSON config, and statistics hooks attached
to whatever optimizer DeepSpeed builds (docs/design.md §2–3).

``register()`` (run by ``import vrgd_ds``) patches four points of ``DeepSpeedEngine`` at
class level, the one place every entry path (``deepspeed.initialize``, HF ``Trainer``,
Accelerate, Megatron-DeepSpeed) goes through:

* ``_is_supported_optimizer``: our names pass the config sanity check;
* ``_configure_basic_optimizer``: builds our class for ``"type": "VRLamb"`` etc.;
* ``_configure_optimizer``: rejects what the hooks do not cover, then attaches statistics,
  layout and the step hook to the optimizer DeepSpeed wrapped (config or client instance);
* ``engine.is_zero_supported_optimizer``: our classes run under ZeRO without
  ``zero_allow_untested_optimizer``;

and ``FP16_UnfusedOptimizer.initialize_optimizer_states`` (stage 0 fp16/bf16), which steps the
optimizer once on zero gradients: VRGD state is created at the first real step instead.
"""
from __future__ import annotations

import difflib
import logging
from typing import Any

import torch

from vrgd_ds.optim.base import GSNROptimizer, InvalidArgument
from vrgd_ds.optim.registry import REGISTRY

logger = logging.getLogger(__name__)

#: DeepSpeed versions whose internals the hooks were written against (pinned in pyproject).
SUPPORTED_DEEPSPEED = ("0.19.8",)

#: our optimizer names accepted in ``"optimizer": {"type": ...}``
NAMES = {name: info.cls for name, info in REGISTRY.items()}

_registered = False


class UnsupportedConfiguration(ValueError):
    """A DeepSpeed configuration the VRGD hooks do not cover (the message says which key)."""


def _require(obj: Any, names: tuple[str, ...], where: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    if missing:
        import deepspeed

        raise RuntimeError(
            f"vrgd_ds: DeepSpeed {deepspeed.__version__} lacks {where}.{', '.join(missing)}, which the VRGD hooks "
            f"use; supported DeepSpeed versions: {', '.join(SUPPORTED_DEEPSPEED)} (pip install deepspeed=="
            f"{SUPPORTED_DEEPSPEED[-1]})"
        )


def check_version() -> None:
    import deepspeed

    if deepspeed.__version__ not in SUPPORTED_DEEPSPEED:
        raise RuntimeError(
            f"vrgd_ds supports DeepSpeed {', '.join(SUPPORTED_DEEPSPEED)}, found {deepspeed.__version__}: its hooks "
            f"use DeepSpeed internals that change between releases. Install: pip install deepspeed=="
            f"{SUPPORTED_DEEPSPEED[-1]}"
        )


def resolve(name: str | None) -> type[GSNROptimizer] | None:
    """Our class for a config ``"type"`` (DeepSpeed lower-cases its own names, e.g. ``lamb``).

    ``Lamb`` is also DeepSpeed's (FusedLamb, CUDA only): ours serves it on the CPU accelerator,
    DeepSpeed's on GPUs. Use ``VRLamb`` with ``gamma: 1`` for our exact-under-ZeRO LAMB anywhere.
    """
    if name is None:
        return None
    if name in NAMES:
        return NAMES[name]
    if name == "lamb":
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() == "cpu":
            return NAMES["Lamb"]
    return None


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    if not close:
        close = [c for c in choices if c.lower() == word.lower()]
    return f"; did you mean {close[0]!r}?" if close else ""


def accepted_params(cls: type[GSNROptimizer]) -> list[str]:
    """The ``optimizer.params`` keys of a config ``"type"`` (a base variant fixes ``gsnr``)."""
    return REGISTRY[cls.__name__].accepted_params()


def check_params(cls: type[GSNROptimizer], type_name: str, params: dict[str, Any]) -> None:
    """Rejects ``optimizer.params`` keys the class does not take, naming the key."""
    if "max_grad_norm" in params and "max_grad_norm" not in accepted_params(cls):
        raise UnsupportedConfiguration(
            "optimizer.params.max_grad_norm: use DeepSpeed's top-level 'gradient_clipping' instead")
    accepted = accepted_params(cls)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise UnsupportedConfiguration(
            f"optimizer.params.{unknown[0]}: not a parameter of {cls.__name__} (type {type_name!r})"
            f"{_did_you_mean(unknown[0], accepted)}; accepted: {', '.join(accepted)}")


def check_optimizer_block(raw_config: dict[str, Any]) -> type[GSNROptimizer]:
    """Validates the ``"optimizer"`` block of a DeepSpeed config dict before any work: the type
    is a VRGD optimizer, every parameter is one it takes, and every value passes its checks
    (the class is built on a one-element dummy parameter). Errors name the key."""
    block = raw_config.get("optimizer")
    if not isinstance(block, dict) or "type" not in block:
        raise UnsupportedConfiguration('optimizer: the config needs an "optimizer" block with a "type", e.g. '
                                       '{"type": "VRLamb", "params": {"lr": 6e-3}}')
    name = block["type"]
    cls = resolve(name) if isinstance(name, str) else None
    if cls is None:
        raise UnsupportedConfiguration(
            f"optimizer.type: {name!r} is not a VRGD optimizer{_did_you_mean(str(name), list(NAMES))}; "
            f"registered: {', '.join(NAMES)}")
    params = block.get("params") or {}
    if not isinstance(params, dict):
        raise UnsupportedConfiguration(f"optimizer.params: must be an object of {cls.__name__}'s arguments, "
                                       f"got {type(params).__name__}")
    check_params(cls, name, params)
    try:
        cls([torch.zeros(1, requires_grad=True)], **params)
    except InvalidArgument as e:
        raise UnsupportedConfiguration(f"optimizer.params.{e.name.split('[')[0]}: {e}") from None
    except (ValueError, TypeError) as e:
        raise UnsupportedConfiguration(f"optimizer.params: {e}") from None
    return cls


def register() -> None:
    """Makes the VRGD names valid DeepSpeed optimizer types (idempotent)."""
    global _registered
    if _registered:
        return
    check_version()
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime.engine import DeepSpeedEngine

    _require(DeepSpeedEngine, ("_is_supported_optimizer", "_configure_basic_optimizer", "_configure_optimizer",
                               "allreduce_bucket", "optimizer_name", "optimizer_params"), "DeepSpeedEngine")
    _require(ds_engine, ("is_zero_supported_optimizer",), "deepspeed.runtime.engine")

    is_supported = DeepSpeedEngine._is_supported_optimizer
    configure_basic = DeepSpeedEngine._configure_basic_optimizer
    configure = DeepSpeedEngine._configure_optimizer
    zero_supported = ds_engine.is_zero_supported_optimizer

    def _is_supported_optimizer(self, optimizer_name):
        return resolve(optimizer_name) is not None or is_supported(self, optimizer_name)

    def _configure_basic_optimizer(self, model_parameters):
        cls = resolve(self.optimizer_name())
        if cls is None:
            return configure_basic(self, model_parameters)
        params = dict(self.optimizer_params() or {})
        check_params(cls, self.optimizer_name(), params)
        return cls(model_parameters, **params)

    def _configure_optimizer(self, client_optimizer, model_parameters):
        config_name = self._config.optimizer_name  # optimizer_name() reports the client's class instead
        ours = resolve(config_name) is not None
        client = client_optimizer is not None and not _is_dummy(client_optimizer)
        if client and config_name is not None and (ours or isinstance(client_optimizer, GSNROptimizer)):
            raise UnsupportedConfiguration(
                f"both a config optimizer ('optimizer.type': {config_name!r}) and a client optimizer "
                f"({type(client_optimizer).__name__}) were given to deepspeed.initialize; DeepSpeed would silently "
                "use the client one. Remove the 'optimizer' block from the config or do not pass optimizer=")
        if ours or isinstance(client_optimizer, GSNROptimizer):
            check_engine(self)
        configure(self, client_optimizer, model_parameters)
        if isinstance(self.basic_optimizer, GSNROptimizer):
            from vrgd_ds.ds.attach import attach

            attach(self)

    def is_zero_supported_optimizer(optimizer):
        return isinstance(optimizer, GSNROptimizer) or zero_supported(optimizer)

    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    _require(FP16_UnfusedOptimizer, ("initialize_optimizer_states",), "FP16_UnfusedOptimizer")
    init_states = FP16_UnfusedOptimizer.initialize_optimizer_states

    def initialize_optimizer_states(self):
        # DeepSpeed steps the optimizer once on zero gradients to allocate its state; VRGD
        # creates state at the first real step (and a step needs statistics).
        if not isinstance(self.optimizer, GSNROptimizer):
            init_states(self)

    FP16_UnfusedOptimizer.initialize_optimizer_states = initialize_optimizer_states
    DeepSpeedEngine._is_supported_optimizer = _is_supported_optimizer
    DeepSpeedEngine._configure_basic_optimizer = _configure_basic_optimizer
    DeepSpeedEngine._configure_optimizer = _configure_optimizer
    ds_engine.is_zero_supported_optimizer = is_zero_supported_optimizer
    _registered = True


def _is_dummy(opt: Any) -> bool:
    """HF/Accelerate hand DeepSpeed a placeholder when the config names the optimizer."""
    return type(opt).__name__ == "DummyOptim"


def check_engine(engine: Any) -> None:
    """Rejects configurations the VRGD hooks do not cover, naming the key (docs/design.md §3)."""
    stage = int(engine.zero_optimization_stage())

    def no(key: str, why: str) -> None:
        raise UnsupportedConfiguration(f"vrgd_ds: '{key}' is not supported with VRGD optimizers: {why}")

    if engine.zero_offload_optimizer() is not None and str(engine.zero_offload_optimizer().device) not in (
            "none", "OffloadDeviceEnum.none"):
        no("zero_optimization.offload_optimizer", "CPU/NVMe optimizer offload moves the update off the path the "
           "statistics hooks feed; remove the block")
    if engine.zero_offload_param() is not None and str(engine.zero_offload_param().device) not in (
            "none", "OffloadDeviceEnum.none"):
        no("zero_optimization.offload_param", "parameter offload is not covered by the hooks; remove the block")
    if getattr(engine, "pipeline_parallelism", False):
        no("PipelineModule", "pipeline parallelism is not covered; use data parallelism (ZeRO 0-3)")
    if engine.zero_quantized_gradients():
        no("zero_optimization.zero_quantized_gradients", "ZeRO++ quantised gradients bypass the fused "
           "reduction; set it to false")
    if engine.zero_hpz_partition_size() > 1:
        no("zero_optimization.zero_hpz_partition_size", "ZeRO++ hierarchical partitioning is not covered; set it to 1")
    if stage in (1, 2) and not engine.zero_contiguous_gradients():
        no("zero_optimization.contiguous_gradients", "false reduces through a path without the hooks; set it to true")
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        no("sequence_parallel_size", "sequence parallelism is not covered")
    if engine.is_deepcompile_enabled():
        no("compile.deepcompile", "DeepCompile does its own gradient reduction; disable it")
    if getattr(engine, "zenflow", False):
        no("zero_optimization.zenflow", "ZenFlow is not covered; remove the block")
    if not engine.gradient_average:
        no("gradient_allreduce_op", "VRGD needs DeepSpeed's mean gradient reduction (the default)")
    if engine.postscale_gradients() is False:
        no("prescale_gradients", "set prescale_gradients to false (the default)")
    if engine.gradient_predivide_factor() != 1.0:
        no("gradient_predivide_factor", "set it to 1.0 (the default)")
    model_dtype, accum_dtype = engine.get_data_types()
    if stage == 0 and model_dtype == torch.float16:
        no("fp16 with zero_optimization.stage 0", "DeepSpeed 0.19.8's engine.backward applies the fp16 loss scale "
           "only for ZeRO optimizers, while FP16_UnfusedOptimizer.step divides by it: gradients come out "
           "loss_scale times too small for any client optimizer. Use ZeRO stage >= 1 with fp16, or bf16")
    if stage == 1 and model_dtype == torch.bfloat16 and accum_dtype == torch.float32:
        no("data_types.grad_accum_dtype", "bf16 with ZeRO-1 and fp32 gradient accumulation uses BF16_Optimizer, "
           "which the hooks do not cover; use ZeRO-2, or drop grad_accum_dtype")
    if engine.communication_data_type not in (model_dtype, torch.float32):
        from vrgd_ds.ds.config import reduction_config

        if reduction_config(getattr(engine._config, "_param_dict", {}) or {}).scheme(stage) == "per_micro_step":
            logger.warning("vrgd_ds: communication_data_type %s is ignored for gradients: the fused [g | g²] "
                           "reduction (\"squares\": \"per_micro_step\") is fp32", engine.communication_data_type)
