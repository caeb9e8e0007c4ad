"""The job's spine (``vrgd_ds.train.loop.Job``: steps, records, checkpoints, signals, the run
directory's owner) in this process, on a 1-rank gloo world, with an engine that trains nothing:
what the spine does around the steps, without DeepSpeed. (The engines themselves, end to end:
tests/integration/test_pretrain.py and test_reliability.py.)"""
from __future__ import annotations

import json
import logging
import pickle
import re
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from vrgd_ds.train import checkpoints as ckpt
from vrgd_ds.train import loop
from vrgd_ds.train.config import parse_job
from vrgd_ds.train.engines import Engine
from vrgd_ds.train.resume import ResumePlan
from vrgd_ds.train.rundir import OWNER, RunDirBusy


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: tuple[int, int]) -> dict[str, torch.Tensor]:
        return {"x": torch.tensor([float(key[1])])}


def stack(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([s["x"] for s in samples])}


class Optimizer:
    gsnr = False  # statistics gathered (their metrics: none, so an adaptive batch stays where it is)

    def __init__(self) -> None:
        self.param_groups = [{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.0, "gsnr": self.gsnr}]
        self.state: dict = {}
        self.skipped_steps = 0

    def gsnr_metrics(self, per_tensor: bool = False) -> dict:
        return {}


class StandIn(Engine):
    """An engine whose steps train nothing; ``during[step]`` runs inside the step that follows
    ``step`` (the job's ``step`` counts the steps done)."""
    name, task, reporter = "deepspeed", "mlm", True
    job: loop.Job | None = None
    during: dict = {}

    @staticmethod
    def check_config(raw, job, finished=frozenset()) -> None:
        pass

    def __init__(self, raw, job, backend, timeout, finished=frozenset()) -> None:
        self.rank, self.world, self.device = 0, 1, torch.device("cpu")
        self.data_rank, self.data_world, self.fingerprint, self.positions = 0, 1, "stand-in", 512

    def setup(self, run_dir, barrier) -> None:
        self.optimizer = Optimizer()

    def datasets(self, seq_len):
        return Samples(1000), Samples(100)

    collate = staticmethod(stack)

    def train_step(self, batches, gas, seeds, cosine=None):
        for _ in range(gas):
            next(batches)
        if StandIn.job.step in StandIn.during:
            StandIn.during[StandIn.job.step](StandIn.job)
        return {"loss_sum": float(gas), "tokens": gas, "skipped": False, "measured": None}

    def evaluate(self, batches):
        return 2.0, 1.0, 4.0

    def plan(self, ckpt_dir, tag, optimizer, policy):
        return ResumePlan()

    def save(self, ckpt_dir, tag, state) -> None:
        (ckpt_dir / tag).mkdir(parents=True, exist_ok=True)
        (ckpt_dir / tag / "state.pkl").write_bytes(pickle.dumps(state))

    def load(self, ckpt_dir, tag, plan):
        return pickle.loads((ckpt_dir / tag / "state.pkl").read_bytes())

    def checkpoint_bytes(self) -> int:
        return 100

    def layout(self) -> dict:
        return {"zero_stage": 0}


CONFIG = {"job": {"total_steps": 4, "checkpoint_every": 2, "eval_every": 0, "keep_checkpoints": 2,
                  "telemetry": {"tensorboard": False},
                  "phases": [{"seq_len": 32, "fraction": 1.0, "global_batch": 4, "micro_batch": 2, "lr": 1e-3}]}}


