"""``tests/launching.py``: a launch that outlives its timeout fails the test with what is needed to
tell a hang from a stalled host; ``tests/conftest.py``: a run given a time (``VRGD_TESTS_UNTIL``)
ends inside it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import launching
import pytest

pytestmark = pytest.mark.slow  # starts processes, waits out a timeout (6 s)
ROOT = Path(__file__).resolve().parents[2]

# a "rank" that waits in a function of its own, beside a child of its own (a process of the group)
HANGS = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
def waits_in_a_collective():
    print("rank up", flush=True)
    time.sleep(600)
waits_in_a_collective()
"""


@pytest.mark.exhaustive  # waits out a 6 s timeout
def test_a_timed_out_launch_fails_with_its_stacks_and_the_machine_state(tmp_path):
    """The failure names the function the process waited in (its ``faulthandler`` stack, printed
    on SIGABRT), the load and memory at the timeout, and the output so far; nothing of the launch
    is left running. Before these, a launch that hung in CI said only that it was still running."""
    marker = tmp_path / "hang-marker"
    with pytest.raises(pytest.fail.Exception) as failed:
        launching.run([sys.executable, "-c", HANGS, str(marker)], timeout=3, marker=marker)
    message = str(failed.value)
    assert "still running after 3 s" in message
    assert "rank up" in message  # stdout so far
    assert "in waits_in_a_collective" in message  # the stack, from faulthandler
    assert "load average" in message and "MemAvailable" in message
    left = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True)
    assert left.stdout == "", left.stdout


@pytest.mark.exhaustive  # a pytest run of its own (5 s each); CI's exhaustive tier is what it bounds
@pytest.mark.parametrize("given, outcome", [(-60, "1 skipped"), (3600, "1 passed")])
def test_a_test_that_would_start_after_the_runs_time_is_skipped(given, outcome):
    """``VRGD_TESTS_UNTIL`` (``.ci/run`` gives the exhaustive tier CI's minute 75): a test that would
    start after it is skipped, with the reason in the summary; one before it runs."""
    test = "tests/unit/test_docs.py::test_relative_links_point_to_existing_files_and_headings[README.md]"
    env = {**os.environ, "VRGD_TESTS_UNTIL": str(time.time() + given)}
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert outcome in proc.stdout, proc.stdout[-3000:]
    if given < 0:
        assert "the time this run was given is spent" in proc.stdout
