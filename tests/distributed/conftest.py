"""The session's rank pools (``pool.py``): one 2-rank group for every DeepSpeed and DDP case,
a 1-rank group for the cases that need a single rank, a 4-rank one for DeepSpeed pipelines with
data parallelism inside each stage, 2- and 4-rank groups for megatron-core
(their cases patch torch for CPU ranks, ``megatron_worker.prepare``: groups of their own).
Started on first use, stopped after the last test of this directory (idle ranks would otherwise
poll through the rest of the session)."""
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


@pytest.fixture(scope="session")
def pool(tmp_path_factory):
    yield from _pool(tmp_path_factory, "pool2", 2)


@pytest.fixture(scope="session")
def pool1(tmp_path_factory):
    yield from _pool(tmp_path_factory, "pool1", 1)


@pytest.fixture(scope="session")
def _pool4(tmp_path_factory):
    yield from _pool(tmp_path_factory, "pool4", 4)


@pytest.fixture
def pool4(_pool4, pool):
    """The 4-rank DeepSpeed pool for one test, the 2-rank one stopped while it runs (started again by
    its next case): 4 ranks on 2 cores need them all."""
    pool.close(ask=False)
    yield _pool4
    _pool4.close(ask=False)


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
    """``megatron(ranks)``: the 2- or 4-rank megatron-core pool, the other one stopped first (idle
    ranks poll in their wait: two groups at once would take the cores the running one needs)."""

    def get(ranks: int) -> Pool:
        for other, p in _megatron_pools.items():
            if other != ranks:
                p.close(ask=False)
        return _megatron_pools[ranks]

    return get


@pytest.fixture
def megatron2(megatron):
    return megatron(2)


def pytest_runtest_teardown(item, nextitem):
    """After the last test here (pytest runs a directory's tests together), the pools stop; a
    later test that asks for one again starts a fresh group."""
    if nextitem is None or HERE not in Path(nextitem.path).parents:
        for p in _OPEN:
            p.close(ask=False)  # nothing to finish: the group is killed at once
