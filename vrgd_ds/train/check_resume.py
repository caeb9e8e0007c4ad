"""``vrgd-pretrain --check-resume``: what a resume of a run directory would load and, given a
configuration and a number of ranks, what would change or stop it, read from the checkpoint's
marker without loading tensors or starting ranks. It asks the functions the job asks
(``resume``, ``config``, and the engine's own configuration checks)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.train.config import ConfigError
from vrgd_ds.train.engines import engine_class
from vrgd_ds.train.resume import (data_change, engine_switch, gpt_change, named_params, option_changes, plan_resume,
                                  positions_change, resumed_optimizer, saved_positions, streams_change, wrapper_change)


def _layout(info: dict[str, Any]) -> str:
    """A marker's (or a configuration's) layout in words: the ZeRO stage, or Megatron's sizes."""
    if "tensor_model_parallel_size" in info:
        return (f"TP {info['tensor_model_parallel_size']} × PP {info.get('pipeline_model_parallel_size', '?')} × DP "
                f"{info.get('data_parallel_size', '?')}")
    return f"ZeRO stage {info.get('zero_stage', '?')}"


def check(run_dir: Path, raw: dict[str, Any] | None, world: int | None) -> tuple[str, bool]:
    """The ``--check-resume`` report: what a resume of ``run_dir`` would load and, given the
    configuration ``raw`` and the number of ranks, what would change. Returns (report, whether
    the resume would go ahead)."""
    from vrgd_ds.optim.registry import OptimizerBlockError, checked_group
    from vrgd_ds.train.config import (check_gsnr_groups, check_optimizer_lr, check_resume_marker, data_change_policy,
                                      finished_phases, optimizer_state_policy, parse_job, phase_settings, position_table)
    from vrgd_ds.train.data import configured_fingerprint
    from vrgd_ds.train.schedule import PhaseSchedule

    ckpt_dir = run_dir / "checkpoints"
    lines = [f"run directory {run_dir}"]
    choice = ckpt.choose(ckpt_dir)
    lines += [f"  skipped: {why}" for why in choice.skipped]
    if choice.tag is None:
        lines.append("  no complete checkpoint: the job would start afresh" if not choice.skipped else
                     "  no complete checkpoint to resume from: the job would stop (move the directory away to start "
                     "afresh, or restore the files)")
        return "\n".join(lines), not choice.skipped
    record = ckpt.marker(ckpt_dir, choice.tag)
    info = record.get("info") or {}
    saved_world = ckpt.saved_world_size(ckpt_dir, choice.tag)
    opt = info.get("optimizer") or {}
    lines += [f"  checkpoint:  {ckpt_dir / choice.tag} (step {record.get('step')})",
              f"  saved on:    {saved_world or record.get('world_size') or '?'} ranks, {_layout(info)}",
              f"  optimizer:   {opt.get('type', '?')} (gsnr {opt.get('gsnr', '?')}, placement "
              f"{opt.get('gsnr_placement', '?')})",
              f"  data:        fingerprint {info.get('data', '?')}, samples consumed per phase {info.get('consumed', '?')}",
              f"  schedule:    {info.get('total_steps', '?')} steps, phases "
              + "; ".join(f"seq {p.get('seq_len')} x {p.get('global_batch')} for {p.get('fraction')}"
                          for p in info.get("phases", []))]
    if converted := ckpt.converted(ckpt_dir, choice.tag):
        lines.append(f"  converted:   {ckpt_dir / ckpt.UNIVERSAL / choice.tag} (from "
                     f"{converted['saved_world_size']} ranks)")
    if raw is None:
        return "\n".join(lines), True
    job = parse_job(raw)
    try:  # validated, with the group it builds (its defaults)
        cls, group = checked_group(raw.get("optimizer"), "the engine's gradient clipping")
    except OptimizerBlockError as e:
        raise ConfigError(str(e)) from None
    now = {"type": cls.__name__, "gsnr": bool(group["gsnr"]), "gsnr_placement": group.get("gsnr_placement")}
    stage = engine_class(job.engine).zero_stage(raw)
    ranks = world if world is not None else saved_world or record.get("world_size") or 1
    lines.append(f"with this configuration on {ranks} ranks:")
    changes = []
    if info.get("total_steps") not in (None, job.total_steps):
        changes.append(f"job.total_steps {info['total_steps']} -> {job.total_steps} (the LR schedule follows)")
    phases = [p.model_dump(mode="json") for p in job.phases]
    if info.get("phases") not in (None, phases):
        changes.append("job.phases differ from the saved run's (the data position is kept per phase)")
    if job.engine != info.get("engine", "deepspeed"):
        lines += [f"  would stop: {engine_switch(ckpt_dir / choice.tag, info.get('engine', 'deepspeed'), job.engine)}"]
        return "\n".join(lines), False
    if job.engine == "megatron":
        block = raw.get("megatron") or {}
        tp, pp = block.get("tensor_model_parallel_size", 1), block.get("pipeline_model_parallel_size", 1)
        layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                  "data_parallel_size": ranks // (tp * pp) if ranks % (tp * pp) == 0 else "?"}
        if any(info.get(k) not in (None, v) for k, v in layout.items()):
            changes.append(f"{_layout(info)} -> {_layout(layout)} (dist-checkpointing reshards every tensor)")
    elif info.get("zero_stage") not in (None, stage):
        changes.append(f"ZeRO stage {info['zero_stage']} -> {stage}")
    positions, key = position_table(job, raw)
    data = configured_fingerprint(job, run_dir)
    if data is None:
        changes.append("the configured data is not prepared yet (the job would prepare it; its fingerprint is then "
                       "compared by hand)")
    try:
        finished = finished_phases(job, info)  # no steps left: their batches need not split over the ranks
        engine_class(job.engine).check_for_ranks(raw, job, ranks, finished)  # the job's checks before any work
        positions_change(ckpt_dir / choice.tag, saved_positions(info), positions, key,
                         max(p.seq_len for p in job.phases))
        if data is not None and (note := data_change(ckpt_dir / choice.tag, info.get("data"), data,
                                                     data_change_policy(raw))):
            changes.append(note)
        if note := streams_change(ckpt_dir / choice.tag, info, data_change_policy(raw)):
            changes.append(note)
        fresh = job.engine == "megatron" and wrapper_change(
            ckpt_dir / choice.tag, info, block.get("use_distributed_optimizer", True),
            block.get("precision", "fp32"), optimizer_state_policy(raw))  # MegatronBlock's defaults
        if fresh:
            changes.append(fresh)
        tp_pp = (block.get("tensor_model_parallel_size", 1) * block.get("pipeline_model_parallel_size", 1)
                 if job.engine == "megatron" else 1)
        data_world = max(ranks // tp_pp, 1)
        check_optimizer_lr(raw, job)
        check_gsnr_groups(raw, job)
        phase_settings(job, data_world, PhaseSchedule(job).steps, finished)
        check_resume_marker(job, info, data_world)
        if job.engine == "megatron":  # the block as the job reads it (checked above)
            from vrgd_ds.train.engines.megatron import parse_block

            block_now = parse_block(raw)
            changes += gpt_change(ckpt_dir / choice.tag, info, block_now.model.share_embeddings_and_output_weights,
                                  block_now.virtual_pipeline_model_parallel_size)
        plan = plan_resume(ckpt_dir, choice.tag, resumed_optimizer(now, opt, named_params(raw)), ranks, stage,
                           optimizer_state_policy(raw))
    except ConfigError as e:
        lines += [f"  - {c}" for c in changes] + [f"  would stop: {e}"]
        return "\n".join(lines), False
    changes += [] if fresh else plan.notes  # a fresh state: no switch's "carries over" (MegatronEngine.plan)
    if plan.optimizer_states and not fresh:
        changes += option_changes(info.get("options"), raw)
    lines += [f"  - {c}" for c in changes] or ["  nothing changes: the run continues as it was saved"]
    return "\n".join(lines), True