@pytest.fixture
def start(tmp_path, monkeypatch):
    """``start(run_dir)``: one start of the job (``setup`` and ``train``) on a 1-rank world;
    returns what ``train`` returned, or the exception it ended with."""
    monkeypatch.setattr(loop, "engine_class", lambda name: StandIn)
    monkeypatch.setattr(StandIn, "during", {})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    handler = signal.getsignal(loop.PREEMPT_SIGNAL)

    def run(run_dir: Path, config: dict = CONFIG):
        job = loop.Job(config, parse_job(config), run_dir, None)
        StandIn.job = job
        try:
            job.setup()
            return job.train()
        except (RunDirBusy, loop.Preempted) as e:
            return e
        finally:
            job.release()

    try:
        yield run
    finally:
        signal.signal(loop.PREEMPT_SIGNAL, handler)
        dist.destroy_process_group()


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_job_whose_run_directory_was_taken_over_writes_nothing_more_into_it(start, tmp_path):
    """Another job takes the run directory over during step 2, a checkpoint step: this job stops
    with ``RunDirBusy`` and writes neither that step's record nor its checkpoint, and leaves the
    new owner's checkpoints and ``latest`` as they are. Fails on the code that took the periodic
    checkpoint (and wrote the step's record) before it looked at the owner: ``step00000002``
    appeared beside the new owner's checkpoint and ``latest`` named it."""
    run_dir = tmp_path / "run"

    def taken_over(job: loop.Job) -> None:
        record = json.loads((run_dir / OWNER).read_text())
        (run_dir / OWNER).write_text(json.dumps({**record, "token": "another job", "pid": 1}))
        ckpt_dir = run_dir / "checkpoints"
        (ckpt_dir / "step00000010").mkdir(parents=True)
        (ckpt_dir / "step00000010" / "state.pkl").write_bytes(b"the new owner's")
        ckpt.mark_complete(ckpt_dir, "step00000010", 10)
        job.lock.refresh()  # what the owner's heartbeat does every few seconds

    StandIn.during[1] = taken_over
    assert isinstance(start(run_dir), RunDirBusy)
    assert ckpt.tags(run_dir / "checkpoints") == ["step00000010"]
    assert (run_dir / "checkpoints" / ckpt.LATEST).read_text() == "step00000010"
    assert [r["step"] for r in records(run_dir)] == [0, 1]  # the evaluation before training, step 1


def test_a_pre_emption_signal_while_starting_checkpoints_after_the_first_step(start, tmp_path, monkeypatch):
    """``SIGUSR1`` while the job still starts (config checks, rendezvous, run-directory lock: after
    ``main`` took the signal, before ``Job.setup``): the job goes on, checkpoints after its first step
    and exits for the requeue, its marker naming the Slurm job and start that wrote it. Fails on the
    code before, where nothing had taken the signal yet: its default action ended the process
    (exit 138, no checkpoint, no marker); here, main left the test's own handler in place."""
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")

    def untouched(signum, frame):
        raise AssertionError("main did not take the pre-emption signal")

    signal.signal(loop.PREEMPT_SIGNAL, untouched)
    assert loop.main(["--config", str(tmp_path / "missing.json"), "--run-dir", str(tmp_path / "x")]) == loop.EXIT_CONFIG
    assert signal.getsignal(loop.PREEMPT_SIGNAL) is not untouched
    signal.raise_signal(loop.PREEMPT_SIGNAL)  # the warning arrives while the job starts
    out = start(tmp_path / "run")
    assert isinstance(out, loop.Preempted), out
    marker = json.loads((tmp_path / "run" / loop.REQUEUE_MARKER).read_text())
    assert marker == {"tag": "step00000001", "slurm_job_id": "777", "slurm_restart": 2}


