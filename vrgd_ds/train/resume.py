"""What a resume loads, decided from a checkpoint's marker and the configuration alone: the
job (``loop.Job.resume``) and ``vrgd-pretrain --check-resume`` ask the same function.

* Another **number of ranks**: ZeRO-1/2 checkpoints are converted once to DeepSpeed's universal
  form (``vrgd_ds.ds.universal``, keeping the GSNR momentum) and loaded that way; stage 0 loads
  on any number of ranks; ZeRO-3 is refused, naming both world sizes.
* Another **optimizer**: a member and its base (``REGISTRY[...].base``: VRLamb/Lamb, VRAdam with
  ``gsnr`` on/off) share their state; another family (LAMB -> SGD) follows
  ``checkpoint.optimizer_state``: ``require`` stops, ``reset_if_incompatible`` loads the weights
  and data position and starts the optimizer fresh.
* Other **data** (another fingerprint: tokenizer, shards, seed, held-out split, sentence-pair
  task) follows ``checkpoint.data_change``: ``refuse`` stops, ``continue`` keeps the saved
  position in the new sample stream, with a warning.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vrgd_ds.optim.base import gsnr_switch
from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.train.config import CHECKPOINT_KEY, DATA_CHANGE_KEY, OPTIMIZER_STATE_KEY, ConfigError

RESET_HINT = (f"set \"{CHECKPOINT_KEY}\": {{\"{OPTIMIZER_STATE_KEY}\": \"reset_if_incompatible\"}} (--set "
              f"'{CHECKPOINT_KEY}={{\"{OPTIMIZER_STATE_KEY}\": \"reset_if_incompatible\"}}')")


def data_change(path: Path, saved: str | None, now: str, policy: str) -> str | None:
    """Checkpoint ``path`` trained on data of fingerprint ``saved``, resumed on ``now``'s: None
    where they are the same (or the marker predates fingerprints); else, per
    ``checkpoint.data_change`` (``policy``), a ``ConfigError`` or the warning to log."""
    if saved in (None, now):
        return None
    what = (f"{path}: the data differs from the checkpoint's, fingerprint {saved} -> {now} (the tokenizer, the "
            "shards, job.seed, job.data.heldout_fraction or job.data.next_sentence changed)")
    if policy == "refuse":
        raise ConfigError(f"{what}: the samples already seen are not those of the new stream, and documents trained on "
                          "may now be held out. Resume with the data and settings it was saved with, or set "
                          f"\"{CHECKPOINT_KEY}\": {{\"{DATA_CHANGE_KEY}\": \"continue\"}} (--set '{CHECKPOINT_KEY}="
                          f"{{\"{DATA_CHANGE_KEY}\": \"continue\"}}') to go on from the saved position in the new stream")
    return f"{what}: going on from the saved position in the new stream ({CHECKPOINT_KEY}.{DATA_CHANGE_KEY} \"continue\")"


def saved_positions(info: dict[str, Any]) -> int | None:
    """The learned positions of the model a checkpoint holds (its marker's ``info``): recorded,
    or for a Megatron GPT saved before they were, its longest phase's ``seq_len`` (the only size
    it could be built with then); None for a BERT checkpoint that predates the record (its size
    depended on an override the marker does not hold)."""
    if info.get("max_position_embeddings") is not None:
        return int(info["max_position_embeddings"])
    if info.get("engine") == "megatron" and info.get("phases"):
        return max(int(p["seq_len"]) for p in info["phases"])
    return None


def positions_change(path: Path, saved: int | None, now: int, key: str, longest: int) -> None:
    """A ``ConfigError`` where checkpoint ``path``'s model has another number of learned positions
    (``saved``, from its marker; None: the marker predates the record) than this configuration
    builds (``now``, set by ``key``; ``longest``: its longest phase): the position table does not
    load into another size, and every older checkpoint of the run would fail the same way."""
    if saved in (None, now):
        return
    fits = (f"set {key} to {saved}" if longest <= saved else
            f"a phase of seq_len {longest} does not fit the {saved} positions the run was built with, so it cannot "
            f"continue this run (a run that will grow its sequences sets {key} to the longest from its start)")
    raise ConfigError(f"{path}: its model has position embeddings for {saved} tokens, this configuration builds {now} "
                      f"({key}, by default from the longest phase): {fits}")


class ConversionFailed(ConfigError):
    """A checkpoint saved on another number of ranks did not convert to universal form (a damaged
    file, say): the job tries the previous checkpoint, and says this if none loads."""


@dataclass
class ResumePlan:
    optimizer_states: bool = True  # False: the weights and the data position only
    universal: bool = False  # load the universal conversion (another number of ranks)
    saved_world: int | None = None  # ranks that wrote the ZeRO shards (None: stage 0)
    switched: bool = False  # saved by another member of the same family (or other GSNR settings)
    notes: list[str] = field(default_factory=list)  # what changes, one line each


def _megatron_wrapper(distributed: bool, precision: str) -> str:
    """The Megatron optimizer wrapper a layout builds, which fixes its checkpoint's optimizer format."""
    return ("DistributedOptimizer" if distributed else "FP32Optimizer" if precision == "fp32"
            else "Float16OptimizerWithFloat16Params")


