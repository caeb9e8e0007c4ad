"""``get_megatron_optimizer`` for the VRGD family: Megatron's param groups and process groups, our
optimizer wrapped as Megatron wraps its own (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``
or ``DistributedOptimizer``, in a ``ChainedOptimizer``), the statistics attached
(``vrgd_ds/megatron/stats.py``). Tensors whose per-micro-batch gradient is partial per
tensor-parallel rank step with GSNR off (``partial_gradient_tensors``), and so, where asked
(``tied_across_stages="gsnr_off"``), do the tensors summed across pipeline stages
(``stage_tied_tensors``); what is not covered yet is refused here, naming the option."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch

from vrgd_ds.megatron import checkpoint
from vrgd_ds.megatron.internals import UnsupportedMegatronConfiguration, check_version, require
from vrgd_ds.megatron.stats import MegatronLayout, attach, model_tensors, pairs, supersede
from vrgd_ds.optim.base import GSNROptimizer, built_for_engine
from vrgd_ds.optim.registry import REGISTRY
from vrgd_ds.stats.layout import key_mask
from vrgd_ds.optim._impl import select_for

logger = logging.getLogger(__name__)

#: DistributedOptimizer methods that save or load its state in formats written for Adam's
#: ``exp_avg``/``exp_avg_sq`` (megatron-core 0.16.1): refused on a VRGD inner optimizer
_ADAM_CHECKPOINT_METHODS = ("save_parameter_state", "load_parameter_state",
                            "get_parameter_state_dp_zero", "load_parameter_state_from_dp_zero")


def _refuse(option: str, why: str, fix: str) -> None:
    raise UnsupportedMegatronConfiguration(f"vrgd_ds.megatron: {option} is not supported with a VRGD optimizer: "
                                           f"{why}. {fix}")


def check_configuration(config: Any, chunks: list[Any], name: str, gsnr: bool | None = None,
                        tied_across_stages: str = "refuse") -> None:
    """Refuses what the statistics do not cover yet, naming the option (docs/megatron.md).
    ``gsnr``: whether the member steps with the GSNR (its ``gsnr`` argument; default: a VR
    member does); the refusals that concern the statistics apply only then.
    ``tied_across_stages``: ``"gsnr_off"`` lifts the refusals of tensors summed across pipeline
    stages (they step with the GSNR off instead: ``stage_tied_tensors``)."""
    from megatron.core import parallel_state as ps

    if name not in REGISTRY:
        raise ValueError(f"vrgd_ds.megatron: unknown optimizer {name!r}; the family: {', '.join(REGISTRY)}")
    ddp = chunks[0].ddp_config
    model = chunks[0].config
    gsnr = REGISTRY[name].vr if gsnr is None else gsnr
    for chunk in chunks:
        if chunk.ddp_config != ddp:
            raise ValueError("vrgd_ds.megatron: the model chunks have different DistributedDataParallelConfigs")
    if bool(config.use_distributed_optimizer) != bool(ddp.use_distributed_optimizer):
        raise ValueError(
            "vrgd_ds.megatron: OptimizerConfig.use_distributed_optimizer is "
            f"{config.use_distributed_optimizer} but the model's DistributedDataParallelConfig.use_distributed_optimizer "
            f"is {ddp.use_distributed_optimizer}: the buffers would reduce-scatter gradients that a non-distributed "
            "optimizer steps on whole (the data-parallel replicas drift apart), or the other way round fail at the "
            "first step. Set both to the same value")
    accepted = REGISTRY[name].accepted_params()
    if not config.decoupled_weight_decay and config.weight_decay and "betas" in accepted:  # Adam's L2 decay
        l2_mode = "adam_w_mode" in accepted
        if gsnr:  # the GSNR off is a way out only for a member with an L2 mode (VRLamb: Lamb's)
            _refuse("OptimizerConfig.decoupled_weight_decay=False", "the GSNR scales the data gradient, and Adam's "
                    "L2 decay would be part of it", "Set decoupled_weight_decay=True" + (
                        f" (or the GSNR off: {REGISTRY[name].base}'s L2 mode)" if l2_mode else
                        ", or use Lamb (which takes it as adam_w_mode=False)"))
        if not l2_mode:
            _refuse("OptimizerConfig.decoupled_weight_decay=False", f"{name} decouples its weight decay (as AdamW); "
                    "Adam's L2 decay in the gradient is not one of its modes",
                    "Set decoupled_weight_decay=True, or use Lamb (which takes it as adam_w_mode=False)")
    if config.optimizer_cpu_offload:
        _refuse("OptimizerConfig.optimizer_cpu_offload", "the hybrid CPU/GPU optimizer steps Adam or SGD of its own",
                "Set optimizer_cpu_offload=False")
    if config.use_precision_aware_optimizer:
        _refuse("OptimizerConfig.use_precision_aware_optimizer", "it needs TransformerEngine's FusedAdam",
                "Set use_precision_aware_optimizer=False")
    if config.overlap_param_gather_with_optimizer_step:
        _refuse("OptimizerConfig.overlap_param_gather_with_optimizer_step", "it splits the chunks into two optimizers",
                "Set it to False")
    if getattr(ddp, "use_megatron_fsdp", False):
        _refuse("DistributedDataParallelConfig.use_megatron_fsdp", "FSDP has no grad buffers the statistics read",
                "Use Megatron's DistributedDataParallel, with or without use_distributed_optimizer")
    if ddp.num_distributed_optimizer_instances > 1:
        _refuse("DistributedDataParallelConfig.num_distributed_optimizer_instances > 1",
                "the squares would need a second, inter-instance reduction",
                "Set num_distributed_optimizer_instances=1")
    if getattr(model, "gradient_accumulation_fusion", False):
        _refuse("TransformerConfig.gradient_accumulation_fusion",
                "it writes weight gradients straight into main_grad, so no per-micro-batch gradient reaches a hook",
                "Set gradient_accumulation_fusion=False")
    if (len(chunks) > 1 and ps.get_pipeline_model_parallel_world_size() == 2 and getattr(model, "batch_p2p_comm", False)
            and not getattr(model, "use_ring_exchange_p2p", False)):  # training, whatever the GSNR
        _refuse("TransformerConfig.batch_p2p_comm=True with model chunks on 2 pipeline stages",
                "megatron-core's batched exchange posts a send and a receive for each direction to and from the same "
                "rank, in the same order on both ranks, so a gradient meets an activation's receive and every stage "
                "trains on the wrong tensors without an error",
                "Set batch_p2p_comm=False and overlap_p2p_comm=True (Megatron-LM's default with model chunks), or "
                "batch_p2p_comm=False alone")
    if ps.get_context_parallel_world_size() > 1:
        _refuse("context_parallel_size > 1", "context-parallel ranks hold partial gradients of the same samples",
                "Use context_parallel_size=1")
    if getattr(model, "num_moe_experts", None) or any(getattr(c, "expert_parallel_buffers", None) for c in chunks):
        _refuse("MoE experts (num_moe_experts)", "expert parameters are reduced over the expert data-parallel group",
                "Use a dense model")
    if ps.get_tensor_model_parallel_world_size() > 1 and REGISTRY[name].row_col_maxima:  # GSNR on or off
        _refuse(f"{name} with tensor parallelism", "its row and column maxima would span tensor-parallel shards",
                "Use tensor_model_parallel_size=1 or another member")
    if not gsnr:
        return
    tied = stage_tied_tensors(chunks) if tied_across_stages == "refuse" else {}
    if tied:
        kind, tensor = min(tied.values(), key=lambda kt: ("mtp", "tied", "cond").index(kt[0]))  # the first named
        off = ('or tied_across_stages="gsnr_off" (those tensors then step as the base optimizer, every other '
               f'tensor with its GSNR), or the base optimizer ({REGISTRY[name].base})')
        if kind == "mtp":
            _refuse("multi-token prediction (TransformerConfig.mtp_num_layers) across pipeline stages",
                    f"its embedding ({tensor}) is the first stage's, summed across stages once per step, after "
                    f"the squares", f"Set mtp_num_layers=None or pipeline_model_parallel_size=1, {off}")
        if kind == "tied":
            _refuse("share_embeddings_and_output_weights across pipeline stages",
                    f"the tied weight ({tensor}) is summed across stages once per step, after the squares",
                    f"Set share_embeddings_and_output_weights=False, {off}")
        _refuse("conditional embedders on every pipeline stage (TransformerConfig.has_cond_embedder)",
                f"their gradient ({tensor}) is summed across the stages once per step, after each stage's squares",
                f"Use pipeline_model_parallel_size=1, {off}")
    if getattr(model, "calculate_per_token_loss", False):
        _refuse("TransformerConfig.calculate_per_token_loss",
                "Megatron then divides the reduced gradient by the step's token count after the micro-batches' "
                "squares were taken, so the mean gradient and the squares would be on different scales",
                "Set calculate_per_token_loss=False (the loss averaged per micro-batch)")
    if (config.bf16 or config.fp16) and not ddp.grad_reduce_in_fp32:
        _refuse("bf16/fp16 without DistributedDataParallelConfig.grad_reduce_in_fp32",
                "the mean gradient would come from a low-precision reduction and meet fp32 squares in s - gbar²",
                "Set grad_reduce_in_fp32=True")


def _refused_on_every_rank(check: Any) -> None:
    """Runs ``check`` and raises a refusal of any rank on every rank. Some refusals depend on what
    a rank holds (the tied embedding on the first and last pipeline stages only, a rank without a
    trainable parameter); a rank that went on would wait for the refused ones in Megatron's
    collectives (``_get_param_groups_and_buffers`` gathers over every rank) until the timeout."""
    error: Exception | None = None
    try:
        check()
    except (UnsupportedMegatronConfiguration, ValueError) as e:
        error = e
    dist = torch.distributed
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list[Any] = [None] * dist.get_world_size()
        mine = None if error is None else (isinstance(error, UnsupportedMegatronConfiguration), str(error))
        dist.all_gather_object(everyone, mine)
        refused = next(((rank, *e) for rank, e in enumerate(everyone) if e), None)
        if error is None and refused is not None:
            rank, unsupported, message = refused
            error = (UnsupportedMegatronConfiguration if unsupported else ValueError)(f"{message} (on rank {rank})")
    if error is not None:
        raise error


def partial_gradient_tensors(model_chunks: list[Any]) -> dict[int, str]:
    """The parameters whose gradient of a micro-batch is partial on each tensor-parallel rank, by
    id, with their names: sequence-parallel ones (LayerNorms, row-parallel biases) and the q/k
    LayerNorms under ``qk_layernorm``, which Megatron sums over TP once per step, and those marked
    ``average_gradients_across_tp_domain`` (every parameter of a wrapped HuggingFace module), which
    it averages there — Megatron's own rule
    (``finalize_model_grads._allreduce_non_tensor_model_parallel_grads``). The square of a partial
    is not a partial of the square, nor one rank's square that of the ranks' mean, so no
    per-micro-batch statistic of theirs is exact; they step with GSNR switched off
    (``_twin_groups``)."""
    config = model_chunks[0].config
    out = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if (config.sequence_parallel and getattr(p, "sequence_parallel", False)) or (
                    config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)) or getattr(
                    p, "average_gradients_across_tp_domain", False):
                out[id(p)] = name
    return out


def stage_tied_tensors(model_chunks: list[Any]) -> dict[int, tuple[str, str]]:
    """The parameters Megatron sums across pipeline stages once per step (``finalize_model_grads``),
    by id, with their kind and name: a word embedding tied to the output layer of the last stage
    (``share_embeddings_and_output_weights``: ``shared_embedding``/``shared``; ``"tied"``), the
    embedding multi-token prediction copies to the last stage (``"mtp"``) and a diffusion model's
    conditional embedders, a copy on every stage (``has_cond_embedder``: ``pipeline_parallel``;
    ``"cond"``). Each stage holds a partial of their gradient of a micro-batch, so the square of
    none is exact. Empty without pipeline stages; a frozen one is left out (Megatron sums no
    gradient of it, and no optimizer steps it)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return {}
    config = model_chunks[0].config
    shared_kind = "mtp" if getattr(config, "mtp_num_layers", None) else "tied"
    cond = getattr(config, "has_cond_embedder", False)
    out = {}
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if not p.requires_grad:
                continue
            if getattr(p, "shared_embedding", False) or getattr(p, "shared", False):
                out[id(p)] = (shared_kind, name)
            elif cond and getattr(p, "pipeline_parallel", False):
                out[id(p)] = ("cond", name)
    return out