def test_a_pre_emption_at_the_last_step_finishes_the_run(start, tmp_path):
    """``SIGUSR1`` during the last step: nothing is left to requeue for, so the job evaluates,
    takes its final checkpoint (with that evaluation) and ends as a finished run, with no requeue
    marker; started again, it finds the run finished and logs nothing more. Fails on the code
    that took a pre-emption checkpoint without the final evaluation and asked for a requeue: the
    requeued start evaluated but did not save (its step was saved already), and each later start
    logged the final evaluation once more."""
    run_dir = tmp_path / "run"
    StandIn.during[3] = lambda job: signal.raise_signal(loop.PREEMPT_SIGNAL)
    out = start(run_dir)
    assert isinstance(out, dict) and out["steps"] == 4, out
    assert not (run_dir / loop.REQUEUE_MARKER).exists()
    saved = pickle.loads((run_dir / "checkpoints" / "step00000004" / "state.pkl").read_bytes())
    assert [e["step"] for e in saved["evals"]] == [0, 4]
    StandIn.during.clear()
    again = start(run_dir)
    assert isinstance(again, dict) and again["steps"] == 4
    evals = [r["step"] for r in records(run_dir) if "eval/mlm_loss" in r]
    assert evals == [0, 4]


def test_a_resume_that_would_move_an_adaptive_phases_controller_names_the_keys(start, tmp_path, monkeypatch):
    """A run with an adaptive phase, pre-empted, resumed with another ``total_steps``: the
    controller's start after the warmup (``start_step``) would move, and the job stops naming the
    config keys it comes from. Fails on the code before, whose message named ``start_step``."""
    monkeypatch.setattr(Optimizer, "gsnr", True)
    config = json.loads(json.dumps(CONFIG))
    config["job"]["phases"][0].update(warmup_fraction=0.25, adaptive_batch={"target_ratio": 1.0, "min_batch": 4,
                                                                             "max_batch": 16, "every": 1})
    run_dir = tmp_path / "run"
    StandIn.during[1] = lambda job: signal.raise_signal(loop.PREEMPT_SIGNAL)
    assert isinstance(start(run_dir, config), loop.Preempted)
    StandIn.during.clear()
    config["job"]["total_steps"] = 8
    with pytest.raises(loop.ConfigError, match=r"adaptive_batch: the checkpoint's controller settings differ in "
                                               r"start_step \(from job.total_steps, job.phases\[0\].fraction"):
        start(run_dir, config)


@pytest.mark.parametrize("key, value, said", [
    ("seq_len", 64, r"job.phases\[0\].seq_len: the checkpoint trained 8 samples of this phase at seq_len 32, the "
                    r"config has 64"),
    ("global_batch", 16, r"job.phases\[0\].global_batch: the checkpoint is 8 samples into the phase, no multiple "
                         r"of 16")])
def test_a_resume_the_checkpoints_position_refuses_stops_before_loading(start, tmp_path, monkeypatch, key, value,
                                                                         said):
    """Pre-empted 8 samples into a seq-32 phase of global batch 4, resumed with seq 64 there (its
    position counts samples of the seq-32 index: another stream, its samples repeated or
    skipped), or with global batch 16 (8 samples is no whole step of it): the job stops naming
    the key, before it loads the checkpoint (on another number of ranks a load can be a whole
    conversion), as ``--check-resume`` says. Fails on the old code, which resumed the seq-64 run at
    step 2 in the other stream, saying nothing, and refused the batch only after the load."""
    loads = []
    monkeypatch.setattr(StandIn, "load", lambda self, ckpt_dir, tag, plan: loads.append(tag) or pickle.loads(
        (ckpt_dir / tag / "state.pkl").read_bytes()))
    run_dir = tmp_path / "run"
    StandIn.during[1] = lambda job: signal.raise_signal(loop.PREEMPT_SIGNAL)
    assert isinstance(start(run_dir), loop.Preempted)
    StandIn.during.clear()
    config = json.loads(json.dumps(CONFIG))
    config["job"]["phases"][0][key] = value
    with pytest.raises(loop.ConfigError, match=said):
        start(run_dir, config)
    assert loads == []
    out = start(run_dir)  # the config it was saved with goes on
    assert isinstance(out, dict) and out["steps"] == 4 and loads == ["step00000002"], (out, loads)