def wrapper_change(where: Path, saved: dict[str, Any], distributed: bool, precision: str, policy: str) -> str | None:
    """A Megatron checkpoint saved under another optimizer wrapper (``use_distributed_optimizer``
    switched, or fp32 <-> bf16/fp16 without it; ``saved``: its marker's info) has an optimizer state
    of another format, which no load carries over: per ``checkpoint.optimizer_state`` (``policy``)
    a ``ConfigError`` naming the keys, or the note of a resume with a fresh state. None where the
    wrapper is the same (or the marker predates the record)."""
    was_distributed, was_precision = saved.get("use_distributed_optimizer"), saved.get("precision")
    if was_distributed is None or was_precision is None:
        return None
    was, now = _megatron_wrapper(was_distributed, was_precision), _megatron_wrapper(distributed, precision)
    if was == now:
        return None
    how = f"megatron.use_distributed_optimizer {str(was_distributed).lower()} and megatron.precision {was_precision!r}"
    if policy != "reset_if_incompatible":
        raise ConfigError(f"{where} was saved with {how}, whose optimizer state ({was}) does not load into {now}: "
                          f"resume with those settings, or {RESET_HINT} to continue from its weights and data "
                          "position with a fresh optimizer state")
    return (f"{where} was saved with {how} ({was}); resuming its weights and data position with a fresh {now} "
            "state (checkpoint.optimizer_state = reset_if_incompatible)")


def family(optimizer_type: str) -> str:
    """The optimizer whose state a type shares: a member and its base are one family."""
    from vrgd_ds.optim.registry import REGISTRY

    info = REGISTRY.get(optimizer_type)
    return info.base if info is not None else optimizer_type


def named_params(raw: dict[str, Any]) -> set[str]:
    """The options the config names in ``optimizer.params`` that a loaded state would otherwise
    bring (torch's rule: a param group's options come from the checkpoint); the job sets them
    back to the config's after the load (``Job._apply_configured_options``). ``lr`` follows the
    schedule and ``gsnr`` is the built one (``GSNROptimizer.wiring_keys``) either way."""
    return set((raw.get("optimizer") or {}).get("params") or {}) - {"lr", "gsnr"}


def configured_options(raw: dict[str, Any]) -> dict[str, Any]:
    """The values the config names in ``optimizer.params`` that a resume sets back (``named_params``)."""
    params = (raw.get("optimizer") or {}).get("params") or {}
    return {k: params[k] for k in sorted(named_params(raw))}


def option_note(key: str, saved: Any, configured: Any) -> str:
    return f"optimizer.params.{key}: the checkpoint has {saved!r}, the config {configured!r}; continuing with the config's"


def resumed_options(saved: dict[str, Any] | None, raw: dict[str, Any]) -> dict[str, Any]:
    """The options a resumed run steps with, as the marker records them (``Job.resume_info``):
    the config's for the keys it names, the checkpoint's for the others (torch's rule)."""
    return {**(saved or {}), **configured_options(raw)}


