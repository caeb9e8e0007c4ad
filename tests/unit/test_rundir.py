"""The run directory's owner record (``vrgd_ds.train.rundir``): one job at a time, dead owners
taken over, a requeued Slurm job continuing. The jobs themselves are in
``tests/integration/test_reliability.py``."""
from __future__ import annotations

import json
import socket
import os
import subprocess
import sys
import time

import pytest

from vrgd_ds.train.rundir import OWNER, RunDirBusy, RunDirLock


def _record(run_dir, **fields) -> None:
    base = {"host": "node-a", "pid": 4242, "proc_start": "1", "slurm_job_id": None, "slurm_restart": 0,
            "token": "someone-else", "started": time.time() - 60, "heartbeat": time.time(), "command": "x"}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / OWNER).write_text(json.dumps({**base, **fields}))


def test_the_first_job_takes_the_directory_and_a_second_is_refused_naming_it(tmp_path):
    first = RunDirLock(tmp_path / "run")
    assert first.acquire() is None and first.held
    second = RunDirLock(tmp_path / "run")
    with pytest.raises(RunDirBusy) as e:
        second.acquire()
    msg = str(e.value)
    assert f"pid {os.getpid()}" in msg and "not a Slurm job" in msg and "--run-dir" in msg and OWNER in msg
    assert json.loads((tmp_path / "run" / OWNER).read_text())["token"] == first.token  # untouched
    first.release()
    assert not (tmp_path / "run" / OWNER).exists()
    assert second.acquire() is None  # free again
    second.release()