def test_a_config_error_of_the_data_in_training_is_every_ranks(start, tmp_path, monkeypatch):
    """Held-out samples too few for the ranks (``eval_batches``' refusal, raised in training on
    every rank from the same data): the error is marked as every rank's, so ``main`` ends the ranks
    together. Fails on the old code, which marked only a refused resume: each rank left the
    process group alone, and one could die in gloo's teardown (SIGABRT, exit 250, not 2)."""
    def refused(self, batches):
        raise loop.ConfigError("job.data.eval_samples: 1 for 2 data-parallel ranks; evaluate at least 2 (one per rank)")

    monkeypatch.setattr(StandIn, "evaluate", refused)
    with pytest.raises(loop.ConfigError, match="eval_samples") as e:
        start(tmp_path / "run")
    assert getattr(e.value, "agreed", False)


def test_a_training_split_smaller_than_a_step_is_said(start, tmp_path, monkeypatch, caplog):
    """3 training samples against a global batch of 4: every step holds a sample twice (their
    groups are not independent), which the job says once, at the phase's start, naming the phase
    and the key; 1000 samples say nothing. Fails on the old code, which said nothing."""
    caplog.set_level(logging.WARNING, logger="vrgd_ds.train.loop")
    assert isinstance(start(tmp_path / "large"), dict)
    assert "fewer than a step's" not in caplog.text
    monkeypatch.setattr(StandIn, "datasets", lambda self, seq_len: (Samples(3), Samples(100)))
    assert isinstance(start(tmp_path / "small"), dict)
    said = [r.getMessage() for r in caplog.records if "fewer than a step's" in r.getMessage()]
    assert said == ["job.phases[0]: the training split holds 3 samples at seq_len 32, fewer than a step's "
                    "global_batch 4: steps hold samples twice, and their gradient groups are not independent as "
                    "the GSNR assumes; use more data or a smaller batch"], said


@pytest.mark.parametrize("resumed_with", ["fixed", "dropped"])
def test_a_phase_not_started_may_change_from_adaptive_to_fixed_or_go_on_resume(start, tmp_path, monkeypatch,
                                                                               resumed_with):
    """A run pre-empted in its first phase, whose second phase is adaptive, resumed with that phase
    fixed, or with a config that ends after the first phase: the phase has not started, so nothing
    of its controller is kept and the run goes on (the checkpoint holds a controller for every
    adaptive phase; ``resumed_consumed`` and ``--check-resume`` allow both). Fails on the old code,
    which refused either ("phase 1 ran with adaptive_batch, the config has none there"; the
    ``dropped`` case until a controller past the config's phases was passed over too). A phase
    that ran is still refused so (``test_check_resume.py``)."""
    monkeypatch.setattr(Optimizer, "gsnr", True)
    config = json.loads(json.dumps(CONFIG))
    config["job"]["total_steps"] = 8
    fixed = dict(config["job"]["phases"][0], fraction=0.5)
    config["job"]["phases"] = [fixed, dict(fixed, adaptive_batch={"target_ratio": 1.0, "min_batch": 4,
                                                                  "max_batch": 16, "every": 1})]
    run_dir = tmp_path / "run"
    StandIn.during[1] = lambda job: signal.raise_signal(loop.PREEMPT_SIGNAL)
    assert isinstance(start(run_dir, config), loop.Preempted)
    StandIn.during.clear()
    config["job"]["phases"][1] = fixed
    # dropped: phase 0 alone, the same 4 steps of 4 samples
    out = start(run_dir, config if resumed_with == "fixed" else CONFIG)
    assert isinstance(out, dict) and out["steps"] == (8 if resumed_with == "fixed" else 4), out