def option_changes(saved: dict[str, Any] | None, raw: dict[str, Any]) -> list[str]:
    """What a resume does to the optimizer's options (``Job._apply_configured_options``), from the
    marker's record of them (``saved``: none in a marker that predates the record) and the config."""
    now = configured_options(raw)
    if saved is None:
        return ["the checkpoint does not record its optimizer options: the job's log lists the ones the config "
                "changes"] if now else []
    notes = [option_note(k, saved[k], v) for k, v in now.items() if k in saved and saved[k] != v]
    notes += [f"optimizer.params.{k}: the checkpoint's run left it to the optimizer's default, the config sets "
              f"{v!r}" for k, v in now.items() if k not in saved]
    notes += [f"optimizer.params.{k}: {v!r} carries on from the checkpoint (the config no longer names it; name it "
              "to change it)" for k, v in sorted(saved.items()) if k not in now]
    return notes


def resumed_optimizer(built: dict[str, Any], saved: dict[str, Any] | None, named: set[str]) -> dict[str, Any]:
    """The optimizer a resume continues with (``{"type", "gsnr", "gsnr_placement"}``): ``built``,
    as the config makes it, except a placement the config leaves out, which the loaded state of
    the same family brings from ``saved``."""
    if (not saved or family(saved["type"]) != family(built["type"]) or "gsnr_placement" in named
            or saved.get("gsnr_placement") is None):
        return built
    return {**built, "gsnr_placement": saved["gsnr_placement"]}


def convert_command(ckpt_dir: Path, tag: str) -> str:
    return (f"python -m vrgd_ds.ds.universal --input_folder {ckpt_dir / tag} "
            f"--output_folder {ckpt_dir / ckpt.UNIVERSAL / tag}")


#: ZeRO stage -> the layout of DeepSpeed's checkpoint files (1 and 2 share theirs)
_STAGE_FORMAT = {0: "replicated", 1: "partitioned optimizer", 2: "partitioned optimizer", 3: "partitioned model"}


def plan_resume(ckpt_dir: Path, tag: str, optimizer: dict[str, Any], world: int, zero_stage: int,
                policy: str) -> ResumePlan:
    """How to load ``tag`` with ``optimizer`` (``{"type", "gsnr", "gsnr_placement"}``, as the
    resume continues with it: ``resumed_optimizer``) on ``world`` ranks; raises ``ConfigError``
    for a resume that cannot work, saying what to do."""
    where = ckpt_dir / tag
    info = ckpt.marker(ckpt_dir, tag).get("info") or {}
    saved, saved_stage = info.get("optimizer"), info.get("zero_stage")  # a DeepSpeed marker's stage
    if saved_stage is not None and _STAGE_FORMAT[saved_stage] != _STAGE_FORMAT[zero_stage]:
        raise ConfigError(f"{where}: saved under ZeRO stage {saved_stage}, the config has zero_optimization.stage "
                          f"{zero_stage}: DeepSpeed's checkpoint of one does not load into the other (stages 1 and 2 "
                          f"load each other's). Resume with zero_optimization.stage {saved_stage}")
    plan = ResumePlan(saved_world=ckpt.saved_world_size(ckpt_dir, tag))
    if saved and family(saved["type"]) != family(optimizer["type"]):
        if policy == "require":
            raise ConfigError(
                f"{where}: saved with optimizer {saved['type']}, the config has {optimizer['type']}: a "
                f"{saved['type']} state cannot carry over to {optimizer['type']}. Resume with \"optimizer\": "
                f"{{\"type\": \"{saved['type']}\"}}, or {RESET_HINT} to continue from its weights and data position "
                f"with a fresh {optimizer['type']} state")
        plan.optimizer_states = False
        plan.notes.append(f"{where} was saved with {saved['type']}; resuming its weights and data position with a "
                          f"fresh {optimizer['type']} state (checkpoint.optimizer_state = reset_if_incompatible)")
        return plan  # the weights load on any number of ranks
    if saved and saved != optimizer:
        plan.switched = True
        gsnr = gsnr_switch(saved["gsnr"], optimizer["gsnr"])
        plan.notes.append(f"{where} was saved with {saved['type']} (gsnr {saved['gsnr']}, placement "
                          f"{saved.get('gsnr_placement')}), resuming with {optimizer['type']} (gsnr "
                          f"{optimizer['gsnr']}, placement {optimizer.get('gsnr_placement')}): the weights and "
                          f"moments carry over, {gsnr}")
    if zero_stage == 0 or plan.saved_world is None or plan.saved_world == world:
        return plan
    if zero_stage == 3:
        raise ConfigError(f"{where}: saved on {plan.saved_world} ranks, resumed on {world}: a ZeRO-3 checkpoint is "
                          f"not converted to another number of ranks ({convert_command(ckpt_dir, tag)} handles "
                          f"ZeRO-1/2). Resume it on {plan.saved_world} ranks")
    plan.universal = True
    out = ckpt_dir / ckpt.UNIVERSAL / tag
    if ckpt.converted(ckpt_dir, tag) is not None:
        plan.notes.append(f"{where} was saved on {plan.saved_world} ranks; resuming on {world} from its universal "
                          f"conversion {out} (made earlier)")
    else:
        plan.notes.append(f"{where} was saved on {plan.saved_world} ranks; converting it for {world} to the "
                          f"universal checkpoint {out} (DeepSpeed's state and the GSNR momentum) and resuming from that")
    return plan


