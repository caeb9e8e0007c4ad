"""A persistent group of ranks for distributed tests: one start of N ranks (``ranks.py``) per pytest session
(gloo on CPU), one test case per pytest item.

``Pool.run(module, function, case)`` has every rank call ``module.function(case)`` (modules of
``tests/distributed/``) and returns rank 0's result; an exception on any rank fails the test with
that rank's traceback. A case that hangs past its timeout or kills a rank fails with the ranks'
output, and the next case starts a fresh group: one bad case costs itself, not its module.
(The shape of DeepSpeed's own ``tests/unit/common.py`` ``DistributedTest`` with
``reuse_dist_env``, driven from outside the ranks here.)
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import launching
import pytest

HERE = Path(__file__).parent
START_TIMEOUT_S = 180.0


class Pool:
    def __init__(self, root: Path, ranks: int = 2, setup: tuple[tuple[str, str], ...] = ()) -> None:
        """``setup``: ``(module, function)`` pairs every fresh group runs first (with ``{}``)."""
        self.root, self.ranks, self.setup = root, ranks, setup
        self.proc: subprocess.Popen | None = None
        self.control: Path | None = None
        self.log: Path | None = None
        self.port: int | None = None  # the current group's MASTER_PORT
        self._ids = itertools.count()
        self._starts = itertools.count()
        self.cases_run = 0

    # ---- the ranks ---------------------------------------------------------------------------

    def _start(self) -> None:
        start = next(self._starts)
        self.control = self.root / f"pool{start}"
        self.control.mkdir(parents=True)
        self.log = self.control / "ranks.log"
        self.port = launching.free_port()
        cmd = [sys.executable, str(HERE / "ranks.py"), "--nproc", str(self.ranks), "--master_port", str(self.port),
               str(HERE / "pool_worker.py"), "--control", str(self.control), "--owner", str(os.getpid())]
        env = dict(os.environ, PYTHONPATH=str(HERE.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   PYTHONUNBUFFERED="1")
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True, cwd=self.control, env=env)
        deadline = time.time() + START_TIMEOUT_S
        while not (self.control / "ready.json").exists():
            if self.proc.poll() is not None or time.time() > deadline:
                tail = self._tail()
                self.close(ask=False)
                pytest.fail(f"the {self.ranks}-rank pool did not start:\n{tail}")
            time.sleep(0.05)

    def _tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text()[-chars:] if self.log else ""
        except OSError:
            return ""

    def _stacks(self) -> str:
        """The end of the ranks' output, then the Python stacks of every process of the group that
        runs ``pool_worker.py`` (the ranks, and what they spawned: ``faulthandler`` on SIGUSR2):
        where a hung case waits."""
        before = self._tail(3000)
        start = self.log.stat().st_size if self.log and self.log.exists() else 0
        signalled = []
        for pid, cmdline in _group(self.proc.pid):
            launcher = pid == self.proc.pid  # ranks.py: SIGUSR2 would end it
            if not launcher and ("pool_worker.py" in cmdline or "multiprocessing" in cmdline):
                try:
                    os.kill(pid, signal.SIGUSR2)
                    signalled.append(f"{pid} {cmdline[:120]}")
                except OSError:
                    pass
        time.sleep(2.0)
        try:
            with open(self.log) as fh:
                fh.seek(start)
                stacks = fh.read()[-20000:]
        except OSError:
            stacks = ""
        listed = "\n".join(signalled) or "none"
        return f"{before}\n---- Python stacks of the group's processes:\n{listed}\n----\n{stacks}"

    def close(self, ask: bool = True) -> None:
        """Stops the ranks: asks them to leave (``ask``), then kills the group."""
        if self.proc is None:
            return
        if ask and self.proc.poll() is None and self.control is not None:
            self._request({"op": "stop"})
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        launching.kill(self.proc, marker=self.control)
        self.proc = None

    def _request(self, payload: dict) -> Path:
        request_id = f"{next(self._ids):06d}"
        path = self.control / f"req-{request_id}.json"
        tmp = self.control / f".req-{request_id}.tmp"
        tmp.write_text(json.dumps({**payload, "id": request_id}))
        os.replace(tmp, path)
        return self.control / f"res-{request_id}.json"

    # ---- cases -------------------------------------------------------------------------------

    def run(self, module: str, function: str, case: dict, timeout: float = 180.0) -> dict:
        """``module.function(case)`` on every rank; rank 0's result."""
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:
                self.close()
            self._start()
            for setup_module, setup_function in self.setup:
                self.run(setup_module, setup_function, {}, timeout)
        result = self._request({"module": module, "function": function, "case": case})
        deadline = time.time() + timeout
        while not result.exists():
            code = self.proc.poll()
            if code is not None or time.time() > deadline:
                tail = self._tail() if code is not None else self._stacks()
                self.close(ask=False)  # a hung or broken group cannot answer; the next case starts afresh
                why = (f"a rank died (launcher exit {code})" if code is not None else
                       f"no result after {timeout:.0f} s (a hang)")
                pytest.fail(f"{module}.{function}({case}): {why}; the ranks' output:\n{tail}")
            time.sleep(0.01)
        self.cases_run += 1
        outcome = json.loads(result.read_text())
        if "error" in outcome:
            pytest.fail(f"{module}.{function}({case}) raised on {outcome['error']}\n{outcome['trace']}")
        return outcome["result"]


def _group(pgid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the live processes in process group ``pgid`` (Linux ``/proc``)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append((int(stat.parent.name), cmdline.strip()))
        except (OSError, IndexError, ValueError):
            pass
    return sorted(found)
