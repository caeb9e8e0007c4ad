"""The job's checkpoint directory: which checkpoints are complete, which one to resume from,
which ones to delete, and whether the next one fits on the disk.

DeepSpeed 0.19.8 writes ``latest`` from rank 0 right after rank 0's own files, without waiting
for the other ranks' (``DeepSpeedEngine.save_checkpoint``), and ``torch.save`` writes in place:
a job killed while saving can leave ``latest`` naming a checkpoint whose other files are cut
short. So the job saves with ``save_latest=False`` and, once every rank has returned from the
save (DeepSpeed's closing barrier), rank 0 records the checkpoint as complete:

    <dir>/<tag>/vrgd_complete.json    {"tag", "step", "world_size", "info", "files": {relative path: bytes}}
    <dir>/latest                      the tag, written atomically (temporary file + rename)

(``info``: what a resume would load, for ``vrgd-pretrain --check-resume`` without reading the
tensors.) A checkpoint resumed on another number of ranks is converted once to DeepSpeed's
universal form, next to it::

    <dir>/universal/<tag>/...                  the converted checkpoint (``vrgd_ds.ds.universal``)
    <dir>/universal/<tag>/vrgd_converted.json  {"from", "saved_world_size", "state_keys"}, written last

Every node fsyncs the checkpoint's files before the marker is written (``flush``); the marker
and ``latest`` are fsynced with their directory.

A checkpoint counts only with its marker, and only if every file the marker lists is there with
its size. Resuming takes the newest such checkpoint; newer ones that are incomplete or broken
are reported by name and skipped (and left on disk for inspection).

Everything here is filesystem work on the directory every rank sees; no collectives.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from vrgd_ds.data_pipeline.tokenizer import fsync_dir

MARKER = "vrgd_complete.json"
LATEST = "latest"
UNIVERSAL = "universal"
CONVERTED = "vrgd_converted.json"
_ZERO_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_TAG = re.compile(r"^step(\d{8})$")


def tag_of(step: int) -> str:
    return f"step{step:08d}"


def step_of(tag: str) -> int | None:
    m = _TAG.match(tag)
    return int(m.group(1)) if m else None


def _fsync(path: Path) -> None:
    """A file's bytes to the disk (an error is one: the checkpoint is not durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)  # the rename itself


def flush(root: Path) -> None:
    """fsyncs every file under ``root``, then its directories, deepest first. ``torch.save`` and
    dist-checkpointing close their files without it, so after a power loss a marker made durable
    later could list files the disk never got. Each node's first rank calls it (``Job.save``): the
    node's page cache holds what all its ranks wrote."""
    dirs = [root]
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            _fsync(p)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(d)  # a no-op where the filesystem refuses a directory's fsync


def mark_complete(ckpt_dir: Path, tag: str, step: int, world_size: int | None = None,
                  info: dict | None = None) -> None:
    """Rank 0, after every rank's files are written: the marker, then ``latest``."""
    root = ckpt_dir / tag
    files = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*"))
             if p.is_file() and p.name != MARKER}
    if not files:
        raise RuntimeError(f"{root}: the checkpoint wrote no files")
    record = {"tag": tag, "step": step, "world_size": world_size, "info": info or {}, "files": files}
    _atomic_write(root / MARKER, json.dumps(record, indent=1))
    _atomic_write(ckpt_dir / LATEST, tag)


def marker(ckpt_dir: Path, tag: str) -> dict:
    """The marker of a complete checkpoint (``{}`` if unreadable)."""
    try:
        return json.loads((ckpt_dir / tag / MARKER).read_text())
    except (OSError, ValueError):
        return {}


def saved_world_size(ckpt_dir: Path, tag: str) -> int | None:
    """How many data-parallel ranks wrote a ZeRO checkpoint (None: no ZeRO shards, as on stage
    0, whose files load on any number of ranks). Read from the marker, else from the shards."""
    shards = [m for p in (ckpt_dir / tag).iterdir() if (m := _ZERO_SHARD.match(p.name))] if (ckpt_dir / tag).is_dir() else []
    if not shards:
        return None
    recorded = marker(ckpt_dir, tag).get("world_size")
    return int(recorded) if recorded else len({m.group(1) for m in shards})


def converted(ckpt_dir: Path, tag: str) -> dict | None:
    """The record of ``tag``'s finished universal conversion, or None."""
    try:
        return json.loads((ckpt_dir / UNIVERSAL / tag / CONVERTED).read_text())
    except (OSError, ValueError):
        return None


def record_conversion(ckpt_dir: Path, tag: str, saved_world: int, state_keys: list[str]) -> None:
    """Rank 0, once the conversion (its own files) is written: those files, then the record."""
    flush(ckpt_dir / UNIVERSAL / tag)
    _atomic_write(ckpt_dir / UNIVERSAL / tag / CONVERTED,
                  json.dumps({"from": tag, "saved_world_size": saved_world, "state_keys": state_keys}, indent=1))