def test_the_skipped_step_count_goes_on_across_a_resume(start, tmp_path, monkeypatch):
    """``step/skipped_total`` is the run's count: a run that skipped steps 1 and 2, pre-empted,
    resumed and skipping step 3 reports 1, 2, 3, 3. Fails on the old code, whose count was the
    process's optimizer's: 1, 2, then 1, 1 after the resume."""
    monkeypatch.setattr(Optimizer, "gsnr_metrics",
                        lambda self, per_tensor=False: {"step/skipped_total": float(self.skipped_steps)})

    def skip(job):
        job.optimizer.skipped_steps += 1

    run_dir = tmp_path / "run"
    StandIn.during.update({0: skip, 1: lambda job: (skip(job), signal.raise_signal(loop.PREEMPT_SIGNAL))})
    assert isinstance(start(run_dir), loop.Preempted)
    StandIn.during.clear()
    StandIn.during[2] = skip
    assert start(run_dir)["steps"] == 4
    assert [r["step/skipped_total"] for r in records(run_dir) if "step/skipped_total" in r] == [1, 2, 3, 3]


def test_a_phase_added_after_the_saved_ones_is_trained_and_a_dropped_phase_that_ran_is_refused(start, tmp_path):
    """A finished one-phase run resumed with a second phase (the usual BERT recipe: seq 128, then
    512): the new phase starts at 0 samples and runs. Fails on the old code, which kept the
    checkpoint's per-phase positions at their saved length, so the new phase was never trained and
    the job exited 0 "after 4 steps". The reverse, a config without a phase the run trained, is
    refused naming ``job.phases``."""
    run_dir = tmp_path / "run"
    assert start(run_dir)["steps"] == 4
    two = json.loads(json.dumps(CONFIG))
    two["job"]["total_steps"] = 8
    two["job"]["phases"] = [dict(CONFIG["job"]["phases"][0], fraction=0.5),
                            dict(CONFIG["job"]["phases"][0], fraction=0.5, seq_len=64)]
    out = start(run_dir, two)
    assert isinstance(out, dict) and out["steps"] == 8, out
    assert [r["phase"] for r in records(run_dir) if "train/loss" in r] == [0] * 4 + [1] * 4
    with pytest.raises(loop.ConfigError, match=r"job.phases: the checkpoint trained 2 phases \(phase 1: 16 "
                                               r"samples\), the config has 1"):
        start(run_dir, CONFIG)


def test_a_newest_checkpoint_that_does_not_convert_falls_back_to_the_one_before(start, tmp_path, monkeypatch):
    """A resume on another number of ranks whose newest checkpoint does not convert to universal
    form (a damaged shard of the right size) resumes from the one before it, as a damaged
    checkpoint on the same ranks does; when none converts, the newest one's error (which says to
    resume on the ranks that saved it) ends the job, not "move the directory away". Fails on the
    old code, which stopped at the newest (exit 2), the one before never tried."""
    from vrgd_ds.train.resume import ConversionFailed

    run_dir = tmp_path / "run"
    assert start(run_dir)["steps"] == 4
    assert ckpt.tags(run_dir / "checkpoints") == ["step00000002", "step00000004"]
    longer = json.loads(json.dumps(CONFIG))
    longer["job"]["total_steps"] = 6
    bad = {"step00000004"}

    def plan(self, ckpt_dir, tag, optimizer, policy):
        if tag in bad:
            raise ConversionFailed(f"{ckpt_dir / tag}: converting it failed; or resume it on 2 ranks")
        return ResumePlan()

    monkeypatch.setattr(StandIn, "plan", plan)
    resumed_at = []
    StandIn.during[2] = lambda job: resumed_at.append(job.step)  # the first step after step 2's checkpoint
    out = start(run_dir, longer)
    assert isinstance(out, dict) and out["steps"] == 6 and resumed_at == [2], (out, resumed_at)
    bad.update(ckpt.tags(run_dir / "checkpoints"))
    with pytest.raises(ConversionFailed, match="step00000006: converting it failed; or resume it on 2 ranks"):
        start(run_dir, longer)


