"""Which GPU a rank takes (``vrgd_ds.train.engines.base.local_cuda_device``), with the GPUs it
sees stood in for: no GPU is needed."""
from __future__ import annotations

import pytest
import torch

from vrgd_ds.train.engines.base import local_cuda_device


@pytest.mark.parametrize("seen, local, rank, want", [
    (8, "5", 13, 5),   # one task per GPU, each sees the node's 8: LOCAL_RANK is the device
    (8, None, 13, 5),  # no LOCAL_RANK (a launcher that sets none): the global rank modulo the GPUs
    (1, "5", 13, 0),   # Slurm bound the task to its GPU (--gpus-per-task=1): the one it sees
    (1, None, None, 0),
])
def test_a_rank_takes_its_gpu_among_those_it_sees(monkeypatch, seen, local, rank, want):
    """Fails on the old code where Slurm binds each task to its own GPU: it took device
    LOCAL_RANK of the one it sees, "invalid device ordinal" on every task but the first."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: seen)
    if local is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local)
    assert local_cuda_device(rank) == want


def test_more_tasks_than_gpus_on_a_node_is_an_error_naming_both(monkeypatch):
    """8 tasks on a node whose ranks see 4 GPUs (sbatch -N 2 --gpus-per-node=4 with the file's 8
    tasks per node): the error names LOCAL_RANK and the GPUs seen, not CUDA's "invalid device
    ordinal"."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "6")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 6, but this rank sees 4 GPUs .*--ntasks-per-node"):
        local_cuda_device(6)
