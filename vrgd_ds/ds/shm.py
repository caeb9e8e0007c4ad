"""DeepSpeed's shared-memory all-reduce segments on the CPU accelerator.

With every rank on one node, DeepSpeed 0.19.8 maps a 69 MB segment per rank (``shm_initialize``
in ``deepspeed/ops/csrc/cpu/comm/shm.cpp``), named from the uid, MASTER_ADDR, MASTER_PORT and
rank, and never unlinks it: each job would leave them in ``/dev/shm`` (RAM) until the node
reboots. Once every rank has mapped its peers' segments the names are not needed: the mappings
stay valid and the memory is freed when the processes exit, also after a crash or a kill.

DeepSpeed builds the op behind these collectives (``deepspeed_shm_comm``) on first use, with the
``ninja`` first on PATH, in torch's extension directory shared by every job of the user:
``prepare_build`` makes that the build the fused kernels get (``vrgd_ds.optim._fused``), with the
same ninja and a killed build's lock removed.
"""
from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")

#: the JIT extension DeepSpeed builds at ``init_distributed`` on the CPU accelerator
#: (``build_shm_op`` in ``deepspeed/comm/torch.py``)
OP_NAME = "deepspeed_shm_comm"


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


def prepare_build() -> None:
    """Before ``deepspeed.init_distributed`` in a process of ours (the job, ``vrgd_ds.run``): the
    ``ninja`` package's binary first on PATH, as for the fused kernels, and a lock a killed build
    left in the op's build directory removed (``_fused.clear_stale_lock``). Two ninjas (the
    package's, Debian's ``ninja-build``) keep their build logs in two hash formats, so processes
    alternating between them (the tests, the job started from a shell) each rebuilt the op, half
    a minute to a minute and a half on two cores; a build killed during that (a pre-empted job)
    left a lock on which every later job waited at 0 % CPU. Only the directory holding ``ninja``
    joins PATH; the op builds, or is loaded, by DeepSpeed as before."""
    from vrgd_ds.optim import _fused

    ninja = _fused.ninja_dir()
    path = os.environ.get("PATH", "")
    if ninja is not None and path.split(os.pathsep)[0] != ninja:
        os.environ["PATH"] = ninja + (os.pathsep + path if path else "")
    # Only where DeepSpeed runs the CPU accelerator, the one that builds the op: a torch without
    # CUDA or ROCm, or DS_ACCELERATOR=cpu. Asked of torch's build, not of DeepSpeed: get_accelerator()
    # fixes its choice for the process, and vrgd_ds.run calls this before the script, whose own
    # environment (DS_ACCELERATOR, CUDA_VISIBLE_DEVICES set at its top) must still decide.
    import torch

    if (torch.version.cuda is None and torch.version.hip is None) or os.environ.get("DS_ACCELERATOR") == "cpu":
        _fused.clear_stale_build_lock(OP_NAME)