#: the param-group key that tells a twin group (``_twin_groups``) from its original: True on the twin.
#: Named for its first use; the twin also holds the tensors tied across pipeline stages, and the name
#: stays, being in saved checkpoints' param groups
TWIN_KEY = "tp_partial_grads"


def _twin_groups(param_groups: list[dict], partial: dict[int, str], tied: dict[int, tuple[str, str]]) -> list[dict]:
    """Each Megatron param group followed by its twin (same LR and weight decay, ``gsnr=False``,
    ``TWIN_KEY`` True) holding the ``partial`` and ``tied`` tensors, which step as the base
    optimizer on the gradient Megatron completes over TP or across the stages; the rest keep their
    GSNR. Every rank, layout and member has the twins, empty where nothing is moved (TP1 and one
    stage, a member without GSNR, a group without such tensors), so that a dist checkpoint's param
    groups are the same list on every rank and in a resume on another tensor-parallel size or
    with the member's base, as dist-checkpointing needs (it merges the saved list with the loading
    optimizer's). Logged once per reason, naming the tensors."""
    out = []
    for g in param_groups:
        keep = [p for p in g["params"] if id(p) not in partial and id(p) not in tied]
        moved = [p for p in g["params"] if id(p) in partial or id(p) in tied]
        out += [{**g, "params": keep, TWIN_KEY: False}, {**g, "params": moved, "gsnr": False, TWIN_KEY: True}]
    held = {id(p) for g in param_groups for p in g["params"]}
    for off, why in (([n for i, n in partial.items() if i in held], "under tensor parallelism their gradient of a "
                      "micro-batch is partial on each rank (sequence parallelism, qk_layernorm) or averaged over "
                      "the ranks (average_gradients_across_tp_domain)"),
                     ([n for i, (_, n) in tied.items() if i in held], "Megatron sums their gradient across "
                      "pipeline stages once per step, so each stage holds a partial of a micro-batch's "
                      '(tied_across_stages="gsnr_off")')):
        if off:
            logger.warning("vrgd_ds.megatron: GSNR switched off for %d tensors (%s%s): %s, so their GSNR cannot be "
                           "taken exactly; they step as the base optimizer", len(off), ", ".join(off[:4]),
                           ", ..." if len(off) > 4 else "", why)
    return out


