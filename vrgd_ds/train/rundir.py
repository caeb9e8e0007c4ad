"""One job per run directory: an owner record that works on NFS and Lustre.

``flock``/``fcntl`` locks are not reliable on the shared file systems clusters run on (NFS
without lockd, Lustre mounted without ``flock``), and they vanish with the holder's node without
a trace of who held them. The run directory is instead owned through a record,
``<run dir>/owner.json``::

    {"host", "pid", "pid_ns", "proc_start", "slurm_job_id", "slurm_restart", "token", "started",
     "heartbeat", "command"}

* **Taking it.** The record is written to a private temporary file and hard-linked to
  ``owner.json``: ``link`` is atomic on NFS and Lustre (unlike ``O_EXCL`` on old NFS clients),
  and a lost reply is recognised by the temporary file's link count. The first job wins; a
  second one, finding a live owner, stops before touching anything else (``RunDirBusy``, whose
  message names the owner and what to do). A file system without hard links (some FUSE and SMB
  mounts) is refused the same way, naming the cause (``RunDirUnusable``).
* **Heartbeat.** A thread of the owner rewrites the record every ``REFRESH_S`` seconds, after
  checking that the record is still its own (same ``token``); if another job took it over (this
  one was stopped for longer than ``STALE_S``), ``lost`` is set and the job stops. A record it
  cannot read (an NFS ``ESTALE``, a torn read) is a hiccup the next beat retries, not a take-over.
* **Dead owners.** A record is taken over, with a log line saying why, when its owner is gone:
  on this host and in this pid namespace (not another container's), its pid no longer runs (or
  runs a different process: the start time differs); anywhere, its heartbeat is older than
  ``STALE_S`` (a node that died); or it is an earlier start of this same Slurm job
  (``SLURM_JOB_ID`` with a lower ``SLURM_RESTART_COUNT``: a requeued job continues, another
  training in the same allocation does not). Taking over is a
  ``rename`` of the dead record to a name of one's own (only one contender's rename succeeds)
  followed by a fresh ``link``.
* **Leaving.** The owner removes the record when the job ends through Python's clean-up (its
  end, an error, the pre-emption signal's checkpoint and exit). A job killed outright (SIGKILL,
  or a SIGTERM, which the job leaves at its default action rather than unwind in the middle of a
  collective) leaves it behind; the next start takes it over as a dead owner's, above.

Heartbeat ages compare the owner host's clock with this one's: clusters keep them within a
second (NTP), far below ``STALE_S``.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

OWNER = "owner.json"
REFRESH_S = 10.0  # how often the owner rewrites its heartbeat
STALE_S = 120.0  # a record whose heartbeat is older than this belongs to a dead job


class RunDirBusy(RuntimeError):
    """The run directory belongs to a live job; the message names it and what to do."""


class RunDirUnusable(RunDirBusy):
    """The run directory's file system cannot hold the owner record (no hard links): refused like
    a busy directory (exit 6, nothing touched), the message names the cause."""


def process_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (``/proc/<pid>/stat`` field 22): with
    the pid it names one process (a pid is reused, the pair is not). None without ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def pid_namespace() -> str | None:
    """This process's pid namespace (``/proc/self/ns/pid``): containers on one host that share
    its network, and so its host name, each have their own, where a pid means another process."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def describe(record: dict[str, Any], now: float | None = None) -> str:
    """``host …, pid …, Slurm job … , started …, heartbeat … s ago``."""
    now = time.time() if now is None else now
    job = f"Slurm job {record['slurm_job_id']}" if record.get("slurm_job_id") else "not a Slurm job"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.get("started", 0)))
    return (f"host {record.get('host')}, pid {record.get('pid')}, {job}, started {started}, last heartbeat "
            f"{now - record.get('heartbeat', 0):.0f} s ago")


