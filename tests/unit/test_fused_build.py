"""The fused kernels' build directory: a killed build's lock does not hang every later build."""
from __future__ import annotations

import os
import time

import pytest

from vrgd_ds.optim import _fused


def test_a_killed_builds_lock_is_removed_and_a_live_one_kept(tmp_path, caplog):
    """Bug: a build killed half-way (seen: a CI run stopped while the kernels compiled) left
    torch's ``lock`` in the shared build directory, and every later process — tests, the study's
    runs — waited on it forever at 0 % CPU. Fails on the old code: no ``clear_stale_lock``."""
    lock = tmp_path / "lock"
    lock.touch()
    assert not _fused.clear_stale_lock(tmp_path) and lock.exists()  # a build in progress
    old = time.time() - _fused.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert _fused.clear_stale_lock(tmp_path) and not lock.exists()
    assert str(lock) in caplog.text
    assert not _fused.clear_stale_lock(tmp_path)  # nothing to remove


@pytest.mark.parametrize("edit", ["\n// another version\n", ""])
def test_two_versions_or_checkouts_never_share_a_build_directory(monkeypatch, tmp_path, edit):
    """Bug: two checkouts with the same kernels.cpp shared one build directory, whose build.ninja
    names the source by path, and rebuilt each other's kernels at every switch (seen: a test run
    beside a study waited on a minute-long rebuild at each launch). Fails on the old code."""
    other = tmp_path / "kernels.cpp"
    other.write_text(_fused._SOURCE.read_text() + edit)
    mine = _fused.extension_name()
    monkeypatch.setattr(_fused, "_SOURCE", other)
    assert _fused.extension_name() != mine
    assert _fused.extension_name().startswith(mine.rsplit("_", 1)[0])  # the same CPU part