def _inner_kwargs(config: Any, name: str, given: dict[str, Any]) -> dict[str, Any]:
    """The member's arguments from Megatron's ``OptimizerConfig`` where it has them; ``given`` wins."""
    accepted = set(REGISTRY[name].accepted_params())
    out: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
    if "betas" in accepted:
        out["betas"] = (config.adam_beta1, config.adam_beta2)
    if "eps" in accepted:
        out["eps"] = config.adam_eps
    if "momentum" in accepted:
        out["momentum"] = config.sgd_momentum
    if "adam_w_mode" in accepted:  # Megatron's Adam: L2 decay in the gradient unless decoupled (AdamW)
        out["adam_w_mode"] = bool(config.decoupled_weight_decay)
    return {**out, **given}


@contextlib.contextmanager
def _distributed_optimizer_accepts(cls: type) -> Iterator[None]:
    """THE ONE PLACE the Adam-only check is handled. megatron-core 0.16.1's ``DistributedOptimizer``
    asserts in ``__init__`` that its inner optimizer is an ``Adam``, ``torch.optim.AdamW`` or
    ``HybridDeviceOptimizer`` "due to checkpointing requirements"; the assert reads the module's
    name ``Adam``, which names ``cls`` too while the optimizer is built. The checkpoint methods
    written for Adam's state are refused on the result (``_refuse_adam_checkpoints``)."""
    import megatron.core.optimizer.distrib_optimizer as distrib

    saved = distrib.Adam
    distrib.Adam = (saved, cls)
    try:
        yield
    finally:
        distrib.Adam = saved


