"""The checks of a DeepSpeed JSON config before any work (``check_config``: its top-level keys, the
optimizer block, ``gradient_clipping``, the set-ups the hooks do not cover), and its ``"vrgd"``
block, the options of the statistics reduction.

DeepSpeed ignores top-level keys it does not know, so the block sits beside DeepSpeed's own (here
an unknown key is said, and a near miss of a known one refused)::

    "vrgd": {"squares_dtype": "bf16"}
"""
from __future__ import annotations

import difflib
import logging
import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from vrgd_ds.ds.internals import UnsupportedConfiguration
from vrgd_ds.ds.names import check_optimizer_block
from vrgd_ds.optim.checks import is_number

KEY = "vrgd"

logger = logging.getLogger(__name__)

#: DeepSpeed 0.19.8's top-level config keys (its config-json documentation; ``runtime/config.py``,
#: ``deepspeed.initialize`` and the engine read them), and the blocks of our own beside them: a key
#: a letter or two from one of them is a misspelt block, which DeepSpeed would ignore
#: (``"zero_optimisation"``: ZeRO off). The keys 0.19.8 removed are refused by name (``check_top_level``).
TOP_LEVEL_KEYS = frozenset((
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer", "scheduler",
    "communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
    "gradient_predivide_factor", "fp16", "bf16", "bfloat16", "torch_autocast", "gradient_clipping",
    "zero_optimization", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "activation_checkpointing",
    "aio", "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "autotuning", "data_efficiency", "checkpoint",
    "data_types", "dataloader_drop_last", "disable_allgather", "disable_python_gc", "expert_parallel",
    "gradient_allreduce_op", "hybrid_engine", "log_level", "managed_gradient_accumulation", "pipeline",
    "tensor_parallel", "timers", "use_data_before_expert_parallelism", "weight_quantization", "compile",
    "datastates_ckpt", "vocabulary_size", "sequence_parallel_size", "data_parallel_size",
    KEY, "job", "megatron"))


