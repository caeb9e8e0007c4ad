"""The console scripts (``[project.scripts]`` in pyproject.toml), each checking first that the
extra it needs is installed.

``pip install vrgd-ds`` gives the optimizers and the DeepSpeed integration; the commands need
the ``train`` extra (``pip install "vrgd-ds[train]"``). Without it a command exits with status 2
and a message naming the extra and the missing modules, instead of an import traceback from
deep inside the job.
"""
from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence

# Import names of the modules each extra of pyproject.toml provides (test_packaging.py checks
# this against the extras' requirements).
EXTRAS: dict[str, tuple[str, ...]] = {
    "train": ("transformers", "sentencepiece", "tensorboard", "matplotlib"),
}

# command -> (extra, the modules of it the command imports)
NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vrgd-data": ("train", ("sentencepiece",)),
    "vrgd-plots": ("train", ("matplotlib",)),
    # the job logs to TensorBoard by default (job.telemetry.tensorboard) and writes its plots at the end
    "vrgd-pretrain": ("train", ("transformers", "sentencepiece", "tensorboard", "matplotlib")),
}


def missing_modules(modules: Sequence[str]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def require(command: str) -> None:
    """Exits with status 2, naming the extra to install, when ``command`` lacks a module."""
    extra, modules = NEEDS[command]
    missing = missing_modules(modules)
    if missing:
        print(f"{command}: needs the '{extra}' extra ({', '.join(missing)} not installed); "
              f"install it with: pip install \"vrgd-ds[{extra}]\"", file=sys.stderr)
        raise SystemExit(2)


def data() -> int | None:
    require("vrgd-data")
    from vrgd_ds.data_pipeline.cli import main

    return main()


def plots() -> int | None:
    require("vrgd-plots")
    from vrgd_ds.train.plots import main

    return main()


def pretrain() -> int | None:
    require("vrgd-pretrain")
    from vrgd_ds.train.loop import run_process

    return run_process()