def problem(ckpt_dir: Path, tag: str) -> str | None:
    """Why ``tag`` cannot be resumed from, or ``None`` if it is complete."""
    root = ckpt_dir / tag
    marker = root / MARKER
    if not marker.is_file():
        return f"{root}: incomplete (no {MARKER}: the save did not finish on every rank)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{marker}: unreadable ({e})"
    for rel, size in files.items():
        path = root / rel
        try:
            got = path.stat().st_size if path.is_file() else None
        except OSError:  # removed since is_file() (a rotation by the run that owns the directory)
            got = None
        if got is None:
            return f"{path}: missing"
        if got != size:
            return f"{path}: {got} bytes, {size} when it was written (truncated or overwritten)"
    return None


@dataclass
class Choice:
    tag: str | None  # the checkpoint to resume from (None: none is complete)
    skipped: list[str]  # what was passed over, newest first, with the reason


def tags(ckpt_dir: Path) -> list[str]:
    """The job's checkpoint tags, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p.name) is not None]
    return sorted(found, key=step_of)


def choose(ckpt_dir: Path, exclude: tuple[str, ...] = ()) -> Choice:
    """The newest complete checkpoint; ``exclude``: tags that failed to load."""
    skipped = []
    for tag in reversed(tags(ckpt_dir)):
        why = f"{ckpt_dir / tag}: failed to load" if tag in exclude else problem(ckpt_dir, tag)
        if why is None:
            return Choice(tag, skipped)
        skipped.append(why)
    return Choice(None, skipped)


def rotate(ckpt_dir: Path, keep: int, protect: str | None = None, newest: str | None = None,
           passed_over: Collection[str] = ()) -> list[str]:
    """Deletes complete checkpoints beyond the newest ``keep``, never ``protect`` (the last one
    before a run of skipped steps). An incomplete one (a save cut short, a damaged one) is not
    counted, and is kept for inspection while the kept ones are older: once the oldest kept
    complete checkpoint is newer, it is deleted too (each pre-emption cut short would otherwise
    leave one behind, up to a checkpoint's size). ``newest``: the checkpoint just written; a
    later one is one the resume passed over (it did not load), kept for inspection and not
    counted either, so that the one just written is never the one deleted. ``passed_over``: the
    ones this process's resume passed over, counted as incomplete also once the run is past
    them (a run going on with another ``checkpoint_every`` never writes their tags again).
    Returns the deleted tags."""
    last = step_of(newest) if newest is not None else None
    every = tags(ckpt_dir)
    broken = {t for t in every if t in passed_over or problem(ckpt_dir, t) is not None}
    complete = [t for t in every if t not in broken and (last is None or step_of(t) <= last)]
    deleted = []
    for tag in complete[:-keep] if keep > 0 else complete:
        if tag == protect:
            continue
        remove(ckpt_dir, tag)
        deleted.append(tag)
    window = complete[-keep:] if keep > 0 else []
    for tag in sorted(broken, key=step_of):
        if tag != protect and window and step_of(tag) < step_of(window[0]):
            remove(ckpt_dir, tag)
            deleted.append(tag)
    return deleted


def remove(ckpt_dir: Path, tag: str) -> None:
    """Deletes a checkpoint's directory and its conversion, if any."""
    shutil.rmtree(ckpt_dir / tag, ignore_errors=True)
    shutil.rmtree(ckpt_dir / UNIVERSAL / tag, ignore_errors=True)


def size_of(ckpt_dir: Path, tag: str) -> int:
    """Bytes of a checkpoint's files."""
    return sum(p.stat().st_size for p in (ckpt_dir / tag).rglob("*") if p.is_file())


class NoSpace(OSError):
    """Not enough free space for a checkpoint (the message names the path and the sizes)."""


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem ``path`` is (or will be) on: its nearest existing folder's."""
    probe = Path(path).absolute()
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def check_space(ckpt_dir: Path, need_bytes: int) -> None:
    """Raises ``NoSpace`` unless ``ckpt_dir``'s filesystem has ``need_bytes`` free."""
    free = free_bytes(ckpt_dir)
    if free < need_bytes:
        raise NoSpace(f"no space left on {ckpt_dir} for the next checkpoint: need about {need_bytes / 2**20:,.0f} MB, "
                      f"{free / 2**20:,.0f} MB free. Free space there, lower job.keep_checkpoints, or point "
                      "--run-dir at a larger filesystem")


#: what a write's last buffered chunk raises through torch.save's stream when the disk is full:
#: no errno, so a full disk is told by the free space left (``is_disk_full``'s ``where``)
_STREAM_ERROR = "basic_ios::clear: iostream error"


def is_disk_full(exc: BaseException, where: Path | None = None) -> bool:
    """torch.save on a full disk raises ``RuntimeError: ... unexpected pos ...``, ``OSError``
    ENOSPC (also from an fsync, where a network filesystem reports it), or, failing on its last
    chunk, an iostream error (counted as such where ``where``'s filesystem has under 16 MiB free);
    dist-checkpointing (Megatron) wraps each rank's in a ``CheckpointException`` (a
    ``BaseException``) of its ``failures``."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == 28:
            return True
        if isinstance(e, RuntimeError) and ("unexpected pos" in str(e) or "No space left" in str(e)):
            return True
        if isinstance(e, RuntimeError) and _STREAM_ERROR in str(e) and where is not None:
            try:
                if free_bytes(where) < 16 * 2**20:
                    return True
            except OSError:
                pass
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    return False