#: a param group's place among the optimizer's, in Megatron's key only while a state loads
_PLACE_KEY = "vrgd_place"


def _aligned_groups(saved: list[dict], current: list[dict], identify: Any) -> list[dict] | None:
    """THE ONE PLACE a loaded state's param groups are matched to the optimizer's twins. megatron-core
    0.16.1 matches them by ``param_group_identifier_keys`` (wd_mult, lr_mult, is_expert_parallel,
    is_decoupled_lr; ``identify``): ``_filter_and_reorder_param_groups`` without the distributed
    optimizer, ``DistributedOptimizer.load_state_dict`` with it. A twin group (``_twin_groups``) has
    its original's key, so both matched one of them. Here each of the optimizer's groups gets the
    saved group of its key and role (original or twin, ``TWIN_KEY``), or of its key alone in a
    state saved without twins (Megatron's own optimizers'), with ``TWIN_KEY`` set as the
    optimizer's, which the key is widened with for the load (``_loads_twin_groups``). The
    hyperparameters of a group and its twin are the same; ``gsnr`` is a wiring key, kept as built
    (``GSNROptimizer.load_state_dict``). The ``params`` stay where they were in the list: without
    the distributed optimizer dist-checkpointing put the loading optimizer's own there, in its
    order (the distributed optimizer's state has none: it takes its own). None where a group's
    key is not in the state (Megatron's load names it). Megatron's key does not tell apart groups
    that differ only in an override it leaves out of it (``decoupled_lr``'s ``max_lr``/``min_lr``, the
    embedding and output layer's, beside the default group): the k-th group of a key and role
    gets the saved k-th, in Megatron's (sorted) group order."""
    out, seen = [], {}
    for at, group in enumerate(current):
        kind = (identify(group), group[TWIN_KEY])
        k = seen[kind] = seen.get(kind, -1) + 1
        same = [g for g in saved if identify(g) == kind[0]]
        pool = [g for g in same if g.get(TWIN_KEY, False) == group[TWIN_KEY]] or same
        pick = pool[k] if k < len(pool) else (pool[0] if pool else None)
        if pick is None:
            return None
        aligned = {**pick, TWIN_KEY: group[TWIN_KEY]}
        if len(saved) == len(current) and "params" in saved[at]:
            aligned["params"] = saved[at]["params"]
        out.append(aligned)
    return out


