"""What a resume loads, decided from a checkpoint's marker and the configuration alone: the
job (``loop.Job.resume``) and ``vrgd-pretrain --check-resume`` (``check_resume``) ask the same
functions.

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


def streams_change(path: Path, saved: dict[str, Any], policy: str) -> str | None:
    """Checkpoint ``path`` (its marker's ``info``, ``saved``) drew its sample order and masks with
    the numpy its ``numpy_streams`` records: None where this numpy draws the same (or the marker
    predates the record); else, per ``checkpoint.data_change`` (``policy``), a ``ConfigError`` or
    the warning to log."""
    import numpy as np

    from vrgd_ds.data_pipeline.samples import generator_streams

    then = saved.get("numpy_streams")
    if then is None or then == generator_streams():
        return None
    release = saved.get("numpy", "another release")
    what = (f"{path}: numpy {release} drew this run's sample order and masks; numpy {np.__version__} draws others from "
            "the same seeds (numpy keeps a Generator's draws within a release only)")
    if policy == "refuse":
        raise ConfigError(f"{what}: the rest of the epoch would repeat samples already seen and skip others. Resume "
                          f"with numpy {release} (pip install numpy=={release}), or set \"{CHECKPOINT_KEY}\": "
                          f"{{\"{DATA_CHANGE_KEY}\": \"continue\"}} to go on from the saved position in the new stream")
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


def tie_change(where: Path, saved: dict[str, Any], tied: bool) -> None:
    """A ``ConfigError`` where the Megatron GPT of checkpoint ``where`` (``saved``: its marker's info;
    a marker that predates the record holds an untied one, the only one built then) was tied
    otherwise than ``tied``: an untied checkpoint's output layer would be dropped from the load, and a
    tied one has no output layer to load, so the layer would keep its fresh weights."""
    was = bool(saved.get("share_embeddings_and_output_weights", False))
    if saved.get("engine") == "megatron" and was != tied:
        raise ConfigError(f"{where}: its GPT was saved with megatron.model.share_embeddings_and_output_weights "
                          f"{str(was).lower()}, this configuration builds {str(tied).lower()}: the output layer does "
                          "not carry over between the two; resume with the tie the run was saved with")


def gpt_change(where: Path, saved: dict[str, Any], tied: bool, chunks: int | None) -> list[str]:
    """What a resume changes in the Megatron GPT of checkpoint ``where`` (``saved``: its marker's
    info): ``tie_change``'s error where the tie differs; a note where the model chunks a stage
    differ (``virtual_pipeline_model_parallel_size``; None, as a marker that predates the record:
    one chunk), which load either way (the sharded keys are global)."""
    tie_change(where, saved, tied)
    was = saved.get("virtual_pipeline_model_parallel_size")
    if saved.get("engine") != "megatron" or was == chunks:
        return []
    return [f"{where} was saved with {was or 1} model chunk(s) a pipeline stage; resuming with {chunks or 1} "
            "(dist-checkpointing reshards every tensor)"]


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
    if zero_stage == 3 and plan.saved_world is not None and plan.saved_world != world:
        # before the optimizer's policy: DeepSpeed reads ZeRO-3's weights from each rank's own file
        # too, which a rank beyond the saved ones lacks (its load fails while the others go on
        # into the load's collectives)
        raise ConfigError(f"{where}: saved on {plan.saved_world} ranks, resumed on {world}: a ZeRO-3 checkpoint is "
                          f"not converted to another number of ranks ({convert_command(ckpt_dir, tag)} handles "
                          f"ZeRO-1/2). Resume it on {plan.saved_world} ranks")
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
        return plan  # the weights load on any number of ranks (ZeRO-3's on the saved number: above)
    if saved and saved != optimizer:
        plan.switched = True
        gsnr = gsnr_switch(saved["gsnr"], optimizer["gsnr"])
        plan.notes.append(f"{where} was saved with {saved['type']} (gsnr {saved['gsnr']}, placement "
                          f"{saved.get('gsnr_placement')}), resuming with {optimizer['type']} (gsnr "
                          f"{optimizer['gsnr']}, placement {optimizer.get('gsnr_placement')}): the weights and "
                          f"moments carry over, {gsnr}")
    if zero_stage == 0 or plan.saved_world is None or plan.saved_world == world:
        return plan
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
