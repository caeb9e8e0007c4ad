"""Configuration of the BERT pretraining job: the ``"job"`` block of a DeepSpeed JSON config.

One file holds both: DeepSpeed's own keys (``optimizer``, ``zero_optimization``, ``fp16`` /
``bf16``, ``gradient_clipping``, the ``"vrgd"`` reduction block) and the job's block, which
describes the model, the data and the two phases of NVIDIA's LAMB recipe (seq 128 for 7,038
steps, 90% of the samples, then seq 512 for 1,563; each with its own global batch, learning rate
and warmup; ``configs/bert_large_64k_32k_vr_lamb.json``, derived in ``configs/README.md``)::

    "job": {
      "model": {"size": "large"},
      "total_steps": 8601,
      "phases": [
        {"seq_len": 128, "fraction": 0.81828, "global_batch": 65536, "micro_batch": 64,
         "lr": 6e-3, "warmup_fraction": 0.2843},
        {"seq_len": 512, "fraction": 0.18172, "global_batch": 32768, "micro_batch": 16,
         "lr": 4e-3, "warmup_fraction": 0.128}
      ]
    }

The job derives DeepSpeed's ``train_batch_size`` / ``train_micro_batch_size_per_gpu`` /
``gradient_accumulation_steps`` per phase as global batch = micro-batch × accumulation ×
ranks; a config that sets them itself is rejected (they would disagree with the phases).
Every model rejects unknown keys; messages name the key and the fix.
"""
from __future__ import annotations

import copy
import difflib
import json
import math
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

JOB_KEY = "job"
CHECKPOINT_KEY = "checkpoint"  # DeepSpeed's block; the job reads OPTIMIZER_STATE_KEY from it
OPTIMIZER_STATE_KEY = "optimizer_state"
OPTIMIZER_STATE_POLICIES = ("require", "reset_if_incompatible")
DATA_CHANGE_KEY = "data_change"
DATA_CHANGE_POLICIES = ("refuse", "continue")
JOB_CHECKPOINT_KEYS = (OPTIMIZER_STATE_KEY, DATA_CHANGE_KEY)  # the job's keys in DeepSpeed's block
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


class ConfigError(ValueError):
    """A job configuration that cannot run; the message names the key and the fix."""


class _Strict(BaseModel):
    # allow_inf_nan: JSON's Infinity passes a bound such as lr > 0 (an infinite LR, or a decay
    # power that leaves the LR 0 after the warmup); no key of the job means "no limit" by inf
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, strict=True,
                              allow_inf_nan=False)


MODEL_SIZES: dict[str, dict[str, int]] = {
    # BERT shapes (Devlin et al. 2019, Table/Section 3); "tiny"/"mini" are the small BERTs of
    # Turc et al. 2019 for CPU runs and tests.
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "mini": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024),
    "base": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


class ModelConfig(_Strict):
    """The BERT to build from ``transformers.BertConfig`` (nothing is fetched from a hub)."""

    size: Literal["tiny", "mini", "base", "large"] = "tiny"
    """Shape preset: hidden size, layers, heads, intermediate size."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Further ``BertConfig`` fields, e.g. ``{"hidden_dropout_prob": 0.0}``; not the ones the job
    derives (``DERIVED``), and ``max_position_embeddings`` at least the longest phase's
    ``seq_len``."""
    vocab_size: int | None = None
    """Must equal the tokenizer's vocabulary when given; by default taken from it."""

    #: the ``BertConfig`` fields the job sets from the tokenizer and the data, and where from
    DERIVED: ClassVar[dict[str, str]] = {"vocab_size": "the tokenizer's vocabulary (job.model.vocab_size checks it)",
               "pad_token_id": "the tokenizer's [PAD]", "type_vocab_size": "the two segments of a sample"}

    @model_validator(mode="after")
    def _overrides_leave_the_derived_fields(self) -> "ModelConfig":
        for key, source in self.DERIVED.items():
            if key in self.overrides:
                raise ValueError(f"job.model.overrides.{key}: set by the job from {source}; remove it")
        return self


class DataConfig(_Strict):
    """Where the pretraining data comes from."""

    path: str | None = None
    """A directory prepared by ``vrgd-data prepare`` (tokenizer, shards, sample indices); one
    that holds no prepared data is an error unless ``inputs`` are given or ``prepare`` is true.
    With ``null`` the job prepares ``inputs`` (or the embedded default corpus) into
    ``<run dir>/data`` on rank 0 first."""
    prepare: bool = False
    """With ``path``: prepare ``inputs`` (or, without inputs, the embedded corpus) there when it
    holds no prepared data yet (idempotent: a prepared directory is reused)."""
    inputs: list[str] = Field(default_factory=list)
    """Raw corpora (files or globs: plain text, WikiText, JSONL) to prepare in ``<run dir>/data``
    when ``path`` is null, or in ``path`` with ``prepare``. Empty: the embedded default corpus
    (Python's own documentation; no download). A ``path`` prepared already is not rebuilt: inputs
    or options other than it was prepared from are refused, naming them."""
    format: Literal["auto", "text", "wikitext", "jsonl"] = "auto"
    """How ``inputs`` are read: each file by its suffix and first lines (auto), or all as one format
    (``data_pipeline/corpus.py``)."""
    vocab_size: int = Field(8000, ge=64)
    """Vocabulary of the sentencepiece tokenizer trained when preparing. A directory prepared
    beforehand keeps its own tokenizer (a warning names a size given here that differs;
    ``job.model.vocab_size`` refuses one)."""
    heldout_fraction: float = Field(0.02, gt=0.0, lt=0.5)
    """Share of documents (the last ones of the corpus) kept out of training for the held-out
    MLM loss/accuracy."""
    eval_samples: int = Field(256, ge=1)
    """Held-out samples evaluated (fixed masks, so evaluations are comparable), rounded down to a
    multiple of the data-parallel ranks: every rank evaluates as many."""
    next_sentence: Literal["nsp", "sop"] | None = None
    """Second pre-training task: next-sentence (BERT) or sentence-order (ALBERT) prediction."""
    workers: int = Field(0, ge=0)
    """DataLoader worker processes per rank (0: load in the training process)."""
    prepare_workers: int = Field(1, ge=1)
    """Processes for tokenising when the job prepares the data."""


