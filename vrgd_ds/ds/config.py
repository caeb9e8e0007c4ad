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