def test_a_checkpoint_that_did_not_load_is_not_counted_by_rotation_once_the_run_is_past_it(start, tmp_path):
    """A run pre-empted at step 7 (checkpoints 3, 6 and 7, every 3), its step-7 checkpoint then
    damaged in place (its size unchanged: it passes the size check and does not load), resumed with
    ``checkpoint_every`` 2 and ``keep_checkpoints`` 2: it goes on from step 6, and once it writes
    step 8 the kept pair is 6 and 8, with 7 left for inspection. Fails on the code before, whose
    rotation counted 7 once the run was past it: it deleted 6, leaving 8 the one checkpoint that
    loads."""
    run_dir = tmp_path / "run"
    first = json.loads(json.dumps(CONFIG))
    first["job"].update(total_steps=10, checkpoint_every=3, keep_checkpoints=3)
    StandIn.during[6] = lambda job: signal.raise_signal(loop.PREEMPT_SIGNAL)
    assert isinstance(start(run_dir, first), loop.Preempted)
    StandIn.during.clear()
    ckpt_dir = run_dir / "checkpoints"
    assert ckpt.tags(ckpt_dir) == [ckpt.tag_of(s) for s in (3, 6, 7)]
    state = ckpt_dir / ckpt.tag_of(7) / "state.pkl"
    state.write_bytes(bytes(len(state.read_bytes())))
    seen = []
    StandIn.during[8] = lambda job: seen.append(ckpt.tags(ckpt_dir))
    second = json.loads(json.dumps(first))
    second["job"].update(checkpoint_every=2, keep_checkpoints=2)
    out = start(run_dir, second)
    assert isinstance(out, dict) and out["steps"] == 10, out
    assert seen == [[ckpt.tag_of(s) for s in (6, 7, 8)]]
    assert ckpt.tags(ckpt_dir) == [ckpt.tag_of(8), ckpt.tag_of(10)]


def _preempted_at_step_1(start, run_dir: Path) -> None:
    """A first start of the job in ``run_dir``, pre-empted during step 2 (its checkpoint at step 1)."""
    StandIn.during[1] = lambda job: signal.raise_signal(loop.PREEMPT_SIGNAL)
    assert isinstance(start(run_dir), loop.Preempted)
    StandIn.during.clear()


def _refused_unless_it_says_continue(start, run_dir: Path, caplog, refused: str, warned) -> dict:
    """The job started again in ``run_dir`` stops (``refused``: its message), and with
    ``checkpoint.data_change`` "continue" finishes, logging a warning ``warned`` accepts; returns
    that config."""
    with pytest.raises(loop.ConfigError, match=refused):
        start(run_dir)
    go_on = json.loads(json.dumps(CONFIG))
    go_on["checkpoint"] = {"data_change": "continue"}
    with caplog.at_level(logging.WARNING):
        out = start(run_dir, go_on)
    assert isinstance(out, dict) and out["steps"] == 4, out
    assert any(warned(r.getMessage()) for r in caplog.records)
    return go_on


def test_a_resume_on_other_data_stops_unless_the_config_says_continue(start, tmp_path, monkeypatch, caplog):
    """A run pre-empted, then started again on data of another fingerprint (another held-out
    split, seed, tokenizer or shards): the job stops naming ``checkpoint.data_change``, and with
    ``"continue"`` goes on from the saved position, saying so. Fails on the old code, which never
    compared the checkpoint's fingerprint and resumed silently: with ``heldout_fraction`` 0.1 -> 0.2,
    96 of the first 256 held-out samples evaluated had been trained on."""
    run_dir = tmp_path / "run"
    _preempted_at_step_1(start, run_dir)
    real_init = StandIn.__init__

    def other_data(self, *args):
        real_init(self, *args)
        self.fingerprint = "other"

    monkeypatch.setattr(StandIn, "__init__", other_data)
    go_on = _refused_unless_it_says_continue(
        start, run_dir, caplog, r"the data differs from the checkpoint's, fingerprint stand-in -> other .*checkpoint.*"
        r"data_change.*continue", lambda said: "going on from the saved position in the new stream" in said)
    bad = dict(go_on, checkpoint={"data_change": "keep"})
    with pytest.raises(loop.ConfigError, match="checkpoint.data_change: 'keep' is not one of 'refuse', 'continue'"):
        parse_job(bad)


