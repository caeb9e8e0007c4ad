"""The rank pool itself (``pool.py``): a case that raises, hangs or kills its rank fails alone,
with what the ranks said, and the next case runs in a fresh group."""
from __future__ import annotations

import re

import pytest
from pool import Pool

from vrgd_ds.ds import shm


@pytest.fixture(scope="module")
def lone(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("lone"), ranks=1)
    yield p
    p.close()


@pytest.mark.exhaustive  # a group of its own: every distributed case runs through the pool
def test_a_case_runs_and_answers(lone):
    assert lone.run("pool_cases", "ok", {"echo": 7}) == {"rank": 0, "world": 1, "echo": 7}


@pytest.mark.exhaustive  # a group of its own: every distributed case runs through the pool
def test_a_raising_case_fails_with_its_traceback_and_the_group_goes_on(lone):
    proc = lone.proc
    with pytest.raises(pytest.fail.Exception, match=r"raised on rank 0: ValueError: broken on purpose \(x\)"):
        lone.run("pool_cases", "fail", {"echo": "x"})
    assert lone.run("pool_cases", "ok", {"echo": 1})["echo"] == 1
    assert lone.proc is proc  # the same group


@pytest.mark.parametrize("what, timeout, why", [("hang", 3.0, "no result after 3 s (a hang)"),
                                                ("die", 120.0, "a rank died")])  # seen by the launcher's exit
@pytest.mark.exhaustive
def test_a_hung_or_dead_case_fails_with_the_ranks_output_and_the_next_gets_a_fresh_group(lone, what, timeout, why):
    lone.run("pool_cases", "ok", {})
    before = lone.proc
    with pytest.raises(pytest.fail.Exception, match=re.escape(why)) as e:
        lone.run("pool_cases", what, {}, timeout=timeout)
    assert "the ranks' output" in str(e.value)
    if what == "hang":  # where each rank waits, from its own stacks
        assert str(e.value).count("in hang") == lone.ranks, str(e.value)
    assert lone.run("pool_cases", "ok", {"echo": what})["echo"] == what
    assert lone.proc is not before


def test_a_started_group_leaves_no_shared_memory_segment(pool):
    """Every start of a 2-rank group used to leave DeepSpeed's two 69 MB CPU all-reduce segments
    in /dev/shm (``vrgd_ds.ds.shm``) until the machine rebooted: a test session restarts its
    groups dozens of times, and 18 GB of RAM filled up. Fails on the old ``pool_worker.py``, which
    never unlinked them."""
    assert pool.run("pool_cases", "ok", {})["world"] == 2
    assert list(shm.SHM_DIR.glob(shm.segment_name(port=pool.port))) == []
    assert pool.proc.poll() is None  # the group runs on with its mappings
    assert pool.run("pool_cases", "ok", {"echo": 3})["echo"] == 3


def test_a_test_that_uses_no_group_starts_with_every_group_stopped(request):
    """The groups stop in ``pytest_runtest_setup`` (``conftest.py``), before any fixture of a test
    that uses none of them, a module-scoped launch included; a test of a group keeps it. Fails on
    the old code, which stopped them in an autouse fixture, after the module fixtures: the HF
    Trainer's launch ran beside the megatron-core group the tests before it had used."""
    [conf] = [p for p in request.config.pluginmanager.get_plugins()
              if getattr(p, "__file__", "").endswith("distributed/conftest.py")]
    hook = getattr(conf, "pytest_runtest_setup", None)
    assert hook is not None, "the groups are not stopped before the fixtures of a test"

    class Group:
        closed = 0

        def close(self, ask: bool = True) -> None:
            self.closed += 1

    class Item:
        def __init__(self, *fixturenames: str) -> None:
            self.fixturenames = list(fixturenames)

    group = Group()
    conf._OPEN.append(group)
    try:
        hook(Item("megatron2", "tmp_path"))
        assert group.closed == 0  # a test of a group keeps the groups (it stops the others itself)
        hook(Item("result", "tmp_path"))  # a module fixture's launch, as the HF Trainer's
        assert group.closed == 1
    finally:
        conf._OPEN.remove(group)
