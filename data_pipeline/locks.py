"""A directory's writers take turns: an exclusive ``flock`` on a file inside it.

``prepare`` holds ``<dir>/.prepare.lock`` from its first check to its last write, and
``write_shards`` holds ``.<shards>.lock`` beside its directory while it clears and writes a shard
set there, so two
writers of one directory (jobs started together, a ``vrgd-data shard`` beside a ``prepare``)
never delete or rename each other's files. The holder writes its host and pid into the file; a
waiting one logs them.

``flock`` is honoured across the nodes of NFS (as a POSIX lock) and of Lustre mounted with
``-o flock``. Where the filesystem refuses locks (Lustre without ``flock``) this warns and goes on
unlocked: a single writer is still safe, concurrent ones are not; prepare such a directory once
beforehand with ``vrgd-data prepare``. A directory this process may not write into (a read-only
share of prepared data) is not locked: no one can change it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def directory_lock(directory: Path, name: str, what: str) -> Iterator[None]:
    """Hold ``directory/name`` exclusively while the block runs (``what``: the work, for the log)."""
    path = directory / name
    try:
        fh = open(path, "a+")
    except OSError as e:  # a read-only directory: no one writes into it, nothing to take turns on
        if e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
            raise
        logger.debug("not locking read-only %s (%s)", directory, e)
        yield
        return
    with fh:
        locked = _lock(fh, path, what)
        try:
            if locked:
                fh.seek(0)
                fh.truncate()
                fh.write(f"{socket.gethostname()} pid {os.getpid()}\n")
                fh.flush()
            yield
        finally:
            if locked:
                fcntl.flock(fh, fcntl.LOCK_UN)


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
