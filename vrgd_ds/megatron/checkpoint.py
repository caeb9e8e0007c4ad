"""Megatron dist-checkpointing (``sharded_state_dict``) of a VRGD optimizer's state
(docs/megatron.md, "Checkpoints").

Without the distributed optimizer, Megatron's own wrappers save every state key of the inner
optimizer against the model's ShardedTensors; they only need an ``init_state_fn`` that creates
every key before a load (``allocate``).

megatron-core 0.16.1's ``DistributedOptimizer`` formats are written for Adam: ``dp_reshardable``
and ``fully_reshardable`` list ``exp_avg``/``exp_avg_sq`` by name, and ``fully_sharded_model_space``
(its default) builds ShardedTensors with ``flattened_range``, which 0.16.1's dist-checkpointing
rejects. So the distributed optimizer gets ``vrgd_model_space`` here: per model tensor and state
key (the fp32 main weight, the moments, the GSNR momentum, a momentum buffer) the data-parallel
shards are summed into the tensor's model-space shape (one all-reduce each, at save time only;
the summed copies are kept in host memory, one tensor at a time on the device) and saved with
the model tensor's own sharding metadata (its tensor-parallel split and replica ids), as
Megatron's ``fully_reshardable`` does for Adam. A load reads the whole tensor and keeps
this rank's range, so a checkpoint resumes on another data-parallel size. The per-tensor step
counters are one common step (every tensor steps together), saved as ``vrgd_step``. A key a
tensor's state does not have (the GSNR momentum of a tensor stepping with the GSNR off, e.g. a
sequence-parallel LayerNorm under TP) is saved as NaN, and a load leaves it out of that tensor's
state, so that a layout where the tensor has the GSNR on starts its momentum at p̂ = 1, as for a
state without it (checkpoints written before hold zeros there, loaded as zeros).

megatron-core read here (checked when the optimizer is built, ``require``):
``DistributedOptimizer.buffers`` (each ``param_index_map``), ``model_param_group_index_map``,
``_get_model_param_range_map``, ``data_parallel_group``, ``state_dict``/``load_state_dict`` (the
param groups and the grad scaler).
"""
from __future__ import annotations

import types
from dataclasses import replace
from typing import Any, Iterator

import torch

from vrgd_ds.megatron.internals import UnsupportedMegatronConfiguration, require
from vrgd_ds.optim.base import GSNROptimizer

FORMAT = "vrgd_model_space"
_DISTRIBUTED = ("buffers", "model_param_group_index_map", "_get_model_param_range_map", "data_parallel_group",
                "state_dict", "load_state_dict", "sharded_state_dict")


def allocate(inner: GSNROptimizer, config: Any = None) -> None:
    """Megatron's ``init_state_fn``: every state key, before a sharded checkpoint loads into it."""
    inner.allocate_state()


def _refuse_format(fmt: Any) -> None:
    raise UnsupportedMegatronConfiguration(
        f"vrgd_ds.megatron: the distributed optimizer's checkpoint format {fmt!r} "
        "(metadata['distrib_optim_sharding_type']) is not supported with a VRGD optimizer: megatron-core 0.16.1 writes "
        f"it for Adam's exp_avg/exp_avg_sq. Leave the key out, or set it to {FORMAT!r}, which holds every state key")


def _common_step(inner: GSNROptimizer) -> float:
    steps = {float(st["step"]) for st in inner.state.values() if "step" in st}
    if len(steps) > 1:
        raise RuntimeError(f"{inner.name}: the tensors' step counters differ ({sorted(steps)}); a sharded "
                           "checkpoint saves one common step")
    return steps.pop() if steps else 0.0


