"""The pretraining job's spine: one run of ``job.total_steps`` optimizer steps through the phases,
with whichever engine ``job.engine`` names (``vrgd_ds/train/engines``): DeepSpeed (BERT) or
Megatron-core (GPT). Everything here holds for both; nothing here imports either.

Exact resume: the model, optimizer (with the VRGD state), loss scaler and data position come from
the checkpoint (the engine's files and the job's state: steps, samples consumed per phase,
evaluations); the sampler is rebuilt from the samples consumed; the torch RNG (dropout) is
re-seeded from ``(seed, step, slot)`` before every micro-batch, where the slot is the
micro-batch's place in the step's global batch (micro-step × data-parallel ranks + rank), so no
generator state has to be carried over. A run stopped after step N and resumed therefore repeats
the uninterrupted run's losses (fp32); resumed on another number of data-parallel ranks (same
micro-batch), each slot holds the same samples with the same dropout, and only the summation order
differs. On another tensor- or pipeline-parallel layout the slots hold the same samples, but the
dropout masks are drawn for other shapes (a tensor-parallel rank draws its heads' attention
dropout), so only with dropout off do the losses follow the uninterrupted run's.

Failure handling (each case ends the job with a message naming the key, file, rank or step):

* a second job started on a run directory that a live job owns stops before touching it, naming
  the owner (``rundir``, exit ``EXIT_BUSY``); a dead owner's directory, or an earlier start of
  the same Slurm job, is taken over with a log line;
* a bad config (optimizer block, top-level keys, engine block, ``job.model.overrides``, ``--set``
  path, data path, batch arithmetic) fails
  before any work, once, on the first rank (exit ``EXIT_CONFIG``);
* a checkpoint counts once every rank has written it (``checkpoints``): resuming takes the
  newest complete one and names the broken ones it passed over; a save first checks the free
  space and names the path when the disk is full (exit ``EXIT_NO_SPACE``);
* ``job.stop_after_skipped_steps`` consecutive skipped steps (non-finite gradients, fp16
  overflow) stop the run (exit ``EXIT_DIVERGED``); the rotation keeps the last checkpoint
  taken before the skips began;
* a rank without progress for ``job.timeout_minutes`` (``job.startup_timeout_minutes`` before the
  first step) ends the job, naming the stalled rank (``watchdog``, exit 3); collectives time out
  a little later, so that message comes first;
* ``SIGUSR1`` (Slurm's ``--signal=USR1@120`` before a time limit or pre-emption): every rank
  finishes its step, the job takes a checkpoint and exits ``EXIT_REQUEUE`` so the batch script
  requeues it; the requeued job resumes from that checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist

from vrgd_ds.adaptive_batch import BatchController, SettingsDiffer, lr_factor
from vrgd_ds.data_pipeline.samples import generator_streams
from vrgd_ds.run import leave_together
from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.train.config import (ADAPTIVE_NEEDS_GSNR, ConfigError, JobConfig, adaptive_setting_keys,
                                  check_gsnr_groups, check_optimizer_lr, check_resume_marker, check_resume_position,
                                  data_change_policy, done_phases, finished_phases, gradient_accumulation, load_config,
                                  optimizer_state_policy, phase_samples, phase_settings, position_table,
                                  resumed_consumed)
from vrgd_ds.train.data import check_data_path, eval_batches, loader
from vrgd_ds.train.engines import Engine, engine_class
from vrgd_ds.train.engines.base import LAUNCHER_RANK, LAUNCHER_WORLD, launcher_value
from vrgd_ds.train.resume import (ConversionFailed, configured_options, data_change, engine_switch, named_params,
                                  option_note, positions_change, resumed_optimizer, resumed_options, saved_positions,
                                  streams_change)
from vrgd_ds.train.rundir import RunDirBusy, RunDirLock
from vrgd_ds.train.schedule import PhaseSchedule
from vrgd_ds.train.seeds import micro_batch_seed
from vrgd_ds.train.watchdog import Watchdog, collective_timeout

logger = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"

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


ADAPTIVE_EVENTS = ("adaptive/target_batch", "adaptive/measured_similarity")


def record_due(job: JobConfig, step: int, phase_end: bool, adaptive: dict[str, float] | None = None) -> bool:
    """Whether ``step`` writes a metrics record: a log step (``log_every``), a phase's last step,
    an evaluation's (``eval_every``, whatever ``log_every`` is), or a step whose ``adaptive``
    metrics hold an event (``ADAPTIVE_EVENTS``: the controller's adjustment, counted in the phase's
    steps, and a measured half-batch cosine), which would otherwise fall between log steps."""
    return (step % job.log_every == 0 or phase_end or bool(job.eval_every and step % job.eval_every == 0)
            or any(k in (adaptive or {}) for k in ADAPTIVE_EVENTS))


class _Recorder:
    """A batch sampler that remembers the keys it handed out (``TRACE_ENV``)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler, self.keys = sampler, []

    def __iter__(self):
        for keys in self.sampler:
            self.keys.extend(keys)
            yield keys


class _Timed:
    """An iterator that adds the time spent in ``next`` to ``seconds`` (the step's data time)."""

    def __init__(self, it: Any) -> None:
        self.it, self.seconds = it, 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t0 = time.perf_counter()
        try:
            return next(self.it)
        finally:
            self.seconds += time.perf_counter() - t0


def _agreed(error: Exception) -> Exception:
    """``error``, marked as raised on every rank at the same point: ``main`` ends the ranks
    together (a rank leaving the process group alone can die in gloo's teardown)."""
    error.agreed = True
    return error


def _load_errors() -> tuple[type[BaseException], ...]:
    """What a checkpoint that does not load raises: torch's distributed checkpoint's
    ``CheckpointException`` (Megatron's dist-checkpointing) is a BaseException, not an Exception."""
    try:
        from torch.distributed.checkpoint.api import CheckpointException
    except ImportError:  # a torch without distributed checkpointing
        return (Exception,)
    return (Exception, CheckpointException)


_LOAD_ERRORS = _load_errors()


class Diverged(RuntimeError):
    """Too many consecutive skipped steps."""


