"""Step watchdog: a rank that makes no progress for ``timeout`` seconds ends the job with a
message naming the rank(s) that stopped and the step. Until the first finished step the limit is
``startup`` instead (``job.startup_timeout_minutes``): set-up — engine creation, kernels built
on first use, a resume, a checkpoint conversion — may legitimately take longer than a step.

Every rank keeps a heartbeat file ``<run dir>/heartbeat/rank<r>``: its last progress (a step,
an evaluation, a checkpoint, with the step and the time) and an ``alive`` time that a thread of
the process refreshes every poll interval. When a rank has seen no progress of its own for
``timeout`` seconds, it reads every heartbeat and names the ranks whose ``alive`` time stopped
(the process is stopped, hung holding the interpreter, or gone: SIGSTOP, a hung device, a dead
node) or, if all are alive, the ranks at the lowest step; then it exits with ``EXIT_STALLED``
and the launcher (deepspeed, torchrun, srun, mpirun) ends the other ranks. A stalled rank
cannot report on itself, which is why every rank reports on all of them.

The collective timeout given to process-group creation is the second line: a rank blocked in a
collective whose peer is gone raises after that long. It is ``collective_timeout(timeout)``,
``COLLECTIVE_MARGIN_S`` past the watchdog's own deadline, so that the watchdog, which names
the stalled rank, always speaks first; were both equal, a collective entered just after a step's
heartbeat would time out before the watchdog's next poll and the job would end with gloo's or
NCCL's bare "timed out" instead.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from vrgd_ds.train.rundir import pid_namespace, process_start

logger = logging.getLogger(__name__)

EXIT_STALLED = 3
BACKSTOP_S = 60.0  # after the timeout, how long the thread may take before faulthandler ends the process
COLLECTIVE_MARGIN_S = 30.0  # a collective outlives the watchdog's deadline by this much


def collective_timeout(timeout_s: float) -> float:
    """The collective timeout (seconds) for a watchdog of ``timeout_s``: its deadline, its worst
    poll delay, and ``COLLECTIVE_MARGIN_S`` for the message and the exit."""
    return timeout_s + poll_interval(timeout_s) + COLLECTIVE_MARGIN_S


def poll_interval(timeout_s: float) -> float:
    return min(10.0, max(timeout_s / 20, 0.05))


class Watchdog:
    def __init__(self, run_dir: Path, rank: int, world: int, timeout_s: float, poll_s: float | None = None,
                 startup_s: float | None = None) -> None:
        self.dir = run_dir / "heartbeat"
        self.rank, self.world, self.timeout = rank, world, timeout_s
        self.startup = timeout_s if startup_s is None else max(startup_s, timeout_s)
        self._stepped = False  # a step finished: the step limit applies from now on
        self.poll = poll_s if poll_s is not None else poll_interval(timeout_s)
        self.dir.mkdir(parents=True, exist_ok=True)
        #: with host and pid, which process this is: a pid is reused, the triple is not
        self._identity = {"proc_start": process_start(os.getpid()), "pid_ns": pid_namespace()}
        self._last = time.monotonic()
        self._progress = {"step": 0, "what": "start", "time": time.time()}
        self._lock = threading.Lock()
        self._write_failing: str | None = None  # the last heartbeat write's error, until one succeeds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="vrgd-watchdog", daemon=True)
        #: called just before the process ends the job (e.g. to give the run directory back)
        self.on_exit: Callable[[], None] | None = None

    def start(self) -> "Watchdog":
        self.beat(0, "start")
        self._thread.start()
        return self

    def beat(self, step: int, what: str = "step") -> None:
        """Progress: ``what`` finished at ``step``."""
        with self._lock:
            self._last = time.monotonic()
            self._progress = {"step": step, "what": what, "time": time.time()}
            self._stepped = self._stepped or what == "step"
        # The backstop, should this process hold the interpreter lock while stuck (a C call that
        # never returns): faulthandler's own thread dumps every thread's stack and exits.
        faulthandler.dump_traceback_later(self.limit + BACKSTOP_S, exit=True)
        self._write()

    def _write(self) -> None:
        """This rank's heartbeat. A failed write (a full disk, a stale NFS handle) is logged once
        until one succeeds again: the watch goes on, and so does training."""
        with self._lock:  # the thread and the training loop both write: one temporary file at a time
            record = {"rank": self.rank, **self._progress, "alive": time.time(), "host": socket.gethostname(),
                      "pid": os.getpid(), **self._identity}
            tmp = self.dir / f".rank{self.rank}.tmp"
            try:
                tmp.write_text(json.dumps(record))
                os.replace(tmp, self.dir / f"rank{self.rank}")
            except OSError as e:
                if self._write_failing is None:
                    logger.warning("watchdog: rank %d could not write its heartbeat (%s); other ranks may "
                                   "report it unresponsive until a write succeeds", self.rank, e)
                self._write_failing = str(e)
            else:
                self._write_failing = None

    @property
    def limit(self) -> float:
        """The seconds without progress that end the job now."""
        return self.timeout if self._stepped else self.startup

    def stop(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()

    def report(self) -> str:
        """Which ranks hold the job up: silent ones first, else the ones at the lowest step."""
        return self._examine()[0]

    def _examine(self) -> tuple[str, list[int]]:
        """(the report, the pids of silent ranks on this host)."""
        now = time.time()
        beats = {}
        for r in range(self.world):
            try:
                beats[r] = json.loads((self.dir / f"rank{r}").read_text())
            except (OSError, ValueError):
                beats[r] = None
        missing = [r for r, b in beats.items() if b is None]
        silent = sorted(r for r, b in beats.items() if b is not None and now - b["alive"] > 3 * self.poll + 1.0)
        parts = []
        if missing:
            parts.append(f"rank(s) {', '.join(map(str, missing))} never reported")
        for r in silent:
            b = beats[r]
            parts.append(f"rank {r} ({b['host']}, pid {b['pid']}) unresponsive for {now - b['alive']:.0f} s "
                         f"(stopped, hung or gone), last finished {b['what']} at step {b['step']}")
        local_silent = [beats[r]["pid"] for r in silent if self._same_process_here(beats[r])]
        if not parts:
            seen = {r: b for r, b in beats.items() if b is not None}
            lowest = min(b["step"] for b in seen.values())
            for r in sorted(r for r, b in seen.items() if b["step"] == lowest):
                b = seen[r]
                parts.append(f"rank {r} ({b['host']}, pid {b['pid']}) alive but at step {b['step']} since "
                             f"{now - b['time']:.0f} s (last finished {b['what']})")
        return "; ".join(parts), local_silent

    def _same_process_here(self, beat: dict) -> bool:
        """Whether a heartbeat's process still runs on this host, as the same process: another
        rank's, not this one, not a pid reused since (a heartbeat left by an earlier start of the
        job, or one written before the record said which process it was, is never killed)."""
        pid = beat.get("pid")
        return (beat.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid()
                and beat.get("pid_ns") == self._identity["pid_ns"] and beat.get("proc_start") is not None
                and process_start(pid) == beat["proc_start"])

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self._write()
            idle = time.monotonic() - self._last
            if idle < self.limit:
                continue
            step, what = self._progress["step"], self._progress["what"]
            key = "job.timeout_minutes" if self._stepped else "job.startup_timeout_minutes, before the first step"
            report, local_silent = self._examine()
            msg = (f"vrgd-pretrain: rank {self.rank} made no progress for {idle:.0f} s ({key}) after "
                   f"{what} at step {step}: {report}. Ending the job (exit {EXIT_STALLED}); started again, it "
                   "resumes from the last complete checkpoint")
            logger.error("%s", msg)
            print(msg, file=sys.stderr, flush=True)
            # A stopped process ignores the launcher's SIGTERM (DeepSpeed's launcher then waits 30 s
            # before its SIGKILL): end the silent ranks of this host at once.
            for pid in local_silent:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            if self.on_exit is not None:
                try:
                    self.on_exit()
                except Exception as e:  # ending the job matters more
                    logger.warning("watchdog: clean-up before exit failed: %s", e)
            os._exit(EXIT_STALLED)
