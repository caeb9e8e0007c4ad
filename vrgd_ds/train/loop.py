"""The BERT pretraining loop under DeepSpeed: phases, accumulation, evaluation, checkpoints,
automatic resume and telemetry.

One engine serves both phases: at a phase boundary the micro-batch and the global batch of
the next phase are set on it (``set_train_micro_batch_size`` / ``set_train_batch_size``), so
the optimizer state, VRGD statistics hooks and loss scaler carry over. Accumulation
boundaries are set explicitly each micro-step (``set_gradient_accumulation_boundary``):
DeepSpeed's own count (``micro_steps % gradient_accumulation_steps``) would misalign once the
accumulation changes between phases.

Exact resume: the model, optimizer (with the VRGD state), loss scaler and LR position come
from the DeepSpeed checkpoint; the data position is the per-phase ``consumed_samples`` in its
client state (the sampler is rebuilt from it); the torch RNG (dropout) is re-seeded from
``(seed, step, slot)`` before every micro-batch, where the slot is the micro-batch's place in
the step's global batch (micro-step × ranks + rank), so no generator state has to be carried
over. A run stopped after step N and resumed therefore repeats the uninterrupted run's losses
(fp32); resumed on another number of ranks (same micro-batch), each slot holds the same
samples with the same dropout, and only the summation order differs.

Failure handling (each case ends the job with a message naming the key, file, rank or step):

* a second job started on a run directory that a live job owns stops before touching it, naming
  the owner (``rundir``, exit ``EXIT_BUSY``); a dead owner's directory, or an earlier start of
  the same Slurm job, is taken over with a log line;
* a bad config (optimizer block, ``--set`` path, data path) fails before any work, once, on the
  first rank (exit ``EXIT_CONFIG``);
* a checkpoint counts once every rank has written it (``checkpoints``): resuming takes the
  newest complete one and names the broken ones it passed over; a save first checks the free
  space and names the path when the disk is full;
* ``job.stop_after_skipped_steps`` consecutive skipped steps (non-finite gradients, fp16
  overflow) stop the run (exit ``EXIT_DIVERGED``); the rotation keeps the last checkpoint
  taken before the skips began;
* a rank without progress for ``job.timeout_minutes`` (``job.startup_timeout_minutes`` before the
  first step) ends the job, naming the stalled rank
  (``watchdog``, exit 3); collectives time out a little later, so that message comes first;
* ``SIGUSR1`` (Slurm's ``--signal=USR1@120`` before a time limit or pre-emption): every rank
  finishes its step, the job takes a checkpoint and exits ``EXIT_REQUEUE`` so the batch script
  requeues it; the requeued job resumes from that checkpoint.
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

import vrgd_ds
from vrgd_ds.ds import shm
from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.adaptive_batch import BatchController, lr_factor
from vrgd_ds.train.config import (ConfigError, JobConfig, controller_settings, deepspeed_config, gradient_accumulation,
                                  load_config, optimizer_state_policy, phase_samples)
from vrgd_ds.train.data import JobData, check_data_path, eval_batches, loader, prepare_data
from vrgd_ds.train.model import build_model
from vrgd_ds.train.resume import ResumePlan, convert_command, plan_resume
from vrgd_ds.train.rundir import RunDirBusy, RunDirLock
from vrgd_ds.train.schedule import PhaseSchedule
from vrgd_ds.train.watchdog import Watchdog, collective_timeout

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
STATE_KEY = "vrgd_job"

EXIT_CONFIG = 2  # a configuration or data error found before training
EXIT_DIVERGED = 4  # job.stop_after_skipped_steps consecutive steps skipped
EXIT_NO_SPACE = 5  # not enough disk space for a checkpoint
EXIT_BUSY = 6  # the run directory belongs to another live job (rundir)
EXIT_REQUEUE = 75  # checkpointed on SIGUSR1: requeue the job (EX_TEMPFAIL)
REQUEUE_MARKER = "requeue.json"  # <run dir>/requeue.json: the same, for batch scripts (launch/slurm.sbatch)
PREEMPT_SIGNAL = signal.SIGUSR1
#: set to a directory: each rank writes ``samples.rank<r>.jsonl``, the (epoch, sample) keys every
#: optimizer step read, to check data accounting (needs ``job.data.workers`` = 0: no prefetch)
TRACE_ENV = "VRGD_TRACE_SAMPLES"


class _Recorder:
    """A batch sampler that remembers the keys it handed out (``TRACE_ENV``)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.keys = sampler, []

    def __iter__(self):
        for keys in self.sampler:
            self.keys.extend(keys)
            yield keys


class Diverged(RuntimeError):
    """Too many consecutive skipped steps."""


class Preempted(Exception):
    """The job took a checkpoint on ``PREEMPT_SIGNAL`` and should be requeued."""