class AdaptiveBatchConfig(_Strict):
    """``job.phases[i].adaptive_batch``: the global batch follows the gradient noise scale
    (``vrgd_ds.adaptive_batch``). The phase's ``global_batch`` is the first batch and the
    reference of the LR rule; its length is ``steps × global_batch`` *samples*, and warmup and
    decay run over samples, so they stay in place when steps get bigger."""

    target_similarity: float | None = Field(None, gt=0.0, lt=1.0)
    """Target cosine of the two half-batch gradients (SimiGrad's knob); the batch becomes
    ``2 B_simple s / (1 - s)``."""
    target_ratio: float | None = Field(None, gt=0.0)
    """Or a target batch / B_simple (1: the batch at the noise scale, similarity 1/3)."""
    min_batch: int = Field(ge=1)
    """The smallest global batch the controller sets (the phase's ``global_batch`` lies within)."""
    max_batch: int = Field(ge=1)
    """The largest global batch the controller sets."""
    every: int = Field(10, ge=1)
    """Steps between adjustments."""
    smoothing: float = Field(0.9, ge=0.0, lt=1.0)
    """EMA factor of the noise-scale moments tr(Σ) and |G|² (their ratio is B_simple)."""
    max_change: float = Field(2.0, gt=1.0)
    """At most ×/÷ this per adjustment."""
    tolerance: float = Field(0.1, ge=0.0)
    """No change while the target is within this fraction of the current batch."""
    after_warmup: bool = True
    """No adjustment during the phase's LR warmup."""
    lr_rule: Literal["linear", "sqrt", "none"] = "sqrt"
    """LR × (B / global_batch) (linear), × √(B / global_batch) (sqrt) or unchanged (none)."""
    measure_cosine_every: int = Field(0, ge=0)
    """Every N steps also measure the half-batch cosine directly (0: never): 8 B/param of
    memory per rank and one all-reduce of twice the fp32 gradient per measured step."""

    @model_validator(mode="after")
    def _one_target(self) -> "AdaptiveBatchConfig":
        if (self.target_similarity is None) == (self.target_ratio is None):
            raise ValueError("give exactly one of target_similarity and target_ratio")
        if self.min_batch > self.max_batch:
            raise ValueError(f"min_batch {self.min_batch} is above max_batch {self.max_batch}")
        return self


def position_table(job: "JobConfig", raw: dict[str, Any]) -> tuple[int, str]:
    """The learned positions the job's model is built with and the key that sets them: BERT
    (``job.model.overrides.max_position_embeddings``, by default max(512, the longest phase's
    batch width)) or the Megatron GPT (``megatron.model.max_position_embeddings``, by default the
    longest phase's ``seq_len``). A checkpoint loads only into a table of its own size, so the
    marker records it and a resume compares it before loading (``resume.positions_change``)."""
    from vrgd_ds.data_pipeline.samples import padded_length

    longest = max(p.seq_len for p in job.phases)
    if job.engine == "megatron":
        model = ((raw.get("megatron") or {}).get("model") or {})
        return model.get("max_position_embeddings") or longest, "megatron.model.max_position_embeddings"
    return (job.model.overrides.get("max_position_embeddings") or max(512, padded_length(longest)),
            "job.model.overrides.max_position_embeddings")


class PhaseConfig(_Strict):
    """One phase of the recipe."""

    seq_len: int = Field(ge=8)
    """Tokens per sequence in this phase (BERT's recipe: 128, then 512; a GPT context of 1,024 or
    more). The model's position embeddings cover the longest phase."""
    fraction: float = Field(gt=0.0, le=1.0)
    """Share of ``total_steps`` in this phase; the fractions sum to 1."""
    global_batch: int = Field(ge=1)
    """Sequences per optimizer step over all ranks = micro_batch × accumulation × ranks."""
    micro_batch: int = Field(ge=1)
    """Sequences per rank per forward/backward."""
    lr: float = Field(gt=0.0)
    """Peak learning rate of the phase."""
    warmup_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Linear warmup over this share of the phase's steps, then polynomial decay to 0."""
    decay_power: float = Field(0.5, gt=0.0)
    """Power of the polynomial decay (NVIDIA's BERT LAMB recipe: 0.5)."""
    adaptive_batch: AdaptiveBatchConfig | None = None
    """The global batch follows the gradient noise scale (null: fixed ``global_batch``)."""


