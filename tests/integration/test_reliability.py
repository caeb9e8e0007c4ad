"""The pretraining job under failures, on 2 real CPU ranks (gloo), for both engines where the
case applies: DeepSpeed (``deepspeed --num_gpus 2``, BERT) and Megatron-core (``torchrun
--nproc_per_node 2``, GPT), the same job spine and the same exit codes. A diverged run, a broken
newest checkpoint, a stalled rank, a killed rank, the pre-emption signal, one job per run
directory, resuming on another layout or optimizer. Each test says what the code before these
changes did."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import jobs
import launching
import pytest
from jobs import EVAL_LOSS, command, engine_of, heartbeat, records, wait_for, write_config

from vrgd_ds.train import checkpoints as ckpt

pytestmark = pytest.mark.slow

CONFIG = {
    "optimizer": {"type": "VRLamb", "params": {"weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 200000},
    "gradient_clipping": 1.0,
    "job": {
        "model": {"size": "tiny"},
        "data": {"vocab_size": 2000, "eval_samples": 32},
        "total_steps": 8,
        "checkpoint_every": 2,
        "telemetry": {"tensorboard": False},
        "phases": [{"seq_len": 32, "fraction": 1.0, "global_batch": 16, "micro_batch": 4, "lr": 2e-3,
                    "warmup_fraction": 0.25}],
    },
}
#: the same job on the Megatron engine: a 2-layer GPT (hidden 64), windows of 32 tokens
MEGATRON_CONFIG = {
    "optimizer": {"type": "VRLamb", "params": {"weight_decay": 0.01}},
    "megatron": {"model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, "clip_grad": 1.0},
    "job": {**{k: v for k, v in CONFIG["job"].items() if k != "model"}, "engine": "megatron"},
}
TIMEOUT = jobs.TIMEOUT
BOTH = ["deepspeed", "megatron"]
NO_DROPOUT = ("megatron.model.hidden_dropout=0.0", "megatron.model.attention_dropout=0.0")


@pytest.fixture(scope="module", params=BOTH)
def config(request, corpus, tmp_path_factory) -> Path:
    """The engine's config on the session's prepared corpus (a test parametrises ``config`` with
    the engines it applies to)."""
    engine = request.param
    body = {"deepspeed": CONFIG, "megatron": MEGATRON_CONFIG}[engine]
    return write_config(tmp_path_factory.mktemp(f"reliability_{engine}"), body, corpus)


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_diverged_run_stops_and_keeps_the_last_good_checkpoint(config, tmp_path):
    """LR 1e6: every step from the third on is non-finite and skipped. Before: a warning per step,
    the run went on to the end, reported a NaN held-out loss, saved and exited 0, and the rotation
    (keep_checkpoints) deleted the last good checkpoints; DeepSpeed fp32 skips were counted as
    ``step/skipped_overflow`` with ``step/skipped_nonfinite`` 0. Now: exit 4 after
    ``stop_after_skipped_steps`` in a row, the checkpoint before the skips kept, one counter."""
    run = tmp_path / "run"
    proc = launching.run(command(config, run, "job.phases.0.lr=1e6", "job.stop_after_skipped_steps=3",
                                 "job.keep_checkpoints=1", "job.total_steps=20"), timeout=TIMEOUT, marker=run)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 4, out[-4000:]
    rec = records(run)
    skipped = sorted(s for s, r in rec.items() if r.get("step/skipped") == 1.0)
    good = [s for s in sorted(rec) if s > 0 and rec[s].get("step/skipped") == 0.0]
    assert len(skipped) == 3 and skipped == list(range(skipped[0], skipped[0] + 3)), skipped
    assert good and max(good) < skipped[0]
    assert all(rec[s]["step/skipped_nonfinite"] == 1.0 and rec[s]["step/skipped_overflow"] == 0.0 for s in skipped)
    last_good = max(s for s in range(0, skipped[0]) if s % 2 == 0 and s > 0)
    tag = f"step{last_good:08d}"
    assert f"the run diverged: 3 consecutive optimizer steps ({skipped[0]}-{skipped[-1]}) were skipped" in out
    assert f"the last checkpoint before them is {run / 'checkpoints' / tag} (kept by the rotation)" in out
    assert (run / "checkpoints" / tag / "vrgd_complete.json").is_file()
    assert max(rec) == skipped[-1]  # stopped there: no evaluation or checkpoint of the diverged state


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_a_finished_run_started_again_leaves_its_checkpoint_untouched(config, alone, tmp_path):
    """The finished 8-step run started again, checkpointing every 3 steps (so its end is not a
    periodic checkpoint, and the job saves there): it resumes at step 8, has no step to take, and
    exits 0 without writing step 8 again. The old code saved the step it had just resumed from
    (the Megatron engine first clears the directory it writes: a kill then loses the checkpoint
    the run resumed from); it fails on it. Nor is the held-out set evaluated again (``metrics.jsonl``
    unchanged): the final checkpoint holds the final evaluation, which the code before took after
    the periodic checkpoint of the last step (every 2 steps here), and so repeated at each start."""
    run = tmp_path / "run"
    shutil.copytree(alone, run)
    newest = run / "checkpoints" / "step00000008"
    before = {f: f.stat().st_mtime_ns for f in newest.rglob("*") if f.is_file()}
    metrics = (run / "metrics.jsonl").read_bytes()
    again = launching.run(command(config, run, "job.checkpoint_every=3"), timeout=TIMEOUT, marker=run)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert "resumed from" in out and "at step 8" in out, out[-4000:]
    assert {f: f.stat().st_mtime_ns for f in newest.rglob("*") if f.is_file()} == before
    assert sorted(p.name for p in (run / "checkpoints").glob("step*")) == ["step00000006", "step00000008"]
    assert (run / "metrics.jsonl").read_bytes() == metrics


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_broken_newest_checkpoint_falls_back_to_the_previous(config, alone, tmp_path):
    """One rank's optimizer file of the newest checkpoint cut short (as a kill during torch.save
    leaves it). Before: the restart failed with "checkpoint file is corrupted" and no file named,
    with an intact checkpoint beside it. Now: it warns naming the file and resumes from the
    previous complete checkpoint, and finishes. (From a copy of the finished 8-step run, whose
    rotation kept steps 6 and 8.)"""
    run = tmp_path / "run"
    shutil.copytree(alone, run)
    newest = run / "checkpoints" / "step00000008"
    victim = {"deepspeed": lambda: next(newest.glob("*rank_1*optim_states.pt")),  # rank 1's ZeRO shard
              "megatron": lambda: max(newest.glob("*.distcp"), key=lambda f: f.stat().st_size)}[engine_of(config)]()
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    again = launching.run(command(config, run, "job.total_steps=10"), timeout=TIMEOUT, marker=run)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert f"skipping checkpoint {victim}: " in out and "truncated or overwritten" in out
    assert "resumed from" in out and "step00000006" in out
    assert (run / "checkpoints" / "latest").read_text() == "step00000010"


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_stalled_rank_ends_the_job_naming_it(config, tmp_path):
    """SIGSTOP on rank 1. Before: no progress and no exit (watched for 90 s). Now: after
    job.timeout_minutes (here 0.25 min) without progress the job ends, naming rank 1."""
    run = tmp_path / "run"
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:
        proc = subprocess.Popen(command(config, run, "job.timeout_minutes=0.25", "job.total_steps=200",
                                        "job.checkpoint_every=0"),
                                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: (heartbeat(run, 1) or {}).get("step", 0) >= 2, proc)
        pid = heartbeat(run, 1)["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped = time.time()
        proc.wait(timeout=180)
        took = time.time() - stopped
    finally:
        launching.kill(proc, marker=run)
    out = log.read_text()
    assert proc.returncode != 0
    assert "made no progress for" in out and "rank 1 " in out and "unresponsive" in out, out[-4000:]
    assert took < 15 + 15, took  # the timeout, the poll, the launcher ending the ranks
    print(f"stall-to-exit {took:.1f} s (timeout 15 s)")


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_killed_rank_ends_the_whole_job_quickly(config, tmp_path):
    """kill -9 of one rank: the launcher ends the other and exits non-zero within seconds."""
    run = tmp_path / "run"
    proc = launching.spawn(command(config, run, "job.total_steps=200", "job.checkpoint_every=0"))
    try:
        wait_for(lambda: (heartbeat(run, 0) or {}).get("step", 0) >= 2, proc)
        os.kill(heartbeat(run, 0)["pid"], signal.SIGKILL)
        killed = time.time()
        proc.wait(timeout=60)
        took = time.time() - killed
    finally:
        launching.kill(proc, marker=run)
    assert proc.returncode != 0
    assert took < 10, took
    print(f"kill-to-exit {took:.2f} s")


@pytest.fixture(scope="module")
def alone(config, tmp_path_factory) -> Path:
    """The run directory of the config's run, uninterrupted and alone; ``<it>/../trace`` holds
    the samples every step read (``VRGD_TRACE_SAMPLES``)."""
    full = tmp_path_factory.mktemp("alone") / "run"
    (full.parent / "trace").mkdir()
    ref = launching.run(command(config, full), timeout=TIMEOUT, marker=full,
                        env={**os.environ, "VRGD_TRACE_SAMPLES": str(full.parent / "trace")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    return full


def stream(*traces: Path) -> dict[int, list]:
    """step -> the sorted sample keys every rank read in it, over the traces of consecutive
    parts of one run (a step traced by two parts would be counted twice: it fails the test)."""
    out: dict[int, list] = {}
    for trace in traces:
        for path in trace.glob("samples.rank*.jsonl"):
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                out.setdefault(rec["step"], []).extend(tuple(k) for k in rec["keys"])
    return {step: sorted(keys) for step, keys in out.items()}


def preempt(config: Path, run: Path, trace: Path, ranks: int, at_step: int, output: list | None = None,
            sets: tuple[str, ...] = ()) -> None:
    """Runs the config (with ``sets``) on ``ranks`` ranks and stops it with SIGUSR1 once ``at_step``
    is done (a checkpoint there, exit 75); ``output`` receives the job's output."""
    trace.mkdir()
    log = trace.parent / f"{trace.name}.log"
    before = (heartbeat(run, 0) or {}).get("pid")  # a previous part's heartbeat is not this job's
    with open(log, "w") as fh:
        proc = subprocess.Popen(command(config, run, "job.checkpoint_every=0", *sets, ranks=ranks), stdin=subprocess.DEVNULL,
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VRGD_TRACE_SAMPLES": str(trace)})
    try:
        wait_for(lambda: (hb := heartbeat(run, 0) or {}).get("pid") != before and hb.get("step", 0) >= at_step, proc)
        os.kill(heartbeat(run, 0)["pid"], signal.SIGUSR1)
        proc.wait(timeout=TIMEOUT)
    finally:
        launching.kill(proc, marker=run)
    if output is not None:
        output.append(log.read_text())
    assert proc.returncode == 75, log.read_text()[-3000:]


def assert_same_run(run: Path, full: Path) -> None:
    want, got = records(full), records(run)
    for step in range(1, 9):
        assert got[step]["train/loss"] == want[step]["train/loss"], step
    key = next(k for k in EVAL_LOSS.values() if k in want[8])
    assert got[8][key] == want[8][key]


@pytest.mark.exhaustive  # three launches, 68 s (make test: engine checkpoints resumed exactly, test_deepspeed.py)
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_preemption_signal_checkpoints_and_the_requeued_run_continues_exactly(config, alone, tmp_path):
    """SIGUSR1 (Slurm's --signal=USR1@T) to one rank mid-run: every rank finishes its step, the job
    takes a checkpoint and exits 75 (requeue); started again it resumes there and its losses equal
    an uninterrupted run's."""
    run = tmp_path / "run"
    proc = launching.spawn(command(config, run, "job.checkpoint_every=0"))
    try:
        wait_for(lambda: (heartbeat(run, 1) or {}).get("step", 0) >= 3, proc)
        os.kill(heartbeat(run, 1)["pid"], signal.SIGUSR1)
        proc.wait(timeout=TIMEOUT)
    finally:
        launching.kill(proc, marker=run)
    assert proc.returncode == 75
    tags = sorted(p.name for p in (run / "checkpoints").glob("step*"))
    assert len(tags) == 1 and (run / "checkpoints" / tags[0] / "vrgd_complete.json").is_file()
    stopped_at = int(tags[0][4:])
    assert 3 <= stopped_at < 8
    again = launching.run(command(config, run, "job.checkpoint_every=0"), timeout=TIMEOUT, marker=run)
    assert again.returncode == 0, again.stderr[-3000:]
    assert launching.resumed_at(again.stdout + again.stderr) == stopped_at
    assert_same_run(run, alone)


# ---- one job per run directory -------------------------------------------------------------


def rank_pids(run: Path) -> list[int]:
    return [heartbeat(run, r)["pid"] for r in (0, 1)]


@pytest.mark.exhaustive  # make test: the owner record's rules in-process (tests/unit/test_rundir.py)
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_a_second_job_on_the_run_directory_is_refused_and_the_first_is_unharmed(config, alone, tmp_path):
    """Before: the second job's set-up recreated heartbeat/ and the first died in watchdog._write
    (FileNotFoundError), or both trained on, writing the same checkpoints. Now the second exits 6
    within seconds naming the owner, having written nothing, and the first's losses are those of
    the run alone. The first job's ranks are stopped (SIGSTOP) while the second starts, so that
    it is surely still running: a stopped owner whose heartbeat is fresh is alive. Also fails on
    the code before ``_leave_together`` (``vrgd_ds/train/loop.py``), though not on every run: the
    refused job's ranks left the process group one by one, and one could die in gloo's teardown
    (SIGABRT), the launcher then exiting 250, not 6 (seen in a CI run and 1 of 2 runs alone)."""
    run = tmp_path / "run"
    first = launching.spawn(command(config, run))
    try:
        wait_for(lambda: (heartbeat(run, 1) or {}).get("step", 0) >= 2, first)
        pids = rank_pids(run)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(0.5)  # a file being written when the signal came is complete
        before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
        try:
            t0 = time.time()
            # (its own --set marks its processes apart from the first job's for the clean-up)
            second = launching.run(command(config, run, "job.log_every=1"), timeout=TIMEOUT, marker="log_every=1")
            took = time.time() - t0
            after = sorted(str(p.relative_to(run)) for p in run.rglob("*"))  # the first still stopped
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        first.wait(timeout=TIMEOUT)
    finally:
        launching.kill(first, marker=run)
    out = second.stdout + second.stderr
    assert second.returncode == 6, out[-3000:]
    assert f"run directory {run} is in use by another job (host" in out and f"pid {pids[0]}" in out, out[-3000:]
    assert "resumed from" not in out and after == before  # it touched nothing
    assert took < 60, took
    assert first.returncode == 0
    assert_same_run(run, alone)
    assert not (run / "owner.json").exists()  # given back at the end
    print(f"second job refused after {took:.1f} s")


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_a_killed_jobs_run_directory_is_taken_over(config, tmp_path):
    """kill -9 of the whole job (launcher and ranks) leaves its owner record; the next start on
    the same host sees the pid gone, takes the directory over with a log line and resumes."""
    run = tmp_path / "run"
    proc = launching.spawn(command(config, run, "job.total_steps=12"))
    try:
        wait_for(lambda: (run / "checkpoints" / "latest").exists(), proc)
    finally:
        launching.kill(proc, marker=run)
    owner = json.loads((run / "owner.json").read_text())
    again = launching.run(command(config, run, "job.total_steps=12"), timeout=TIMEOUT, marker=run)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert f"taking over run directory {run} from host {owner['host']}, pid {owner['pid']}" in out, out[-3000:]
    assert f"pid {owner['pid']} no longer runs on this host" in out
    assert "resumed from" in out


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_a_requeued_slurm_job_continues_in_its_run_directory(config, tmp_path):
    """The previous start of Slurm job 4711 ran on another node and left its record with a fresh
    heartbeat (the requeue came moments later): the same job id continues (another job id is
    refused: tests/unit/test_rundir.py)."""
    run = tmp_path / "run"
    run.mkdir()
    record = {"host": "node-a", "pid": 12345, "proc_start": "1", "slurm_job_id": "4711", "slurm_restart": 0,
              "token": "previous-start", "started": time.time() - 600, "heartbeat": time.time(), "command": "x"}
    (run / "owner.json").write_text(json.dumps(record))
    same = launching.run(command(config, run), timeout=TIMEOUT, marker=run,
                         env={**os.environ, "SLURM_JOB_ID": "4711", "SLURM_RESTART_COUNT": "1"})
    out = same.stdout + same.stderr
    assert same.returncode == 0, out[-3000:]
    assert "earlier start of this Slurm job 4711 (now restart 1): the requeued job continues" in out



# ---- resuming on other ranks, with another optimizer ---------------------------------------


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_a_checkpoint_resumes_on_another_number_of_ranks_with_the_same_samples(config, alone, tmp_path):
    """Before: saved on 2 ranks and resumed on 1, every checkpoint "failed to load" and the job
    told the user to move the directory away. Now it is converted once to universal form (with
    the GSNR momentum), recorded, and the run goes on. Here 2 ranks stop at step 3, 1 rank goes
    on and stops at step 5 or later, 2 ranks finish: every step reads exactly the samples the
    uninterrupted 2-rank run read, and the losses follow it to fp32 summation order (the dropout
    of each slot of the global batch is the same on any number of ranks)."""
    run = tmp_path / "run"
    preempt(config, run, tmp_path / "trace_a", 2, at_step=3)
    first = (run / "checkpoints" / "latest").read_text()
    outputs = []
    preempt(config, run, tmp_path / "trace_b", 1, at_step=5, output=outputs)
    second = (run / "checkpoints" / "latest").read_text()
    records_of = {first: json.loads((run / "checkpoints" / "universal" / first / "vrgd_converted.json").read_text())}
    (tmp_path / "trace_c").mkdir()
    again = launching.run(command(config, run, "job.checkpoint_every=0"), timeout=TIMEOUT, marker=run,
                          env={**os.environ, "VRGD_TRACE_SAMPLES": str(tmp_path / "trace_c")})
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    for text, before, after in ((outputs[0], 2, 1), (out, 1, 2)):
        assert "Move the directory away" not in text and "failed to load" not in text
        assert f"was saved on {before} ranks; converting it for {after} to the universal checkpoint" in text, \
            text[-3000:]
    records_of[second] = json.loads((run / "checkpoints" / "universal" / second / "vrgd_converted.json").read_text())
    for tag, before in ((first, 2), (second, 1)):  # (the rotation deletes a conversion with its checkpoint)
        assert records_of[tag]["saved_world_size"] == before and records_of[tag]["state_keys"] == ["gsnr_avg"]
    parts = [tmp_path / f"trace_{x}" for x in "abc"]
    assert stream(*parts) == stream(alone.parent / "trace")
    want, got = records(alone), records(run)
    for step in range(1, 9):
        assert got[step]["train/loss"] == pytest.approx(want[step]["train/loss"], rel=1e-6), step  # seen <= 8e-8
    assert got[8]["eval/mlm_loss"] == pytest.approx(want[8]["eval/mlm_loss"], rel=1e-6)
    worst = max(abs(got[s]["train/loss"] / want[s]["train/loss"] - 1) for s in range(1, 9))
    print(f"2 -> 1 -> 2 ranks: largest relative loss difference {worst:.1e}")


#: phase 0's batch of 6 in micro-batches of 2 splits over 1 rank, not 2; phase 1's of 8 over both
SPLIT_ON_ONE = 'job.phases=[{"seq_len": 32, "fraction": 0.5, "global_batch": 6, "micro_batch": 2, "lr": 2e-3, ' \
               '"warmup_fraction": 0.25}, {"seq_len": 32, "fraction": 0.5, "global_batch": 8, "micro_batch": 2, ' \
               '"lr": 1e-3}]'


@pytest.mark.exhaustive  # two launches, about 50 s (make test: --check-resume's report, test_check_resume.py)
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_a_run_resumes_on_ranks_that_do_not_split_a_finished_phases_batch(config, tmp_path):
    """A 1-rank run of two phases, checkpointed at phase 0's end (step 4) and resumed there on 2
    ranks, where phase 0's batch does not split and phase 1's does: the resume goes on in phase 1
    and its losses follow the 1-rank run's to fp32 summation order. Fails on the old code, which
    checked every phase's batch at the set-up (and built DeepSpeed's engine with phase 0's) and
    stopped: "job.phases[0].global_batch: 6 is not divisible by micro_batch x ranks = 2 x 2"."""
    full = tmp_path / "full"
    done = launching.run(command(config, full, "job.checkpoint_every=4", SPLIT_ON_ONE, ranks=1),
                         timeout=TIMEOUT, marker=full)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    run = tmp_path / "run"
    shutil.copytree(full, run)
    ckpt.remove(run / "checkpoints", "step00000008")  # the resume starts from step 4, phase 0 done
    assert ckpt.marker(run / "checkpoints", "step00000004")["info"]["consumed"] == [24, 0]
    again = launching.run(command(config, run, "job.checkpoint_every=0", SPLIT_ON_ONE, ranks=2),
                          timeout=TIMEOUT, marker=run)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "converting it for 2 to the universal checkpoint" in out, out[-3000:]
    want, got = records(full), records(run)
    assert [got[s]["train/accumulation"] for s in (5, 8)] == [2, 2]  # 8 = 2 micro-batches x 2 ranks x 2
    for step in range(1, 9):
        assert got[step]["train/loss"] == pytest.approx(want[step]["train/loss"], rel=1e-6), step
    key = next(k for k in EVAL_LOSS.values() if k in want[8])
    assert got[8][key] == pytest.approx(want[8][key], rel=1e-6)


SLOW_RANK = """
import os, sys, time
import vrgd_ds.train.engines.deepspeed as engine
from vrgd_ds.train import checkpoints as ckpt

planned = engine.plan_resume

def plan_late(ckpt_dir, tag, *args, **kwargs):  # rank 1 reaches the plan once rank 0 has converted
    plan = planned(ckpt_dir, tag, *args, **kwargs)
    deadline = time.time() + 120
    while os.environ.get("RANK") == "1" and ckpt.converted(ckpt_dir, tag) is None and time.time() < deadline:
        time.sleep(0.1)
    return plan

engine.plan_resume = plan_late
from vrgd_ds.train.loop import run_process
sys.exit(run_process())
"""


@pytest.mark.exhaustive  # two launches, about 40 s
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_a_rank_that_comes_late_to_the_conversion_takes_part_in_its_collective(config, tmp_path):
    """Saved on 1 rank, resumed on 2, rank 1 slower than rank 0's conversion: the resume goes on.
    Fails on the old code: each rank read the conversion record for itself, rank 1 found it
    written and skipped the collective rank 0 waited in, and the job hung until the watchdog
    ended it (exit 3)."""
    run, script = tmp_path / "run", tmp_path / "slow_rank.py"
    first = launching.run(command(config, run, "job.total_steps=2", ranks=1), timeout=TIMEOUT, marker=run)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    script.write_text(SLOW_RANK)
    cmd = command(config, run, "job.total_steps=4", "job.timeout_minutes=1", "job.startup_timeout_minutes=1")
    module = cmd.index("--module")
    cmd[module:module + 2] = [str(script)]
    again = launching.run(cmd, timeout=TIMEOUT, marker=run)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "was saved on 1 ranks; converting it for 2 to the universal checkpoint" in out
    assert sorted(records(run))[-1] == 4


@pytest.mark.exhaustive  # one launch, about 25 s
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_a_sink_that_rank_0_cannot_open_ends_every_rank_with_the_config_exit(config, tmp_path):
    """Rank 0 opens the telemetry sinks alone (here ``metrics.jsonl`` is a directory; wandb online
    without credentials is the usual case). Fails on the old code: rank 0 raised a bare traceback
    (exit 1) while the other ranks went on into the first evaluation's all-reduce, where they
    waited (NCCL: until the launcher or the startup watchdog ended them). Now every rank raises it
    before the first evaluation: exit 2, naming ``job.telemetry`` and the error."""
    run = tmp_path / "run"
    (run / "metrics.jsonl").mkdir(parents=True)
    proc = launching.run(command(config, run, "job.total_steps=2"), timeout=TIMEOUT, marker=run)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "error: job.telemetry: rank 0 could not open its sinks: IsADirectoryError" in out, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert not (run / "checkpoints").exists()


@pytest.mark.exhaustive  # one launch beside the shared run, about 25 s
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_a_gradient_clipping_changed_at_a_resume_is_the_configs(config, alone, tmp_path):
    """ZeRO-2 resumed with another ``gradient_clipping``: the run clips at the config's value, says
    so, and saves it. Fails on the old code: DeepSpeed's load put the checkpoint's value back, the
    config's was ignored without a word, and the next checkpoint recorded the old one again."""
    import torch

    run = tmp_path / "run"
    shutil.copytree(alone, run)  # a finished run of 8 steps, clipping at 1.0
    again = launching.run(command(config, run, "job.total_steps=10", "gradient_clipping=0.5"), timeout=TIMEOUT,
                          marker=run)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "gradient_clipping: the checkpoint has 1.0, the config 0.5; continuing with the config's" in out
    saved = torch.load(run / "checkpoints" / "step00000010" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                       weights_only=False)
    assert saved["optimizer_state_dict"]["clip_grad"] == 0.5


@pytest.mark.exhaustive  # one launch beside the shared run, about 25 s (make test: the report, test_check_resume.py)
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_options_changed_at_a_resume_are_recorded_and_reported_beforehand(config, alone, tmp_path):
    """``--check-resume`` lists the option the job then changes, and the next marker records the
    options the run steps with, so a later check knows that a key the config stops naming carries
    on. Before, the report said nothing of options and the marker recorded none. Fails on the
    old code."""
    from vrgd_ds.train.check_resume import check

    run = tmp_path / "run"
    shutil.copytree(alone, run)  # a finished run of 8 steps, weight_decay 0.01
    raw = json.loads(Path(config).read_text())
    raw["optimizer"]["params"]["weight_decay"] = 0.02
    report, ok = check(run, raw, 2)
    line = "optimizer.params.weight_decay: the checkpoint has 0.01, the config 0.02; continuing with the config's"
    assert ok and line in report, report
    again = launching.run(command(config, run, "job.total_steps=10", "optimizer.params.weight_decay=0.02"),
                          timeout=TIMEOUT, marker=run)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert line in out, out[-3000:]
    assert ckpt.marker(run / "checkpoints", "step00000010")["info"]["options"] == {"weight_decay": 0.02}
    del raw["optimizer"]["params"]["weight_decay"]
    report, ok = check(run, raw, 2)
    assert ok and "optimizer.params.weight_decay: 0.02 carries on from the checkpoint" in report, report


@pytest.mark.exhaustive  # make test: a base optimizer's dist checkpoint resumed in the pool (test_megatron.py)
@pytest.mark.parametrize("config", ["megatron"], indirect=True)
def test_a_megatron_checkpoint_resumes_on_another_tensor_parallel_size(config, tmp_path):
    """Megatron dist-checkpointing on another layout: the step-3 checkpoint of a run on TP 1 × DP 2,
    resumed on TP 2 × DP 1 (the later checkpoints removed, as a run killed after step 3 leaves
    it). The resumed steps read exactly the samples of the uninterrupted TP 1 run (a data-parallel
    rank's micro-batches are slots of the global batch on any layout) and the losses follow it to
    fp32 rounding (the split matmuls sum in another order); a wrong optimizer state would show
    from the second resumed step on. Dropout is off: a tensor-parallel split changes the shapes
    its masks are drawn for. Before the Megatron job ran through the job spine it had no
    checkpoint at all and started again from step 0."""
    full = tmp_path / "full"
    (tmp_path / "trace_full").mkdir()
    ref = launching.run(command(config, full, *NO_DROPOUT, "job.checkpoint_every=3", "job.keep_checkpoints=3"),
                        timeout=TIMEOUT, marker=full, env={**os.environ, "VRGD_TRACE_SAMPLES": str(tmp_path / "trace_full")})
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "run"
    shutil.copytree(full, run)
    for tag in ("step00000006", "step00000008"):
        shutil.rmtree(run / "checkpoints" / tag)
    (run / "checkpoints" / "latest").write_text("step00000003")
    (tmp_path / "trace_b").mkdir()
    again = launching.run(command(config, run, *NO_DROPOUT, "job.checkpoint_every=3", "job.keep_checkpoints=3",
                                  "megatron.tensor_model_parallel_size=2"), timeout=TIMEOUT, marker=run,
                          env={**os.environ, "VRGD_TRACE_SAMPLES": str(tmp_path / "trace_b")})
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    assert "was saved on TP 1 × PP 1 × DP 2; resuming on TP 2 × PP 1 × DP 1" in out, out[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step00000003'} at step 3" in out
    want, got = records(full), records(run)
    assert stream(tmp_path / "trace_b") == {s: k for s, k in stream(tmp_path / "trace_full").items() if s > 3}
    for step in range(1, 9):
        assert got[step]["gsnr/n"] == want[step]["gsnr/n"] == 4.0  # 4 micro-batches of 4 on either layout
        if step <= 3:
            assert got[step]["train/loss"] == want[step]["train/loss"], step
        else:
            assert got[step]["train/loss"] == pytest.approx(want[step]["train/loss"], rel=1e-5), step
    assert got[8]["eval/lm_loss"] == pytest.approx(want[8]["eval/lm_loss"], rel=1e-5)
    worst = max(abs(got[s]["train/loss"] / want[s]["train/loss"] - 1) for s in range(4, 9))
    print(f"TP 1 -> TP 2 after step 3: largest relative loss difference {worst:.1e}")


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_a_vr_lamb_run_resumes_as_lamb_and_back(config, alone, tmp_path):
    """Before: resumed with optimizer.type Lamb, both ranks crashed in step() with "Lamb: no
    statistics source is attached", after a warning that the state was "saved by an older
    version". Now the weights and moments carry over, the GSNR momentum is dropped, and one line
    says so; back to VRLamb, the GSNR momentum starts at p̂ = 1. (Megatron: the load back into
    VRLamb raised a CheckpointException on the GSNR momentum the Lamb checkpoint lacks, which
    the job did not catch, until the load left out the keys a checkpoint does not have.)"""
    run = tmp_path / "run"
    shutil.copytree(alone, run)  # a finished VRLamb run: 8 steps
    lamb = launching.run(command(config, run, "job.total_steps=10", 'optimizer.type="Lamb"'), timeout=TIMEOUT,
                         marker=run)
    out = lamb.stdout + lamb.stderr
    assert lamb.returncode == 0, out[-3000:]
    assert "older version" not in out and "no statistics source" not in out
    line = "was saved with VRLamb (gsnr True, placement first_moment), resuming with Lamb (gsnr False"
    assert out.count(line) == 1 and "the GSNR momentum is dropped" in out, out[-3000:]
    back = launching.run(command(config, run, "job.total_steps=12"), timeout=TIMEOUT, marker=run)
    out = back.stdout + back.stderr
    assert back.returncode == 0, out[-3000:]
    assert "resuming with VRLamb (gsnr True" in out and "starts at p̂ = 1" in out
    assert all(math.isfinite(r["train/loss"]) for s, r in records(run).items() if s > 0)


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", BOTH, indirect=True)
def test_a_placement_named_once_stays_until_the_config_names_another(config, alone, tmp_path):
    """A loaded state brings its ``gsnr_placement``; the config's applies where it names one.
    Before, the resume whose config named none logged "resuming with VRLamb (gsnr True, placement
    first_moment)" and then stepped with the saved ``update``. Fails on the old code."""
    run = tmp_path / "run"
    shutil.copytree(alone, run)  # a finished VRLamb run (placement first_moment): 8 steps
    named = launching.run(command(config, run, "job.total_steps=10", 'optimizer.params.gsnr_placement="update"'),
                          timeout=TIMEOUT, marker=run)
    out = named.stdout + named.stderr
    assert named.returncode == 0, out[-3000:]
    assert "placement first_moment), resuming with VRLamb (gsnr True, placement update)" in out, out[-3000:]
    left_out = launching.run(command(config, run, "job.total_steps=12"), timeout=TIMEOUT, marker=run)
    out = left_out.stdout + left_out.stderr
    assert left_out.returncode == 0, out[-3000:]
    assert "resuming with" not in out and "resumed from" in out, out[-3000:]
    for tag in ("step00000010", "step00000012"):
        assert ckpt.marker(run / "checkpoints", tag)["info"]["optimizer"]["gsnr_placement"] == "update", tag


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_a_vr_lamb_run_resumes_as_lamb_on_another_number_of_ranks_and_back(config, alone, tmp_path):
    """The same switch through the universal checkpoint (2 ranks -> 1 -> 2). DeepSpeed's universal
    loader copies the saved groups' options, ``gsnr`` among them, onto the optimizer's: before,
    VRLamb saved on 2 ranks and resumed as Lamb on 1 crashed in step() ("Lamb: no statistics
    source is attached"), and Lamb resumed as VRLamb stepped as plain LAMB (no ``gsnr/*``
    metrics) and saved ``gsnr: False`` into its marker. Now the wiring is the configured one.
    Fails on the old code (the Lamb resume exited 1)."""
    run = tmp_path / "run"
    shutil.copytree(alone, run)  # a finished VRLamb run on 2 ranks: 8 steps
    lamb = launching.run(command(config, run, "job.total_steps=10", 'optimizer.type="Lamb"', ranks=1),
                         timeout=TIMEOUT, marker=run)
    out = lamb.stdout + lamb.stderr
    assert lamb.returncode == 0, out[-3000:]
    assert "converting it for 1 to the universal checkpoint" in out and "no statistics source" not in out
    assert all("gsnr/n" not in records(run)[s] for s in (9, 10))
    back = launching.run(command(config, run, "job.total_steps=12"), timeout=TIMEOUT, marker=run)
    out = back.stdout + back.stderr
    assert back.returncode == 0, out[-3000:]
    assert "converting it for 2 to the universal checkpoint" in out and "starts at p̂ = 1" in out
    assert all(records(run)[s]["gsnr/n"] == 2 * records(run)[s]["train/accumulation"] for s in (11, 12))
    assert ckpt.marker(run / "checkpoints", "step00000012")["info"]["optimizer"]["gsnr"] is True


@pytest.mark.exhaustive
@pytest.mark.parametrize("config", ["deepspeed"], indirect=True)
def test_another_optimizer_family_stops_or_starts_fresh_as_configured(config, alone, tmp_path):
    """VRLamb -> VRSGD cannot carry its state: by default the job stops, naming
    checkpoint.optimizer_state; with "reset_if_incompatible" it continues from the saved weights
    (its first loss is the trained model's, not a fresh one's) with a fresh VRSGD state."""
    run = tmp_path / "run"
    shutil.copytree(alone, run)  # a finished VRLamb run: 8 steps
    sgd = ('optimizer={"type": "VRSGD", "params": {}}', "job.total_steps=12")
    refused = launching.run(command(config, run, *sgd), timeout=TIMEOUT, marker=run)
    assert refused.returncode == 2
    assert "saved with optimizer VRLamb, the config has VRSGD" in refused.stderr
    assert '"checkpoint": {"optimizer_state": "reset_if_incompatible"}' in refused.stderr
    fresh = launching.run(command(config, run, *sgd, 'checkpoint={"optimizer_state": "reset_if_incompatible"}'),
                          timeout=TIMEOUT, marker=run)
    out = fresh.stdout + fresh.stderr
    assert fresh.returncode == 0, out[-3000:]
    assert "with a fresh VRSGD state (checkpoint.optimizer_state = reset_if_incompatible)" in out
    rec = records(run)
    assert rec[9]["train/loss"] < rec[1]["train/loss"] - 0.02, (rec[1]["train/loss"], rec[9]["train/loss"])