class Preempted(Exception):
    """The job took a checkpoint on ``PREEMPT_SIGNAL`` and should be requeued."""


def newest_finished(job: JobConfig, run_dir: Path) -> frozenset[int]:
    """The phases the newest complete checkpoint in ``run_dir`` has finished (``finished_phases``):
    the ones a resume takes no step in, whatever the ranks."""
    ckpt_dir = run_dir / CHECKPOINTS
    tag = ckpt.choose(ckpt_dir).tag if ckpt.tags(ckpt_dir) else None
    return finished_phases(job, ckpt.marker(ckpt_dir, tag).get("info") if tag is not None else None)


class Job:
    """One run of the job on this rank: ``Job(...).setup().train()``."""

    #: the checkpoints the resume passed over (they did not load or convert): rotation does not count them
    passed_over: tuple[str, ...] = ()

    def __init__(self, raw: dict[str, Any], job: JobConfig, run_dir: Path, backend: str | None) -> None:
        self.raw, self.job, self.run_dir = raw, job, run_dir
        self.options = configured_options(raw)  # the optimizer's, as the next checkpoint's marker records them
        timeout = datetime.timedelta(seconds=collective_timeout(max(job.timeout_minutes, job.startup_timeout_minutes) * 60))
        self.finished = newest_finished(job, run_dir)  # phases with no steps left: their batches are not checked
        self.engine: Engine = engine_class(job.engine)(raw, job, backend, timeout, self.finished)
        self.rank, self.world, self.device = self.engine.rank, self.engine.world, self.engine.device
        self.first_on_node = self._first_on_node()
        self.watchdog: Watchdog | None = None
        self.lock = self._take_run_dir()  # before anything in the run directory is touched

    def _first_on_node(self) -> bool:
        """Whether this rank is the lowest of its host's (one all-gather of a hash of the host name)."""
        name = hashlib.blake2b(socket.gethostname().encode(), digest_size=7).digest()
        mine = torch.tensor([int.from_bytes(name, "little")], dtype=torch.int64, device=self.device)
        hosts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(hosts, mine)
        ids = torch.cat(hosts).tolist()  # one read back, not one per rank
        return ids.index(ids[self.rank]) == self.rank

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
        self.engine.close()

    def setup(self) -> "Job":
        """Everything after the run directory is taken: schedule, data, model, optimizer."""
        job, run_dir, engine = self.job, self.run_dir, self.engine
        self.watchdog = Watchdog(run_dir, self.rank, self.world, job.timeout_minutes * 60,
                                 startup_s=job.startup_timeout_minutes * 60)
        if self.lock is not None:
            self.watchdog.on_exit = self.lock.release
        self.watchdog.start()
        self._take_preempt_signal()
        self.schedule = PhaseSchedule(job)
        self.budget = phase_samples(job)
        self.controllers: dict[int, BatchController] = {  # fail before preparing data
            i: BatchController(settings)
            for i, settings in phase_settings(job, engine.data_world, self.schedule.steps, self.finished).items()}
        if self.rank == 0:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.json").write_text(json.dumps(self.raw, indent=2))
            (run_dir / REQUEUE_MARKER).unlink(missing_ok=True)
        engine.setup(run_dir, dist.barrier)
        self.optimizer = engine.optimizer
        if self.controllers and not any(g.get("gsnr") for g in self.optimizer.param_groups):
            raise _agreed(ConfigError(ADAPTIVE_NEEDS_GSNR))  # (checked before any work: check_gsnr_groups)
        self.cosine = None
        if any(p.adaptive_batch is not None and p.adaptive_batch.measure_cosine_every for p in job.phases):
            self.cosine = engine.half_batch_cosine()
        self.step = 0
        self.consumed = [0] * len(job.phases)
        self.evals: list[dict[str, float]] = []
        self.skip_streak_from: int | None = None  # steps completed before the current run of skipped steps
        self.skipped_before = 0  # steps the run skipped before this process (its checkpoint's count)
        self.watchdog.beat(0, "set-up")
        return self

    @contextlib.contextmanager
    def _disk_full_named(self, tag: str, need: int) -> Iterator[None]:
        """A full disk met writing checkpoint ``tag`` (the engine's files, their flush, the marker)
        as ``NoSpace`` (exit 5), naming the directory: torch.save's and dist-checkpointing's errors
        (the latter a ``BaseException``) name neither."""
        try:
            yield
        except BaseException as e:
            if ckpt.is_disk_full(e, self.ckpt_dir):
                raise ckpt.NoSpace(f"no space left on {self.ckpt_dir} while writing {tag} (need about "
                                   f"{need / 2**20:,.0f} MB); the previous checkpoint is intact") from e
            raise

    def _lost(self) -> bool:
        """Whether another job took the run directory over (rank 0 holds the lock; the ranks agree
        on it after each step: ``_after_training_step``)."""
        return self.lock is not None and self.lock.lost is not None

    def _taken_over(self, then: str) -> RunDirBusy:
        """The error every rank raises once the ranks agree another job took the run directory
        over: rank 0's names that job, the others' say what ``then`` became of this one."""
        return RunDirBusy(self.lock.lost if self._lost() else f"another job took the run directory over (rank 0 "
                          f"names it); {then}")

    def _take_preempt_signal(self) -> None:
        """From here the job answers ``PREEMPT_SIGNAL``, and remembers one ``main`` caught earlier
        (during the config checks, the rendezvous or the run-directory lock). The handler goes in
        first: a signal before it lands in the early flag, read after."""
        self.preempt_requested = False
        signal.signal(PREEMPT_SIGNAL, self._on_preempt_signal)
        if _EARLY_PREEMPT[0]:
            self.preempt_requested, _EARLY_PREEMPT[0] = True, False

    def _on_preempt_signal(self, signum, frame) -> None:  # noqa: ARG002 (signal handler signature)
        self.preempt_requested = True

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any (one small all-reduce)."""
        return self._max_over_ranks(1 if flag else 0) > 0

    def _max_over_ranks(self, value: int) -> int:
        t = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _sum_over_ranks(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    # -- checkpoints ---------------------------------------------------------------------------

    def _seen_alike(self, what: str, seen: Any) -> Any:
        """``seen``, what this rank read of the checkpoints, once every rank has read the same;
        else an error on every rank naming what each saw (a shared file system whose view is
        stale on some node: the ranks would otherwise resume from different checkpoints, or some
        start afresh, and meet in different collectives)."""
        if self.world > 1:
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, seen)
            if any(other != seen for other in everyone):
                views = "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(everyone) if v != everyone[0])
                raise _agreed(ConfigError(
                    f"{self.ckpt_dir}: the ranks disagree on {what} (rank 0: {everyone[0]!r}; {views}); the "
                    "file system's view differs between nodes: wait for it to settle (or remount it with "
                    "consistent caching), then start again"))
        return seen

    @property
    def ckpt_dir(self) -> Path:
        return self.run_dir / CHECKPOINTS

    def resume(self) -> bool:
        """Loads the newest complete checkpoint (``checkpoints``); broken newer ones are named
        and passed over. No checkpoint at all: a fresh start. A checkpoint of another layout or
        another optimizer loads as the engine's plan says (``Engine.plan``: converted, carried
        over, started fresh, or refused, per ``checkpoint.optimizer_state``)."""
        if not self._seen_alike("the checkpoints", ckpt.tags(self.ckpt_dir)):
            return False
        failed: list[str] = []
        unconverted: list[ConversionFailed] = []  # checkpoints of another number of ranks that did not convert
        reported: set[str] = set()
        built = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        while True:
            choice = ckpt.choose(self.ckpt_dir, tuple(failed))
            self._seen_alike("the checkpoint to resume from", choice.tag)
            for why in choice.skipped:
                if self.rank == 0 and why not in reported:
                    logger.warning("skipping checkpoint %s", why)
                reported.add(why)
            if choice.tag is None:
                if unconverted:  # the newest one's advice: it may resume on the ranks that saved it
                    raise unconverted[0]
                raise ConfigError(f"{self.ckpt_dir}: no complete checkpoint to resume from ({'; '.join(choice.skipped)}). "
                                  "Move the directory away to start afresh (or restore the files)")
            saved = ckpt.marker(self.ckpt_dir, choice.tag).get("info") or {}
            if saved.get("engine", "deepspeed") != self.job.engine:
                raise ConfigError(engine_switch(self.ckpt_dir / choice.tag, saved.get("engine", "deepspeed"),
                                                self.job.engine))
            policy = data_change_policy(self.raw)
            data_note = data_change(self.ckpt_dir / choice.tag, saved.get("data"), self.engine.fingerprint, policy)
            streams_note = streams_change(self.ckpt_dir / choice.tag, saved, policy)
            positions_change(self.ckpt_dir / choice.tag, saved_positions(saved), self.engine.positions,
                             position_table(self.job, self.raw)[1], max(p.seq_len for p in self.job.phases))
            try:  # before anything loads or converts, as --check-resume (the loaded state is checked again)
                check_resume_marker(self.job, saved, self.engine.data_world)
            except ConfigError as e:
                raise ConfigError(f"{self.ckpt_dir / choice.tag}: {e}") from None
            self.watchdog.beat(self.step, "conversion")
            try:
                resumed = resumed_optimizer(self.optimizer_info(), saved.get("optimizer"), named_params(self.raw))
                plan = self.engine.plan(self.ckpt_dir, choice.tag, resumed, optimizer_state_policy(self.raw))
            except ConversionFailed as e:  # the same on every rank (the engine agrees on it)
                if self.rank == 0:
                    logger.warning("%s; trying the checkpoint before it", e)
                unconverted.append(e)
                failed.append(choice.tag)
                continue
            self.watchdog.beat(self.step, "conversion")
            try:
                state = self.engine.load(self.ckpt_dir, choice.tag, plan)
                ok = state is not None
            except _LOAD_ERRORS as e:  # a file that passed the size check but does not load
                logger.warning("rank %d: checkpoint %s does not load: %s", self.rank, choice.tag, e)
                ok = False
            if not self._any_rank(not ok):
                break
            failed.append(choice.tag)
        self.passed_over = tuple(failed)
        path, saved_options = self.ckpt_dir / choice.tag, saved.get("options")
        self.step, self.evals = state["step"], list(state["evals"])
        self.consumed = resumed_consumed(self.job, state["consumed"], saved.get("phases"))
        done = done_phases(self.job, self.consumed)
        try:  # a newer checkpoint that did not load may have finished more phases than this one
            for i, settings in phase_settings(self.job, self.engine.data_world, self.schedule.steps, done).items():
                self.controllers.setdefault(i, BatchController(settings))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        self.skip_streak_from = state.get("skip_streak_from")
        self.skipped_before = int(state.get("skipped_total", 0))
        for key, saved in (state.get("adaptive") or {}).items():
            index = int(key)
            if index >= len(self.consumed) or self.consumed[index] == 0:
                continue  # the phase has not started (resumed_consumed: one the config drops had not either)
            if index not in self.controllers:
                if self.job.phases[index].adaptive_batch is None:
                    raise ConfigError(f"{path}: phase {index} ran with adaptive_batch, the config has none there; "
                                      "resume with the config it was saved with")
                continue  # finished: no steps left, and no controller on these ranks
            try:
                self.controllers[index].load_state_dict(saved)
            except SettingsDiffer as e:
                raise ConfigError(f"{path}: job.phases[{index}].adaptive_batch: the checkpoint's controller settings "
                                  f"differ in {', '.join(e.changed)} (from {adaptive_setting_keys(index, e.changed)}): "
                                  "resume with the values it was saved with") from None
            except ValueError as e:
                raise ConfigError(f"{path}: job.phases[{index}].adaptive_batch: {e}") from None
        # after the adaptive phases' checks (as --check-resume): an adaptive phase made fixed is that error
        check_resume_position(self.job, self.consumed, self.budget, self.engine.data_world)
        notes = [n for n in (data_note, streams_note) if n] + plan.notes + (
            self._apply_configured_options(built) if plan.optimizer_states else [])
        if plan.optimizer_states:  # the keys the config leaves out keep the checkpoint's values
            self.options = resumed_options(saved_options, self.raw)
        if self.rank == 0:
            for note in notes:
                logger.warning("%s", note)
            logger.info("resumed from %s at step %d", path, self.step)
        self.saved_step = self.step  # the checkpoint it came from: not written again before a step
        self.watchdog.beat(self.step, "resume")
        return True

    def optimizer_info(self) -> dict[str, Any]:
        groups = self.optimizer.param_groups
        name = getattr(self.optimizer, "name", type(self.optimizer).__name__)  # Lamb: VRLamb with gsnr off
        return {"type": name, "gsnr": any(bool(g.get("gsnr")) for g in groups),
                "gsnr_placement": groups[0].get("gsnr_placement")}

    def resume_info(self) -> dict[str, Any]:
        """What a resume from the next checkpoint will find (its marker; ``--check-resume``)."""
        return {"engine": self.job.engine, "optimizer": self.optimizer_info(), **self.engine.layout(),
                "total_steps": self.job.total_steps, "phases": [p.model_dump(mode="json") for p in self.job.phases],
                "data": self.engine.fingerprint, "numpy_streams": generator_streams(), "numpy": np.__version__,
                "consumed": list(self.consumed), "seed": self.job.seed,
                "options": self.options, "max_position_embeddings": self.engine.positions}

    def _apply_configured_options(self, built: list[dict[str, Any]]) -> list[str]:
        """A loaded optimizer state brings its param-group options (torch's rule); the ones the
        config names in ``optimizer.params`` are the config's again. Returns what changed."""
        named = named_params(self.raw)
        changed: dict[str, tuple[Any, Any]] = {}
        for group, mine in zip(self.optimizer.param_groups, built):
            for key in sorted(named & set(mine)):
                if group.get(key) != mine[key]:
                    changed.setdefault(key, (group.get(key), mine[key]))
                    group[key] = mine[key]
        return [option_note(k, a, b) for k, (a, b) in changed.items()]

    def _checkpoint_bytes(self) -> tuple[int, int, str]:
        """About how many bytes the next checkpoint will take, the room to ask for it, and where
        the figure comes from: the last complete checkpoint's size, else the engine's estimate
        summed over the ranks. Rank 0's figures (it checks the space): the sum runs on every rank
        alike, and rank 0 alone walks the checkpoints, which it then clears and rotates while no
        other rank reads them."""
        estimate = int(self._sum_over_ranks([float(self.engine.checkpoint_bytes())])[0])
        done = [t for t in ckpt.tags(self.ckpt_dir) if ckpt.problem(self.ckpt_dir, t) is None] if self.rank == 0 else []
        if done:
            written = getattr(self, "written", None)  # (tag, bytes) of this job's last save: no second walk
            size = written[1] if written and written[0] == done[-1] else ckpt.size_of(self.ckpt_dir, done[-1])
            return size, int(size * 1.05) + (1 << 20), f"the size of {done[-1]}"
        return estimate, int(estimate * 1.1) + (1 << 20), "the engine's estimate"

    def save(self) -> None:
        if getattr(self, "saved_step", None) == self.step:  # e.g. a pre-emption right after a periodic save
            return
        tag = ckpt.tag_of(self.step)
        expected, need, basis = self._checkpoint_bytes()
        short, lost = None, self._lost()
        if self.rank == 0 and not lost:  # a directory taken over since the step: nothing cleared or written
            try:
                self.ckpt_dir.mkdir(parents=True, exist_ok=True)
                ckpt.check_space(self.ckpt_dir, need)
            except ckpt.NoSpace as e:
                short = str(e)
            else:  # a save of this step cut short before (then a resume from an older one) left files
                # there, maybe of another number of ranks, that would join this one; cleared before
                # any rank writes (the all-reduce below)
                ckpt.remove(self.ckpt_dir, tag)
        stop = self._max_over_ranks(2 if lost else 1 if short is not None else 0)
        if stop == 2:
            raise self._taken_over("this job stops without writing to it")
        if stop == 1:
            # every rank raises it here (not so a write that fails on one rank's disk)
            raise _agreed(ckpt.NoSpace(short or f"no space left on {self.ckpt_dir} for the next checkpoint (see rank 0)"))
        state = {"step": self.step, "consumed": self.consumed, "evals": self.evals, "world_size": self.world,
                 "skip_streak_from": self.skip_streak_from, "optimizer": self.optimizer_info(),
                 "skipped_total": self.skipped_before + int(self.optimizer.skipped_steps),
                 "adaptive": {str(i): c.state_dict() for i, c in self.controllers.items()}}
        with self._disk_full_named(tag, need):
            self.engine.save(self.ckpt_dir, tag, state)
            if self.first_on_node:  # before the marker can be durable (``checkpoints.flush``)
                ckpt.flush(self.ckpt_dir / tag)
        dist.barrier()  # every rank's files are written and on disk
        if self._lost():  # taken over while writing: neither marked nor rotated (the new owner's checkpoints stay)
            logger.error("checkpoint %s not marked complete: %s", tag, self.lock.lost)
        elif self.rank == 0:
            with self._disk_full_named(tag, need):
                ckpt.mark_complete(self.ckpt_dir, tag, self.step, self.world, self.resume_info())
            # written again: no longer the checkpoint the resume passed over
            self.passed_over = tuple(t for t in self.passed_over if t != tag)
            self.written = (tag, ckpt.size_of(self.ckpt_dir, tag))
            logger.info("checkpoint %s: %.2f MB written (expected %.2f MB: %s)", tag, self.written[1] / 2**20,
                        expected / 2**20, basis)
            protect = None
            if self.skip_streak_from is not None:
                before = [t for t in ckpt.tags(self.ckpt_dir) if ckpt.step_of(t) <= self.skip_streak_from
                          and t not in self.passed_over and ckpt.problem(self.ckpt_dir, t) is None]
                protect = before[-1] if before else None
            deleted = ckpt.rotate(self.ckpt_dir, self.job.keep_checkpoints, protect, newest=tag,
                                  passed_over=self.passed_over)
            if protect is not None and protect not in deleted and (self.ckpt_dir / protect).exists():
                logger.warning("keeping checkpoint %s beyond keep_checkpoints=%d: it is the last one before the "
                               "skipped steps that began at step %d", protect, self.job.keep_checkpoints,
                               self.skip_streak_from + 1)
        dist.barrier()
        self.saved_step = self.step
        self.watchdog.beat(self.step, "checkpoint")

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, held, seq_len: int) -> dict[str, float]:
        """The held-out loss and accuracy: the first ``job.data.eval_samples`` samples of ``held``
        (the held-out samples of ``seq_len``, recorded as ``eval/seq_len``), split over the
        data-parallel ranks. Before training and at the end: the last phase's; between: the
        current phase's."""
        phase = self.job.phases[self.current_phase()]
        if phase.seq_len != seq_len:  # the final length before training: the micro-batch its phase trains at
            phase = next(p for p in reversed(self.job.phases) if p.seq_len == seq_len)
        batches = eval_batches(held, self.job.data.eval_samples, phase.micro_batch, self.engine.data_rank,
                               self.engine.data_world, self.engine.collate)
        sums = self.engine.evaluate(batches)  # every rank runs it (model-parallel ranks run it together)
        loss, correct, count = self._sum_over_ranks(list(sums))
        self.watchdog.beat(self.step, "evaluation")
        count = max(count, 1.0)
        task = self.engine.task
        return {f"eval/{task}_loss": loss / count, f"eval/{task}_acc": correct / count, "eval/tokens": count,
                "eval/seq_len": float(seq_len)}

    # -- training ------------------------------------------------------------------------------

    def current_phase(self) -> int:
        """The first phase that has samples left (the last one once all are done)."""
        return next((i for i, (c, b) in enumerate(zip(self.consumed, self.budget)) if c < b), len(self.budget) - 1)

    def _set_batch(self, index: int, batch: int) -> int:
        """Sets the engine's micro-batch and global batch (between optimizer steps); returns the
        accumulation steps."""
        p = self.job.phases[index]
        self.engine.set_batch(p.micro_batch, batch, p.seq_len)
        return batch // (p.micro_batch * self.engine.data_world)

    def train(self) -> dict[str, Any]:
        """Resumes (or starts), trains every phase's budget, evaluates and checkpoints at the end;
        the telemetry sinks are closed however it ends."""
        try:
            resumed = self.resume()
        except ConfigError as e:  # from the marker and the config (a load failure is agreed first): every rank
            raise _agreed(e)  # raises it here
        # A fresh start drops what an earlier start of this run directory logged before it was
        # killed without a checkpoint (-1: every step), as a resume drops the steps after its checkpoint
        sinks = self._open_sinks(resumed)
        try:
            result = self._train(sinks)
        except BaseException as e:  # Preempted, Diverged or a failure: the sinks' buffered records are written,
            if sinks:  # and the training's own error decides the exit, not a sink's that fails to close
                try:
                    sinks.close()
                except Exception:  # MultiSink.close logged each failure
                    pass
            if isinstance(e, ConfigError):  # the data's split, the held-out batches, the trace's setting: every
                raise _agreed(e)  # rank judges the same config and data, and raises it here
            raise
        if sinks:
            sinks.close()
        return result

    def _open_sinks(self, resumed: bool):
        """Rank 0's telemetry sinks (None on the other ranks). A sink that fails to open (wandb
        online without credentials, a run directory it cannot write) is agreed over the ranks:
        every rank raises it here, where the others would wait in the first evaluation's
        all-reduce until the launcher or the watchdog killed them."""
        from vrgd_ds.train import telemetry

        sinks, failed = None, [None]
        if self.rank == 0:
            try:
                sinks = telemetry.build_sinks(
                    self.run_dir, jsonl=self.job.telemetry.jsonl, tensorboard=self.job.telemetry.tensorboard,
                    wandb=wandb.model_dump() if (wandb := self.job.telemetry.wandb) else None,
                    resume_step=self.step if resumed else -1)
            except Exception as e:  # noqa: BLE001 (named in the agreed error)
                hint = (" (wandb: log in, or set WANDB_API_KEY, or set job.telemetry.wandb.mode to \"offline\")"
                        if type(e).__module__.startswith("wandb") else "")
                failed[0] = f"job.telemetry: rank 0 could not open its sinks: {type(e).__name__}: {e}{hint}"
        if self.world > 1:
            dist.broadcast_object_list(failed, src=0)
        if failed[0] is not None:
            raise _agreed(ConfigError(failed[0]))
        return sinks

    def _train(self, sinks) -> dict[str, Any]:
        """``train`` from its first evaluation on, with the sinks open."""
        from tqdm import tqdm

        self.splits = {p.seq_len: self.engine.datasets(p.seq_len) for p in self.job.phases}
        helds = {n: held for n, (_, held) in self.splits.items()}
        final_held = helds[self.job.phases[-1].seq_len]
        if not self.evals:
            self.evals.append({"step": 0, **self.evaluate(final_held, self.job.phases[-1].seq_len)})
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
            self.evals.append({"step": self.step, **self.evaluate(final_held, self.job.phases[-1].seq_len)})
            if sinks and not self._lost():
                sinks.write(self.step, {k: v for k, v in self.evals[-1].items() if k != "step"})
        self.save()  # with the final evaluation (the last step takes no periodic checkpoint); none if saved
        if self._any_rank(self._lost()):
            raise self._taken_over("this job's last checkpoint is not marked complete")
        return {"before": self.evals[0], "after": self.evals[-1], "steps": self.step, "task": self.engine.task}

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
            complete = [t for t in ckpt.tags(self.ckpt_dir) if ckpt.problem(self.ckpt_dir, t) is None]
            kept = [t for t in complete if ckpt.step_of(t) <= self.skip_streak_from]
            after = [t for t in complete if ckpt.step_of(t) > self.skip_streak_from]
            where = (f"the last checkpoint before them is {self.ckpt_dir / kept[-1]} (kept by the rotation)" if kept
                     else "no checkpoint was taken before them")
            # a start resumes from the newest complete checkpoint: the ones taken during the skips
            # have to go for the one before them to be the newest
            move = (f"move the checkpoints taken during the skips ({', '.join(after)}) out of {self.ckpt_dir}, "
                    if kept and after else "")
            fix = (f"To start again from it, {move}lower the learning rate or the warmup's peak, and start the job "
                   "again: it resumes from the newest complete checkpoint" if kept else
                   "Lower the learning rate or the warmup's peak and start afresh (move the run directory away)")
            raise Diverged(f"the run diverged: {streak} consecutive optimizer steps ({self.skip_streak_from + 1}-"
                           f"{self.step}) were skipped on non-finite gradients or fp16 overflow "
                           f"(job.stop_after_skipped_steps={self.job.stop_after_skipped_steps}); {where}. {fix}")

    def _run_phase(self, index: int, sinks, bar, held, gsnr_on: bool) -> None:
        """Steps of phase ``index`` until its sample budget is consumed: the batch and LR of each
        step, the step itself, its record, and what follows a step (beat, checkpoint, signals)."""
        p = self.job.phases[index]
        gradient_accumulation(p, self.engine.data_world, index)
        controller = self.controllers.get(index)
        ab = p.adaptive_batch
        sampler, batches, trace = self._phase_data(index)
        engine_batch = None
        while self.consumed[index] < self.budget[index]:
            batch, lr = self._batch_and_lr(index, controller)
            if batch != engine_batch:
                gas = self._set_batch(index, batch)
                engine_batch = batch
            self.engine.set_lr(lr)
            measure = bool(self.cosine is not None and ab is not None and ab.measure_cosine_every
                           and (self.step + 1) % ab.measure_cosine_every == 0)
            took = self._train_step(batches, gas, measure)
            self.step += 1
            self.consumed[index] += batch
            self.watchdog.beat(self.step)  # before an evaluation: the watchdog times that on its own
            if trace:
                self._trace_samples(trace, sampler, index)
            phase_end = self.consumed[index] >= self.budget[index]
            adaptive: dict[str, float] = {}
            if controller is not None:
                ta = time.perf_counter()
                adaptive = self._adapt(controller, batch, took["measured"], phase_end)
                adaptive["adaptive/controller_s"] = time.perf_counter() - ta  # metrics read + controller
            if record_due(self.job, self.step, phase_end, adaptive):
                self._log_step(index, batch, gas, lr, took, adaptive, gsnr_on, held, sinks, bar)
            bar.update(1)
            self._after_training_step(took)

    def _phase_data(self, index: int):
        """The phase's sampler (resumed at the samples consumed), its batch iterator, and the
        sample trace's directory when ``VRGD_TRACE_SAMPLES`` asks for one."""
        from vrgd_ds.data_pipeline.sampler import PretrainingSampler

        p = self.job.phases[index]
        train, _ = self.splits[p.seq_len]
        adaptive = p.adaptive_batch is not None
        largest = p.adaptive_batch.max_batch if adaptive else p.global_batch
        if len(train) < largest and self.rank == 0:
            logger.warning("job.phases[%d]: the training split holds %d samples at seq_len %d, fewer than %s %d: %s "
                           "hold samples twice, and their gradient groups are not independent as the GSNR assumes; "
                           "use more data or a smaller batch", index, len(train), p.seq_len,
                           "adaptive_batch.max_batch" if adaptive else "a step's global_batch", largest,
                           f"steps above {len(train)} samples would" if adaptive else "steps")
        # phases of one sequence length read on where the one before stopped: one stream per sample
        # index, every sample once per epoch, each epoch with its masks
        same = [k for k in range(index) if self.job.phases[k].seq_len == p.seq_len]
        sampler = PretrainingSampler(len(train), micro_batch_size=p.micro_batch, rank=self.engine.data_rank,
                                     world_size=self.engine.data_world, seed=self.job.seed + (same + [index])[0],
                                     consumed_samples=self.consumed[index],
                                     stream_offset=sum(self.consumed[k] for k in same))
        trace = os.environ.get(TRACE_ENV)
        if trace:
            if self.job.data.workers:
                raise ConfigError(f"{TRACE_ENV} needs job.data.workers = 0 (workers prefetch ahead of the steps)")
            sampler = _Recorder(sampler)
        batches = loader(train, sampler, self.job.data.workers, self.device.type == "cuda", self.engine.collate)
        return sampler, batches, trace

    def _batch_and_lr(self, index: int, controller: BatchController | None) -> tuple[int, float]:
        """This step's global batch and LR: the phase's, or the adaptive controller's (the last step
        of the phase takes only what is left of its samples; a step that would leave less than
        ``min_batch`` after it takes that rest too, so that no step has fewer groups than
        ``min_batch`` gives, or, where that would pass ``max_batch``, leaves ``min_batch`` for the
        last step; where no split keeps both steps in bounds, a rest below 2 × ``min_batch`` with
        ``max_batch`` under it, the step takes the whole rest and passes ``max_batch``)."""
        p = self.job.phases[index]
        if controller is None:
            return p.global_batch, self.schedule.lr_in_phase(index, self.consumed[index] // p.global_batch)
        left = self.budget[index] - self.consumed[index]
        batch = min(controller.batch, left)
        if left - batch < p.adaptive_batch.min_batch:  # the rest with it, within max_batch where both fit
            batch = left if left <= p.adaptive_batch.max_batch or left < 2 * p.adaptive_batch.min_batch else (
                left - p.adaptive_batch.min_batch)
        return batch, self.schedule.lr_samples(index, self.consumed[index], batch,
                                               lr_factor(p.adaptive_batch.lr_rule, batch, p.global_batch))

    def _train_step(self, batches, gas: int, measure: bool) -> dict[str, Any]:
        """One optimizer step of ``gas`` micro-steps: the summed loss, tokens, data and step time,
        whether the optimizer skipped it, and the half-batch cosine when ``measure``."""
        engine = self.engine
        seeds = [micro_batch_seed(self.job.seed, self.step, j * engine.data_world + engine.data_rank)
                 for j in range(gas)]
        timed = _Timed(batches)
        t0 = time.perf_counter()
        took = engine.train_step(timed, gas, seeds, cosine=self.cosine if measure else None)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return dict(took, data_time=timed.seconds, step_time=time.perf_counter() - t0)

    def _trace_samples(self, trace: str, sampler, index: int) -> None:
        """One line per step on each reporting rank (one per data-parallel rank: the model-parallel
        ranks beside it read the same samples)."""
        if self.engine.reporter:
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
        report = self.engine.reporter
        loss_sum, tok, data_time, reporters = self._sum_over_ranks(
            [took["loss_sum"] / gas if report else 0.0, float(took["tokens"]) if report else 0.0, took["data_time"],
             1.0 if report else 0.0])
        loss_mean = loss_sum / reporters
        record = {"phase": index, "train/loss": loss_mean, "train/lr": lr, "train/step_time_s": step_time,
                  "train/data_time_s": data_time / self.world, "train/tokens_per_s": tok / step_time,
                  "train/samples": float(sum(self.consumed)), "train/seq_len": p.seq_len,
                  "train/global_batch": float(batch), "train/accumulation": float(gas), **adaptive,
                  **took.get("metrics", {})}
        m = self.optimizer.gsnr_metrics(per_tensor=self.job.telemetry.per_layer_group)
        if "step/skipped_total" in m:  # the run's count, not this process's
            m["step/skipped_total"] += self.skipped_before
        if gsnr_on and m.get("gsnr/n") and "noise_scale/b_simple_groups" in m:  # groups -> samples
            m["noise_scale/b_simple"] = m["noise_scale/b_simple_groups"] * batch / m["gsnr/n"]
        per_tensor = {k: v for k, v in m.items() if k.startswith("tensor/")}
        record.update({k: v for k, v in m.items() if not k.startswith("tensor/")})
        if per_tensor:
            record.update(telemetry.group_summary(per_tensor))
        done = all(c >= b for c, b in zip(self.consumed, self.budget))
        if self.job.eval_every and self.step % self.job.eval_every == 0 and not done:
            ev = self.evaluate(held, self.job.phases[index].seq_len)
            self.evals.append({"step": self.step, **ev})
            record.update(ev)
        if sinks and not self._lost():  # rank 0: the run directory is another job's now
            sinks.write(self.step, record)
        bar.set_postfix(loss=f"{loss_mean:.3f}", tok_s=f"{tok / step_time:,.0f}", step_s=f"{step_time:.2f}",
                        phase=index, refresh=False)

    def _after_training_step(self, took: dict[str, Any]) -> None:
        """The divergence count, a checkpoint when due, and the signals every rank agrees on:
        another job took the directory over, or a pre-emption."""
        if not math.isfinite(took["loss_sum"]) and not took["skipped"] and self.rank == 0:
            logger.warning("non-finite training loss at step %d", self.step)
        self._after_step(took["skipped"])
        # the signals first: a directory another job took over gets no checkpoint of this one
        lost = self._lost()
        signal_code = self._max_over_ranks(2 if lost else 1 if self.preempt_requested else 0)
        if signal_code == 2:  # another job took the directory over: write nothing more into it
            raise self._taken_over("this job stops without writing to it")
        done = all(c >= b for c, b in zip(self.consumed, self.budget))  # train() saves after its evaluation
        if signal_code == 1 and done:  # nothing left to requeue for: train() ends the run, evaluated and saved
            if self.rank == 0:
                logger.warning("%s at the last step: the run finishes (its final evaluation and checkpoint) "
                               "instead of stopping for a requeue", signal.Signals(PREEMPT_SIGNAL).name)
            return
        if self.job.checkpoint_every and self.step % self.job.checkpoint_every == 0 and not done:
            self.save()
        if signal_code == 1:
            self.save()
            if self._any_rank(self._lost()):  # taken over during the save: no requeue marker in its directory
                raise self._taken_over("this job's last checkpoint is not marked complete")
            if self.rank == 0:  # for the batch script: the exit code of srun is the first rank's to end;
                # the Slurm job and start it was written by, which alone may requeue on it
                owner = self.lock.record if self.lock is not None else {}
                (self.run_dir / REQUEUE_MARKER).write_text(json.dumps(
                    {"tag": ckpt.tag_of(self.step), "slurm_job_id": owner.get("slurm_job_id"),
                     "slurm_restart": owner.get("slurm_restart")}))
            raise Preempted(f"checkpoint {ckpt.tag_of(self.step)} taken on {signal.Signals(PREEMPT_SIGNAL).name}")

    def _adapt(self, controller: BatchController, batch: int, measured: float | None,
               phase_end: bool = False) -> dict[str, float]:
        """Feeds the step's noise-scale moments to the controller (the same on every rank: the
        statistics are complete on each); returns the step's ``adaptive/*`` metrics. A change
        decided at the phase's last step is never applied: it is not announced."""
        m = self.optimizer.gsnr_metrics()
        n = m.get("gsnr/n")
        if n and "noise_scale/trace_cov" in m and not m.get("step/skipped"):
            per_group = batch / n  # samples per gradient group
            decision = controller.observe(m["noise_scale/trace_cov"] * per_group, m["noise_scale/grad_sq"], batch)
        else:
            decision = controller.observe(math.nan, math.nan, batch)
        out = {"adaptive/b_simple": decision.b_simple, "adaptive/implied_similarity": decision.implied_similarity,
               "adaptive/next_batch": float(decision.batch)}
        if math.isfinite(decision.target):
            out["adaptive/target_batch"] = decision.target
        if measured is not None:
            out["adaptive/measured_similarity"] = measured
        if decision.changed and self.rank == 0 and not phase_end:
            logger.info("adaptive batch: %d -> %d after step %d (B_simple %.0f, target %.0f)", batch, decision.batch,
                        self.step, decision.b_simple, decision.target)
        return out


def _check_resume(args: argparse.Namespace) -> int:
    from vrgd_ds.train.check_resume import check

    run_dir = Path(args.check_resume)
    raw = None
    try:
        if args.config:
            raw, _ = load_config(args.config, args.set)
        report, ok = check(run_dir, raw, args.world_size)
    except ConfigError as e:
        print(f"vrgd-pretrain: error: {args.config}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    print(report, flush=True)
    return 0 if ok else EXIT_CONFIG


#: ``PREEMPT_SIGNAL`` caught before ``Job.setup`` took it over (its default action ends the process)
_EARLY_PREEMPT = [False]


def _early_preempt(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    _EARLY_PREEMPT[0] = True


def run_process(argv: list[str] | None = None) -> int:
    """``main`` as the process's entry point (``python -m vrgd_ds.train``, ``vrgd-pretrain``). Once
    the job has ended, whatever the end (checkpointed on a warning, finished, refused, failed), a
    later warning (Slurm's, or one per node alias) must not end the process on its way out:
    Python's shutdown puts the default action back for a signal it handles, and a signal sent to
    the process goes to any thread not blocking it (gloo's, a data loader's). So the process
    ignores it from there, a disposition the shutdown leaves as it is, and only there: ``main``
    called in a process that goes on leaves no ignored signal to the children it starts later."""
    try:
        return main(argv)
    finally:
        signal.signal(PREEMPT_SIGNAL, signal.SIG_IGN)


def _plot(run_dir: Path) -> list[Path]:
    """The run's plots from its ``metrics.jsonl``; a failure is a warning (it must not fail a finished run)."""
    try:
        from vrgd_ds.train.plots import plot_run

        return plot_run(run_dir)
    except Exception as e:
        logger.warning("plots were not written: %s", e)
        return []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vrgd-pretrain", description="Pretraining with VRGD optimizers: BERT under "
                                 "DeepSpeed or GPT under Megatron-core, as the config's job.engine says (launch with "
                                 "deepspeed, torchrun, mpirun or srun).")
    ap.add_argument("--config", help="JSON config with a 'job' block (see configs/ and configs/megatron/)")
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
    _EARLY_PREEMPT[0] = False  # a pre-emption warning from here on checkpoints at the first step
    signal.signal(PREEMPT_SIGNAL, _early_preempt)
    # one held since the process started (launch/hold_usr1.py blocks it) is delivered here
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {PREEMPT_SIGNAL})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.check_resume:
        return _check_resume(args)
    if args.world_size is not None:
        ap.error("--world-size applies to --check-resume only (a run's ranks are the launcher's)")
    if not args.config or not args.run_dir:
        ap.error("--config and --run-dir are required (or --check-resume RUN_DIR)")
    first = (launcher_value(LAUNCHER_RANK) or 0) == 0
    from vrgd_ds.data_pipeline.errors import DataError

    # DataError: data that cannot be prepared or read (rank 0 prepares; the launcher ends the others)
    refused: tuple[type[Exception], ...] = (ConfigError, DataError)
    try:  # everything that can be checked without a process group, before any work
        raw, job = load_config(args.config, args.set)
        engine = engine_class(job.engine)
        refused += engine.config_errors()
        finished, world = newest_finished(job, Path(args.run_dir)), launcher_value(LAUNCHER_WORLD)
        if world is None:
            engine.check_config(raw, job, finished)
        else:  # the batch split over the launcher's ranks too
            engine.check_for_ranks(raw, job, world, finished)
        check_optimizer_lr(raw, job)
        check_gsnr_groups(raw, job)
        check_data_path(job)
    except refused as e:
        if first:
            print(f"vrgd-pretrain: error: {args.config}: {e}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    run_dir = Path(args.run_dir)
    run = None
    plots: list[Path] = []
    try:
        run = Job(raw, job, run_dir, args.backend)
        result = run.setup().train()
        if run.rank == 0 and job.telemetry.jsonl:  # while the run directory is still this job's
            # the run has finished, the other ranks' watchdogs stopped: rank 0's would take their
            # silence while it plots for a stall (and SIGKILL those on its host)
            run.watchdog.stop()
            plots = _plot(run_dir)
    except RunDirBusy as e:  # agreed over the ranks (_take_run_dir, _max_over_ranks): all of them are here
        if first:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        leave_together()
        return EXIT_BUSY
    except refused as e:
        if run is None or run.rank == 0:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        if getattr(e, "agreed", False):  # raised on every rank (a refused resume): a rank leaving the process
            leave_together()  # group alone can die in gloo's teardown, its exit 2 then a SIGABRT
        return EXIT_CONFIG
    except Diverged as e:  # the skips are agreed over the ranks: every rank stops at the same step
        if run.rank == 0:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        leave_together()
        return EXIT_DIVERGED
    except ckpt.NoSpace as e:
        if run is None or run.rank == 0:
            print(f"vrgd-pretrain: error: {e}", file=sys.stderr, flush=True)
        if getattr(e, "agreed", False):
            leave_together()
        return EXIT_NO_SPACE
    except Preempted as e:  # agreed over the ranks (_max_over_ranks)
        if run.rank == 0:
            print(f"vrgd-pretrain: {e}; exiting {EXIT_REQUEUE} to be requeued (it resumes from there)", flush=True)
        leave_together()
        return EXIT_REQUEUE
    finally:
        if run is not None:
            run.release()
    if run.rank == 0:
        b, a, task = result["before"], result["after"], result["task"]
        print(f"\nheld-out {task.upper()} loss {b[f'eval/{task}_loss']:.4f} -> {a[f'eval/{task}_loss']:.4f}, accuracy "
              f"{b[f'eval/{task}_acc']:.4f} -> {a[f'eval/{task}_acc']:.4f} after {result['steps']} steps")
        if job.telemetry.jsonl:
            print(f"metrics:    {run_dir / 'metrics.jsonl'}")
        if plots:
            print(f"plots:      {plots[0].parent}")
        print(f"checkpoint: {run_dir / CHECKPOINTS} (latest: "
              f"{(run_dir / CHECKPOINTS / ckpt.LATEST).read_text().strip()})", flush=True)
    leave_together()
    return 0