class WandbConfig(_Strict):
    """A Weights & Biases run of the job's metrics (``telemetry.WandbSink``)."""

    project: str
    """The wandb project."""
    mode: Literal["offline", "online", "disabled"] = "offline"
    """``offline`` writes under ``<run dir>/wandb`` (``wandb sync`` uploads it); only ``online``
    connects."""
    name: str | None = None
    """The run's display name."""
    config: dict[str, Any] | None = None
    """What the run shows beside its charts."""

    @model_validator(mode="after")
    def _installed(self) -> "WandbConfig":
        import importlib.util

        if self.mode != "disabled" and importlib.util.find_spec("wandb") is None:
            raise ValueError('the wandb package is not installed: pip install "vrgd-ds[wandb]", or remove the block')
        return self


class TelemetryConfig(_Strict):
    """Where each step's metrics go, from the first rank (``vrgd_ds/train/telemetry.py``)."""

    jsonl: bool = True
    """``<run dir>/metrics.jsonl``, one record per logged step (what the plots read)."""
    tensorboard: bool = True
    """TensorBoard event files under ``<run dir>/tensorboard``."""
    wandb: WandbConfig | None = None
    """A wandb run (``project``, ``mode`` = offline by default, ``name``, ``config``); null: off."""
    per_layer_group: bool = True
    """Add ``group/<layer group>/*`` GSNR rows (embeddings, encoder.layer.i, head)."""


class JobConfig(_Strict):
    """The ``"job"`` block."""

    comment: str = ""
    """Free text: why the file's values are what they are (JSON has no comments); not read."""
    engine: Literal["deepspeed", "megatron"] = "deepspeed"
    """Who trains: ``deepspeed`` (BERT, the file's other keys are DeepSpeed's config) or
    ``megatron`` (GPT under Megatron-core, the ``"megatron"`` block; ``vrgd_ds/train/engines``)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The BERT to train (``engine: deepspeed``; the ``"megatron"`` block shapes the GPT)."""
    data: DataConfig = Field(default_factory=DataConfig)
    """The corpus, its preparation and the held-out split."""
    phases: list[PhaseConfig]
    """The recipe's phases in order (e.g. seq 128 for 90% of the samples, then 512)."""
    total_steps: int = Field(ge=1)
    """Optimizer steps over both phases."""
    seed: int = Field(1234, ge=0)
    """Fixes the initial weights, the sample order and masks, and each micro-batch's dropout seed."""
    log_every: int = Field(1, ge=1)
    """Metrics are logged every N optimizer steps, and at a phase's last step and every evaluation."""
    eval_every: int = Field(0, ge=0)
    """Held-out evaluation every N steps (0: only before training and at the end)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every N steps (0: only at the end); the job resumes from the latest one."""
    keep_checkpoints: int = Field(2, ge=1)
    """Complete checkpoints kept; older ones are deleted once a newer one is complete (never the
    last one before a run of skipped steps). Saving needs room for one more than this."""
    stop_after_skipped_steps: int = Field(50, ge=1)
    """The job stops (non-zero exit) after this many consecutive optimizer steps skipped on
    non-finite gradients or fp16 overflow: the run has diverged. fp16's dynamic loss scale
    skips a handful in a row while it settles; 50 leaves room for that."""
    timeout_minutes: float = Field(30.0, gt=0.0, le=1e6)
    """A rank without progress (a step, an evaluation, a checkpoint) for this long ends the job
    with a message naming the rank that stalled; every collective times out a little later
    (``watchdog.collective_timeout``), so the watchdog's message comes first. At most 1e6
    (about two years: no limit in effect)."""
    startup_timeout_minutes: float = Field(10.0, gt=0.0, le=1e6)
    """The same limit until the first step finishes (set-up, kernels built on first use, a
    resume or a checkpoint conversion), when it is longer than ``timeout_minutes``. Data the job
    prepares itself (``job.data.inputs``: the tokenizer trained, the corpus sharded) counts
    against it on every rank: prepare a large corpus beforehand with ``vrgd-data prepare``, or
    raise this."""
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    """Where the metrics go."""

    @model_validator(mode="after")
    def _phases_fit(self) -> "JobConfig":
        if not self.phases:
            raise ValueError("job.phases: give at least one phase")
        total = sum(p.fraction for p in self.phases)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            raise ValueError(f"job.phases[*].fraction: the fractions sum to {total:g}, not 1; e.g. 0.9 and 0.1")
        for i, p in enumerate(self.phases):
            if p.global_batch % p.micro_batch:
                raise ValueError(f"job.phases[{i}].global_batch: {p.global_batch} is not a multiple of micro_batch "
                                 f"{p.micro_batch}")
            ab = p.adaptive_batch
            if ab is not None and not ab.min_batch <= p.global_batch <= ab.max_batch:
                raise ValueError(f"job.phases[{i}].adaptive_batch: global_batch {p.global_batch} (the first batch) "
                                 f"must lie in [min_batch, max_batch] = [{ab.min_batch}, {ab.max_batch}]")
        from vrgd_ds.data_pipeline.samples import padded_length

        longest = max(p.seq_len for p in self.phases)
        positions = self.model.overrides.get("max_position_embeddings")
        if positions is not None and (not isinstance(positions, int) or isinstance(positions, bool)):
            raise ValueError(f"job.model.overrides.max_position_embeddings: {positions!r} is not an integer")
        if positions is not None and positions < padded_length(longest):
            raise ValueError(f"job.model.overrides.max_position_embeddings: {positions!r} is fewer positions than the "
                             f"longest phase's seq_len {longest} padded as a batch is ({padded_length(longest)}); raise "
                             "it or remove it (the job takes max(512, that width))")
        from vrgd_ds.train.schedule import warmup_steps

        steps = self.phase_steps()
        for i, n in enumerate(steps):
            if n < 1:
                raise ValueError(f"job.phases[{i}].fraction: {self.phases[i].fraction} of total_steps "
                                 f"{self.total_steps} leaves the phase no step; raise total_steps")
            fraction = self.phases[i].warmup_fraction
            if n > 1 and warmup_steps(fraction, n) >= n:  # the phase would end at its peak, never decaying
                raise ValueError(f"job.phases[{i}].warmup_fraction: {fraction} of the phase's {n} steps rounds up to "
                                 f"{n} warmup steps, leaving none to decay; use a warmup_fraction of at most "
                                 f"{math.floor((n - 1) / n * 1e4) / 1e4:g} or raise total_steps")
        return self

    def phase_steps(self) -> list[int]:
        """Steps per phase: rounded cumulative fractions, so they add up to ``total_steps``."""
        bounds, acc = [], 0.0
        for p in self.phases:
            acc += p.fraction
            bounds.append(round(acc * self.total_steps))
        bounds[-1] = self.total_steps
        return [b - a for a, b in zip([0] + bounds[:-1], bounds)]


