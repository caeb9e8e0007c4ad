"""JIT build directories (the fused kernels', DeepSpeed's CPU op's): a killed build's lock does not
hang every later build, and no two processes of ours build one extension with two ninjas."""
from __future__ import annotations

import datetime
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from vrgd_ds.ds import shm
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


@pytest.fixture
def other_ninja_and_a_killed_shm_build(tmp_path, monkeypatch):
    """PATH headed by another ``ninja`` (as Debian's ``ninja-build`` in ``/usr/bin`` is for a shell
    without the environment's ``bin``), and the lock of a killed build of DeepSpeed's CPU op in a
    fresh extension directory. Returns the lock."""
    other = tmp_path / "bin"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    lock = tmp_path / "extensions" / shm.OP_NAME / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    old = time.time() - _fused.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    return lock


def test_the_job_builds_deepspeeds_cpu_op_with_the_packages_ninja_past_a_killed_builds_lock(
        other_ninja_and_a_killed_shm_build, monkeypatch):
    """Bug: the job's ranks started from a shell ran Debian's ninja for DeepSpeed's CPU op
    (``deepspeed_shm_comm``), the tests the package's; their build logs hash commands differently,
    so each rebuilt the op after the other (seen: three builds of 37–85 s in one session), and a
    build killed meanwhile left a lock on which every later job hung. Fails on the old code: at
    ``init_distributed`` the other ninja came first and the lock stood."""
    import deepspeed

    from vrgd_ds.train.engines.deepspeed import DeepSpeedEngine

    lock, seen = other_ninja_and_a_killed_shm_build, {}

    def init_distributed(**_):
        seen.update(ninja=shutil.which("ninja"), lock=lock.exists())
        raise KeyboardInterrupt  # nothing after it is under test

    monkeypatch.setattr(deepspeed, "init_distributed", init_distributed)
    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29500"}.items():  # a launcher's (the engine sets them itself without one)
        monkeypatch.setenv(var, value)
    with pytest.raises(KeyboardInterrupt):
        DeepSpeedEngine({}, None, None, datetime.timedelta(seconds=60))
    assert seen == {"ninja": str(Path(_fused.ninja_dir()) / "ninja"), "lock": False}


def test_a_script_started_through_vrgd_ds_run_gets_the_same_build(other_ninja_and_a_killed_shm_build,
                                                                   monkeypatch, tmp_path):
    """The same for an unmodified script (``python -m vrgd_ds.run``), whose own
    ``deepspeed.initialize`` builds the op. Fails on the old code."""
    from vrgd_ds import run

    lock = other_ninja_and_a_killed_shm_build
    script, out = tmp_path / "train.py", tmp_path / "seen.txt"
    script.write_text(f"import os, shutil\nseen = [shutil.which('ninja'), str(os.path.exists({str(lock)!r}))]\n"
                      f"open({str(out)!r}, 'w').write(' '.join(seen))\n")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    run.main([str(script)])
    assert out.read_text() == f"{Path(_fused.ninja_dir()) / 'ninja'} False"


def test_the_vector_width_flag_is_given_on_x86_alone():
    """``-mprefer-vector-width`` is an x86 option: GCC on aarch64 (a Grace CPU) refuses it, so the
    build failed there and the optimizers fell back to the reference kernels. Fails on the old
    code, whose flags were one list for every machine."""
    assert "-mprefer-vector-width=512" in _fused.cflags("x86_64")
    arm = _fused.cflags("aarch64")
    assert "-mprefer-vector-width=512" not in arm and "-march=native" in arm and "-ffp-contract=off" in arm