#: ``Float16OptimizerWithFloat16Params``'s fp32 main weights in its state dict: a list per param group
_FP32_FROM_FP16 = "fp32_from_fp16_params"


def _keeps_empty_groups_in_place(mopt: Any) -> None:
    """THE ONE PLACE ``Float16OptimizerWithFloat16Params.sharded_state_dict`` is reshaped: its fp32
    main weights, a list per param group, go by group index (``{index: list}``, the empty groups
    left out). megatron-core 0.16.1's dist-checkpointing keeps the empty lists among the saved
    common state but shifted to the front (``extract_matching_values`` appends them), and its load
    then merged an empty list with a full one and refused ("Cannot merge two lists with different
    lengths (0 and 11, ... 'fp32_from_fp16_params', 0)"). ``_loads_twin_groups`` turns it back."""
    sharded = mopt.sharded_state_dict

    def sharded_state_dict(*args: Any, **kwargs: Any) -> dict:
        out = sharded(*args, **kwargs)
        out[_FP32_FROM_FP16] = {i: group for i, group in enumerate(out[_FP32_FROM_FP16]) if group}
        return out

    mopt.sharded_state_dict = sharded_state_dict


def _loads_twin_groups(mopt: Any, inner_optimizer: GSNROptimizer) -> None:
    """``mopt.load_state_dict`` with the saved param groups matched to the twins (``_aligned_groups``)
    and ``TWIN_KEY`` in Megatron's param-group key while it loads (the only place it is widened)."""
    import megatron.core.optimizer.distrib_optimizer as distrib
    import megatron.core.optimizer.optimizer as plain

    require(plain, ("param_group_identifier_keys",), "megatron.core.optimizer.optimizer")
    require(distrib, ("param_group_identifier_keys",), "megatron.core.optimizer.distrib_optimizer")
    load = mopt.load_state_dict
    keys = plain.param_group_identifier_keys

    def identify(group: dict) -> tuple:  # Megatron's key, NeMo's pre_ spelling too
        return tuple(group.get(k, group.get(f"pre_{k}")) for k in keys)

    def load_state_dict(state_dict: dict) -> Any:
        state_dict = dict(state_dict)
        if isinstance(state_dict.get(_FP32_FROM_FP16), dict):  # by group index (``_keeps_empty_groups_in_place``)
            by_index = state_dict[_FP32_FROM_FP16]
            state_dict[_FP32_FROM_FP16] = [by_index.get(i, []) for i in range(len(inner_optimizer.param_groups))]
        nested = isinstance(state_dict.get("optimizer"), dict)  # the mixed-precision wrappers nest the torch state
        inner = dict(state_dict["optimizer"]) if nested else state_dict
        aligned = None
        if isinstance(inner.get("param_groups"), list):
            aligned = _aligned_groups(inner["param_groups"], inner_optimizer.param_groups, identify)
        if aligned is None:
            return load(state_dict)
        # each group's place in the optimizer, in the saved group aligned to it and in the group, widens
        # Megatron's key for the load: its own matching, by key, then pairs them as aligned here
        for at, (group, mine) in enumerate(zip(aligned, inner_optimizer.param_groups)):
            group[_PLACE_KEY] = mine[_PLACE_KEY] = at
        inner["param_groups"] = aligned
        if nested:
            state_dict["optimizer"] = inner
        saved = plain.param_group_identifier_keys, distrib.param_group_identifier_keys
        plain.param_group_identifier_keys = distrib.param_group_identifier_keys = (*keys, TWIN_KEY, _PLACE_KEY)
        try:
            return load(state_dict)
        finally:
            plain.param_group_identifier_keys, distrib.param_group_identifier_keys = saved
            for group in inner_optimizer.param_groups:  # the loaded groups hold it too
                group.pop(_PLACE_KEY, None)

    mopt.load_state_dict = load_state_dict