def engine_switch(where: Path, saved: str, configured: str) -> str:
    """The error for a checkpoint of one engine resumed by the other."""
    return (f"{where}: written by the {saved} engine, the config has job.engine {configured!r}: the checkpoint does "
            f"not load into the other engine's model. Resume with job.engine {saved!r}, or use another run directory")


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
    import torch

    from vrgd_ds.optim.registry import OptimizerBlockError, check_optimizer
    from vrgd_ds.train.config import (check_gsnr_groups, check_resume_marker, data_change_policy,
                                      optimizer_state_policy, parse_job, phase_settings, position_table)
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
    try:  # validated; built on a dummy parameter for its defaults
        cls = check_optimizer(raw.get("optimizer"), "the engine's gradient clipping")
    except OptimizerBlockError as e:
        raise ConfigError(str(e)) from None
    group = cls([torch.nn.Parameter(torch.zeros(1))], **(raw["optimizer"].get("params") or {})).param_groups[0]
    now = {"type": cls.__name__, "gsnr": bool(group["gsnr"]), "gsnr_placement": group.get("gsnr_placement")}
    stage = int((raw.get("zero_optimization") or {}).get("stage", 0))
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
        if job.engine == "megatron":  # the checks the job makes before its process group (the layout's too)
            from vrgd_ds.train.engines.megatron import check as check_megatron

            check_megatron(raw, job, ranks)
        else:
            from vrgd_ds.train.engines.deepspeed import DeepSpeedEngine

            DeepSpeedEngine.check_config(raw, job)
        positions_change(ckpt_dir / choice.tag, saved_positions(info), positions, key,
                         max(p.seq_len for p in job.phases))
        if data is not None and (note := data_change(ckpt_dir / choice.tag, info.get("data"), data,
                                                     data_change_policy(raw))):
            changes.append(note)
        fresh = job.engine == "megatron" and wrapper_change(
            ckpt_dir / choice.tag, info, block.get("use_distributed_optimizer", True),
            block.get("precision", "fp32"), optimizer_state_policy(raw))  # MegatronBlock's defaults
        if fresh:
            changes.append(fresh)
        tp_pp = (block.get("tensor_model_parallel_size", 1) * block.get("pipeline_model_parallel_size", 1)
                 if job.engine == "megatron" else 1)
        data_world = max(ranks // tp_pp, 1)
        check_gsnr_groups(raw, job)
        phase_settings(job, data_world, PhaseSchedule(job).steps)
        check_resume_marker(job, info, data_world)
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