def test_a_resume_under_a_numpy_that_draws_other_samples_stops_unless_the_config_says_continue(start, tmp_path,
                                                                                                   monkeypatch, caplog):
    """The job's checkpoint records what this numpy's ``Generator`` draws from fixed seeds (the
    calls the sample order and the masks make) and its release; started again where numpy draws
    otherwise (another release), the job stops naming both releases and ``checkpoint.data_change``,
    and with ``"continue"`` goes on from the saved position, saying so. Fails on the code before,
    which recorded neither: the rest of the epoch in another order, samples repeated and skipped."""
    import numpy as np

    from vrgd_ds.data_pipeline import samples

    run_dir = tmp_path / "run"
    _preempted_at_step_1(start, run_dir)
    info = ckpt.marker(run_dir / "checkpoints", ckpt.tags(run_dir / "checkpoints")[-1])["info"]
    assert info["numpy_streams"] == samples.generator_streams() and info["numpy"] == np.__version__
    monkeypatch.setattr(samples, "generator_streams", lambda: "fedcba9876543210")
    _refused_unless_it_says_continue(
        start, run_dir, caplog, rf"numpy {re.escape(np.__version__)} drew this run's sample order and masks.*pip "
        r"install numpy==.*checkpoint.*data_change.*continue",
        lambda said: "drew this run's sample order" in said and "going on from the saved position" in said)


@pytest.mark.parametrize("where", ["engine", "marker"])
def test_a_full_disk_met_writing_a_checkpoint_ends_the_job_naming_the_directory(start, tmp_path, monkeypatch, where):
    """The engine's save fails as Megatron's dist-checkpointing reports it (a ``CheckpointException``,
    a ``BaseException``, holding a rank's ENOSPC), or the marker's write does (an ENOSPC from its
    fsync, as a network filesystem reports it): the job ends with ``NoSpace`` (exit 5) naming the
    checkpoint directory and the step's tag. Fails on the code before, which caught ``Exception``
    around the engine's save only: the job ended with the bare error (exit 1)."""
    import traceback

    from torch.distributed.checkpoint import CheckpointException

    def full(*args, **kwargs):
        if where == "engine":
            raise CheckpointException("write", {0: (OSError(28, "No space left on device"), traceback.StackSummary())})
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StandIn if where == "engine" else ckpt, "save" if where == "engine" else "mark_complete",
                        full)
    with pytest.raises(ckpt.NoSpace, match=rf"no space left on {re.escape(str(tmp_path / 'run' / 'checkpoints'))} while "
                                           r"writing step00000002"):
        start(tmp_path / "run")


def test_dropout_seeds_of_a_step_with_more_slots_than_the_stride_are_not_the_next_steps():
    """A global batch of 8,192 micro-batch slots (65,536 / micro-batch 8): no slot of a step shares
    its dropout seed with a slot of the next step or of its own, and the slots below 4,099 keep
    their seeds (the records' runs, at most 4,096 slots, are unchanged). Fails on the old code,
    whose seed ``(seed * 1_000_003 + step) * 4099 + slot`` gave slot 4,099 of step 5 the seed of slot
    0 of step 6: 4,093 of step 5's slots repeated step 6's dropout masks."""
    slots = range(8192)
    five = [loop.micro_batch_seed(1234, 5, j) for j in slots]
    six = [loop.micro_batch_seed(1234, 6, j) for j in slots]
    assert len(set(five) | set(six)) == 2 * len(slots)
    assert five[:4099] == [(1234 * 1_000_003 + 5) * 4099 + j for j in range(4099)]
    assert max(five + six) * 4096 < 2 ** 64
