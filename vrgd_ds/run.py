"""``python -m vrgd_ds.run SCRIPT [ARGS ...]`` (or ``-m MODULE [ARGS ...]``): an unmodified training
script with the VRGD optimizer names registered in DeepSpeed.

A script nobody may edit (a cluster's shared ``pretrain.py``, Megatron-DeepSpeed's entry points)
picks ``"optimizer": {"type": "VRLamb"}`` by its JSON alone when started through this module::

    deepspeed --hostfile hosts --module vrgd_ds.run pretrain.py --deepspeed_config ds.json
    torchrun --nproc_per_node 8 -m vrgd_ds.run pretrain.py --deepspeed_config ds.json
    srun python -m vrgd_ds.run pretrain.py --deepspeed_config ds.json

It imports :mod:`vrgd_ds` (which registers the names as soon as the script imports DeepSpeed),
then runs the script as ``__main__`` with the arguments it would have had: ``sys.argv[0]`` is the
script, the launcher's ``--local_rank=N`` (placed before the script by ``deepspeed --module``;
``--local-rank=N`` by ``torch.distributed.launch``) moves after it, and the script's directory heads ``sys.path`` as with ``python SCRIPT``. When the
script ends on a rank, that rank leaves the process group with the others (``leave_together``):
a script that ends without ``destroy_process_group`` can otherwise die in gloo's teardown.
"""
from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence

USAGE = "usage: python -m vrgd_ds.run [--local_rank=N | --local-rank=N] (SCRIPT | -m MODULE) [ARGS ...]"


def leave_together() -> None:
    """Every rank leaves the process group together: a rank exiting alone can die in gloo's
    teardown (SIGABRT, "terminate called without an active exception"), which replaces the exit
    code the launcher and the batch script act on (seen for a refused second job: 250, not 6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """Leading launcher arguments (``--local_rank=N`` / ``--local_rank N``, and torch's spelling
    ``--local-rank``) and the rest."""
    launcher: list[str] = []
    while argv and argv[0].startswith(("--local_rank", "--local-rank")):
        arg = argv.pop(0)
        launcher.append(arg)
        if arg in ("--local_rank", "--local-rank") and argv:
            launcher.append(argv.pop(0))
    return launcher, argv


def main(argv: Sequence[str] | None = None) -> None:
    launcher, rest = _split(list(sys.argv[1:] if argv is None else argv))
    if not rest or rest[0] in ("-h", "--help"):
        print(__doc__.split("\n\n")[0].replace("``", "") + "\n\n" + USAGE, file=sys.stderr)
        raise SystemExit(0 if rest else 2)
    module = None
    if rest[0] == "-m":
        if len(rest) < 2:
            print(f"vrgd_ds.run: -m needs a module name\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
        module, args = rest[1], rest[2:]
        target = module
        import importlib.util

        top = module.partition(".")[0]  # found without importing anything (a package's own errors stay runpy's)
        if not top or importlib.util.find_spec(top) is None:
            print(f"vrgd_ds.run: -m {module}: no module named {top!r}\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)
    else:
        target, args = rest[0], rest[1:]
        if not os.path.isfile(target):
            print(f"vrgd_ds.run: {target}: no such script\n{USAGE}", file=sys.stderr)
            raise SystemExit(2)

    import vrgd_ds  # noqa: F401  registers the names now, or right after the script imports deepspeed
    from vrgd_ds.ds import shm

    shm.prepare_build()  # the script's init_distributed builds DeepSpeed's CPU op with the package's ninja

    sys.argv = [target, *launcher, *args]
    try:
        if module is not None:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(os.path.abspath(target), run_name="__main__")  # __file__ absolute, as python SCRIPT
    except SystemExit as e:  # sys.exit(main()): the script ended here too when it exits 0
        if e.code in (None, 0):
            leave_together()
        raise
    leave_together()  # the script ended here: not after a failure, where a barrier would wait forever


if __name__ == "__main__":
    main()
