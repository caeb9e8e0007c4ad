"""The session's rank pools (``pool.py``): one 2-rank group for every DeepSpeed and DDP case,
a 1-rank group for the cases that need a single rank. Started on first use."""
from __future__ import annotations

import pytest
from pool import Pool


@pytest.fixture(scope="session")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("pool2"), ranks=2, setup=(("worker", "prepare_process"),))
    yield p
    p.close()


@pytest.fixture(scope="session")
def pool1(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("pool1"), ranks=1, setup=(("worker", "prepare_process"),))
    yield p
    p.close()