def test_a_dead_owner_on_this_host_is_taken_over_at_once(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    _record(tmp_path, host=RunDirLock(tmp_path).record["host"], pid=gone.pid)
    lock = RunDirLock(tmp_path)
    note = lock.acquire()
    assert note is not None and f"pid {gone.pid} no longer runs" in note and "taking over" in note
    assert json.loads((tmp_path / OWNER).read_text())["token"] == lock.token
    lock.release()


def test_a_reused_pid_is_not_its_old_owner(tmp_path):
    """The pid runs (it is this process), but it started at another time: another process."""
    _record(tmp_path, host=RunDirLock(tmp_path).record["host"], pid=os.getpid(), proc_start="1")
    note = RunDirLock(tmp_path).acquire()
    assert note is not None and "is now another process" in note


@pytest.mark.parametrize("age, taken", [(30.0, False), (500.0, True)])
def test_an_owner_on_another_host_is_dead_only_once_its_heartbeat_is_stale(tmp_path, age, taken):
    _record(tmp_path, heartbeat=time.time() - age)
    lock = RunDirLock(tmp_path, stale_s=120.0)
    if taken:
        assert "heartbeat is 500 s old" in lock.acquire()
    else:
        with pytest.raises(RunDirBusy, match="host node-a, pid 4242"):
            lock.acquire()


@pytest.mark.parametrize("previous, continues", [("777", True), ("778", False)])
def test_a_requeued_slurm_job_continues_and_another_job_is_refused(tmp_path, monkeypatch, previous, continues):
    """The previous start of Slurm job 777 ran on another node whose heartbeat is fresh (it was
    requeued moments ago): only the same job id continues."""
    _record(tmp_path, slurm_job_id=previous)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = RunDirLock(tmp_path)
    if continues:
        assert "earlier start of this Slurm job 777 (now restart 1)" in lock.acquire()
    else:
        with pytest.raises(RunDirBusy, match="scancel 778"):
            lock.acquire()


def test_an_owner_in_another_container_on_this_host_is_alive_while_its_heartbeat_is(tmp_path):
    """Containers with the host's network (``docker run --network host``) share its host name but
    not its pids: a record from another pid namespace is judged by its heartbeat, not by a pid
    that means another process here. Fails on the code before, which found pid 4242 not running
    and took the directory from a live job."""
    _record(tmp_path, host=socket.gethostname(), pid_ns="pid:[4026531836-elsewhere]")
    with pytest.raises(RunDirBusy, match="pid 4242"):
        RunDirLock(tmp_path).acquire()


def test_another_training_in_the_same_slurm_allocation_is_refused(tmp_path, monkeypatch):
    """Two trainings started in one allocation (``salloc``, two ``srun`` steps) share the job id
    and its restart count: the second is no requeue of the first, whose heartbeat is fresh on
    another node, and is refused. Fails on the code before, which took over any record of the
    same job id."""
    _record(tmp_path, slurm_job_id="777", slurm_restart=1)
    monkeypatch.setenv("SLURM_JOB_ID", "777")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    with pytest.raises(RunDirBusy, match="scancel 777"):
        RunDirLock(tmp_path).acquire()


def test_the_heartbeat_refreshes_and_a_taken_over_owner_knows(tmp_path):
    lock = RunDirLock(tmp_path, refresh_s=0.05)
    lock.acquire()
    before = json.loads((tmp_path / OWNER).read_text())["heartbeat"]
    lock.start()
    time.sleep(0.3)
    assert json.loads((tmp_path / OWNER).read_text())["heartbeat"] > before
    assert lock.lost is None
    _record(tmp_path, token="intruder")  # another job decided this one was dead
    deadline = time.time() + 5
    while lock.lost is None and time.time() < deadline:
        time.sleep(0.05)
    assert lock.lost is not None and "taken over by another job" in lock.lost and "node-a" in lock.lost
    lock.release()  # must not delete the other job's record
    assert json.loads((tmp_path / OWNER).read_text())["token"] == "intruder"


def test_a_torn_record_is_treated_as_a_dead_owner_once_stale(tmp_path):
    (tmp_path / OWNER).write_text("{not json")
    note = RunDirLock(tmp_path).acquire()
    assert note is not None and "stale" in note


def test_a_failed_read_of_its_own_record_is_retried_not_taken_for_a_take_over(tmp_path, monkeypatch):
    """Fails on the old code: ``refresh`` turned an unreadable record (an NFS ``ESTALE``) into one
    owned by nobody, set ``lost`` and stopped the heartbeat, so one hiccup ended the job (exit 6)
    and ``release`` left ``owner.json`` behind."""
    import errno
    from pathlib import Path

    lock = RunDirLock(tmp_path)
    lock.acquire()
    real, failures = Path.read_text, []

    def flaky(path, *a, **k):
        if path.name == OWNER and not failures:
            failures.append(path)
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(path, *a, **k)

    monkeypatch.setattr(Path, "read_text", flaky)
    with pytest.raises(OSError, match="Stale file handle"):
        lock.refresh()  # _beat logs it and tries again at the next beat
    assert failures and lock.lost is None and lock.held
    assert lock.refresh() and lock.lost is None
    lock.release()
    assert not (tmp_path / OWNER).exists()


def test_a_link_retried_by_nfs_after_its_reply_was_lost_still_takes_the_run_directory(tmp_path, monkeypatch):
    """NFS retries a ``link()`` whose reply was lost; the retry finds the link made and answers
    EEXIST. The job checks the link count (2: the record is its own) and takes the directory,
    as open(2) advises. Fails on the old code, which took EEXIST for another job's record: the
    job read its own record as a live owner and stopped (exit 6), leaving it behind."""
    link = os.link

    def lost_reply(src, dst, *a, **k):
        link(src, dst, *a, **k)
        raise FileExistsError(17, "File exists")

    monkeypatch.setattr(os, "link", lost_reply)
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / OWNER).read_text())["pid"] == os.getpid()
    monkeypatch.setattr(os, "link", link)
    lock.release()
    assert not (tmp_path / OWNER).exists()


def test_a_file_system_without_hard_links_is_refused_naming_the_cause(tmp_path, monkeypatch):
    """Fails on the old code: a ``link`` refused with EPERM (some FUSE and SMB mounts) counted as a
    lost race five times over, and the job stopped blaming several jobs starting at once."""
    import errno

    def no_links(src, dst, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(RunDirBusy, match="hard link.*Operation not permitted.*--run-dir"):
        RunDirLock(tmp_path).acquire()
    assert list(tmp_path.iterdir()) == []  # nothing left behind
