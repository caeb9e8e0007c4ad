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

from typing import Any

import torch

from vrgd_ds.ds import pipeline
from vrgd_ds.ds.config import not_covered, reduction_config
from vrgd_ds.ds.internals import SUPPORTED_DEEPSPEED, UnsupportedConfiguration, check_version, require
from vrgd_ds.ds.names import NAMES, accepted_params, check_optimizer_block, check_params, resolve
from vrgd_ds.optim.base import GSNROptimizer, built_for_engine

__all__ = ["SUPPORTED_DEEPSPEED", "UnsupportedConfiguration", "check_version", "require", "NAMES", "accepted_params",
           "check_optimizer_block", "check_params", "resolve", "register", "check_engine"]


_registered = False


def register() -> None:
    """Makes the VRGD names valid DeepSpeed optimizer types (idempotent)."""
    global _registered
    if _registered:
        return
    check_version()  # imports DeepSpeed, whose import hook (``vrgd_ds.ds.lazy``) may have registered meanwhile
    if _registered:
        return
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.runtime.engine import DeepSpeedEngine

    require(DeepSpeedEngine, ("_is_supported_optimizer", "_configure_basic_optimizer", "_configure_optimizer",
                               "allreduce_bucket", "optimizer_name", "optimizer_params"), "DeepSpeedEngine")
    require(ds_engine, ("is_zero_supported_optimizer",), "deepspeed.runtime.engine")

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
        with built_for_engine():  # vrgd_ds.ds.attach feeds it from DeepSpeed's reduction
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
        checked = ours or isinstance(client_optimizer, GSNROptimizer)
        if checked:
            check_engine(self)
        configure(self, client_optimizer, model_parameters)
        if isinstance(self.basic_optimizer, GSNROptimizer):
            from vrgd_ds.ds.attach import attach

            if not checked:  # a callable client optimizer (e.g. functools.partial(VRLamb, lr=...)) built it
                if config_name is not None:
                    raise UnsupportedConfiguration(
                        f"both a config optimizer ('optimizer.type': {config_name!r}) and a client optimizer (a "
                        f"callable that built {type(self.basic_optimizer).__name__}) were given to "
                        "deepspeed.initialize; DeepSpeed used the client one and dropped the config's. Remove the "
                        "'optimizer' block from the config or do not pass optimizer=")
                check_engine(self)
            attach(self)

    def is_zero_supported_optimizer(optimizer):
        return isinstance(optimizer, GSNROptimizer) or zero_supported(optimizer)

    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    require(FP16_UnfusedOptimizer, ("initialize_optimizer_states",), "FP16_UnfusedOptimizer")
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

    # the key as the config wrote it: DeepSpeed reads its deprecated cpu_offload(_param) as the blocks
    written = (getattr(engine._config, "_param_dict", None) or {}).get("zero_optimization")
    written = written if isinstance(written, dict) else {}

    def key(block: str, deprecated: str) -> str:
        return f"zero_optimization.{deprecated if written.get(deprecated) and block not in written else block}"

    if engine.zero_offload_optimizer() is not None and str(engine.zero_offload_optimizer().device) not in (
            "none", "OffloadDeviceEnum.none"):
        no(key("offload_optimizer", "cpu_offload"), "CPU/NVMe optimizer offload moves the update off the path the "
           "statistics hooks feed; remove it")
    if engine.zero_offload_param() is not None and str(engine.zero_offload_param().device) not in (
            "none", "OffloadDeviceEnum.none"):
        no(key("offload_param", "cpu_offload_param"), "parameter offload is not covered by the hooks; remove it")
    bf16 = getattr(engine._config, "bfloat16_config", None)
    if getattr(bf16, "enabled", False) and getattr(bf16, "bf16_master_weights_and_grads", False):
        raise not_covered("bf16.bf16_master_weights_and_grads")
    if pipeline.is_pipeline(engine):
        scheme = reduction_config(getattr(engine._config, "_param_dict", {}) or {}).scheme(stage)
        pipeline.check(engine, "per_step" if scheme == "auto" else scheme)  # auto takes per_step on pipelines
    if engine.zero_quantized_gradients():
        raise not_covered("zero_optimization.zero_quantized_gradients")
    if engine.zero_hpz_partition_size() > 1:
        raise not_covered("zero_optimization.zero_hpz_partition_size")
    if stage in (1, 2) and engine.zero_elastic_checkpoint():
        raise not_covered("zero_optimization.elastic_checkpoint")
    if stage in (1, 2) and not engine.zero_contiguous_gradients():
        raise not_covered("zero_optimization.contiguous_gradients")
    # ZeRO-3 without contiguous gradients: refused by attach, where whether statistics are read is known
    if getattr(engine, "sequence_parallel_size", 1) > 1:
        no("sequence_parallel_size", "sequence parallelism is not covered")
    require(engine, ("autotp_size", "mpu", "has_moe_layers"), "DeepSpeedEngine")
    # Model parallelism: a weight sharded across ranks would get its GSNR mean and its LAMB/LARS
    # trust ratio from this rank's shard alone; refused until the shards are completed exactly.
    if engine.autotp_size() > 1:
        no("tensor_parallel.autotp_size", f"AutoTP shards weights across {engine.autotp_size()} ranks and the "
           "per-tensor GSNR mean and trust ratios would be computed per shard; use data parallelism (ZeRO 0-3) "
           "or a non-VRGD optimizer")
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_world_size

    if bwc_tensor_model_parallel_world_size(engine.mpu) > 1:
        no("mpu (tensor model parallelism)", f"the model is sharded over {bwc_tensor_model_parallel_world_size(engine.mpu)} "
           "tensor-parallel ranks and the per-tensor GSNR mean and trust ratios would be computed per shard; use "
           "data parallelism (ZeRO 0-3)")
    if engine.has_moe_layers:
        no("MoE layers", "expert parameters are reduced over expert-data-parallel groups the statistics hooks do "
           "not cover; use a dense model")
    if engine.is_deepcompile_enabled():
        no("compile.deepcompile", "DeepCompile does its own gradient reduction; disable it")
    if getattr(engine, "zenflow", False):
        no("zero_optimization.zenflow", "ZenFlow is not covered; remove the block")
    if not engine.gradient_average:
        raise not_covered("gradient_allreduce_op")
    if engine.postscale_gradients() is False:
        raise not_covered("prescale_gradients")
    if engine.gradient_predivide_factor() != 1.0:
        raise not_covered("gradient_predivide_factor")
    model_dtype, accum_dtype = engine.get_data_types()
    if stage == 0 and model_dtype == torch.float16:
        raise not_covered("fp16 with zero_optimization.stage 0")
    if stage == 0 and model_dtype == torch.bfloat16 and pipeline.is_pipeline(engine):
        no("bf16 with zero_optimization.stage 0 under pipeline parallelism", "DeepSpeed 0.19.8 wraps the optimizer "
           "of a PipelineModule in BF16_Optimizer there, which the hooks do not cover; use ZeRO stage 1")
    if stage == 1 and model_dtype == torch.bfloat16 and accum_dtype == torch.float32:
        raise not_covered("data_types.grad_accum_dtype")
