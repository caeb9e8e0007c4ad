"""The session's rank pools (``pool.py``): one 2-rank group for every DeepSpeed and DDP case,
a 1-rank group for the cases that need a single rank, a 4-rank one for DeepSpeed pipelines with
data parallelism inside each stage (and the 4-rank FSDP2 and hierarchical cases), 2- and 4-rank
groups for megatron-core (their cases patch torch for CPU ranks, ``megatron_worker.prepare``:
groups of their own). One group runs at a time: a test's group is started on first use, the
others stopped; all stop after the last test of this directory (idle ranks would otherwise poll
through the rest of the session)."""
from __future__ import annotations

from pathlib import Path

import pytest
from pool import Pool

HERE = Path(__file__).parent
_OPEN: list[Pool] = []


def _pool(tmp_path_factory, name: str, ranks: int):
    p = Pool(tmp_path_factory.mktemp(name), ranks=ranks, setup=(("worker", "prepare_process"),))
    _OPEN.append(p)
    yield p
    p.close()


def _alone(p: Pool, request=None) -> Pool:
    """``p``, every other group stopped first: idle ranks poll in their wait, and two groups at
    once would take the cores the running one needs. Consecutive tests of one group keep it. A
    test asking for two groups (``request``) has only the first stop the others: it runs them in
    turn and stops the first itself, so the group the tests before it left running goes on."""
    names = [] if request is None else [n for n in request.fixturenames if n in _POOLS]
    if names and request.fixturename != names[0]:
        return p
    for other in _OPEN:
        if other is not p:
            other.close(ask=False)
    return p


@pytest.fixture(scope="session")
def _pool2(tmp_path_factory):
    yield from _pool(tmp_path_factory, "pool2", 2)


@pytest.fixture(scope="session")
def _pool1(tmp_path_factory):
    yield from _pool(tmp_path_factory, "pool1", 1)


@pytest.fixture(scope="session")
def _pool4(tmp_path_factory):
    yield from _pool(tmp_path_factory, "pool4", 4)


@pytest.fixture
def pool(_pool2, request):
    return _alone(_pool2, request)


@pytest.fixture
def pool1(_pool1, request):
    return _alone(_pool1, request)


@pytest.fixture
def pool4(_pool4, request):
    """The 4-rank DeepSpeed pool (4 ranks on 2 cores need them all: the others stopped)."""
    return _alone(_pool4, request)


@pytest.fixture(scope="session")
def _megatron_pools(tmp_path_factory):
    pools = {ranks: Pool(tmp_path_factory.mktemp(f"megatron{ranks}"), ranks=ranks,
                         setup=(("megatron_worker", "prepare"),)) for ranks in (2, 4)}
    _OPEN.extend(pools.values())
    yield pools
    for p in pools.values():
        p.close()


@pytest.fixture
def megatron(_megatron_pools):
    """``megatron(ranks)``: the 2- or 4-rank megatron-core pool, every other group stopped first."""

    def get(ranks: int) -> Pool:
        return _alone(_megatron_pools[ranks])

    return get


@pytest.fixture
def megatron2(megatron):
    return megatron(2)


_DEEPSPEED_POOLS = ("pool", "pool1", "pool4")
_POOLS = {*_DEEPSPEED_POOLS, "megatron", "megatron2"}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test that launches ranks of its own (HF Trainer, ``vrgd_ds.run``, the pool's own tests)
    runs with no group idling beside it: the groups stop before any of its fixtures start,
    module-scoped ones included (an autouse fixture came after them: the HF Trainer's launch, a
    module fixture, ran beside the megatron-core group the tests before it had used)."""
    if not _POOLS & set(getattr(item, "fixturenames", ())):
        for p in _OPEN:
            p.close(ask=False)


#: the order the groups' cases run in (the others last): each group then starts once, not once per switch
_GROUP_ORDER = {"pool": 0, "pool1": 1, "pool4": 2, "megatron": 3, "megatron2": 3}


def _megatron_ranks(item) -> int:
    """The megatron-core group a case asks for first: 2 for ``megatron2`` and the matrix's rows
    off the 2 × 2 layout, else 4 (the 4-rank layouts, the hierarchical cases)."""
    names = getattr(item, "fixturenames", ())
    if "megatron2" in names:
        return 2
    row = getattr(getattr(item, "callspec", None), "params", {}).get("row")
    return 4 if not isinstance(row, dict) or row.get("layout") == "tp2dp2" else 2


def pytest_collection_modifyitems(session, config, items):
    """The cases of this directory grouped by the rank group they use, in file order within a
    group: 4 ranks on 2 cores need them all, so one group runs at a time, and every switch
    between groups is a start (10-25 s). Within a group, a case that goes on to another group
    (the DCP resume on 2 ranks of a 4-rank checkpoint) comes last, and megatron-core's 4-rank
    cases come before its 2-rank ones."""
    here = [i for i, item in enumerate(items) if HERE in Path(str(item.path)).parents]

    def key(item) -> tuple[int, int]:
        names = getattr(item, "fixturenames", ())
        found = [order for name, order in _GROUP_ORDER.items() if name in names]
        group = max(found, default=len(_GROUP_ORDER))
        if group == _GROUP_ORDER["megatron"]:
            return group, 0 if _megatron_ranks(item) == 4 else 1
        return group, sum(name in names for name in _DEEPSPEED_POOLS) - 1

    for i, item in zip(here, sorted((items[i] for i in here), key=key)):
        items[i] = item


def pytest_runtest_teardown(item, nextitem):
    """After the last test here (pytest runs a directory's tests together), the pools stop; a
    later test that asks for one again starts a fresh group."""
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        for p in _OPEN:
            p.close(ask=False)  # nothing to finish: the group is killed at once