def _model_at(root: type[BaseModel], loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model that validates the object at ``loc`` below ``root`` (list indices skipped)."""
    model: Any = root
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        kinds = [field.annotation]
        model = None
        while kinds:  # list[X], X | None: the model among the annotation's arguments
            kind = kinds.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                model = kind
                break
            kinds += list(get_args(kind))
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def validation_error(e: ValidationError, prefix: str, root: type[BaseModel]) -> ConfigError:
    """``root``'s validation errors of the block ``prefix``, one line each naming its key; an
    unknown key gets the closest known one of its block and the known ones (a misspelt key would
    otherwise read only "Extra inputs are not permitted")."""
    from vrgd_ds.optim.registry import did_you_mean

    lines = []
    for err in e.errors():
        key = ".".join([prefix, *map(str, err["loc"])]) if err["loc"] else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "string_type" and isinstance(err.get("input"), (int, float)):  # JSON read it as a number
            text = json.dumps(str(err["input"]).lower() if isinstance(err["input"], bool) else str(err["input"]))
            msg += f" (a number or a boolean here; write the text as a JSON string: {text}, with --set: '{key}={text}')"
        if err["type"] == "extra_forbidden" and err["loc"]:
            model = _model_at(root, tuple(err["loc"][:-1]))
            if model is not None:
                known = list(model.model_fields)
                msg += did_you_mean(str(err["loc"][-1]), known) + f"; known: {', '.join(known)}"
        lines.append(f"{key}: {msg}" if not msg.startswith(prefix) else msg)
    return ConfigError("; ".join(lines))


def parse_job(raw: dict[str, Any], source: str = "config") -> JobConfig:
    """The validated ``"job"`` block of a DeepSpeed config dict; errors name the key."""
    if JOB_KEY not in raw:
        raise ConfigError(f"{source}: no '{JOB_KEY}' block; the pretraining job needs one (see configs/)")
    for key in BATCH_KEYS:
        if key in raw:
            raise ConfigError(f"{source}: '{key}' is derived per phase from job.phases[*].global_batch and "
                              f"micro_batch; remove it")
    optimizer_state_policy(raw)
    data_change_policy(raw)
    try:
        return JobConfig.model_validate(raw[JOB_KEY])
    except ValidationError as e:
        raise validation_error(e, JOB_KEY, JobConfig) from None


#: DeepSpeed 0.19.8's keys of the ``checkpoint`` block (deepspeed/runtime/constants.py), which it
#: reads by name and so ignores any other
DEEPSPEED_CHECKPOINT_KEYS = ("tag_validation", "load_universal", "use_node_local_storage", "parallel_write")


def _checkpoint_block(raw: dict[str, Any]) -> dict[str, Any]:
    """The config's ``checkpoint`` block, whose keys must be the job's or (the deepspeed engine)
    DeepSpeed's: a misspelt one would be ignored by both, and its policy silently the default."""
    from vrgd_ds.optim.registry import did_you_mean

    block = raw.get(CHECKPOINT_KEY) or {}
    if not isinstance(block, dict):
        raise ConfigError(f"{CHECKPOINT_KEY}: must be an object, got {type(block).__name__}")
    megatron = (raw.get(JOB_KEY) or {}).get("engine") == "megatron"
    known = list(JOB_CHECKPOINT_KEYS) + ([] if megatron else list(DEEPSPEED_CHECKPOINT_KEYS))
    unknown = [k for k in block if k not in known]
    if unknown:
        has = (f"the megatron engine's checkpoint block has the keys {', '.join(JOB_CHECKPOINT_KEYS)}" if megatron
               else f"the checkpoint block has the job's keys {', '.join(JOB_CHECKPOINT_KEYS)} and DeepSpeed's "
                    f"{', '.join(DEEPSPEED_CHECKPOINT_KEYS)}")
        raise ConfigError(f"{CHECKPOINT_KEY}.{unknown[0]}: {has}{did_you_mean(str(unknown[0]), known)}")
    return block


def optimizer_state_policy(raw: dict[str, Any]) -> str:
    """``checkpoint.optimizer_state``: what a resume does when the checkpoint's optimizer state
    cannot carry over to the configured optimizer (another family, e.g. LAMB -> SGD):
    ``"require"`` (default) stops with a message naming this option; ``"reset_if_incompatible"``
    loads the weights and the data position and starts the optimizer fresh, with a warning.
    A member and its base (VRLamb <-> Lamb, ``gsnr`` on/off) always carry the state over."""
    block = _checkpoint_block(raw)
    if block.get("load_universal"):
        raise ConfigError(f"{CHECKPOINT_KEY}.load_universal: remove it; the job converts a checkpoint to universal "
                          "form and loads it that way by itself when the number of ranks changed")
    value = block.get(OPTIMIZER_STATE_KEY, OPTIMIZER_STATE_POLICIES[0])
    if value not in OPTIMIZER_STATE_POLICIES:
        raise ConfigError(f"{CHECKPOINT_KEY}.{OPTIMIZER_STATE_KEY}: {value!r} is not one of "
                          f"{', '.join(map(repr, OPTIMIZER_STATE_POLICIES))}")
    return value


def data_change_policy(raw: dict[str, Any]) -> str:
    """``checkpoint.data_change``: what a resume does when the configured data is not the data the
    checkpoint was trained on (its fingerprint: tokenizer, shards, ``job.seed``,
    ``job.data.heldout_fraction``, ``job.data.next_sentence``): ``"refuse"`` (default) stops,
    naming this option; ``"continue"`` keeps the saved position in the new sample stream, with a
    warning (the samples already seen are not those of the new stream, and documents trained on may
    now be held out)."""
    value = _checkpoint_block(raw).get(DATA_CHANGE_KEY, DATA_CHANGE_POLICIES[0])
    if value not in DATA_CHANGE_POLICIES:
        raise ConfigError(f"{CHECKPOINT_KEY}.{DATA_CHANGE_KEY}: {value!r} is not one of "
                          f"{', '.join(map(repr, DATA_CHANGE_POLICIES))}")
    return value


def gradient_accumulation(phase: PhaseConfig, world_size: int, index: int) -> int:
    """Accumulation steps of a phase on ``world_size`` ranks; an error names the key if the
    global batch does not split evenly."""
    per_step = phase.micro_batch * world_size
    if phase.global_batch % per_step:
        raise ConfigError(f"job.phases[{index}].global_batch: {phase.global_batch} is not divisible by micro_batch "
                          f"x ranks = {phase.micro_batch} x {world_size}; change global_batch or micro_batch")
    return phase.global_batch // per_step


#: an adaptive phase with an optimizer that takes no gradient statistics
ADAPTIVE_NEEDS_GSNR = ("job.phases[*].adaptive_batch needs the gradient statistics: optimizer.params.gsnr is false. "
                       "For plain LAMB with an adaptive batch use VRLamb with \"gamma\": 1 (its step equals LAMB's "
                       "bit for bit; the statistics are still gathered)")


def check_optimizer_lr(raw: dict[str, Any], job: JobConfig) -> None:
    """Refuses an ``optimizer.params.lr`` other than ``job.phases[0].lr``: the job sets every
    group's learning rate from its phases before each step, so the optimizer block's only builds
    the optimizer, and a sweep or override of it would change nothing."""
    given = ((raw.get("optimizer") or {}).get("params") or {}).get("lr")
    if given is None or not isinstance(given, (int, float)) or isinstance(given, bool):
        return  # absent, or the optimizer's own check names the type
    first = job.phases[0].lr
    if not math.isclose(given, first, rel_tol=1e-9, abs_tol=0.0):
        raise ConfigError(f"optimizer.params.lr: {given:g} has no effect, the job sets the learning rate from its "
                          f"phases (job.phases[*].lr, warmup_fraction, decay_power; job.phases[0].lr is {first:g}): "
                          "set the LR there, and drop optimizer.params.lr or give it job.phases[0].lr (a sweep by "
                          "--set job.phases.0.lr=X: --set optimizer.params.lr=X beside it, or no optimizer.params.lr "
                          "in the config)")


def check_gsnr_groups(raw: dict[str, Any], job: JobConfig) -> None:
    """Refuses, before any work, a fixed-batch phase whose steps would have fewer gradient groups
    than the GSNR needs, naming the phase's keys. A step's groups are its data-parallel ranks ×
    micro-steps, ``global_batch / micro_batch`` on any number of ranks (stage 0 / ZeRO-1 with the
    per-micro-step reduction count the ranks alone; then phase 0's check at the engine's start
    covers every phase). The engine checks only the batch it starts with, so a later phase of one
    group crashed at its first step, hours in, on every resume too."""
    from vrgd_ds.optim.base import MIN_GROUPS
    from vrgd_ds.optim.registry import OptimizerBlockError, checked_group

    try:
        _, group = checked_group(raw.get("optimizer"), "the engine's gradient clipping")
    except OptimizerBlockError:
        return  # the engine's own check names it
    if not group.get("gsnr"):
        if any(p.adaptive_batch is not None for p in job.phases):
            raise ConfigError(ADAPTIVE_NEEDS_GSNR)
        return
    for i, p in enumerate(job.phases):
        groups = p.global_batch // p.micro_batch
        if p.adaptive_batch is None and groups < MIN_GROUPS:
            raise ConfigError(f"job.phases[{i}].global_batch: {p.global_batch} in micro-batches of {p.micro_batch} "
                              f"gives a step of {groups} gradient group(s) (ranks x micro-steps), and the GSNR needs "
                              f">= {MIN_GROUPS}: raise global_batch to {MIN_GROUPS * p.micro_batch} or more, lower "
                              "micro_batch, or set optimizer.params.gsnr false")


def phase_settings(job: JobConfig, world_size: int, phase_steps: list[int],
                   finished: frozenset[int] = frozenset()) -> dict[int, Any]:
    """What the job checks of every phase on ``world_size`` data-parallel ranks before it prepares
    data (``--check-resume`` asks the same): each global batch splits into micro-batches evenly
    (``gradient_accumulation``); returns the controller settings of the adaptive phases. The
    phases the checkpoint it resumes from has ``finished`` (``finished_phases``) take no more
    steps and are not checked: their batch may not split over the ranks of a resume."""
    out = {}
    for i, p in enumerate(job.phases):
        if i in finished:
            continue
        gradient_accumulation(p, world_size, i)
        if p.adaptive_batch is not None:
            out[i] = controller_settings(p, world_size, i, phase_steps[i])
    return out


def resumed_consumed(job: JobConfig, consumed: list[int], saved_phases: list[dict] | None = None) -> list[int]:
    """The samples a checkpoint consumed per phase, for this config's phases: a phase the config
    adds after the saved ones starts at 0; a saved phase the config drops must not have started.
    A started phase keeps its ``seq_len`` (``saved_phases``: the checkpoint's, where it records
    them): its position counts samples of that length's index, and another length's index is
    another stream (its samples would repeat or be skipped)."""
    out = [int(c) for c in consumed[:len(job.phases)]] + [0] * (len(job.phases) - len(consumed))
    dropped = [i for i in range(len(job.phases), len(consumed)) if consumed[i]]
    if dropped:
        raise ConfigError(f"job.phases: the checkpoint trained {len(consumed)} phases (phase {dropped[0]}: "
                          f"{consumed[dropped[0]]} samples), the config has {len(job.phases)}; resume with the "
                          "phases it was saved with (phases may be added after them)")
    for index, (done, saved) in enumerate(zip(out, saved_phases or [])):
        if done and saved.get("seq_len") not in (None, job.phases[index].seq_len):
            raise ConfigError(
                f"job.phases[{index}].seq_len: the checkpoint trained {done} samples of this phase at seq_len "
                f"{saved['seq_len']}, the config has {job.phases[index].seq_len}; a started phase keeps its sequence "
                f"length (its position is in that length's samples): resume with seq_len {saved['seq_len']}, and for "
                "longer sequences end the phase (its fraction) and add one after it")
    return out


def check_resume_position(job: JobConfig, consumed: list[int], budget: list[int], world_size: int) -> None:
    """A checkpoint's position in each unfinished phase must be a whole number of ``micro_batch ×
    ranks`` rounds on this layout: an adaptive phase saved on another number of ranks took batches
    of that layout's multiples, and each rank's samples start at ``consumed + rank × micro_batch``.
    The error names the rank counts that can resume it. A fixed phase must also be a whole number
    of its ``global_batch`` in (one resumed with another batch would end past its samples). And a
    phase before the one the checkpoint is in must not have samples left: the job takes the first
    phase with samples left, so a larger ``job.total_steps`` would send it back to an earlier one."""
    last = max((i for i, done in enumerate(consumed) if done > 0), default=0)
    for index in range(last):
        if consumed[index] < budget[index]:
            phase = job.phases[index]
            raise ConfigError(
                f"job.phases[{index}]: the checkpoint is in phase {last} ({consumed[last]} samples in), and this "
                f"config gives phase {index} {budget[index]} samples, {budget[index] - consumed[index]} more than it "
                f"trained: the job would go back to it (job.total_steps or the phases' fractions changed). Resume "
                f"with a config that gives phase {index} at most the {consumed[index]} samples it trained "
                f"({consumed[index] // phase.global_batch} steps of {phase.global_batch}), e.g. a smaller "
                f"job.phases[{index}].fraction beside the larger job.total_steps")
    for index, (phase, done, total) in enumerate(zip(job.phases, consumed, budget)):
        per_round = phase.micro_batch * world_size
        if done >= total:
            continue
        if done % per_round:
            ab = phase.adaptive_batch  # its bounds must be multiples of micro_batch x ranks too (controller_settings)
            bounds = (phase.global_batch, done) + ((ab.min_batch, ab.max_batch) if ab is not None else ())
            fits = [w for w in range(1, 4 * world_size + 1) if all(b % (phase.micro_batch * w) == 0 for b in bounds)]
            raise ConfigError(
                f"job.phases[{index}]: the checkpoint is {done} samples into the phase, which is no multiple of "
                f"micro_batch x ranks = {phase.micro_batch} x {world_size} (an adaptive batch saved on another "
                f"number of ranks); resume on {', '.join(map(str, fits)) or 'another number of'} data-parallel "
                f"rank(s), or with a micro_batch that divides {done} and the global batch")
        if phase.adaptive_batch is not None and 0 < done and total - done < phase.adaptive_batch.min_batch:
            # the batch rule keeps the rest at 0 or >= min_batch for the budget it started with; another
            # budget (job.total_steps or the phase's fraction changed) can leave less for the last step
            raise ConfigError(
                f"job.phases[{index}].adaptive_batch.min_batch: the checkpoint is {done} samples into the phase, "
                f"and this config gives it {total}: its last step would take the {total - done} left, fewer than "
                f"min_batch {phase.adaptive_batch.min_batch} (job.total_steps or the phase's fraction changed). "
                f"Give the phase at least {done + phase.adaptive_batch.min_batch} samples, or end it at {done}")
        if phase.adaptive_batch is None and done % phase.global_batch:  # its samples: steps x global_batch
            raise ConfigError(
                f"job.phases[{index}].global_batch: the checkpoint is {done} samples into the phase, no multiple of "
                f"{phase.global_batch} (a fixed phase resumed with another global_batch would end past its "
                f"samples); resume with a global_batch that divides {done}, such as the one it was saved with")


def finished_phases(job: JobConfig, info: dict[str, Any] | None) -> frozenset[int]:
    """The phases of ``job`` a checkpoint's marker (``info``: its record of the run) has finished,
    every sample of their budget consumed: a resume takes no more steps in them. None where the
    marker records no position, or one this config cannot resume (the resume names why)."""
    consumed = (info or {}).get("consumed")
    if not isinstance(consumed, list):
        return frozenset()
    try:
        return done_phases(job, resumed_consumed(job, consumed, info.get("phases")))
    except ConfigError:
        return frozenset()


def done_phases(job: JobConfig, consumed: list[int]) -> frozenset[int]:
    """The phases whose sample budget (``phase_samples``) ``consumed`` (per phase, as
    ``resumed_consumed`` gives it) has used up."""
    return frozenset(i for i, (d, total) in enumerate(zip(consumed, phase_samples(job))) if d >= total)


def check_resume_marker(job: JobConfig, info: dict[str, Any], world_size: int) -> None:
    """What a resume refuses from the checkpoint's marker alone (``info``: its record of the run),
    before anything loads or converts: a started phase dropped or given another ``seq_len``
    (``resumed_consumed``), an adaptive phase changed (``adaptive_changes``), a position that does
    not fit this layout (``check_resume_position``), on ``world_size`` data-parallel ranks. The
    job and ``--check-resume`` both ask it; a marker without these records is not checked here
    (the job checks the loaded state's position again)."""
    consumed = info.get("consumed") if isinstance(info.get("consumed"), list) else None
    resumed = None if consumed is None else resumed_consumed(job, consumed, info.get("phases"))
    phases, total = info.get("phases"), info.get("total_steps")
    if phases is not None and total is not None and any(p.get("adaptive_batch") for p in phases):
        try:  # the saved phases as the code of now reads them; a check added since may refuse them
            saved_job = parse_job({"job": {"total_steps": total, "phases": phases}})
        except ConfigError:
            saved_job = None  # the loaded controller's settings are compared after the load
        if saved_job is not None and (refused := adaptive_changes(saved_job, job, world_size, consumed)):
            raise ConfigError("; ".join(refused))
    if resumed is not None:
        check_resume_position(job, resumed, phase_samples(job), world_size)


def phase_samples(job: JobConfig) -> list[int]:
    """Samples per phase: its steps at its ``global_batch``. An adaptive phase runs until it has
    consumed them, whatever batches it takes."""
    return [n * p.global_batch for n, p in zip(job.phase_steps(), job.phases)]


def controller_settings(phase: PhaseConfig, world_size: int, index: int, phase_steps: int):
    """The ``BatchController`` settings of an adaptive phase on ``world_size`` ranks; errors
    name the key."""
    from vrgd_ds.adaptive_batch import ControllerSettings
    from vrgd_ds.optim.base import MIN_GROUPS

    ab = phase.adaptive_batch
    assert ab is not None
    g = phase.micro_batch * world_size
    for key in ("min_batch", "max_batch"):
        value = getattr(ab, key)
        if value % g:
            raise ConfigError(f"job.phases[{index}].adaptive_batch.{key}: {value} is not a multiple of micro_batch "
                              f"x ranks = {phase.micro_batch} x {world_size}; only the accumulation changes")
    if ab.min_batch < MIN_GROUPS * phase.micro_batch:  # a step's groups: ranks x micro-steps = batch / micro_batch
        floor = -(-MIN_GROUPS * phase.micro_batch // g) * g
        raise ConfigError(f"job.phases[{index}].adaptive_batch.min_batch: {ab.min_batch} gives a step of "
                          f"{ab.min_batch // phase.micro_batch} gradient group(s) (batch / micro_batch: ranks x "
                          f"micro-steps), and the GSNR needs >= {MIN_GROUPS}; use min_batch >= {floor}")
    return ControllerSettings(**controller_fields(phase, world_size, phase_steps))


def controller_fields(phase: PhaseConfig, world_size: int, phase_steps: int) -> dict[str, Any]:
    """The ``ControllerSettings`` fields of an adaptive phase on ``world_size`` ranks, unchecked (a
    saved phase's, compared on the ranks of a resume, need not suit them)."""
    from vrgd_ds.train.schedule import warmup_steps

    ab = phase.adaptive_batch
    assert ab is not None
    start = warmup_steps(phase.warmup_fraction, phase_steps) if ab.after_warmup else 0
    return dict(initial_batch=phase.global_batch, min_batch=ab.min_batch, max_batch=ab.max_batch,
                granularity=phase.micro_batch * world_size, target_similarity=ab.target_similarity,
                target_ratio=ab.target_ratio, every=ab.every, start_step=start, smoothing=ab.smoothing,
                max_change=ab.max_change, tolerance=ab.tolerance)


#: the keys a controller setting comes from, where it is not the block's own key of that name
_SETTING_KEYS = {"initial_batch": "job.phases[{i}].global_batch",
                 "start_step": "job.total_steps, job.phases[{i}].fraction or warmup_fraction (with after_warmup the "
                               "controller starts when the warmup ends)"}


def adaptive_setting_keys(index: int, changed: list[str]) -> str:
    """The config keys behind the controller settings ``changed`` of phase ``index``."""
    return "; ".join(_SETTING_KEYS[k].format(i=index) if k in _SETTING_KEYS
                     else f"job.phases[{index}].adaptive_batch.{k}" for k in changed)


def adaptive_changes(saved: "JobConfig", job: "JobConfig", world_size: int,
                     consumed: list[int] | None = None) -> list[str]:
    """Per adaptive phase of ``job``, what a resume of a run saved with ``saved`` would refuse: its
    controller's settings on ``world_size`` ranks differ (``BatchController.load_state_dict``;
    the granularity, micro-batch × ranks, may), or the phase ran adaptive and is fixed now. One
    line per phase, naming the config keys. A phase the checkpoint has not started (``consumed``,
    its samples per phase, 0) may change freely, as the job lets it."""
    out = []
    steps, saved_steps = job.phase_steps(), saved.phase_steps()
    started = [consumed is None or i >= len(consumed) or consumed[i] > 0 for i in range(len(saved.phases))]
    for i, before in enumerate(saved.phases):  # the checkpoint holds a controller for each (Job.resume)
        if not started[i]:
            continue
        if before.adaptive_batch is not None and (i >= len(job.phases) or job.phases[i].adaptive_batch is None):
            out.append(f"job.phases[{i}]: phase {i} ran with adaptive_batch, the config has none there; resume "
                       "with the config it was saved with")
    for i, phase in enumerate(job.phases):
        if phase.adaptive_batch is None or i >= len(saved.phases) or saved.phases[i].adaptive_batch is None:
            continue
        if not started[i]:
            continue
        mine = controller_fields(phase, world_size, steps[i])
        before = controller_fields(saved.phases[i], world_size, saved_steps[i])
        changed = sorted(k for k in before if k != "granularity" and before[k] != mine[k])
        if changed:
            out.append(f"job.phases[{i}].adaptive_batch: the checkpoint's controller settings differ in "
                       f"{', '.join(changed)} (from {adaptive_setting_keys(i, changed)}): resume with the values it "
                       "was saved with")
    return out


def deepspeed_config(raw: dict[str, Any], phase: PhaseConfig, world_size: int, index: int) -> dict[str, Any]:
    """DeepSpeed's part of the file with the batch keys of ``phase`` filled in."""
    ds = {k: copy.deepcopy(v) for k, v in raw.items() if k != JOB_KEY}
    if isinstance(ds.get(CHECKPOINT_KEY), dict):  # the job's key, not DeepSpeed's
        for key in JOB_CHECKPOINT_KEYS:
            ds[CHECKPOINT_KEY].pop(key, None)
        if not ds[CHECKPOINT_KEY]:
            del ds[CHECKPOINT_KEY]
    ds["train_micro_batch_size_per_gpu"] = phase.micro_batch
    ds["gradient_accumulation_steps"] = gradient_accumulation(phase, world_size, index)
    ds["train_batch_size"] = phase.global_batch
    ds.setdefault("steps_per_print", 10**9)  # the job reports progress itself
    return ds


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``key.path=value`` overrides (value parsed as JSON, else a string), e.g.
    ``job.total_steps=20`` or ``job.phases.0.micro_batch=4``."""
    out = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. job.total_steps=20")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node: Any = out
        parts = key.split(".")
        for j, part in enumerate(parts):
            here = ".".join(parts[:j + 1])
            last = j == len(parts) - 1
            if isinstance(node, list):
                if not part.lstrip("-").isdigit():
                    raise ConfigError(f"--set {key}: '{'.'.join(parts[:j]) or 'the config'}' is a list; "
                                      f"'{part}' is not an index (0..{len(node) - 1})")
                i = int(part)
                if not 0 <= i < len(node):
                    raise ConfigError(f"--set {key}: '{'.'.join(parts[:j])}' has {len(node)} entries "
                                      f"(0..{len(node) - 1}); there is no {here}")
                if last:
                    node[i] = value
                else:
                    node = node[i]
            elif isinstance(node, dict):
                close = [] if part in node else difflib.get_close_matches(
                    part, [k for k in node if isinstance(k, str)], n=1, cutoff=0.8)  # a misspelt key's
                if last:
                    # a new key; a misspelt one would do nothing (DeepSpeed ignores it). The job and megatron
                    # blocks, the optimizer block and its params, and the top-level keys are checked by name where
                    # they are read
                    if close and parts[0] not in ("job", "megatron") and parts[:2] != ["optimizer", "params"]:
                        raise ConfigError(f"--set {key}: no key '{here}' in the config; did you mean "
                                          f"'{'.'.join(parts[:j] + close)}'? (a new key is added only when "
                                          "none of its block's keys is spelt this close to it)")
                    node[part] = value
                elif part not in node:  # a block the config lacks: a misspelt one's name, else set it whole
                    if close:
                        raise ConfigError(f"--set {key}: no key '{here}' in the config; did you mean "
                                          f"'{'.'.join(parts[:j] + close + parts[j + 1:])}'?")
                    rest = json.dumps({".".join(parts[j + 1:]): value}) if j + 2 == len(parts) else "{...}"
                    raise ConfigError(f"--set {key}: no key '{here}' in the config; add the block whole: "
                                      f"--set '{here}={rest}'")
                else:
                    node = node[part]
            else:
                raise ConfigError(f"--set {key}: '{'.'.join(parts[:j])}' is a value ({node!r}), not an object or "
                                  f"a list; set '{'.'.join(parts[:j])}=...' instead")
    return out


def load_config(path: str | Path, overrides: list[str] = ()) -> tuple[dict[str, Any], JobConfig]:
    """Reads a config file (raw dict with overrides applied, validated job block)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    raw = apply_overrides(raw, list(overrides))
    return raw, parse_job(raw, str(path))
