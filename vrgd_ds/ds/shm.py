"""DeepSpeed's shared-memory all-reduce segments on the CPU accelerator.

With every rank on one node, DeepSpeed 0.19.8 maps a 69 MB segment per rank (``shm_initialize``
in ``deepspeed/ops/csrc/cpu/comm/shm.cpp``), named from the uid, MASTER_ADDR, MASTER_PORT and
rank, and never unlinks it: each job would leave them in ``/dev/shm`` (RAM) until the node
reboots. Once every rank has mapped its peers' segments the names are not needed: the mappings
stay valid and the memory is freed when the processes exit, also after a crash or a kill.
"""
from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def segment_name(addr: str = "*", port: str | int = "*", rank: str | int = "*") -> str:
    """The segment's file name in ``/dev/shm``; the ``*`` defaults make it a glob pattern."""
    return f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank}"


def unlink_own_segment(rank: int) -> None:
    """Removes the name of this rank's segment (call after a barrier that follows
    ``deepspeed.init_distributed``, when every rank has mapped its peers')."""
    name = segment_name(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""), rank)
    try:
        (SHM_DIR / name).unlink()
    except FileNotFoundError:  # GPUs, or ranks on several nodes: no segment
        pass