def _refuse_adam_checkpoints(mopt: Any) -> None:
    for method in _ADAM_CHECKPOINT_METHODS:
        if hasattr(mopt, method):
            def refused(*args: Any, _method: str = method, **kwargs: Any) -> Any:
                _refuse(f"DistributedOptimizer.{_method} (Megatron's distributed-optimizer checkpoint formats)",
                        "they are written for Adam's exp_avg/exp_avg_sq", "Checkpoint with dist-checkpointing "
                        "(sharded_state_dict: every state key in the 'vrgd_model_space' format, docs/megatron.md)")

            setattr(mopt, method, refused)


def _wrap(config: Any, chunks: list[Any], inner: GSNROptimizer, groups: dict[str, Any]) -> Any:
    """Our optimizer in the wrapper Megatron's ``_get_megatron_optimizer_based_on_param_groups``
    would choose for its own, with the same grad scaler."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    if not (config.fp16 or config.bf16 or config.use_distributed_optimizer):
        mopt = FP32Optimizer(inner, config, checkpoint.allocate)
        mopt.grad_stats_parallel_group = groups["mp_group"]
        _loads_twin_groups(mopt, inner)
        return mopt
    scaler = None
    if config.loss_scale:
        scaler = ConstantGradScaler(config.loss_scale)
    elif config.fp16:
        scaler = DynamicGradScaler(initial_scale=config.initial_loss_scale, min_scale=config.min_loss_scale,
                                   growth_factor=2.0, backoff_factor=0.5, growth_interval=config.loss_scale_window,
                                   hysteresis=config.hysteresis)
    if not config.use_distributed_optimizer:
        mopt = Float16OptimizerWithFloat16Params(inner, config, scaler, checkpoint.allocate)
        mopt.grad_stats_parallel_group = groups["mp_group"]
        _keeps_empty_groups_in_place(mopt)
        _loads_twin_groups(mopt, inner)
        return mopt
    buffers = {i: chunk.buffers for i, chunk in enumerate(chunks)}
    with _distributed_optimizer_accepts(type(inner)):
        mopt = DistributedOptimizer(inner, config, scaler, None, model_chunks=chunks, per_model_buffers=buffers,
                                    data_parallel_group=groups["intra_dp_cp_group"],
                                    data_parallel_group_gloo=groups["intra_dp_cp_group_gloo"],
                                    data_parallel_group_idx=torch.distributed.get_rank(groups["mp_group"]),
                                    distributed_optimizer_instance_id=0)
    mopt.grad_stats_parallel_group = groups["intra_dist_opt_group"]
    _refuse_adam_checkpoints(mopt)
    checkpoint.distributed(mopt, inner)
    _loads_twin_groups(mopt, inner)
    return mopt


def get_megatron_optimizer(config: Any, model_chunks: list[Any], optimizer: str = "VRLamb",
                           optimizer_kwargs: dict[str, Any] | None = None, config_overrides: Any = None,
                           use_gloo_process_groups: bool = True, micro_steps: str = "auto",
                           squares: str = "per_step", node_size: int | None = None,
                           tied_across_stages: str = "refuse") -> Any:
    """Megatron's ``get_megatron_optimizer`` with a VRGD member as the inner optimizer.

    ``config`` (``OptimizerConfig``: lr, weight decay, Adam betas/eps, clipping, precision,
    ``use_distributed_optimizer``), ``model_chunks`` (Megatron ``DistributedDataParallel``
    chunks of this pipeline stage) and ``config_overrides`` as Megatron takes them;
    ``optimizer``: a family name (``vrgd_ds.optim.registry.REGISTRY``), built with the arguments
    ``OptimizerConfig`` has for it and ``optimizer_kwargs`` (gamma, beta3, gsnr_placement, ...).
    Returns a ``ChainedOptimizer`` whose ``step()`` returns ``(ok, grad_norm, zeros)`` as
    Megatron's does; its ``vrgd_sources`` are the statistics (``counters``: extra bytes), none
    where no param group steps with the GSNR (``Lamb``, ``gsnr=False``: no hooks, no reduction).
    ``micro_steps``: ``"auto"`` folds each micro-batch's square into Megatron's ``main_grad``
    accumulation (one launch per tensor, Megatron's own add skipped); ``"hooks"`` keeps Megatron's
    add and launches the statistics beside it (the same statistics and gradients, bit for bit).
    ``squares``: ``"per_step"`` (full-size buffers, one reduction per step) or ``"hierarchical"``
    (the distributed optimizer over every rank: each micro-step's statistics reduce-scattered
    within nodes of ``node_size`` ranks, default those sharing a host, then once per step across
    nodes; ``vrgd_ds/stats/hierarchical.py``).
    ``tied_across_stages``: the tensors Megatron sums across pipeline stages once per step (an
    embedding tied to the last stage's output layer, multi-token prediction's copy of it, a
    diffusion model's conditional embedders) hold a partial gradient of a micro-batch on each
    stage, so their GSNR cannot be taken exactly: ``"refuse"`` (default) refuses a VR member on
    them, naming the option; ``"gsnr_off"`` steps them as the base optimizer (logged, as the
    tensors partial per tensor-parallel rank), every other tensor with its GSNR.
    """
    check_version()
    if micro_steps not in ("auto", "hooks"):
        raise ValueError(f"vrgd_ds.megatron: micro_steps={micro_steps!r}: use 'auto' or 'hooks'")
    if squares not in ("per_step", "hierarchical"):
        raise ValueError(f"vrgd_ds.megatron: squares={squares!r}: use 'per_step' or 'hierarchical'")
    if node_size is not None and squares != "hierarchical":
        raise ValueError("vrgd_ds.megatron: node_size applies to squares='hierarchical' only")
    if tied_across_stages not in ("refuse", "gsnr_off"):
        raise ValueError(f"vrgd_ds.megatron: tied_across_stages={tied_across_stages!r}: use 'refuse' or 'gsnr_off'")
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import _get_param_groups_and_buffers
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    def check() -> None:
        check_configuration(config, model_chunks, optimizer, (optimizer_kwargs or {}).get("gsnr"), tied_across_stages)
        if not any(p.requires_grad for chunk in model_chunks for p in chunk.parameters()):
            raise ValueError("vrgd_ds.megatron: no trainable parameter in the model chunks of this rank")

    _refused_on_every_rank(check)
    groups = ProcessGroupCollection.setup_process_groups_for_optimizer(None, model_chunks, use_gloo_process_groups)
    param_groups, _ = _get_param_groups_and_buffers(model_chunks, 0, config, config_overrides,
                                                    lambda g: not g["is_expert_parallel"], "buffers")
    # the empty groups stay: dist-checkpointing saves rank 0's param groups for every rank (Megatron
    # gives each rank the same groups, empty ones included, for that)
    kwargs = _inner_kwargs(config, optimizer, optimizer_kwargs or {})
    gsnr = kwargs.get("gsnr", REGISTRY[optimizer].vr)
    partial = partial_gradient_tensors(model_chunks) if ps.get_tensor_model_parallel_world_size() > 1 and gsnr else {}
    tied = stage_tied_tensors(model_chunks) if tied_across_stages == "gsnr_off" and gsnr else {}
    param_groups = _twin_groups(param_groups, partial, tied)
    with built_for_engine():  # fed from Megatron's grad buffers (attach below)
        inner = REGISTRY[optimizer].cls(param_groups, **kwargs)
    mopt = _wrap(config, model_chunks, inner, groups)
    tp_group = ps.get_tensor_model_parallel_group()
    tp = (tp_group, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size())
    stages = ps.get_pipeline_model_parallel_group() if ps.get_pipeline_model_parallel_world_size() > 1 else None
    if any(g.get("gsnr") for g in inner.param_groups):
        source = attach(mopt, model_chunks, select_for(inner), fold=micro_steps == "auto", squares=squares,
                        node_size=node_size)
    else:  # the base optimizer (or every group's GSNR off): no hooks, squares or reduction to pay for
        source = None
        supersede(model_chunks)  # an earlier optimizer's hooks on these chunks go all the same
    names, keys, numel, shapes, duplicate = model_tensors(model_chunks, tp[2])
    # the first chunk with a buffer: a chunk whose parameters are all frozen has none (a frozen first
    # layer on model chunks), and this rank has one somewhere (check)
    buffer = next(b for chunk in model_chunks for b in chunk.buffers)
    distributed = config.use_distributed_optimizer and buffer.data_parallel_group.size() > 1
    if distributed and tp[2] > 1:
        group = ps.get_tensor_and_data_parallel_group()
    elif distributed:
        group = buffer.data_parallel_group
    else:
        group = tp_group if tp[2] > 1 else None
    device = buffer.grad_data.device
    layout = MegatronLayout(names, numel, shapes, group, duplicate, tp[1], stages, device)
    if stages is not None:  # the last stage's copy of embeddings tied across stages (Megatron's grad norm skips it)
        layout.replicated = key_mask(keys, layout.num_keys,
                                     (p for c in model_chunks for p in c.parameters() if getattr(p, "shared", False)))
    for p, t in pairs(mopt):
        offset = mopt._get_model_param_range_map(p)["param"].start if config.use_distributed_optimizer else 0
        layout.add(t, [(0, t.numel(), keys[id(p)], offset)])
    inner.set_statistics_source(source, layout)
    chained = ChainedOptimizer([mopt])
    _hook_step(chained, mopt, source)
    chained.vrgd_sources = [source] if source is not None else []
    return chained


def _hook_step(chained: Any, mopt: Any, source: Any) -> None:
    """The statistics' step begins where Megatron's does (``prepare_grads``: before it copies,
    unscales and clips the reduced gradients) and ends after it, taken or skipped, whether the
    chain or its Megatron optimizer (``chained_optimizers[0]``) was stepped. A step Megatron
    skips before calling the inner optimizer (fp16 overflow; NaN in the gradients) is recorded as
    skipped there, so its metrics are not the previous step's."""
    prepare, inner = mopt.prepare_grads, mopt.optimizer
    reason = "step/skipped_overflow" if getattr(mopt.config, "fp16", False) else "step/skipped_nonfinite"

    def prepare_grads() -> bool:
        if source is not None:
            source.begin_step()
        return prepare()

    def ending(step: Any) -> Any:
        def stepped() -> Any:
            inner.begin_step_records()
            calls = inner.step_calls
            try:
                return step()
            finally:
                n = source.n if source is not None else 0
                if source is not None:
                    source.end_step()
                if inner.step_calls == calls:
                    inner.record_skipped(reason, n)
        return stepped

    mopt.prepare_grads = prepare_grads
    # the chain's step calls the Megatron optimizer's prepare_grads and step_with_ready_grads, not
    # its step: a caller may step either, and each ends the statistics' step once
    chained.step = ending(chained.step)
    mopt.step = ending(mopt.step)