def distributed(mopt: Any, inner: GSNROptimizer) -> None:
    """``sharded_state_dict``/``load_state_dict`` of a ``DistributedOptimizer`` in ``vrgd_model_space``."""
    require(mopt, _DISTRIBUTED, "DistributedOptimizer")
    megatron_state_dict, megatron_load = mopt.state_dict, mopt.load_state_dict

    def model_params() -> Iterator[torch.nn.Parameter]:
        for buffer in mopt.buffers:  # the same order on every rank of a model-parallel layout
            yield from buffer.param_index_map

    def local(p: Any) -> tuple[torch.Tensor, dict, Any] | None:
        where = mopt.model_param_group_index_map.get(p)
        if where is None:  # no piece of it on this data-parallel rank
            return None
        main = inner.param_groups[where[0]]["params"][where[1]]
        return main, inner.state[main], mopt._get_model_param_range_map(p)["param"]

    def keys() -> list[str]:
        return ["fp32_param", *sorted({k for g in inner.param_groups for k in inner.element_state_keys(g)})]

    def state_dict(self) -> dict:
        # Megatron's state_dict reads a step from every tensor's state; the other keys stay absent
        # where they are (a load leaves a key out that the first step builds: saved as NaN, not zeros)
        inner.allocate_state(steps_only=True)
        out = megatron_state_dict()
        out["vrgd_step"] = _common_step(inner)
        return out

    def sharded_state_dict(self, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           sharding_type: str | None = None, metadata: dict | None = None) -> dict:
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
        from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

        fmt = sharding_type or (metadata or {}).get("distrib_optim_sharding_type") or FORMAT
        if fmt != FORMAT:
            _refuse_format(fmt)
        out = self.state_dict()
        tensors, _ = extract_sharded_tensors_and_factories(model_sharded_state_dict or {})
        by_param = {sh.data: sh for sh in nested_values(tensors)}
        param_state = {}
        for i, p in enumerate(model_params()):
            sh = by_param.get(p)
            if sh is None:
                raise ValueError("vrgd_ds.megatron: a model parameter is not in the model's sharded state dict; build "
                                 "it with keep_vars=True (Megatron's sharded_state_dict does)")
            mine = None if is_loading else local(p)
            entry = {}
            for key in keys():
                if is_loading:  # in host memory, as the saved copies
                    full = torch.zeros(p.numel(), dtype=torch.float32)
                else:
                    full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
                    if mine is not None:
                        main, st, rng = mine
                        src = main if key == "fp32_param" else st.get(key)
                        # NaN: a key this tensor's state lacks (its every piece: one param group)
                        full[rng.start:rng.end] = float("nan") if src is None else src.detach().reshape(-1).float()
                    torch.distributed.all_reduce(full, group=self.data_parallel_group)  # the shards, summed
                    # one model-space tensor at a time on the device: the copies wait in host memory
                    full = full.cpu()
                kw = dict(key=f"optimizer.state.{key}.{sh.key}", data=full.view(p.shape), dtype=full.dtype,
                          replica_id=sh.replica_id)
                if isinstance(sh, ShardedTensorFactory):
                    kw.pop("dtype")
                entry[key] = replace(sh, **kw)
            param_state[i] = entry
        out["param_state"] = param_state
        out["param_state_sharding_type"] = FORMAT
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        param_state = state_dict.pop("param_state", None)
        fmt = state_dict.pop("param_state_sharding_type", None)
        step = state_dict.pop("vrgd_step", None)
        if param_state is not None and fmt != FORMAT:
            _refuse_format(fmt)
        inner.allocate_state()  # every key exists before Megatron's load (it allocates Adam's only)
        megatron_load(state_dict)
        if step is not None:
            for st in inner.state.values():
                st["step"] = torch.tensor(float(step), dtype=torch.float32, device=st["step"].device)
        if param_state is None:
            return
        for i, p in enumerate(model_params()):
            mine = local(p)
            if mine is None:
                continue
            main, st, rng = mine
            loaded = param_state[i]
            present = set()
            for key, full in loaded.items():
                piece = full.reshape(-1)[rng.start:rng.end]
                if key == "fp32_param":
                    main.copy_(piece)
                elif key in st and not bool(piece.isnan().all()):  # NaN: not in the saved tensor's state
                    st[key].copy_(piece)
                    present.add(key)
            # a key the checkpoint lacks (a non-strict load, e.g. of the base optimizer's checkpoint,
            # or the tensor's state had none) goes: the first step builds it as for any state without
            # it (GSNR momentum at p̂ = 1), not from the zeros allocated above
            for key in [k for k in st if k != "step" and k not in present]:
                del st[key]

    for name, fn in (("state_dict", state_dict), ("sharded_state_dict", sharded_state_dict),
                     ("load_state_dict", load_state_dict)):
        setattr(mopt, name, types.MethodType(fn, mopt))

