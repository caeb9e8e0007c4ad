"""A directory's writers take turns: an exclusive ``flock`` on a file inside it.

``prepare`` holds ``<dir>/.prepare.lock`` from its first check to its last write, and
``write_shards`` holds ``.<shards>.lock`` beside its directory (named from its resolved path, so a
symlink to it takes the same lock; inside it, ``.shard-write.lock``, where only the directory
itself may be written: ``shards.shard_write_lock``) while it clears and writes a shard set there,
so two
writers of one directory (jobs started together, a ``vrgd-data shard`` beside a ``prepare``)
never delete or rename each other's files. The holder writes its host and pid into the file; a
waiting one logs them.

``flock`` is honoured across the nodes of NFS (as a POSIX lock) and of Lustre mounted with
``-o flock``. Where the filesystem refuses locks (Lustre without ``flock``) this warns and goes on
unlocked: a single writer is still safe, concurrent ones are not; prepare such a directory once
beforehand with ``vrgd-data prepare``. A directory this process may not write into (a read-only
share of prepared data) is not locked: no one can change it. In a directory shared by several
users, the lock file is made group-writable by whoever creates it; one another user left
without write permission is locked through a read-only descriptor (``flock`` needs none,
locally and on Lustre), and where that fails too (NFS's POSIX emulation needs one) the error
names the file, its owner and the fix: never unlocked in a directory others can write into.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from vrgd_ds.data_pipeline.errors import DataError

logger = logging.getLogger(__name__)


_held = threading.local()  # .paths: the lock files this thread holds (directory_lock is reentrant)


@contextlib.contextmanager
def directory_lock(directory: Path, name: str, what: str) -> Iterator[None]:
    """Hold ``directory/name`` exclusively while the block runs (``what``: the work, for the log).

    Reentrant within a thread: a block that holds the lock (a job deciding, under ``prepare``'s
    lock, whether to prepare) may call code that takes it again (``prepare``), which then goes on
    without waiting for itself (``flock`` on a second descriptor would)."""
    path = directory / name
    held = _held.__dict__.setdefault("paths", set())
    key = os.path.realpath(path)
    if key in held:
        yield
        return
    fh, writable = _open(path)
    if fh is None:  # a read-only directory: no one writes into it, nothing to take turns on
        yield
        return
    with fh:
        try:
            locked = _lock(fh, path, what)
        except OSError as e:
            if writable or e.errno not in (errno.EBADF, errno.EACCES, errno.EPERM):
                raise
            raise DataError(f"{path}: the lock file of this shared directory belongs to {_owner(path)} and this user "
                            f"cannot write it, which this filesystem needs to lock it ({e.strerror}); ask its owner "
                            f"to make it group-writable (chmod g+w {path}), or remove it while no one prepares data "
                            f"in {directory}") from None
        try:
            if locked and writable:
                fh.seek(0)
                fh.truncate()
                fh.write(f"{socket.gethostname()} pid {os.getpid()}\n")
                fh.flush()
            held.add(key)
            yield
        finally:
            held.discard(key)
            if locked:
                fcntl.flock(fh, fcntl.LOCK_UN)


def _owner(path: Path) -> str:
    """The user owning ``path``, by name where known."""
    import pwd

    uid = path.stat().st_uid
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"


def _open(path: Path):
    """``(file, writable)`` to lock ``path`` through: read-write, creating it group-writable;
    read-only where another user's lock file may not be written; ``(None, False)`` in a directory
    this process may not write into (``os.access``), whose files no one here can change."""
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o664)
        except PermissionError:  # fs.protected_regular refuses O_CREAT on another user's file in a sticky directory
            fd = os.open(path, os.O_RDWR)
    except OSError as e:
        if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM, errno.ENOENT):
            raise
        if e.errno == errno.EROFS or not os.access(path.parent, os.W_OK):
            logger.debug("not locking read-only %s (%s)", path.parent, e)
            return None, False
        try:  # another user's lock file in a directory this user writes into too
            return os.fdopen(os.open(path, os.O_RDONLY), "r"), False
        except OSError as again:
            raise DataError(f"{path}: cannot open the lock file of {path.parent} ({again.strerror}; it belongs to "
                            f"{_owner(path)}): ask its owner to make it group-readable and writable (chmod g+rw "
                            f"{path}), or remove it while no one prepares data there") from None
    if os.fstat(fd).st_uid == os.geteuid():  # ours: other users of a shared directory must be able to lock it
        with contextlib.suppress(OSError):
            os.fchmod(fd, os.fstat(fd).st_mode & 0o7777 | 0o660)
    return os.fdopen(fd, "a+"), True


def _lock(fh, path: Path, what: str) -> bool:
    """Take ``flock`` on the open ``path``, waiting (and saying for whom) while another holds it;
    False (with a warning) where the filesystem has no locks."""
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        pass
    except OSError as e:
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
        logger.warning("%s cannot be locked on this filesystem (%s): %s unlocked; writers of %s at once can "
                       "break each other's data: prepare it once beforehand with vrgd-data prepare", path, e,
                       what, path.parent)
        return False
    fh.seek(0)
    holder = fh.read().strip() or "another process"
    logger.info("waiting for another %s of %s to finish (lock %s, last taken by %s)", what, path.parent, path, holder)
    fcntl.flock(fh, fcntl.LOCK_EX)
    return True
