"""Universal-checkpoint conversion that keeps the VRGD optimizer state (docs/design.md §4).

DeepSpeed's ``ds_to_universal`` extracts only ``exp_avg``, ``exp_avg_sq``, ``fp32`` and
``step`` from each rank's ZeRO shard: ``gsnr_avg`` (the GSNR momentum) and
``momentum_buffer`` would be dropped silently and a resume on another number of ranks would
restart them from zero. This converter runs DeepSpeed's, with the extraction extended to every
partition-shaped state tensor, then merges the extra keys the way DeepSpeed merges its own
(``<output>/zero/<param>/<key>.pt``, ``{"param": tensor}``), which DeepSpeed's universal
loader reads back for any key.

Usage::

    python -m vrgd_ds.ds.universal --input_folder ckpt/global_step100 --output_folder ckpt/global_step100_universal

(which also writes ``ckpt/latest_universal``), then, in a DeepSpeed script of your own, resume
from ``ckpt`` with ``"checkpoint": {"load_universal": true}`` on any number of ranks. The
pretraining job converts and loads by itself, and refuses that key in its config.
ZeRO-1/2 checkpoints without tensor or pipeline parallelism are supported.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
from typing import Any

import torch

#: keys DeepSpeed's converter handles itself
_OWN = ("exp_avg", "exp_avg_sq", "fp32", "step")


class NoSpaceToConvert(OSError):
    """Less free space where the universal checkpoint goes than the conversion writes."""


def check_space(input_folder: str, output_folder: str) -> None:
    """The conversion writes about twice the checkpoint (DeepSpeed's per-fragment files, kept for
    the extra keys, then the merged tensors): refused before it starts where the output folder's
    filesystem has less free, rather than failing part-way on a full disk."""
    from pathlib import Path

    from vrgd_ds.train.checkpoints import free_bytes, size_of

    tag = Path(input_folder)
    need, free = 2 * size_of(tag.parent, tag.name), free_bytes(Path(output_folder))
    if free < need:
        raise NoSpaceToConvert(
            f"{output_folder}: converting {input_folder} to a universal checkpoint writes about {need / 2**20:,.0f} MB "
            f"(twice the checkpoint), {free / 2**20:,.0f} MB are free there; free space on that filesystem, or resume "
            "on the number of ranks that saved it")


def _extra_keys(state: dict[str, Any], numel: int) -> list[str]:
    return sorted(k for k, v in state.items()
                  if k not in _OWN and torch.is_tensor(v) and v.dim() == 1 and v.numel() == numel)


def convert(input_folder: str, output_folder: str, keep_temp_folder: bool = False) -> list[str]:
    """Converts a ZeRO-1/2 checkpoint folder (one tag) to universal form; returns the
    VRGD state keys carried over beyond DeepSpeed's own."""
    from deepspeed.checkpoint import ds_to_universal as u
    from deepspeed.checkpoint.constants import (BASE_OPTIMIZER_STATE, OPTIMIZER_STATE_DICT, PARAM,
                                                PARAM_SLICE_MAPPINGS, SINGLE_PARTITION_OF_FP32_GROUPS)

    if not glob.glob(os.path.join(input_folder, "*_optim_states.pt")) and glob.glob(
            os.path.join(input_folder, "mp_rank_*_model_states.pt")):
        raise NotImplementedError(
            f"{input_folder}: saved without ZeRO (stage 0): its optimizer state is whole in the model-state file "
            "and loads on any number of ranks as it is; nothing to convert")
    if u._get_zero_stage(u._get_optim_files(input_folder)) > 2:
        raise NotImplementedError("vrgd_ds universal conversion supports ZeRO-1/2 checkpoints; this one is ZeRO-3")
    # one model-state file per pipeline stage × tensor-parallel rank (DeepSpeed's mp_rank_XX), read by
    # name: before DeepSpeed's converter writes anything
    model_ranks = glob.glob(os.path.join(input_folder, "mp_rank_*_model_states.pt"))
    if len(model_ranks) > 1:
        raise NotImplementedError(
            f"{input_folder}: saved by {len(model_ranks)} model-parallel ranks (pipeline stages × tensor-parallel "
            "ranks); vrgd_ds universal conversion supports ZeRO-1/2 checkpoints without pipeline or tensor "
            "parallelism. Resume it on the layout it was saved with")
    check_space(input_folder, output_folder)
    extra: set[str] = set()

    def extract_zero_shards(dir, ds_checkpoint, indices_3D):
        pp_index, tp_index, dp_index = indices_3D
        if pp_index or tp_index:
            raise NotImplementedError("vrgd_ds universal conversion: pipeline/tensor parallel checkpoints")
        sd = ds_checkpoint.get_zero_checkpoint_state(pp_index=pp_index, tp_index=tp_index, dp_index=dp_index)
        optim_sd = sd[OPTIMIZER_STATE_DICT]
        states = optim_sd[BASE_OPTIMIZER_STATE]["state"]
        fp32_groups = optim_sd[SINGLE_PARTITION_OF_FP32_GROUPS]
        for group_id, mapping in enumerate(optim_sd[PARAM_SLICE_MAPPINGS]):
            state = states.get(group_id, {})
            flat = {"fp32": fp32_groups[group_id]}
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    flat[key] = state[key]
            keys = _extra_keys(state, fp32_groups[group_id].numel())
            extra.update(keys)
            flat.update({k: state[k] for k in keys})
            for name, fragment in mapping.items():
                for key, value in flat.items():
                    u.dump_param_fragment(dir, tp_index, dp_index, key, value, name, fragment.start, fragment.numel)

    original = u.extract_zero_shards
    u.extract_zero_shards = extract_zero_shards
    try:
        args = argparse.Namespace(input_folder=input_folder, output_folder=output_folder, num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=True, strict=True,
                                  inject_missing_state=True)
        u.main(args)
    finally:
        u.extract_zero_shards = original

    temp_dir = os.path.join(output_folder, "tmp")
    zero_dir = os.path.join(output_folder, "zero")
    for key in sorted(extra):
        for param_dir in sorted(glob.glob(os.path.join(temp_dir, "*"))):
            name = os.path.basename(param_dir)
            slices = u._merge_zero_shards(param_dir, key, 1)
            if not slices:
                continue
            shape = torch.load(os.path.join(zero_dir, name, "fp32.pt"), weights_only=False)[PARAM].shape
            torch.save({PARAM: slices[0].reshape(shape)}, os.path.join(zero_dir, name, f"{key}.pt"))
    if not keep_temp_folder:
        shutil.rmtree(temp_dir, ignore_errors=True)
    # DeepSpeed's loader finds the universal tag through this file next to it.
    parent = os.path.dirname(os.path.abspath(output_folder))
    with open(os.path.join(parent, "latest_universal"), "w") as fh:
        fh.write(os.path.basename(os.path.abspath(output_folder)))
    return sorted(extra)


def main() -> None:
    ap = argparse.ArgumentParser(description="DeepSpeed checkpoint -> universal checkpoint, keeping VRGD state")
    ap.add_argument("--input_folder", required=True, help="a checkpoint tag folder, e.g. ckpt/global_step100")
    ap.add_argument("--output_folder", required=True)
    ap.add_argument("--keep_temp_folder", action="store_true")
    a = ap.parse_args()
    try:
        keys = convert(a.input_folder, a.output_folder, a.keep_temp_folder)
    except (NotImplementedError, FileNotFoundError, NoSpaceToConvert) as e:  # not handled here, none, or no room
        ap.exit(2, f"error: {e}\n")
    print(f"universal checkpoint written to {a.output_folder}; VRGD state kept: {', '.join(keys) or 'none'}")


if __name__ == "__main__":
    main()
