"""Starting multi-process launchers from tests without ever hanging the test session.

``subprocess.run(..., capture_output=True, timeout=T)`` is not enough for a launcher: on timeout
it kills the launcher only, and then waits for the pipes to close, which the launcher's ranks
(its children, holding the same pipes) never do if one of them is stuck in a collective. Here
every launch runs in its own session; on timeout the whole process group is killed, along with
any process whose command line names the run's unique marker (ranks started over ssh/pdsh live
outside the group), and the test fails with the output collected so far, the Python stacks of the
launch's processes at the timeout (``faulthandler``, which every launch has on) and the state of
the machine then (load, memory, the busiest processes): where a hung launch waited, or whether the
host itself had stalled.
"""
from __future__ import annotations

import os
import re
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from vrgd_ds.ds import shm

GRACE_S = 30  # after the kill, how long the pipes may take to close
STACKS_S = 3  # after SIGABRT, how long the processes get to print their stacks


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous port of one launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_marked(marker: str | os.PathLike | None, sig: int = signal.SIGKILL) -> None:
    if marker is not None:
        subprocess.run(["pkill", f"-{int(sig)}", "-f", str(marker)], capture_output=True)


def _dump_stacks(pgid: int, marker: str | os.PathLike | None) -> None:
    """SIGABRT to the launch's processes: a Python process started with ``PYTHONFAULTHANDLER=1``
    prints every thread's stack to its stderr, then dies (``run`` kills what is left)."""
    _kill_group(pgid, signal.SIGABRT)
    _kill_marked(marker, signal.SIGABRT)
    time.sleep(STACKS_S)


def machine_state(processes: int = 12) -> str:
    """Load average, memory and swap, and the ``processes`` busiest processes (lifetime CPU share;
    ``STAT`` D is a process waiting on I/O): whether a timed-out launch hung or the host stalled."""
    lines = [f"load average (1, 5, 15 min; runnable/all; last pid): {Path('/proc/loadavg').read_text().strip()}"
             f" on {os.cpu_count()} CPUs"]
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    lines.append(", ".join(f"{k} {meminfo[k].strip()}" for k in ("MemTotal", "MemAvailable", "SwapTotal", "SwapFree")
                           if k in meminfo))
    ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,pcpu,rss,etimes,args", "--sort=-pcpu"],
                        capture_output=True, text=True)
    lines += [row[:200] for row in ps.stdout.splitlines()[:processes + 1]]
    return "\n".join(lines)


def _unlink_shm_segments(since: float) -> None:
    """DeepSpeed's CPU all-reduce segments (``vrgd_ds.ds.shm``) that this launch created and
    left: the job removes its own, test workers built on plain DeepSpeed do not."""
    for segment in shm.SHM_DIR.glob(shm.segment_name()):
        try:
            if segment.stat().st_mtime >= since:
                segment.unlink()
        except FileNotFoundError:
            pass


def _no_core_files() -> None:
    """No core dumps (SIGABRT's default action) from this process or what it starts: the soft
    limit of the test process, which every launch inherits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if soft != 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))


def run(cmd: Sequence[str | os.PathLike], *, timeout: float, marker: str | os.PathLike | None = None,
        unlink_shm: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """Runs ``cmd`` like ``subprocess.run(capture_output=True, text=True)``; fails the test if it
    is still running after ``timeout`` seconds, after killing its process group and every process
    whose command line contains ``marker`` (e.g. the run directory). Stragglers of a finished
    launch (a rank left behind by a launcher that exited) are killed the same way, so no launch
    leaves processes that hold ports or files for the next one. DeepSpeed's shared-memory
    segments created meanwhile are removed unless ``unlink_shm`` is false. A timeout's failure
    gives the machine's state and the stacks the launch's Python processes print on SIGABRT."""
    cmd = [str(c) for c in cmd]
    started = time.time() - 1
    kwargs.setdefault("stdin", subprocess.DEVNULL)  # no rank may wait on the session's terminal
    kwargs["env"] = {**(kwargs.get("env") or os.environ), "PYTHONFAULTHANDLER": "1"}
    _no_core_files()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        state = machine_state()
        _dump_stacks(proc.pid, marker)
        _kill_group(proc.pid)
        _kill_marked(marker)  # ranks outside the group (ssh/pdsh, Slurm) hold the pipes too
        try:
            out, err = proc.communicate(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            out, err = "", f"(output lost: the pipes stayed open {GRACE_S} s after the kill)"
        pytest.fail(f"{' '.join(cmd)}\nstill running after {timeout:.0f} s: killed it and its ranks\n"
                    f"--- the machine at the timeout\n{state}\n"
                    f"--- stdout (tail)\n{(out or '')[-4000:]}\n"
                    f"--- stderr (tail: the processes' stacks at the timeout last)\n{(err or '')[-12000:]}")
    finally:
        _kill_group(proc.pid)
        _kill_marked(marker)
        if unlink_shm:
            _unlink_shm_segments(started)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def spawn(cmd: Sequence[str | os.PathLike], **kwargs) -> subprocess.Popen:
    """Starts ``cmd`` in its own session with its output discarded (for tests that kill it)."""
    return subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, **kwargs)


def kill(proc: subprocess.Popen, marker: str | os.PathLike | None = None) -> None:
    """SIGKILL to ``proc``'s whole process group (launcher and ranks) and reaps it."""
    _kill_group(proc.pid)
    _kill_marked(marker)
    proc.wait()


def wait_until(done, what: str, timeout: float = 120.0) -> None:
    """Poll ``done()`` every 50 ms until it is true; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def resumed_at(output: str) -> int:
    """The step a job's output says it resumed at (``loop.Job.resume``'s line, which names the
    checkpoint tag it loaded: the same step). A job that started afresh instead, on a
    deterministic run, writes the same records and would pass a comparison of them alone."""
    found = re.findall(r"resumed from \S*step(\d+) at step (\d+)", output)
    assert len(found) >= 1, "the job did not say it resumed: " + output[-3000:]
    tag, step = found[-1]
    assert int(tag) == int(step), found
    return int(step)