class RunDirLock:
    """The owner record of ``run_dir`` (see the module docstring). ``acquire()`` takes it or
    raises ``RunDirBusy``; ``start()`` begins the heartbeat; ``release()`` gives it back."""

    def __init__(self, run_dir: Path, refresh_s: float = REFRESH_S, stale_s: float = STALE_S) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / OWNER
        self.refresh_s, self.stale_s = refresh_s, stale_s
        self.token = uuid.uuid4().hex
        self.record = {
            "host": socket.gethostname(), "pid": os.getpid(), "pid_ns": pid_namespace(),
            "proc_start": process_start(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID") or None,
            "slurm_restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
            "token": self.token, "started": time.time(), "heartbeat": time.time(),
            "command": " ".join(sys.argv)[:500],
        }
        self.held = False
        self.lost: str | None = None  # why the record is no longer ours (another job took it over)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io = threading.Lock()

    # ---- taking and giving back --------------------------------------------------------------

    def acquire(self) -> str | None:
        """Takes the directory. Returns the log line of a take-over (None if it was free);
        raises ``RunDirBusy`` naming the live owner."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        note = None
        for _ in range(5):  # a record that vanishes or changes meanwhile: look again
            if self._link():
                self.held = True
                return note
            current = self._read()
            if current is None:
                continue
            why = self.dead_because(current)
            if why is None:
                raise RunDirBusy(self.busy_message(current))
            aside = self.path.with_name(f".{OWNER}.dead-{self.token}")
            try:
                os.rename(self.path, aside)
            except FileNotFoundError:  # another contender moved it first
                continue
            moved = self._read(aside)
            if moved != current:
                # the record changed between reading and moving (its owner refreshed it, or a
                # contender took it over): put it back unless a new record exists, and look again
                try:
                    os.link(aside, self.path)
                except FileExistsError:
                    pass
                aside.unlink(missing_ok=True)
                continue
            aside.unlink(missing_ok=True)
            note = f"taking over run directory {self.run_dir} from {describe(current)}: {why}"
        raise RunDirBusy(f"{self.path}: could not take the run directory: its owner record keeps changing "
                         "(several jobs starting at once?). Start one job only")

    def _link(self) -> bool:
        tmp = self.path.with_name(f".{OWNER}.{self.token}.tmp")
        self._write_file(tmp)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:  # another's record, or (NFS) this link's retry after its reply was lost
            return os.stat(tmp).st_nlink == 2
        except OSError as e:
            if os.stat(tmp).st_nlink == 2:  # NFS: the link happened, its reply was lost
                return True
            raise RunDirUnusable(f"{self.path}: could not create the owner record as a hard link ({e}): this "
                                 "job takes its run directory with link(), which NFS, Lustre and local file "
                                 "systems have and some FUSE or SMB mounts do not. Pass a --run-dir on such a "
                                 "file system") from e
        finally:
            tmp.unlink(missing_ok=True)

    def _write_file(self, path: Path) -> None:
        self.record["heartbeat"] = time.time()
        with open(path, "w") as fh:
            fh.write(json.dumps(self.record, indent=1))
            fh.flush()
            os.fsync(fh.fileno())

    def _read(self, path: Path | None = None, owned: bool = False) -> dict[str, Any] | None:
        """The record at ``path`` (default ``owner.json``), None if there is none. One that cannot
        be read or parsed counts as owned by nobody we know, unless ``owned`` (the owner's own
        heartbeat): then it raises ``OSError``, a hiccup the next beat retries, not a take-over."""
        path = path or self.path
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            if owned:
                raise OSError(f"{path}: could not read the owner record ({e})") from e
            return {"token": None, "heartbeat": 0.0, "host": "?", "pid": None}

    def dead_because(self, record: dict[str, Any]) -> str | None:
        """Why the owner of ``record`` is gone, or None if it may be alive."""
        me = self.record
        earlier = int(record.get("slurm_restart", -1) or 0) < me["slurm_restart"]  # a requeue counts up
        if me["slurm_job_id"] and record.get("slurm_job_id") == me["slurm_job_id"] and earlier:
            return (f"it is an earlier start of this Slurm job {me['slurm_job_id']} (now restart "
                    f"{me['slurm_restart']}): the requeued job continues")
        age = time.time() - float(record.get("heartbeat", 0.0))
        same_pids = record.get("pid_ns", me["pid_ns"]) == me["pid_ns"]  # not another container's
        if record.get("host") == me["host"] and same_pids and isinstance(record.get("pid"), int):
            pid = record["pid"]
            if not _pid_runs(pid):
                return f"pid {pid} no longer runs on this host"
            if record.get("proc_start") and process_start(pid) not in (None, record["proc_start"]):
                return f"pid {pid} is now another process"
        if age > self.stale_s:
            return f"its heartbeat is {age:.0f} s old (stale after {self.stale_s:.0f} s: the job or its node is gone)"
        return None

    def busy_message(self, record: dict[str, Any]) -> str:
        stop = (f"scancel {record['slurm_job_id']}" if record.get("slurm_job_id")
                else f"kill {record.get('pid')} on {record.get('host')}")
        return (f"run directory {self.run_dir} is in use by another job ({describe(record)}; {self.path}). Two jobs "
                "in one run directory overwrite each other's checkpoints, so this one stops before touching it. Wait "
                f"for that job to end, or stop it ({stop}) and start again: this job then resumes from its last "
                f"checkpoint; or pass another --run-dir. A job that died without cleaning up is taken over "
                f"automatically once its heartbeat is {self.stale_s:.0f} s old (at once on the same host, in the "
                f"same container); after making sure it is gone, deleting {self.path} frees the directory at once")

    def release(self) -> None:
        """Gives the directory back (only if the record is still ours)."""
        self._stop.set()
        if not self.held:
            return
        with self._io:
            current = self._read()
            if current is not None and current.get("token") == self.token:
                self.path.unlink(missing_ok=True)
            self.held = False

    # ---- heartbeat ---------------------------------------------------------------------------

    def start(self) -> "RunDirLock":
        self._thread = threading.Thread(target=self._beat, name="vrgd-run-dir-owner", daemon=True)
        self._thread.start()
        return self

    def refresh(self) -> bool:
        """Rewrites the heartbeat if the record is still ours; else records ``lost``."""
        with self._io:
            if not self.held:
                return False
            current = self._read(owned=True)
            if current is None:  # a contender's rename and restore in flight: look once more
                time.sleep(0.5)
                current = self._read(owned=True)
            if current is None or current.get("token") != self.token:
                self.lost = (f"run directory {self.run_dir} was taken over by another job"
                             + (f" ({describe(current)})" if current else " (its owner record was deleted)")
                             + f" while this job held it (no heartbeat for over {self.stale_s:.0f} s?)")
                self.held = False
                return False
            tmp = self.path.with_name(f".{OWNER}.{self.token}.beat")
            self._write_file(tmp)
            os.replace(tmp, self.path)
            return True

    def _beat(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                if not self.refresh():
                    if self.lost:
                        logger.error("%s", self.lost)
                    return
            except OSError as e:  # a file-system hiccup: the next beat tries again
                logger.warning("run directory owner heartbeat failed: %s", e)
