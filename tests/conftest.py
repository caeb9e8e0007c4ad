import os
import pathlib
import sys
import time

import pytest
import torch

SHARED = pathlib.Path(__file__).resolve().parents[2] / "shared"

# As in an activated environment: launchers, and the ninja that JIT extension builds run,
# come from this interpreter's environment for the session and every process it starts (two
# ninjas would each rebuild DeepSpeed's extensions: their build logs differ).
_BIN = str(pathlib.Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")


# The Triton kernels run on CPU tensors under Triton's interpreter (tests/unit/test_triton.py);
# the flag is read when the kernels are defined, so it is set before anything imports them.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_runtest_setup(item):
    """``VRGD_TESTS_UNTIL`` (a Unix time; ``.ci/run`` sets it for the exhaustive tier): a test that
    would start after it is skipped before its fixtures start anything, with the reason in the
    summary, so a tier run on a slow host ends inside the time it was given."""
    until = os.environ.get("VRGD_TESTS_UNTIL")
    if until and time.time() > float(until):
        pytest.skip(f"VRGD_TESTS_UNTIL={until} has passed: the time this run was given is spent")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def shared_data() -> pathlib.Path:
    path = SHARED / "data" / "wikitext-2"
    if not path.is_dir():
        pytest.skip("../shared/data/wikitext-2 is not present")
    return path


def pytest_collection_finish(session):
    """Builds the JIT extensions the launched ranks load (our fused kernels, DeepSpeed's CPU
    shared-memory all-reduce) once, here, before any launch: ranks then only load them, and a
    rank killed on a timeout can never leave a build lock that every later launch would wait
    on. A build that fails here fails again, with its message, where it is used. DeepSpeed's op
    only when a collected test launches ranks (the unit tier, ``make test-unit``, starts none),
    built by a process of its own beside ours: each build is one compiler on one core, so on a
    fresh clone the two take the time of the longer, not of both."""
    import logging
    import subprocess
    import tempfile

    from vrgd_ds.optim import _fused

    unit = pathlib.Path(__file__).resolve().parent / "unit"
    ranks = not all(unit in pathlib.Path(str(item.path)).resolve().parents for item in session.items)
    # what TorchBackend calls in every rank, in a process with the ranks' environment
    with tempfile.TemporaryFile("w+") as out:
        shm = subprocess.Popen([sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
                               stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT) if ranks else None
        try:
            _fused.load()
        except _fused.FusedKernelsUnavailable as exc:
            logging.getLogger(__name__).warning("%s", exc)
        if shm is not None and shm.wait() != 0:  # reported, and met again by the test that needs it
            out.seek(0)
            logging.getLogger(__name__).warning("building DeepSpeed's shared-memory op failed:\n%s", out.read()[-3000:])