def _seed_micro_batch(seed: int, step: int, slot: int) -> None:
    """Dropout of the micro-batch in ``slot`` of the step's global batch (its samples are
    ``slot × micro_batch`` onwards on any number of ranks: ``PretrainingSampler``)."""
    torch.manual_seed((seed * 1_000_003 + step) * 4099 + slot)


def _inputs(batch: dict[str, torch.Tensor], device: torch.device, next_sentence: bool) -> dict[str, torch.Tensor]:
    keys = ("input_ids", "token_type_ids", "attention_mask", "labels") + (("next_sentence_label",) if next_sentence else ())
    return {k: batch[k].to(device, non_blocking=True) for k in keys}


class Trainer:
    def __init__(self, raw: dict[str, Any], job: JobConfig, run_dir: Path, backend: str | None) -> None:
        import deepspeed
        import deepspeed.comm as dist

        self.raw, self.job, self.run_dir = raw, job, run_dir
        cuda = torch.cuda.is_available()
        deepspeed.init_distributed(dist_backend=backend or ("nccl" if cuda else "gloo"), auto_mpi_discovery=True,
                                   timeout=datetime.timedelta(seconds=collective_timeout(max(job.timeout_minutes, job.startup_timeout_minutes) * 60)))
        self.dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if cuda:
            local = int(os.environ.get("LOCAL_RANK", self.rank % max(torch.cuda.device_count(), 1)))
            torch.cuda.set_device(local)
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.watchdog: Watchdog | None = None
        self.lock = self._take_run_dir()  # before anything in the run directory is touched

    def _take_run_dir(self) -> RunDirLock | None:
        """Rank 0 takes the run directory (``rundir``); every rank learns whether it could."""
        lock, refused = None, None
        if self.rank == 0:
            lock = RunDirLock(self.run_dir)
            try:
                note = lock.acquire()
            except RunDirBusy as e:
                refused = str(e)
            else:
                if note:
                    logger.warning("%s", note)
                lock.start()
        if self._any_rank(refused is not None):
            raise RunDirBusy(refused or "the run directory is in use by another job (rank 0 names it)")
        return lock

    def release(self) -> None:
        """Stops the watchdog and gives the run directory back (every exit path)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.lock is not None:
            self.lock.release()

    def setup(self) -> "Trainer":
        """Everything after the run directory is taken: data, model, engine."""
        import deepspeed

        job, run_dir, raw, dist = self.job, self.run_dir, self.raw, self.dist
        self.watchdog = Watchdog(run_dir, self.rank, self.world, job.timeout_minutes * 60,
                                 startup_s=job.startup_timeout_minutes * 60)
        if self.lock is not None:
            self.watchdog.on_exit = self.lock.release
        self.watchdog.start()
        self.preempt_requested = False
        signal.signal(PREEMPT_SIGNAL, self._on_preempt_signal)
        dist.barrier()  # every rank has mapped its peers' shared memory (CPU accelerator)
        shm.unlink_own_segment(self.rank)
        self.schedule = PhaseSchedule(job)
        self.budget = phase_samples(job)
        self.controllers: dict[int, BatchController] = {}
        for i, p in enumerate(job.phases):
            gradient_accumulation(p, self.world, i)  # fail before preparing data
            if p.adaptive_batch is not None:
                self.controllers[i] = BatchController(controller_settings(p, self.world, i, self.schedule.steps[i]))
        if self.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(json.dumps(raw, indent=2))
            (run_dir / REQUEUE_MARKER).unlink(missing_ok=True)
        self.data: JobData = prepare_data(job, run_dir, self.rank, dist.barrier, sorted({p.seq_len for p in job.phases}))
        self.next_sentence = self.data.next_sentence is not None
        self.data_fingerprint = self.data.fingerprint()
        torch.manual_seed(job.seed)  # the same initial weights on every rank and every start
        model = build_model(job.model, self.data.vocab_size, max(p.seq_len for p in job.phases), self.next_sentence)
        ds_cfg = deepspeed_config(raw, job.phases[0], self.world, 0)
        wd = float(ds_cfg.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0))
        groups = vrgd_ds.param_groups(model, weight_decay=wd)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_cfg)
        self.optimizer = self.engine.basic_optimizer
        if self.controllers and not any(g.get("gsnr") for g in self.optimizer.param_groups):
            raise ConfigError("job.phases[*].adaptive_batch needs the gradient statistics: optimizer.params.gsnr is "
                              "false. For plain LAMB with an adaptive batch use VRLamb with \"gamma\": 1 (its step "
                              "equals LAMB's bit for bit; the statistics are still gathered)")
        self.cosine = None
        if any(p.adaptive_batch is not None and p.adaptive_batch.measure_cosine_every for p in job.phases):
            from vrgd_ds.train.halves import HalfBatchCosine

            self.cosine = HalfBatchCosine(self.engine, self.dist)
        self.step = 0
        self.consumed = [0] * len(job.phases)
        self.evals: list[dict[str, float]] = []
        self.skip_streak_from: int | None = None  # steps completed before the current run of skipped steps
        self.watchdog.beat(0, "set-up")
        return self

    def _on_preempt_signal(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self.preempt_requested = True

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (one small all-reduce)."""
        return self._max_over_ranks(1 if flag else 0) > 0

    def _max_over_ranks(self, value: int) -> int:
        t = torch.tensor([float(value)], device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return int(t.item())

    # -- checkpoints ---------------------------------------------------------------------------

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS

    def resume(self) -> bool:
        """Loads the newest complete checkpoint (``checkpoints``); broken newer ones are named
        and passed over. No checkpoint at all: a fresh start. A checkpoint of another number of
        ranks is converted to universal form once (``_plan``); one of another optimizer
        carries its state over, starts it fresh, or stops, per ``checkpoint.optimizer_state``."""
        if not ckpt.tags(self.ckpt_dir):
            return False
        failed: list[str] = []
        reported: set[str] = set()
        built = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        while True:
            choice = ckpt.choose(self.ckpt_dir, tuple(failed))
            for why in choice.skipped:
                if self.rank == 0 and why not in reported:
                    logger.warning("skipping checkpoint %s", why)
                reported.add(why)
            if choice.tag is None:
                raise ConfigError(f"{self.ckpt_dir}: no complete checkpoint to resume from ({'; '.join(choice.skipped)}). "
                                  "Move the directory away to start afresh (or restore the files)")
            plan = self._plan(choice.tag)
            try:
                path, client = self._load(choice.tag, plan)
                ok = path is not None and STATE_KEY in (client or {})
            except Exception as e:  # a file that passed the size check but does not load
                logger.warning("rank %d: checkpoint %s does not load: %s", self.rank, choice.tag, e)
                ok = False
            if not self._any_rank(not ok):
                break
            failed.append(choice.tag)
        state = client[STATE_KEY]
        self.step, self.consumed, self.evals = state["step"], list(state["consumed"]), list(state["evals"])
        self.skip_streak_from = state.get("skip_streak_from")
        for key, saved in (state.get("adaptive") or {}).items():
            index = int(key)
            if index not in self.controllers:
                raise ConfigError(f"{path}: phase {index} ran with adaptive_batch, the config has none there; resume "
                                  "with the config it was saved with")
            try:
                self.controllers[index].load_state_dict(saved)
            except ValueError as e:
                raise ConfigError(f"{path}: job.phases[{index}].adaptive_batch: {e}") from None
        notes = plan.notes + (self._apply_configured_options(built) if plan.optimizer_states else [])
        if self.rank == 0:
            for note in notes:
                logger.warning("%s", note)
            logger.info("resumed from %s at step %d", path, self.step)
        self.watchdog.beat(self.step, "resume")
        return True

    def optimizer_info(self) -> dict[str, Any]:
        groups = self.optimizer.param_groups
        name = getattr(self.optimizer, "name", type(self.optimizer).__name__)  # Lamb: VRLamb with gsnr off
        return {"type": name, "gsnr": any(bool(g.get("gsnr")) for g in groups),
                "gsnr_placement": groups[0].get("gsnr_placement")}

    def resume_info(self) -> dict[str, Any]:
        """What a resume from the next checkpoint will find (its marker; ``--check-resume``)."""
        return {"optimizer": self.optimizer_info(), "zero_stage": self.engine.zero_optimization_stage(),
                "total_steps": self.job.total_steps, "phases": [p.model_dump(mode="json") for p in self.job.phases],
                "data": self.data_fingerprint, "consumed": list(self.consumed), "seed": self.job.seed}

    def _plan(self, tag: str) -> ResumePlan:
        """How to load ``tag`` (``resume.plan_resume``); converts it to universal form here,
        once, if the number of ranks changed."""
        plan = plan_resume(self.ckpt_dir, tag, self.optimizer_info(), self.world,
                           self.engine.zero_optimization_stage(), optimizer_state_policy(self.raw))
        if plan.switched:
            self.optimizer.report_load = False  # the plan's line says it once
        if not plan.universal or ckpt.converted(self.ckpt_dir, tag) is not None:
            return plan
        error = None
        if self.rank == 0:
            self.watchdog.beat(self.step, "conversion")
            try:
                from vrgd_ds.ds.universal import convert

                out = self.ckpt_dir / ckpt.UNIVERSAL / tag
                shutil.rmtree(out, ignore_errors=True)  # a conversion cut short
                keys = convert(str(self.ckpt_dir / tag), str(out))
                ckpt.record_conversion(self.ckpt_dir, tag, plan.saved_world, keys)
            except Exception as e:  # noqa: BLE001 (reported on every rank below)
                error = f"{type(e).__name__}: {e}"
        if self._any_rank(error is not None):
            raise ConfigError(f"{self.ckpt_dir / tag}: saved on {plan.saved_world} ranks, resumed on {self.world}; "
                              f"converting it to a universal checkpoint failed ({error or 'see rank 0'}). Convert it "
                              f"by hand to see why: {convert_command(self.ckpt_dir, tag)}; or resume it on "
                              f"{plan.saved_world} ranks")
        self.watchdog.beat(self.step, "conversion")
        return plan

    def _load(self, tag: str, plan: ResumePlan) -> tuple[str | None, dict | None]:
        config = self.engine._config
        before = config.load_universal_checkpoint
        # DeepSpeed 0.19.8 reads the flag at load time (engine.load_universal_checkpoint())
        config.load_universal_checkpoint = plan.universal
        try:
            load_dir = self.ckpt_dir / ckpt.UNIVERSAL if plan.universal else self.ckpt_dir
            return self.engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=plan.optimizer_states,
                                               load_lr_scheduler_states=plan.optimizer_states)
        finally:
            config.load_universal_checkpoint = before

    def _apply_configured_options(self, built: list[dict[str, Any]]) -> list[str]:
        """A loaded optimizer state brings its param-group options (torch's rule); the ones the
        config names in ``optimizer.params`` are the config's again. Returns what changed."""
        named = set((self.raw.get("optimizer") or {}).get("params") or {}) - {"lr", "gsnr"}
        changed: dict[str, tuple[Any, Any]] = {}
        for group, mine in zip(self.optimizer.param_groups, built):
            for key in sorted(named & set(mine)):
                if group.get(key) != mine[key]:
                    changed.setdefault(key, (group.get(key), mine[key]))
                    group[key] = mine[key]
        return [f"optimizer.params.{k}: the checkpoint has {a!r}, the config {b!r}; continuing with the config's"
                for k, (a, b) in changed.items()]

    def _checkpoint_bytes(self) -> int:
        """About how many bytes the next checkpoint needs: the last complete one's size, else
        an estimate from the module and every rank's optimizer state (fp32 partitions + state)."""
        done = [t for t in ckpt.tags(self.ckpt_dir) if ckpt.problem(self.ckpt_dir, t) is None]
        if done:
            return int(ckpt.size_of(self.ckpt_dir, done[-1]) * 1.05) + (1 << 20)
        opt = self.optimizer
        local = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
        local += sum(p.numel() * 4 for g in opt.param_groups for p in g["params"])  # fp32 master partitions
        total = torch.tensor([float(local)], dtype=torch.float64, device=self.device)
        self.dist.all_reduce(total)
        module = sum(p.numel() * p.element_size() for p in self.engine.module.parameters())
        return int((float(total[0]) + module) * 1.1) + (1 << 20)

    def save(self) -> None:
        tag = ckpt.tag_of(self.step)
        need = self._checkpoint_bytes()
        short = None
        if self.rank == 0:
            try:
                self.ckpt_dir.mkdir(parents=True, exist_ok=True)
                ckpt.check_space(self.ckpt_dir, need)
            except ckpt.NoSpace as e:
                short = str(e)
        if self._any_rank(short is not None):
            raise ckpt.NoSpace(short or f"no space left on {self.ckpt_dir} for the next checkpoint (see rank 0)")
        state = {"step": self.step, "consumed": self.consumed, "evals": self.evals, "world_size": self.world,
                 "skip_streak_from": self.skip_streak_from, "optimizer": self.optimizer_info(),
                 "adaptive": {str(i): c.state_dict() for i, c in self.controllers.items()}}
        try:
            self.engine.save_checkpoint(str(self.ckpt_dir), tag=tag, client_state={STATE_KEY: state},
                                        save_latest=False)
        except Exception as e:
            if ckpt.is_disk_full(e):
                raise ckpt.NoSpace(f"no space left on {self.ckpt_dir} while writing {tag} (need about "
                                   f"{need / 2**20:,.0f} MB); the previous checkpoint is intact") from e
            raise
        self.dist.barrier()  # every rank's files are written (DeepSpeed's closing barrier too)
        if self.rank == 0:
            ckpt.mark_complete(self.ckpt_dir, tag, self.step, self.world, self.resume_info())
            protect = None
            if self.skip_streak_from is not None:
                before = [t for t in ckpt.tags(self.ckpt_dir) if ckpt.step_of(t) <= self.skip_streak_from
                          and ckpt.problem(self.ckpt_dir, t) is None]
                protect = before[-1] if before else None
            deleted = ckpt.rotate(self.ckpt_dir, self.job.keep_checkpoints, protect)
            if protect is not None and protect not in deleted and (self.ckpt_dir / protect).exists():
                logger.warning("keeping checkpoint %s beyond keep_checkpoints=%d: it is the last one before the "
                               "skipped steps that began at step %d", protect, self.job.keep_checkpoints,
                               self.skip_streak_from + 1)
        self.dist.barrier()
        self.watchdog.beat(self.step, "checkpoint")

    # -- evaluation ----------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, held) -> dict[str, float]:
        self.engine.eval()
        phase = self.job.phases[self.current_phase()]
        sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, predicted tokens
        for batch in eval_batches(held, self.job.data.eval_samples, phase.micro_batch, self.rank, self.world):
            inputs = _inputs(batch, self.device, self.next_sentence)
            labels = inputs.pop("labels")
            inputs.pop("next_sentence_label", None)
            out = self.engine(**inputs)
            logits = (out.prediction_logits if self.next_sentence else out.logits).float()
            mask = labels != -100
            sums[0] += float(torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum"))
            sums[1] += float((logits[mask].argmax(-1) == labels[mask]).sum())
            sums[2] += float(mask.sum())
        sums = sums.to(self.device)
        self.dist.all_reduce(sums)
        self.engine.train()
        self.watchdog.beat(self.step, "evaluation")
        count = max(float(sums[2]), 1.0)
        return {"eval/mlm_loss": float(sums[0]) / count, "eval/mlm_acc": float(sums[1]) / count,
                "eval/tokens": float(sums[2])}

    # -- training ------------------------------------------------------------------------------

    def current_phase(self) -> int:
        """The first phase that has samples left (the last one once all are done)."""
        return next((i for i, (c, b) in enumerate(zip(self.consumed, self.budget)) if c < b), len(self.budget) - 1)

    def _set_batch(self, index: int, batch: int) -> int:
        """Sets the engine's micro-batch and global batch (between optimizer steps); returns the
        accumulation steps."""
        p = self.job.phases[index]
        self.engine.set_train_micro_batch_size(p.micro_batch)
        self.engine.set_train_batch_size(batch)
        return batch // (p.micro_batch * self.world)

    def train(self) -> dict[str, Any]:
        from tqdm import tqdm

        from vrgd_ds.train import telemetry

        resumed = self.resume()
        sinks = telemetry.build_sinks(self.run_dir, jsonl=self.job.telemetry.jsonl,
                                      tensorboard=self.job.telemetry.tensorboard, wandb=self.job.telemetry.wandb,
                                      resume_step=self.step if resumed else None) if self.rank == 0 else None
        self.splits = {p.seq_len: self.data.split(p.seq_len) for p in self.job.phases}
        helds = {n: held for n, (_, held) in self.splits.items()}
        final_held = helds[self.job.phases[-1].seq_len]
        if not self.evals:
            self.evals.append({"step": 0, **self.evaluate(final_held)})
            if sinks:
                sinks.write(0, {k: v for k, v in self.evals[-1].items() if k != "step"})
        bar = tqdm(total=self.job.total_steps, initial=self.step, disable=self.rank != 0, dynamic_ncols=True,
                   desc="pretrain")
        gsnr_on = any(g.get("gsnr") for g in self.optimizer.param_groups)
        try:
            while any(c < b for c, b in zip(self.consumed, self.budget)):
                index = self.current_phase()
                self._run_phase(index, sinks, bar, helds[self.job.phases[index].seq_len], gsnr_on)
        finally:
            bar.close()
        last = self.evals[-1]
        if last["step"] != self.step:
            self.evals.append({"step": self.step, **self.evaluate(final_held)})
            if sinks:
                sinks.write(self.step, {k: v for k, v in self.evals[-1].items() if k != "step"})
        if self.job.checkpoint_every == 0 or self.step % self.job.checkpoint_every:
            self.save()
        if sinks:
            sinks.close()
        return {"before": self.evals[0], "after": self.evals[-1], "steps": self.step}

    def _after_step(self, skipped: bool) -> None:
        """Counts consecutive skipped steps; stops a diverged run."""
        if not skipped:
            self.skip_streak_from = None
            return
        if self.skip_streak_from is None:
            self.skip_streak_from = self.step - 1
            if self.rank == 0:
                logger.warning("step %d skipped (non-finite gradients or fp16 overflow); the job stops after %d in a "
                               "row (job.stop_after_skipped_steps)", self.step, self.job.stop_after_skipped_steps)
        streak = self.step - self.skip_streak_from
        if streak >= self.job.stop_after_skipped_steps:
            kept = [t for t in ckpt.tags(self.ckpt_dir) if ckpt.step_of(t) <= self.skip_streak_from
                    and ckpt.problem(self.ckpt_dir, t) is None]
            where = (f"the last checkpoint before them is {self.ckpt_dir / kept[-1]} (kept by the rotation)" if kept
                     else "no checkpoint was taken before them")
            raise Diverged(f"the run diverged: {streak} consecutive optimizer steps ({self.skip_streak_from + 1}-"
                           f"{self.step}) were skipped on non-finite gradients or fp16 overflow "
                           f"(job.stop_after_skipped_steps={self.job.stop_after_skipped_steps}); {where}. Lower the "
                           "learning rate or the warmup's peak, then start again from that checkpoint")

    def _run_phase(self, index: int, sinks, bar, held, gsnr_on: bool) -> None:
        """Steps of phase ``index`` until its sample budget is consumed: the batch and LR of each
        step, the step itself, its record, and what follows a step (beat, checkpoint, signals)."""
        p = self.job.phases[index]
        gradient_accumulation(p, self.world, index)
        controller = self.controllers.get(index)
        ab = p.adaptive_batch
        sampler, batches, trace = self._phase_data(index)
        engine_batch = None
        while self.consumed[index] < self.budget[index]:
            batch, lr = self._batch_and_lr(index, controller)
            if batch != engine_batch:
                gas = self._set_batch(index, batch)
                engine_batch = batch
            for g in self.optimizer.param_groups:
                g["lr"] = lr
            measure = bool(self.cosine is not None and ab is not None and ab.measure_cosine_every
                           and (self.step + 1) % ab.measure_cosine_every == 0)
            took = self._train_step(batches, gas, measure)
            self.step += 1
            self.consumed[index] += batch
            if trace:
                self._trace_samples(trace, sampler, index)
            adaptive: dict[str, float] = {}
            if controller is not None:
                ta = time.perf_counter()
                adaptive = self._adapt(controller, batch, took["measured"])
                adaptive["adaptive/controller_s"] = time.perf_counter() - ta  # metrics read + controller
            if self.step % self.job.log_every == 0 or self.consumed[index] >= self.budget[index]:
                self._log_step(index, batch, gas, lr, took, adaptive, gsnr_on, held, sinks, bar)
            bar.update(1)
            self._after_training_step(took)

    def _phase_data(self, index: int):
        """The phase's sampler (resumed at the samples consumed), its batch iterator, and the
        sample trace's directory when ``VRGD_TRACE_SAMPLES`` asks for one."""
        from vrgd_ds.data_pipeline.sampler import PretrainingSampler

        p = self.job.phases[index]
        train, _ = self.splits[p.seq_len]
        sampler = PretrainingSampler(len(train), micro_batch_size=p.micro_batch, rank=self.rank,
                                     world_size=self.world, seed=self.job.seed + index,
                                     consumed_samples=self.consumed[index])
        trace = os.environ.get(TRACE_ENV)
        if trace:
            if self.job.data.workers:
                raise ConfigError(f"{TRACE_ENV} needs job.data.workers = 0 (workers prefetch ahead of the steps)")
            sampler = _Recorder(sampler)
        batches = iter(loader(train, sampler, self.job.data.workers, self.device.type == "cuda"))
        return sampler, batches, trace

    def _batch_and_lr(self, index: int, controller: BatchController | None) -> tuple[int, float]:
        """This step's global batch and LR: the phase's, or the adaptive controller's (the last step
        of the phase takes only what is left of its samples)."""
        p = self.job.phases[index]
        if controller is None:
            return p.global_batch, self.schedule.lr_in_phase(index, self.consumed[index] // p.global_batch)
        batch = min(controller.batch, self.budget[index] - self.consumed[index])
        return batch, self.schedule.lr_samples(index, self.consumed[index], batch,
                                               lr_factor(p.adaptive_batch.lr_rule, batch, p.global_batch))

    def _train_step(self, batches, gas: int, measure: bool) -> dict[str, Any]:
        """One optimizer step of ``gas`` micro-steps: the summed loss, tokens, data and step time,
        whether the optimizer skipped it, and the half-batch cosine when ``measure``."""
        if measure:
            self.cosine.start(gas)
        t0 = time.perf_counter()
        data_time, loss_sum, tokens = 0.0, 0.0, 0
        skipped_before = self.optimizer.skipped_steps
        for j in range(gas):
            td = time.perf_counter()
            batch_data = next(batches)
            data_time += time.perf_counter() - td
            tokens += int(batch_data["attention_mask"].sum())
            self.engine.set_gradient_accumulation_boundary(j == gas - 1)
            _seed_micro_batch(self.job.seed, self.step, j * self.world + self.rank)
            if measure:
                self.cosine.micro_step(j)
            loss = self.engine(**_inputs(batch_data, self.device, self.next_sentence)).loss
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += float(loss.detach())
        skipped = self.optimizer.skipped_steps > skipped_before
        measured = self.cosine.finish() if measure else None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return dict(loss_sum=loss_sum, tokens=tokens, data_time=data_time, step_time=time.perf_counter() - t0,
                    skipped=skipped, measured=measured)

    def _trace_samples(self, trace: str, sampler, index: int) -> None:
        with open(Path(trace) / f"samples.rank{self.rank}.jsonl", "a") as fh:
            fh.write(json.dumps({"step": self.step, "phase": index, "keys": [list(map(int, k)) for k in
                                                                           sampler.keys]}) + "\n")
        sampler.keys.clear()

    def _log_step(self, index: int, batch: int, gas: int, lr: float, took: dict[str, Any],
                  adaptive: dict[str, float], gsnr_on: bool, held, sinks, bar) -> None:
        """The step's record (loss and throughput over ranks, optimizer metrics, an evaluation when
        due) to the sinks and the progress bar."""
        from vrgd_ds.train import telemetry

        p = self.job.phases[index]
        step_time = took["step_time"]
        red = torch.tensor([took["loss_sum"] / gas, float(took["tokens"]), took["data_time"]], dtype=torch.float64,
                           device=self.device)
        self.dist.all_reduce(red)
        loss_mean, tok = float(red[0]) / self.world, float(red[1])
        record = {"phase": index, "train/loss": loss_mean, "train/lr": lr, "train/step_time_s": step_time,
                  "train/data_time_s": float(red[2]) / self.world, "train/tokens_per_s": tok / step_time,
                  "train/samples": float(sum(self.consumed)), "train/seq_len": p.seq_len,
                  "train/global_batch": float(batch), "train/accumulation": float(gas), **adaptive}
        m = self.optimizer.gsnr_metrics(per_tensor=self.job.telemetry.per_layer_group)
        if gsnr_on and m.get("gsnr/n") and "noise_scale/b_simple_groups" in m:  # groups -> samples
            m["noise_scale/b_simple"] = m["noise_scale/b_simple_groups"] * batch / m["gsnr/n"]
        per_tensor = {k: v for k, v in m.items() if k.startswith("tensor/")}
        record.update({k: v for k, v in m.items() if not k.startswith("tensor/")})
        if per_tensor:
            record.update(telemetry.group_summary(per_tensor))
        done = all(c >= b for c, b in zip(self.consumed, self.budget))
        if self.job.eval_every and self.step % self.job.eval_every == 0 and not done:
            ev = self.evaluate(held)
            self.evals.append({"step": self.step, **ev})
            record.update(ev)
        if sinks:
            sinks.write(self.step, record)
        bar.set_postfix(loss=f"{loss_mean:.3f}", tok_s=f"{tok / step_time:,.0f}", step_s=f"{step_time:.2f}",
                        phase=index, refresh=False)

    def _after_training_step(self, took: dict[str, Any]) -> None:
        """Progress for the watchdog, the divergence count, a checkpoint when due, and the
        signals every rank agrees on: another job took the directory over, or a pre-emption."""
        self.watchdog.beat(self.step)
        if not math.isfinite(took["loss_sum"]) and not took["skipped"] and self.rank == 0:
            logger.warning("non-finite training loss at step %d", self.step)
        self._after_step(took["skipped"])
        if self.job.checkpoint_every and self.step % self.job.checkpoint_every == 0:
            self.save()
        lost = self.lock is not None and self.lock.lost is not None
        signal_code = self._max_over_ranks(2 if lost else 1 if self.preempt_requested else 0)
        if signal_code == 2:  # another job took the directory over: write nothing more into it
            raise RunDirBusy(self.lock.lost if lost else "another job took the run directory over (rank 0 "
                             "names it); this job stops without writing to it")
        if signal_code == 1:
            self.save()
            if self.rank == 0:  # for the batch script: the exit code of srun is the first rank's to end
                (self.run_dir / REQUEUE_MARKER).write_text(json.dumps({"tag": ckpt.tag_of(self.step)}))
            raise Preempted(f"checkpoint {ckpt.tag_of(self.step)} taken on {signal.Signals(PREEMPT_SIGNAL).name}")

    def _adapt(self, controller: BatchController, batch: int, measured: float | None) -> dict[str, float]:
        """Feeds the step's noise-scale moments to the controller (the same on every rank: the
        statistics are complete on each); returns the step's ``adaptive/*`` metrics."""
        m = self.optimizer.gsnr_metrics()
        n = m.get("gsnr/n")
        if n and "noise_scale/trace_cov" in m and not m.get("step/skipped"):
            per_group = batch / n  # samples per gradient group
            decision = controller.observe(m["noise_scale/trace_cov"] * per_group, m["noise_scale/grad_sq"])
        else:
            decision = controller.observe(math.nan, math.nan)
        out = {"adaptive/b_simple": decision.b_simple, "adaptive/implied_similarity": decision.implied_similarity,
               "adaptive/next_batch": float(decision.batch)}
        if math.isfinite(decision.target):
            out["adaptive/target_batch"] = decision.target
        if measured is not None:
            out["adaptive/measured_similarity"] = measured
        if decision.changed and self.rank == 0:
            logger.info("adaptive batch: %d -> %d after step %d (B_simple %.0f, target %.0f)", batch, decision.batch,
                        self.step, decision.b_simple, decision.target)
        return out


def _launch_rank() -> int:
    """This process's rank as the launcher set it (before the process group exists)."""
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _check_resume(args: argparse.Namespace) -> int:
    from vrgd_ds.ds.integration import UnsupportedConfiguration
    from vrgd_ds.train.resume import check

    run_dir = Path(args.check_resume)
    raw = None
    try:
        if args.config:
            raw, _ = load_config(args.config, args.set)
        report, ok = check(run_dir, raw, args.world_size)
    except (ConfigError, UnsupportedConfiguration) as e:
        print(f"vrgd-pretrain: error: {args.config}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(report, flush=True)
    return 0 if ok else EXIT_CONFIG


def main(argv: list[str] | None = None) -> int:
    from vrgd_ds.ds.config import check_config
    from vrgd_ds.ds.integration import UnsupportedConfiguration

    ap = argparse.ArgumentParser(prog="vrgd-pretrain", description="BERT pretraining with VRGD optimizers under "
                                 "DeepSpeed (launch with deepspeed, torchrun, mpirun or srun).")
    ap.add_argument("--config", help="DeepSpeed JSON config with a 'job' block (see configs/)")
    ap.add_argument("--run-dir", help="metrics, TensorBoard, plots and checkpoints; the job resumes "
                    "from the latest checkpoint found here (one job at a time owns it)")
    ap.add_argument("--check-resume", metavar="RUN_DIR", help="report what a resume of RUN_DIR would load (step, "
                    "ranks, optimizer, phases, data fingerprint) and, with --config and --world-size, what would "
                    "change; trains nothing. Exit 0 if the resume would go ahead, else 2")
    ap.add_argument("--world-size", type=int, default=None, help="with --check-resume: the ranks of the resume "
                    "(default: the checkpoint's)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key, e.g. --set job.total_steps=20 (value parsed as JSON)")
    ap.add_argument("--backend", choices=("nccl", "gloo", "mpi"), default=None,
                    help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.check_resume:
        return _check_resume(args)
    if not args.config or not args.run_dir:
        ap.error("--config and --run-dir are required (or --check-resume RUN_DIR)")
    first = _launch_rank() == 0
    try:  # everything that can be checked without a process group, before any work
        raw, job = load_config(args.config, args.set)
        check_config(raw)
        check_data_path(job)
    except (ConfigError, UnsupportedConfiguration) as e:
        if first:
            print(f"vrgd-pretrain: error: {args.config}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    run_dir = Path(args.run_dir)
    trainer = None
    try:
        trainer = Trainer(raw, job, run_dir, args.backend)
        result = trainer.setup().train()
    except RunDirBusy as e:  # agreed over the ranks (_take_run_dir, _max_over_ranks): all of them are here
        if first:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        _leave_together()
        return EXIT_BUSY
    except (ConfigError, UnsupportedConfiguration) as e:
        if trainer is None or trainer.rank == 0:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except Diverged as e:
        if trainer.rank == 0:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    except ckpt.NoSpace as e:
        if trainer is None or trainer.rank == 0:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        return EXIT_NO_SPACE
    except Preempted as e:  # agreed over the ranks (_max_over_ranks)
        if trainer.rank == 0:
            print(f"vrgd-pretrain: {e}; exiting {EXIT_REQUEUE} to be requeued (it resumes from there)", flush=True)
        _leave_together()
        return EXIT_REQUEUE
    finally:
        if trainer is not None:
            trainer.release()
    if trainer.rank == 0:
        plots = []
        try:
            from vrgd_ds.train.plots import plot_run

            plots = plot_run(run_dir)
        except Exception as e:  # plotting must not fail a finished run
            logger.warning("plots were not written: %s", e)
        b, a = result["before"], result["after"]
        print(f"\nheld-out MLM loss {b['eval/mlm_loss']:.4f} -> {a['eval/mlm_loss']:.4f}, accuracy "
              f"{b['eval/mlm_acc']:.4f} -> {a['eval/mlm_acc']:.4f} after {result['steps']} steps")
        print(f"metrics:    {run_dir / 'metrics.jsonl'}")
        if plots:
            print(f"plots:      {plots[0].parent}")
        print(f"checkpoint: {run_dir / CHECKPOINTS} (latest: "
              f"{(run_dir / CHECKPOINTS / ckpt.LATEST).read_text().strip()})", flush=True)
    _leave_together()
    return 0


def _leave_together() -> None:
    """Every rank leaves the process group together: a rank exiting alone can die in gloo's
    teardown (SIGABRT, "terminate called without an active exception"), which replaces the exit
    code the launcher and the batch script act on (seen for a refused second job: 250, not 6)."""
    import deepspeed.comm as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
