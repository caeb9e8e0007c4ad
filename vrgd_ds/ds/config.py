"""The ``"vrgd"`` block of a DeepSpeed JSON config: options of the statistics reduction.

DeepSpeed ignores top-level keys it does not know, so the block sits beside DeepSpeed's own::

    "vrgd": {"squares_dtype": "bf16"}
"""
from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from vrgd_ds.ds.integration import UnsupportedConfiguration

KEY = "vrgd"


class ReductionConfig(BaseModel):
    """Options of the fused ``[g | g²]`` reduction."""

    model_config = ConfigDict(extra="forbid")

    squares_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype the squares travel in. ``fp32``: one fused fp32 collective per bucket (2x the
    gradient's fp32 bytes). ``bf16``: the squares in bf16 (1.5x), as a second collective per
    bucket, since one collective cannot mix dtypes; the statistics buffers stay fp32."""

    @property
    def torch_squares_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.squares_dtype == "bf16" else torch.float32


def reduction_config(raw_config: dict[str, Any]) -> ReductionConfig:
    """Parses the ``"vrgd"`` block of DeepSpeed's raw config dict; errors name the key."""
    block = raw_config.get(KEY) or {}
    try:
        return ReductionConfig.model_validate(block)
    except ValidationError as e:
        err = e.errors()[0]
        key = ".".join([KEY, *map(str, err["loc"])])
        raise UnsupportedConfiguration(f"{key}: {err['msg']} (accepted keys: "
                                       f"{', '.join(ReductionConfig.model_fields)})") from None


def _offload_device(block: Any) -> str:
    if not isinstance(block, dict):
        return "none"
    return str(block.get("device", "none")).lower()


def check_config(raw_config: dict[str, Any]) -> None:
    """What can be checked in a DeepSpeed config dict before any work (no engine, no
    process group): the optimizer block (``check_optimizer_block``), the ``"vrgd"`` block, and
    the ZeRO options the hooks do not cover. ``deepspeed.initialize`` checks the rest."""
    from vrgd_ds.ds.integration import check_optimizer_block

    check_optimizer_block(raw_config)
    reduction_config(raw_config)
    zero = raw_config.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        if _offload_device(zero.get(key)) not in ("none", ""):
            raise UnsupportedConfiguration(
                f"zero_optimization.{key}: CPU/NVMe offload is not supported with VRGD optimizers (the statistics "
                "hooks feed the optimizer on the device); remove the block")