class ReductionConfig(BaseModel):
    """Options of the statistics' reduction (docs/design.md §3). Strict, as the job's block is: a
    value of another type is an error, not coerced (``"node_size": true`` is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    squares: Literal["per_step", "per_micro_step", "hierarchical", "auto"] | None = None  # also "by_memory"
    """``per_step``: DeepSpeed's own gradient reduction untouched; each rank sums its micro-steps'
    squares locally (a full-size fp32 buffer, 4 B/param per rank) and one collective per
    optimizer step reduces them; n = ranks × micro-steps on every stage. ``per_micro_step``:
    DeepSpeed's reduction of every bucket replaced by a fused fp32 ``[g | g²]`` collective (no
    full-size buffer; n = ranks on stage 0/ZeRO-1, where DeepSpeed reduces once per step).
    Default (null): ``per_step`` on stages 0-2, whose ranks already hold a full-size gradient
    (2-4 B/param) and parameters, ``per_micro_step`` on ZeRO-3, which exists to avoid full-size
    buffers per rank. ``hierarchical`` (stage 0, ZeRO-1/2/3): each bucket's statistics reduce-scattered within
    the node every micro-step into buffers partitioned over the node's ranks, then across nodes
    once per step: ``1/node_size`` of ``per_step``'s memory per rank, the same bytes between nodes
    (``vrgd_ds/stats/hierarchical.py``). ``auto``, also spelled ``by_memory``: ``auto_scheme``
    below (the rule of ``benchmarks/comm_model.py``'s memory table). HF ``Trainer`` and Accelerate
    refuse every ``"auto"`` of a config they do not fill themselves: write ``by_memory`` there."""
    gbar: Literal["auto", "engine", "local"] = "auto"
    """``per_step``'s mean gradient ḡ. ``engine``: DeepSpeed's reduced gradient, read before it
    is unscaled and clipped (no extra bytes). ``local``: summed in fp32 beside the squares and
    reduced with them (twice the bytes). ``auto``: ``engine`` in fp32 training that reduces in
    fp32, ``local`` in bf16/fp16 training, or with a bf16/fp16 ``communication_data_type`` or
    ``torch_autocast``, where DeepSpeed reduces (and accumulates) ḡ in the low dtype and its
    rounding meets the fp32 squares in ``s - ḡ²`` (measured: the first step's mean GSNR 4.46
    instead of 1.52 at n = 4 in bf16; see docs/deepspeed.md)."""

    squares_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype the squares travel in. ``fp32``: one fused fp32 collective per bucket (2x the
    gradient's fp32 bytes). ``bf16``: the squares in bf16 (1.5x), as a second collective per
    bucket, since one collective cannot mix dtypes; the statistics buffers stay fp32."""

    micro_steps: Literal["auto", "hooks"] = "auto"
    """Where ``per_step`` reads each micro-step's local gradient. ``auto``: from DeepSpeed's own
    flat reduction bucket wherever one holds a micro-step (ZeRO-2 and ZeRO-3; ZeRO-1 and stage 0
    without accumulation), one launch per bucket and no hook per parameter, else a tensor hook per
    parameter (ZeRO-1 and stage 0 with accumulation). ``hooks``: a tensor hook per
    parameter everywhere, which writes the same statistics bit for bit at one launch per tensor
    (the path the buckets are tested against; for a DeepSpeed whose buckets are laid out otherwise)."""

    node_size: int | None = None
    """``hierarchical``: the ranks per node (consecutive ranks form a node). Default (null): the
    ranks that share a host, found at attach; set it to group ranks otherwise (tests on one
    machine). It must divide the data-parallel ranks."""

    @model_validator(mode="before")
    @classmethod
    def _spellings(cls, data: Any) -> Any:
        """``by_memory`` is ``auto`` (a spelling HF Trainer and Accelerate leave alone)."""
        if isinstance(data, dict) and data.get("squares") == "by_memory":
            data = dict(data, squares="auto")
        return data

    @model_validator(mode="after")
    def _together(self) -> "ReductionConfig":
        if self.node_size is not None and self.node_size < 1:
            raise ValueError("vrgd.node_size must be a positive number of ranks")
        if self.squares in ("hierarchical", "auto") and self.squares_dtype != "fp32":
            raise ValueError("vrgd.squares_dtype: 'hierarchical' reduces [Σg | Σg²] chunks in one dtype, fp32"
                             + (", and 'auto' ('by_memory') may pick it" if self.squares == "auto" else "")
                             + "; remove squares_dtype or use squares 'per_step'")
        if self.node_size is not None and self.squares not in ("hierarchical", "auto"):
            raise ValueError("vrgd.node_size applies to squares 'hierarchical' (or 'auto') only")
        for key in ("gbar", "micro_steps"):  # the default (null) on ZeRO-3 is checked at attach
            if self.squares == "per_micro_step" and getattr(self, key) != "auto":
                raise ValueError(f"vrgd.{key} applies to squares 'per_step' and 'hierarchical' (or 'auto'), not "
                                 "'per_micro_step'")
        return self

    @property
    def torch_squares_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.squares_dtype == "bf16" else torch.float32

    def gbar_for(self, reduce_dtype: torch.dtype) -> str:
        """``auto``: the engine's mean gradient where DeepSpeed reduces gradients in fp32, else the
        local fp32 one (a low-precision ḡ against fp32 squares cancels in s - ḡ²)."""
        if self.gbar != "auto":
            return self.gbar
        return "engine" if reduce_dtype == torch.float32 else "local"

    def scheme(self, stage: int) -> str:
        """The scheme for a ZeRO stage: the one configured, else the default rule above."""
        return self.squares or ("per_micro_step" if stage == 3 else "per_step")


#: ``auto`` keeps the per-step scheme where its full-size buffer takes at most this share of the
#: device memory free when the statistics attach (the model states are placed by then; the rest
#: is left to activations)
AUTO_FREE_SHARE = 0.5


def auto_scheme(stage: int, pipeline: bool, world: int, node_size: int, full_bytes: int, free_bytes: int | None,
                hooks: bool = False) -> str:
    """``"squares": "auto"``: ZeRO-3 ``per_micro_step`` (no full-size buffer); stage 0 (whose ranks
    hold the whole model's sums at the step whatever the scheme) and pipelines ``per_step``;
    ZeRO-1/2 ``hierarchical`` on a single node (nothing crosses InfiniBand) or where the per-step
    scheme's full-size buffer (``full_bytes``) does not fit in ``AUTO_FREE_SHARE`` of the free
    device memory, else ``per_step`` (``free_bytes`` None: a host without a device memory limit).
    Never ``hierarchical`` with one rank a node (``node_size`` 1: its node buffers are the full
    size, nothing saved); and on a single node where the micro-steps are read by a tensor hook
    per parameter (``hooks``: ZeRO-1 with accumulation), whose within-node collectives need every
    rank's backward to reach every parameter, only where ``per_step`` does not fit."""
    if stage == 0 or pipeline:
        return "per_step"
    if stage == 3:  # its point: no full-size buffer per rank
        return "per_micro_step"
    if node_size <= 1:
        return "per_step"
    if world == node_size and not hooks:
        return "hierarchical"
    if free_bytes is not None and full_bytes > AUTO_FREE_SHARE * free_bytes:
        return "hierarchical"
    return "per_step"


def reduction_config(raw_config: dict[str, Any]) -> ReductionConfig:
    """Parses the ``"vrgd"`` block of DeepSpeed's raw config dict; errors name the key."""
    block = raw_config.get(KEY)
    block = {} if block is None else block
    if not isinstance(block, dict):
        raise UnsupportedConfiguration(f"{KEY}: {block!r} is not an object; write it as "
                                       f'{{"squares": "per_step"}} (accepted keys: {", ".join(ReductionConfig.model_fields)})')
    try:
        return ReductionConfig.model_validate(block)
    except ValidationError as e:
        err = e.errors()[0]
        if not err["loc"]:  # a check of several keys together: its message names them
            raise UnsupportedConfiguration(str(err["msg"]).removeprefix("Value error, ")) from None
        key = ".".join([KEY, *map(str, err["loc"])])
        raise UnsupportedConfiguration(f"{key}: {err['msg']} (accepted keys: "
                                       f"{', '.join(ReductionConfig.model_fields)})") from None


def _offload_device(block: Any) -> str:
    if not isinstance(block, dict):
        return "none"
    return str(block.get("device", "none")).lower()


#: what the VRGD hooks do not cover, by the key a refusal names (``check_engine`` on the engine's
#: parsed config, ``check_config`` on the raw dict where its value there says so): why, and the fix
NOT_COVERED = {
    "zero_optimization.zero_quantized_gradients": "ZeRO++ quantised gradients bypass the fused reduction; set it "
                                                  "to false",
    "zero_optimization.zero_hpz_partition_size": "ZeRO++ hierarchical partitioning is not covered; set it to 1",
    "zero_optimization.elastic_checkpoint": "DeepSpeed's elastic ZeRO-1/2 checkpoint takes the step count from "
                                            "param_groups[0]['step'], which VRGD optimizers keep per tensor: its "
                                            "checkpoints do not load or convert; set it to false (to resume on another "
                                            "number of ranks the job converts to a universal checkpoint: "
                                            "vrgd_ds.ds.universal)",
    "zero_optimization.contiguous_gradients": "false reduces through a path without the hooks; set it to true",
    "gradient_allreduce_op": "VRGD needs DeepSpeed's mean gradient reduction (the default)",
    "prescale_gradients": "set prescale_gradients to false (the default)",
    "gradient_predivide_factor": "set it to 1.0 (the default)",
    "fp16 with zero_optimization.stage 0": "DeepSpeed 0.19.8's engine.backward applies the fp16 loss scale only for "
                                           "ZeRO optimizers, while FP16_UnfusedOptimizer.step divides by it: gradients "
                                           "come out loss_scale times too small for any client optimizer. Use ZeRO "
                                           "stage >= 1 with fp16, or bf16",
    "data_types.grad_accum_dtype": "bf16 with ZeRO-1 and fp32 gradient accumulation uses BF16_Optimizer, which the "
                                   "hooks do not cover; use ZeRO-2, or drop grad_accum_dtype",
    "bf16.bf16_master_weights_and_grads": "ZeRO's master weights and gradients in bf16 (and the optimizer states "
                                          "with bf16_optimizer_states) are not what the statistics and the update "
                                          "are checked with; set it to false (the default: fp32 master weights)",
}


def not_covered(key: str) -> UnsupportedConfiguration:
    """The refusal of ``NOT_COVERED[key]``, naming the key."""
    return UnsupportedConfiguration(f"vrgd_ds: '{key}' is not supported with VRGD optimizers: {NOT_COVERED[key]}")


def zero_block(raw_config: dict[str, Any]) -> dict[str, Any] | None:
    """``zero_optimization`` as DeepSpeed reads it: ``true``/``false`` is its old spelling of
    stage 1/0 (``read_zero_config_deprecated``), a stage written as a string of digits is that
    number (its pydantic model converts it); None for anything else that is no dict, or a stage
    DeepSpeed would not take (its own parse names what is wrong there)."""
    zero = raw_config.get("zero_optimization")
    if zero is None:
        return {}
    if isinstance(zero, bool):
        return {"stage": int(zero)}
    if not isinstance(zero, dict):
        return None
    stage = zero.get("stage", 0)
    if isinstance(stage, str) and stage.strip().isdigit():
        stage = int(stage)
    return dict(zero, stage=stage) if stage in (0, 1, 2, 3) and not isinstance(stage, float) else None


def check_not_covered(raw_config: dict[str, Any]) -> None:
    """``NOT_COVERED``'s set-ups, refused from the raw dict before any work where its values say so
    plainly (``check_engine`` refuses them again on the engine's parsed config, for every path
    into DeepSpeed); a ``zero_optimization`` block DeepSpeed would refuse is left to its parse,
    the other set-ups still checked."""
    zero = zero_block(raw_config)
    stage = zero.get("stage", 0) if zero is not None else None
    zero = zero or {}
    hpz = zero.get("zero_hpz_partition_size", 1)
    predivide = raw_config.get("gradient_predivide_factor", 1.0)
    op = raw_config.get("gradient_allreduce_op", "mean")
    enabled = {name: isinstance(raw_config.get(name), dict) and raw_config[name].get("enabled") is True
               for name in ("fp16", "bf16", "bfloat16")}
    bf16_master = any(enabled[name] and raw_config[name].get("bf16_master_weights_and_grads") is True
                      for name in ("bf16", "bfloat16"))
    accum = (raw_config.get("data_types") or {}).get("grad_accum_dtype") if isinstance(
        raw_config.get("data_types"), dict) else None
    for key, refused in (
            ("zero_optimization.zero_quantized_gradients", zero.get("zero_quantized_gradients") is True),
            ("zero_optimization.zero_hpz_partition_size", is_number(hpz) and hpz > 1),
            ("zero_optimization.elastic_checkpoint", stage in (1, 2) and zero.get("elastic_checkpoint") is True),
            ("zero_optimization.contiguous_gradients", stage in (1, 2) and zero.get("contiguous_gradients") is False),
            ("gradient_allreduce_op", isinstance(op, str) and op.lower() != "mean"),
            ("prescale_gradients", raw_config.get("prescale_gradients") is True),
            ("gradient_predivide_factor", is_number(predivide) and predivide != 1.0),
            ("fp16 with zero_optimization.stage 0", stage == 0 and enabled["fp16"]),
            ("data_types.grad_accum_dtype", stage == 1 and (enabled["bf16"] or enabled["bfloat16"])
             and isinstance(accum, str) and accum.lower() in ("fp32", "float32", "float")),
            ("bf16.bf16_master_weights_and_grads", bf16_master)):
        if refused:
            raise not_covered(key)


def _one_edit(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` differ by one letter changed, added or removed, or two swapped."""
    if abs(len(a) - len(b)) > 1 or a == b:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                  and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    short, long = sorted((a, b), key=len)
    return any(long[:i] + long[i + 1:] == short for i in range(len(long)))


def near_miss(key: str, known: frozenset[str]) -> list[str]:
    """The known key ``key`` misspells, if any: the same in another case, a close match
    (difflib's, in lower case), or for a short key (5 letters or fewer, where one letter is too
    much of it for difflib) one edit away."""
    lower = {k.lower(): k for k in known}
    if key.lower() in lower:
        return [lower[key.lower()]]
    close = difflib.get_close_matches(key.lower(), sorted(lower), n=1, cutoff=0.85)
    if not close and len(key) <= 5:
        close = [k for k in sorted(lower) if _one_edit(key.lower(), k)][:1]
    return [lower[k] for k in close]


def check_top_level(raw_config: dict[str, Any]) -> None:
    """A key DeepSpeed 0.19.8 removed (its ``_REMOVED_TOP_LEVEL_CONFIG_KEYS``, and ZeRO's) is refused
    with DeepSpeed's own words, which ``deepspeed.initialize`` would raise after the work before it;
    a top-level key a letter or two from one DeepSpeed or this project reads (``TOP_LEVEL_KEYS``)
    is refused naming it, as DeepSpeed would ignore the block; any other key it does not know is
    said once (DeepSpeed ignores it too)."""
    from deepspeed.runtime import config as ds_config

    zero = raw_config.get("zero_optimization")
    for where, block, removed in (("", raw_config, ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS),
                                  ("zero_optimization.", zero if isinstance(zero, dict) else {},
                                   ds_config._REMOVED_ZERO_CONFIG_KEYS)):
        for key in block:
            if key in removed:
                raise UnsupportedConfiguration(f"{where}{key}: {removed[key]}")
    for key in raw_config:
        if key in TOP_LEVEL_KEYS:
            continue
        close = near_miss(str(key), TOP_LEVEL_KEYS)
        if close:
            raise UnsupportedConfiguration(f"{key}: not a DeepSpeed config key; did you mean {close[0]!r}? DeepSpeed "
                                           "ignores a key it does not know, so the block would have no effect")
        from vrgd_ds.log import warn_once

        warn_once(logger, f"top-level-{key}", "%s: not a key DeepSpeed or vrgd_ds reads; it has no effect", key,
                  scope="job")


def check_config(raw_config: dict[str, Any]) -> None:
    """What can be checked in a DeepSpeed config dict before any work (no engine, no
    process group): its top-level keys (``check_top_level``), the optimizer block
    (``check_optimizer_block``), the ``"vrgd"`` block, ``gradient_clipping``, and the set-ups the
    hooks do not cover (``check_not_covered``, and offload below). ``deepspeed.initialize`` checks
    the rest."""

    check_top_level(raw_config)
    check_optimizer_block(raw_config)
    reduction_config(raw_config)
    check_not_covered(raw_config)
    clip = raw_config.get("gradient_clipping", 0.0)
    if not is_number(clip) or not math.isfinite(clip) or clip < 0:
        raise UnsupportedConfiguration(f"gradient_clipping: {clip!r}: must be a finite number >= 0 (the global "
                                       "gradient norm's threshold; 0, the default, turns clipping off)")
    zero = zero_block(raw_config) or {}
    for key in ("cpu_offload", "cpu_offload_param"):  # DeepSpeed's deprecated spellings of the blocks below
        if zero.get(key):
            raise UnsupportedConfiguration(
                f"zero_optimization.{key}: CPU offload is not supported with VRGD optimizers (the statistics hooks "
                "feed the optimizer on the device); remove the key")
    for key in ("offload_optimizer", "offload_param"):
        if _offload_device(zero.get(key)) not in ("none", ""):
            raise UnsupportedConfiguration(
                f"zero_optimization.{key}: CPU/NVMe offload is not supported with VRGD optimizers (the statistics "
                "hooks feed the optimizer on the device); remove the block")
